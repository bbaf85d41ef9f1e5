"""Shared fixtures for running the suite on 1 rank or under ``mpiexec -n P``.

* ``comm``: mpiattn's wrapper of ``MPI.COMM_WORLD``.
* ``xp``: the array namespace under test: NumPy, or CuPy when
  ``MPIATTN_TEST_BACKEND=cupy`` (skipped cleanly where no GPU is usable).
* ``serial_only``: skips a test (on every rank) when run under several ranks;
  used by tests that launch ``mpiexec`` themselves.
* ``shared_dir``: one temporary directory, the same path on every rank,
  removed after the test.

A test that takes no communicator (neither ``comm`` nor ``shared_dir``, directly or through
its fixtures) computes the same on every rank count, so it runs in the single-process
session only: under several ranks it is deselected (``pytest_collection_modifyitems``). A
test that communicates, through the library's default communicator too, takes ``comm``.

``--launches-only`` keeps, in the single-process session, only the tests that launch their own
MPI jobs (``serial_only``; under several ranks it changes nothing): a lane on another MPI
(.ci/lanes/openmpi.sh) runs those alone at one rank and everything else under several ranks.
"""

import os
import shutil
import tempfile

import numpy as np
import pytest
from mpi4py import MPI

_WORLD = MPI.COMM_WORLD


def _cupy_or_skip():
    try:
        import cupy
        cupy.cuda.runtime.getDeviceCount()
        cupy.zeros(1).sum()
    except Exception as exc:  # noqa: BLE001 - any failure means "no usable GPU"
        pytest.skip(f"CuPy backend requested but no usable GPU: {exc}")
    from mpiattn import gpu
    gpu.bind_device(_WORLD)
    return cupy


@pytest.fixture(scope="session")
def xp():
    name = os.environ.get("MPIATTN_TEST_BACKEND", "numpy")
    if name == "numpy":
        return np
    if name == "cupy":
        return _cupy_or_skip()
    raise ValueError(f"MPIATTN_TEST_BACKEND={name!r}; expected numpy or cupy")


@pytest.fixture(scope="session")
def comm():
    from mpiattn.comm import get_comm
    return get_comm(_WORLD)


@pytest.fixture
def serial_only():
    if _WORLD.Get_size() > 1:
        pytest.skip("launches mpiexec itself; runs in the single-process session")


@pytest.fixture
def shared_dir(comm):
    path = comm.bcast_obj(tempfile.mkdtemp(prefix="mpiattn-test-") if comm.rank == 0 else None)
    yield path
    comm.barrier()
    if comm.rank == 0:
        shutil.rmtree(path, ignore_errors=True)


def pytest_configure(config):
    config.addinivalue_line("markers", "soaks: a search that --soak SECONDS runs for longer")


def pytest_addoption(parser):
    parser.addoption("--launches-only", action="store_true", default=False,
                     help="in one process, run only the tests that launch their own MPI jobs")
    parser.addoption("--soak", type=float, default=None, metavar="SECONDS",
                     help="the search over the contract (tests/attention/test_property.py) runs "
                          "for SECONDS, in rounds of new seeds, instead of its fixed budget")


#: The fixtures that make a test one of several ranks (it runs at every rank count).
_COMMUNICATES = {"comm", "shared_dir"}


def pytest_collection_modifyitems(config, items):
    """Under several ranks, leave out (deselect) the tests that take no communicator (see the
    module docstring): a skipped test still costs pytest's whole protocol, about 3 ms here.
    In one process with ``--launches-only``, leave out all but the launching tests. With
    ``--soak SECONDS``, the tests that take it (the search) get that much more time."""
    names = lambda item: set(getattr(item, "fixturenames", ()))  # noqa: E731
    soak = config.getoption("soak")
    if soak:
        for item in items:
            if "pytestconfig" in names(item) and item.get_closest_marker("soaks"):
                item.add_marker(pytest.mark.timeout(soak + 600))
    if _WORLD.Get_size() == 1:
        if config.getoption("launches_only"):
            serial = [item for item in items if "serial_only" not in names(item)]
        else:
            return
    else:
        serial = [item for item in items if not _COMMUNICATES & names(item)]
    if serial:
        config.hook.pytest_deselected(items=serial)
        left = set(map(id, serial))
        items[:] = [item for item in items if id(item) not in left]
