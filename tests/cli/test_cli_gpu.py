"""``run --device gpu`` through the fake CuPy of tests/fake_cupy.py (no GPU needed).

Exercises the CLI's GPU path: device binding, host slabs uploaded to the
"device", the transport flag (passed to ``gpu.bind_device``, never through the
environment), results brought back to the host and written. The CLI gets a
communicator of its own (a fresh Comm of a duplicate of COMM_WORLD), freed
afterwards.
"""

import os

import numpy as np
import pytest

import fake_cupy
from helpers import install_fake_cupy, reference, whole
from mpiattn import cli
from mpiattn.cli import commands, steps
from mpiattn.comm import core as comm_core


@pytest.fixture
def fake_gpu(monkeypatch, comm):
    """(the fake CuPy, the Comm the CLI uses): a Comm of its own, so its transport is fresh."""
    from mpi4py import MPI
    own = MPI.COMM_WORLD.Dup()
    cli_comm = comm_core.get_comm(own)
    monkeypatch.setattr(steps, "world_comm", lambda: cli_comm)
    monkeypatch.setattr(commands, "world_comm", lambda: cli_comm)
    cp = install_fake_cupy(monkeypatch, device_count=comm.size)  # one GPU per rank
    fake_cupy._state.bus_id = f"0000:{comm.rank:02x}:00.0"
    yield cp, cli_comm
    own.Free()  # frees the CLI's Comm and its transport too (MPI attribute caching)
    fake_cupy.shutdown()


@pytest.mark.parametrize("flag, env, expect", [
    ("staged", None, "staged"),
    ("nccl", None, "nccl"),
    ("staged", "nccl", "staged"),  # the flag wins over MPIATTN_GPU_TRANSPORT
    (None, "nccl", "nccl"),        # no flag: the environment decides
])
def test_run_on_fake_gpu(comm, capsys, shared_dir, fake_gpu, monkeypatch, flag, env, expect):
    if env is None:
        monkeypatch.delenv("MPIATTN_GPU_TRANSPORT", raising=False)
    else:
        monkeypatch.setenv("MPIATTN_GPU_TRANSPORT", env)
    inp = os.path.join(shared_dir, "in.h5")
    out = os.path.join(shared_dir, "out.h5")
    assert cli.main(["make-data", inp, "--heads", "2", "--seq", "40", "--kv-seq", "33", "--dim", "4",
                     "--with-dout", "--padding", "0.2", "--dtype", "float64", "-q"]) == 0
    environ_before = dict(os.environ)
    argv = ["run", inp, "-o", out, "--device", "gpu", "--strategy", "ring", "--block-size", "5",
            "--causal", "--check"]
    if flag is not None:
        argv += ["--gpu-transport", flag]
    code = cli.main(argv)
    text, err = capsys.readouterr()
    assert comm.allgather_obj(code) == [0] * comm.size, err
    assert dict(os.environ) == environ_before  # the CLI leaves the environment alone
    if comm.rank == 0:
        assert "compute  cupy, float64" in text and "OK" in text
    # the transport the CLI's Comm actually got, as it uses it and as the output records it
    cli_comm = fake_gpu[1]
    assert cli_comm.transport == expect and cli_comm.device_transport.name == expect
    got, attrs = whole(out)
    assert attrs["device"] == "cupy" and attrs["gpu_transport"] == expect
    data, _ = whole(inp)
    ref = reference(data["q"], data["k"], data["v"], data["dout"], causal=True,
                    key_padding_mask=data["key_padding_mask"])
    for name in ("out", "dq", "dk", "dv"):
        np.testing.assert_allclose(got[name], getattr(ref, name), atol=1e-12, err_msg=name)


def test_info_on_fake_gpus_says_where_each_engine_runs(comm, capsys, fake_gpu):
    code = cli.main(["info"])
    text, err = capsys.readouterr()
    assert comm.allgather_obj(code) == [0] * comm.size, err
    if comm.rank == 0:
        line = next(ln for ln in text.splitlines() if ln.startswith("engines"))
        assert "native: usable (CPU, GPU); fused: usable (GPU); torch: " in line, line
