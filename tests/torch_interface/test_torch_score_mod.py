"""mpiattn.torch with a ``score_mod`` written in torch ops: values, gradients, and the gradients
of the tensors it captures, against torch autograd on the whole (B, H, N, M) scores in float64."""

import numpy as np
import pytest
from mpi4py import MPI

from mpiattn.strategies import registry

torch = pytest.importorskip("torch")
mt = pytest.importorskip("mpiattn.torch")

B, H, HKV, N, E = 2, 4, 2, 23, 8
STRATEGIES = [s for s in registry.variants(MPI.COMM_WORLD.Get_size())
              if s in ("ring", "allgather", "ulysses", "materialized", "double-ring")]
GLOBAL_TEMP = torch.tensor([1.0, 0.5, 2.0, 0.8], dtype=torch.float64, requires_grad=True)


def _reference(Q, K, V, dO, fn):
    q, k, v = (x.detach().clone().requires_grad_(True) for x in (Q, K, V))
    G = H // HKV
    x = q @ k.repeat_interleave(G, 1).transpose(-1, -2) / np.sqrt(E)
    idx = [torch.arange(n).reshape([-1 if a == axis else 1 for a in range(4)])
           for axis, n in enumerate((B, H, N, N))]
    y = fn(x, *idx).masked_fill(idx[3] > idx[2], float("-inf"))
    out = torch.softmax(y, -1) @ v.repeat_interleave(G, 1)
    (out * dO).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_captured_tensors_get_their_gradients(comm, strategy):
    if strategy == "ulysses" and (H % comm.size or HKV % comm.size):
        pytest.skip("uneven head splits: the contract's heads cases and the search cover them")
    g = torch.Generator().manual_seed(3)
    Q, K, V = (torch.randn(B, h, N, E, dtype=torch.float64, generator=g) for h in (H, HKV, HKV))
    dO = torch.randn(B, H, N, E, dtype=torch.float64, generator=g)
    table = torch.randn(H, 2 * N, dtype=torch.float64, generator=g).requires_grad_(True)

    def rel_bias(s, b, h, q, kv):  # a closure over a bias table, a global temperature
        return s * GLOBAL_TEMP[h] + table[h, q - kv + N]

    if GLOBAL_TEMP.grad is not None:
        GLOBAL_TEMP.grad = None
    qs, ks, vs = (mt.shard(x, dim=2).detach().requires_grad_(True) for x in (Q, K, V))
    out = mt.attention(qs, ks, vs, causal=True, score_mod=rel_bias, strategy=strategy, block_size=8)
    (out * mt.shard(dO, dim=2)).sum().backward()
    mt.reduce_gradients(table)
    mt.reduce_gradients(GLOBAL_TEMP)
    got = [mt.gather(x, dim=2) for x in (out.detach(), qs.grad, ks.grad, vs.grad)]
    got_table, got_temp = table.grad.clone(), GLOBAL_TEMP.grad.clone()
    table.grad, GLOBAL_TEMP.grad = None, None
    t2, temp2 = table.detach().clone().requires_grad_(True), GLOBAL_TEMP.detach().clone().requires_grad_(True)
    ref = _reference(Q, K, V, dO, lambda s, b, h, q, kv: s * temp2[h] + t2[h, q - kv + N])
    for name, a, r in zip(("out", "dq", "dk", "dv"), got, ref):
        torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-10, msg=name)
    torch.testing.assert_close(got_table, t2.grad, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(got_temp, temp2.grad, rtol=1e-10, atol=1e-10)


def test_a_score_mod_in_float32_and_a_plan_beside_it(comm):
    g = torch.Generator().manual_seed(5)
    Q, K, V = (torch.randn(B, h, N, E, generator=g) for h in (H, HKV, HKV))
    qs, ks, vs = (mt.shard(x, dim=2).detach().requires_grad_(True) for x in (Q, K, V))

    def cap(s, b, h, q, kv):
        return 3.0 * torch.tanh(s / 3.0)

    out = mt.attention(qs, ks, vs, causal=True, score_mod=cap)
    out.sum().backward()
    ref = _reference(Q.double(), K.double(), V.double(), torch.ones(B, H, N, E, dtype=torch.float64),
                     lambda s, b, h, q, kv: 3.0 * torch.tanh(s / 3.0))
    torch.testing.assert_close(mt.gather(out.detach(), dim=2).double(), ref[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mt.gather(qs.grad, dim=2).double(), ref[1], rtol=1e-4, atol=1e-5)
    from mpiattn.torch.functions import plan_for

    plan = plan_for(None, qs, ks, vs, comm, causal=True)
    with pytest.raises(ValueError, match="a plan .planned=. does not take a score_mod"):
        mt.attention(qs, ks, vs, causal=True, score_mod=cap, planned=plan)
