"""mpiattn.torch on CUDA tensors (DLPack to CuPy, torch's stream): skipped without a GPU.

Run by a session or job that has one (``jobs/gpu_check.sh`` runs the CuPy suite; these run
with ``python -m pytest tests/torch_interface -q --with-mpi`` there, at 1 and 2 ranks).
"""

import contextlib

import pytest
from mpi4py import MPI

torch = pytest.importorskip("torch")
mt = pytest.importorskip("mpiattn.torch")

if not torch.cuda.is_available():
    pytest.skip("no CUDA device for torch here", allow_module_level=True)
cupy = pytest.importorskip("cupy")


def _bind(comm):
    from mpiattn import gpu
    gpu.bind_device(MPI.COMM_WORLD)
    return torch.device("cuda", cupy.cuda.Device().id)


def test_gpu_torch_attention_matches_the_cpu(comm):
    dev = _bind(comm)
    g = torch.Generator().manual_seed(0)
    Q, K, V = (torch.randn(1, 4, 37, 16, generator=g, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    dO = torch.randn(1, 4, 37, 16, generator=g, dtype=torch.float64)
    outs, grads = [], []
    for device in ("cpu", dev):
        xs = [x.detach().to(device).requires_grad_() for x in (Q, K, V)]
        s = torch.cuda.Stream(device=dev) if device != "cpu" else None
        with torch.cuda.stream(s) if s is not None else contextlib.nullcontext():
            # on a side stream: mpiattn's CuPy work must follow torch's current stream
            out = mt.gather(mt.attention(*(mt.shard(x) for x in xs), causal=True))
            out.backward(dO.to(device))
        if s is not None:
            torch.cuda.current_stream(dev).wait_stream(s)
        outs.append(out.detach().cpu())
        grads.append([x.grad.cpu() for x in xs])
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-12, atol=1e-12)
    for a, b in zip(grads[1], grads[0]):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-12)


def test_gpu_torch_bfloat16_is_refused_with_the_reason(comm):
    dev = _bind(comm)
    q = torch.randn(1, 2, 8, 16, device=dev, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="CuPy has no bfloat16"):
        mt.attention(q, q, q)


def test_gpu_torch_reduce_gradients(comm):
    dev = _bind(comm)
    p = torch.nn.Parameter(torch.zeros(5, device=dev))
    p.grad = torch.full((5,), float(comm.rank + 1), device=dev)
    mt.reduce_gradients([p], comm)
    want = comm.size * (comm.size + 1) / 2
    torch.testing.assert_close(p.grad.cpu(), torch.full((5,), want))
