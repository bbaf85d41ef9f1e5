"""Data safety of the command line: one input per run, sound estimates and checks, strict input.

In-process tests run at any rank count (every rank calls ``main``); the
start-up test launches its own MPI job (serial session only). The signal
steps are in test_signal_points.py.
"""

import math
import os
import subprocess
import sys
import textwrap
import time
import warnings

import h5py
import numpy as np
import pytest

from mpiattn import cli, io
from mpiattn.cli import steps
from mpiattn.comm import node as nodes
from mpiattn.io import atomic, opening, reading, schema

from helpers import finish_group, mpiexec, run_cli as run, whole


def _on_rank0(comm, fn):
    if comm.rank == 0:
        fn()
    comm.barrier()


def _write(path, **arrays_and_attrs):
    with h5py.File(path, "w") as f:
        for k, v in arrays_and_attrs.items():
            if isinstance(v, np.ndarray):
                f.create_dataset(k, data=v)
            else:
                f.attrs[k] = v


# ------------------------------------------------------------------ D2: start-up
START = textwrap.dedent("""
    import os, sys
    open(f"started.{os.getpid()}", "w").close()
    from mpiattn import cli
    sys.argv = ["mpiattn", "info"]
    sys.exit(cli.main())  # MPI_Init waits for a peer that never comes
""")


def test_a_job_whose_peer_never_starts_ends_on_sigterm(serial_only, tmp_path):
    """D2: one MPMD rank exits at once; the others wait in MPI_Init; SIGTERM ends the job."""
    (tmp_path / "start.py").write_text(START)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("MPIATTN_TEST_RANKLOG_DIR", None)
    p = subprocess.Popen([mpiexec(), "-n", "2", sys.executable, "start.py", ":", "-n", "1", "false"],
                         cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True)
    deadline = time.monotonic() + 60
    while len([n for n in os.listdir(tmp_path) if n.startswith("started.")]) < 2:
        assert time.monotonic() < deadline, "the ranks never started"
        if p.poll() is not None:  # Open MPI's prterun ends the job itself: no hang either
            assert p.returncode != 0
            return
        time.sleep(0.05)
    time.sleep(1.0)  # (the ranks are now inside MPI_Init, waiting)
    if p.poll() is not None:
        assert p.returncode != 0
        return
    sent = time.monotonic()
    p.terminate()  # SIGTERM to mpiexec, as `timeout` or SLURM would
    code, out, err = finish_group(p, 60, "the job ignored SIGTERM during MPI_Init")
    assert time.monotonic() - sent < 20, (code, out, err)
    assert code != 0


# ------------------------------------------------------------------ D4: one input per run
def test_an_input_replaced_while_the_ranks_open_it_is_an_error(comm, capsys, shared_dir, monkeypatch):
    """D4: the last rank opens the input after it was swapped for another file: exit 1, no output."""
    inp, alt = os.path.join(shared_dir, "in.h5"), os.path.join(shared_dir, "alt.h5")
    for path, seed in ((inp, 1), (alt, 2)):
        assert run(comm, capsys, "make-data", path, "--seq", 40, "--heads", 2, "--dim", 4,
                   "--with-dout", "--seed", seed, "-q")[0] == 0
    real, opened = opening._open_read, []

    def open_read(path):
        if path == inp and comm.rank == comm.size - 1:
            opened.append(path)
            if len(opened) == 2:  # its data read (the first was rank 0's metadata, at one rank)
                os.replace(alt, inp)
        return real(path)
    for module in (schema, reading):  # where the metadata (rank 0) and the data are opened
        monkeypatch.setattr(module, "_open_read", open_read)
    if comm.rank == comm.size - 1 and comm.size > 1:
        opened.append("metadata read by rank 0")
    out = os.path.join(shared_dir, "out.h5")
    code, _, err = run(comm, capsys, "run", inp, "-o", out, "--engine", "native")
    assert code == 1
    assert comm.rank or ("changed while this run was reading it" in err and "another file" in err)
    assert not os.path.exists(out)


def test_the_output_records_which_input_it_read(comm, capsys, shared_dir):
    inp, out = os.path.join(shared_dir, "in.h5"), os.path.join(shared_dir, "out.h5")
    assert run(comm, capsys, "make-data", inp, "--seq", 30, "--heads", 2, "--dim", 4, "-q")[0] == 0
    assert run(comm, capsys, "run", inp, "-o", out, "-q", "--engine", "native")[0] == 0
    _, attrs = whole(out)
    st = os.stat(inp)
    assert (attrs["input_device"], attrs["input_inode"], attrs["input_size"],
            attrs["input_mtime_ns"]) == (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


# ------------------------------------------------------------------ D5: the space estimate
@pytest.mark.parametrize("extra", [[], ["--with-dout"], ["--with-dout", "--no-backward"]])
def test_the_space_estimate_is_the_output_written(comm, capsys, shared_dir, extra):
    """D5: the estimate before computing equals the data written (GQA, E != Ev, 3-D datasets)."""
    inp, out = os.path.join(shared_dir, "in.h5"), os.path.join(shared_dir, "out.h5")
    make = [e for e in extra if e != "--no-backward"]
    assert run(comm, capsys, "make-data", inp, "--batch", 2, "--heads", 4, "--kv-heads", 2,
               "--seq", 50, "--kv-seq", 30, "--dim", 8, "--value-dim", 5, "-q", *make)[0] == 0
    run_extra = ["--no-backward"] if "--no-backward" in extra else []
    assert run(comm, capsys, "run", inp, "-o", out, "-q", "--engine", "native", *run_extra)[0] == 0
    with h5py.File(out, "r") as f:
        written = sum(f[n].size * f[n].dtype.itemsize for n in f)
    meta = io.read_meta(inp, comm)
    inputs = io.read_input(inp, comm, meta=meta)
    estimate = steps.output_bytes(inputs, backward="--with-dout" in extra and not run_extra)
    assert estimate == written
    assert os.path.getsize(out) <= atomic.space_needed(estimate)


# ------------------------------------------------------------------ D6: the check
def test_check_passes_a_correct_result_whose_exact_gradient_is_zero(comm, capsys, shared_dir):
    """D6: one query, one key per head group: dq is exactly 0; float32 rounding must pass."""
    inp, out = os.path.join(shared_dir, "in.h5"), os.path.join(shared_dir, "out.h5")
    rng = np.random.default_rng(3)
    data = {"q": rng.standard_normal((1, 4, 1, 16)).astype(np.float32),
            "k": rng.standard_normal((1, 2, 1, 16)).astype(np.float32),
            "v": rng.standard_normal((1, 2, 1, 16)).astype(np.float32),
            "dout": rng.standard_normal((1, 4, 1, 16)).astype(np.float32)}
    _on_rank0(comm, lambda: _write(inp, **data))
    from mpiattn.kernels import torch_ops
    for engine in ("native", "torch") if torch_ops.available() is None else ("native",):
        code, text, err = run(comm, capsys, "run", inp, "-o", out, "--check", "--force",
                              "--engine", engine)
        assert code == 0, err
        assert comm.rank or "OK" in text


def test_check_errors_scale_by_the_operands():
    from mpiattn.cli.check import check_errors
    from mpiattn.kernels.reference import Exact

    ref = Exact(out=np.zeros((1, 1, 2, 2)), lse=np.array([[[0.0, -np.inf]]]),
                dq=np.zeros((1, 1, 2, 2)), dk=np.zeros((1, 1, 2, 2)), dv=np.zeros((1, 1, 2, 2)))
    q = k = v = dout = np.full((1, 1, 2, 2), 2.0)
    got = {"dq": np.full((1, 1, 2, 2), 1e-6), "lse": np.array([[[1e-6, -np.inf]]])}
    e = check_errors(got, ref, q, k, v, dout, scale=0.5)
    # dq: |s| |dout| |v| max|k| = 0.5 * sqrt(8) * sqrt(8) * 2 = 8; lse: 1 + 0.5 * 8 = 5
    assert math.isclose(e["dq"], 1e-6 / 8) and math.isclose(e["lse"], 1e-6 / 5)
    assert check_errors({"lse": np.array([[[0.0, 0.0]]])}, ref, q, k, v)["lse"] == math.inf


def test_a_failed_check_leaves_no_output(comm, capsys, shared_dir, monkeypatch):
    """D6: the check runs before the write: a failed check publishes nothing, an old output stays."""
    inp, out = os.path.join(shared_dir, "in.h5"), os.path.join(shared_dir, "out.h5")
    assert run(comm, capsys, "make-data", inp, "--seq", 40, "--heads", 2, "--dim", 4,
               "--with-dout", "-q")[0] == 0
    _on_rank0(comm, lambda: open(out, "w").write("earlier output"))
    real = steps._compute

    def wrong(*a, **kw):
        results = real(*a, **kw)
        results["dv"] = results["dv"] + 1
        return results
    monkeypatch.setattr(steps, "_compute", wrong)
    code, _, err = run(comm, capsys, "run", inp, "-o", out, "--check", "--force", "--engine", "native")
    assert code == 1 and (comm.rank or ("check failed" in err and "no output was written" in err))
    with open(out) as f:
        assert f.read() == "earlier output"
    assert sorted(n for n in os.listdir(shared_dir) if ".mpiattn-" in n) == []


# ------------------------------------------------------------------ smaller items
def test_a_symlink_loop_is_named_as_such(comm, capsys, shared_dir):
    loop = os.path.join(shared_dir, "loop.h5")
    _on_rank0(comm, lambda: os.symlink(loop, loop))
    code, _, err = run(comm, capsys, "run", loop, "-o", os.path.join(shared_dir, "o.h5"))
    assert code == 1 and (comm.rank or "symbolic link loop" in err)
    gone = os.path.join(shared_dir, "gone.h5")
    _on_rank0(comm, lambda: os.symlink(os.path.join(shared_dir, "nothing.h5"), gone))
    code, _, err = run(comm, capsys, "run", gone, "-o", os.path.join(shared_dir, "o.h5"))
    assert code == 1 and (comm.rank or "symbolic link to" in err and "does not exist" in err)
    dirloop = os.path.join(shared_dir, "dirloop")
    _on_rank0(comm, lambda: os.symlink(dirloop, dirloop))
    code, _, err = run(comm, capsys, "make-data", os.path.join(dirloop, "x.h5"), "-q")
    assert code == 1 and (comm.rank or "symbolic link loop" in err)


BAD_ATTRS = [("scale", "0.5", "must be a number"), ("scale", True, "must be a number"),
             ("scale", np.nan, "must be finite"), ("scale", np.inf, "must be finite"),
             ("causal", "yes", "must be a boolean"), ("causal", 2, "must be a boolean")]


@pytest.mark.parametrize("name,value,message", BAD_ATTRS,
                         ids=[f"{n}={v!r}" for n, v, _ in BAD_ATTRS])
def test_attribute_types_are_checked_before_reading(comm, capsys, shared_dir, monkeypatch,
                                                    name, value, message):
    inp = os.path.join(shared_dir, "in.h5")
    x = np.ones((1, 1, 4, 2), dtype=np.float32)
    _on_rank0(comm, lambda: _write(inp, q=x, k=x, v=x, **{name: value}))
    monkeypatch.setattr(reading, "_read_segments", lambda *a: pytest.fail("read the data"))
    code, _, err = run(comm, capsys, "run", inp, "-o", os.path.join(shared_dir, "o.h5"))
    assert code == 1 and (comm.rank or (f"attribute '{name}'" in err and message in err))


def test_zero_feature_size_is_rejected_before_reading(comm, capsys, shared_dir, monkeypatch):
    inp = os.path.join(shared_dir, "in.h5")
    x = np.ones((1, 1, 4, 0), dtype=np.float32)
    _on_rank0(comm, lambda: _write(inp, q=x, k=x, v=np.ones((1, 1, 4, 2), np.float32)))
    monkeypatch.setattr(reading, "_read_segments", lambda *a: pytest.fail("read the data"))
    code, text, err = run(comm, capsys, "run", inp, "-o", os.path.join(shared_dir, "o.h5"))
    assert code == 1 and (comm.rank or "feature size E = 0" in err) and "sqrt(0)" not in text


def test_threads_are_respected_without_contrary_advice(comm, capsys, monkeypatch):
    monkeypatch.setattr(nodes, "blas_threads", lambda: 100000)  # whatever the node: too many
    warned = []
    for argv in (["info", "--threads", 100000], ["info"]):
        monkeypatch.setattr(comm, "_threads_checked", False)  # (checked once per Comm: as if new)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            code, text, _ = run(comm, capsys, *argv)
        assert code == 0
        warned.append(bool([w for w in caught if issubclass(w.category, nodes.OversubscriptionWarning)]))
        if comm.rank == 0 and len(argv) > 1:
            line = [ln for ln in text.splitlines() if ln.startswith("threads")][0]
            count = int(line.split("BLAS")[1].split()[0])
            assert "--threads 100000" in line
            assert count == 100000 or f"the BLAS library runs at most {count}" in line, line
    node = comm.node
    assert warned[0] is False  # the user asked for them: no advice against it
    assert warned[1] is (node.local_rank == 0 and node.local_size > 1)  # (the control)
