"""``run --device gpu`` through the fake CuPy of tests/fake_cupy.py (no GPU needed).

Exercises the CLI's GPU path: device binding, host slabs uploaded to the
"device", the transport flag, results brought back to the host and written.
The CLI gets a communicator of its own (fresh Comm cache), freed afterwards.
"""

import os

import h5py
import numpy as np
import pytest

import fake_cupy
from mpiattn import cli, gpu
from mpiattn import comm as comm_module
from mpiattn.reference import reference




@pytest.fixture
def fake_gpu(monkeypatch, comm):
    monkeypatch.setattr(gpu, "_STREAMS", {})
    monkeypatch.setattr(gpu, "_UPLOADERS", {})
    monkeypatch.setattr(gpu, "_SAID", set())
    monkeypatch.setattr(comm_module, "_CACHE", {})  # the CLI's get_comm() makes a Comm of its own
    monkeypatch.setenv("MPIATTN_GPU_TRANSPORT", "auto")  # restored afterwards (the CLI sets it)
    cp = fake_cupy.install(monkeypatch, device_count=comm.size)  # one GPU per rank
    fake_cupy._state.bus_id = f"0000:{comm.rank:02x}:00.0"
    yield cp
    for _, c in list(comm_module._CACHE.values()):
        if getattr(c, "device_transport", None) is not None:
            c.device_transport.close()
        c.mpi.Free()
    fake_cupy.shutdown()


@pytest.mark.parametrize("transport", ["staged", "nccl"])
def test_run_on_fake_gpu(comm, capsys, shared_dir, fake_gpu, transport):
    inp = os.path.join(shared_dir, "in.h5")
    out = os.path.join(shared_dir, "out.h5")
    assert cli.main(["make-data", inp, "--heads", "2", "--seq", "40", "--kv-seq", "33", "--dim", "4",
                     "--with-dout", "--padding", "0.2", "--dtype", "float64", "-q"]) == 0
    code = cli.main(["run", inp, "-o", out, "--device", "gpu", "--gpu-transport", transport,
                     "--strategy", "ring", "--block-size", "5", "--causal", "--check"])
    text, err = capsys.readouterr()
    assert comm.allgather_obj(code) == [0] * comm.size, err
    if comm.rank == 0:
        assert "compute  cupy, float64" in text and "OK" in text
    with h5py.File(inp, "r") as f:
        data = {name: f[name][...] for name in f}
    with h5py.File(out, "r") as f:
        got = {name: f[name][...] for name in f}
        assert f.attrs["device"] == "cupy"
        if comm.size > 1:  # (one rank never communicates: any transport will do)
            assert f.attrs["gpu_transport"] == transport
    ref = reference(data["q"], data["k"], data["v"], data["dout"], causal=True,
                    key_padding_mask=data["key_padding_mask"])
    for name in ("out", "dq", "dk", "dv"):
        np.testing.assert_allclose(got[name], getattr(ref, name), atol=1e-12, err_msg=name)
    assert os.environ["MPIATTN_GPU_TRANSPORT"] == transport
