"""mpiattn.torch with the score modifiers: learnable sinks, softcap, ALiBi, masks, max logit.

Compared with float64 torch autograd of the whole sequence, the modifiers written out in
the test: every rank's rows of the output and of the gradients of
``q``, ``k``, ``v``; the sinks' gradient is each rank's part, and ``reduce_gradients``
sums the parts into the single-process gradient.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
mt = pytest.importorskip("mpiattn.torch")

import mpiattn  # noqa: E402

from helpers import visible_matrix  # noqa: E402


def _block_mod(b, h, i, j):
    return (i // 4 == j // 4) | (j < 2)


@pytest.mark.parametrize("return_lse", [False, True])
def test_learnable_sinks_and_every_modifier_match_single_process_autograd(comm, return_lse):
    rng = np.random.default_rng(21)
    B, H, Hkv, N, E = 2, 4, 2, 11, 6
    Q, K, V, dO = (rng.standard_normal(s) for s in ((B, H, N, E), (B, Hkv, N, E), (B, Hkv, N, E),
                                                      (B, H, N, E)))
    dL = rng.standard_normal((B, H, N))
    slopes = rng.uniform(0.1, 0.4, H)
    s0 = rng.standard_normal(H)
    lay = "zigzag"
    sinks = torch.tensor(s0, requires_grad=True)
    q, k, v = (torch.tensor(mpiattn.shard(x, layout=lay), requires_grad=True) for x in (Q, K, V))
    details = {}
    got = mt.attention(q, k, v, causal=True, layout=lay, block_size=3, softcap=2.5,
                       alibi_slopes=slopes, mask_mod=_block_mod, sinks=sinks, max_logit=True,
                       return_lse=return_lse, details=details)
    out, lse = got if return_lse else (got, None)
    loss = (out * torch.tensor(mpiattn.shard(dO, layout=lay))).sum()
    if return_lse:
        loss = loss + (lse * torch.tensor(mpiattn.shard(dL, axis=-1, layout=lay))).sum()
    loss.backward()
    mt.reduce_gradients([sinks], comm=comm.mpi)

    vis = visible_matrix(B, N, N, True)[:, None] & _block_mod(*np.ix_(range(B), range(H), range(N),
                                                                      range(N)))
    bias = -slopes[None, :, None, None] * np.abs(np.arange(N)[:, None] - np.arange(N)[None, :])
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (Q, K, V))
    ts = torch.tensor(s0, requires_grad=True)
    G = H // Hkv
    x = (tq @ tk.repeat_interleave(G, 1).transpose(-1, -2)) / np.sqrt(E)
    y = 2.5 * torch.tanh(x / 2.5) + torch.tensor(bias)
    y = y.masked_fill(~torch.tensor(np.broadcast_to(vis, y.shape).copy()), float("-inf"))
    ref_lse = torch.logsumexp(torch.cat([y, ts.view(1, H, 1, 1).expand(B, H, N, 1)], -1), -1)
    ref_out = torch.exp(y - ref_lse[..., None]) @ tv.repeat_interleave(G, 1)
    ref_loss = (ref_out * torch.tensor(dO)).sum()
    if return_lse:
        ref_loss = ref_loss + (ref_lse * torch.tensor(dL)).sum()
    ref_loss.backward()

    sh = lambda t, axis=-2: mpiattn.shard(t.detach().numpy(), axis=axis, layout=lay)  # noqa: E731
    np.testing.assert_allclose(out.detach().numpy(), sh(ref_out), rtol=1e-11, atol=1e-11)
    if return_lse:
        np.testing.assert_allclose(lse.detach().numpy(), sh(ref_lse, -1), rtol=1e-11, atol=1e-11)
    for mine, ref in ((q, tq), (k, tk), (v, tv)):
        np.testing.assert_allclose(mine.grad.numpy(), sh(ref.grad), rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(sinks.grad.numpy(), ts.grad.numpy(), rtol=1e-10, atol=1e-10)
    xm = x.detach().masked_fill(~torch.tensor(np.broadcast_to(vis, x.shape).copy()), float("-inf"))
    np.testing.assert_allclose(details["max_logit"], xm.amax(dim=(0, 2, 3)).numpy(), rtol=1e-12)


def test_sinks_given_as_an_array_need_no_gradient(comm):
    x = torch.tensor(mpiattn.shard(np.random.default_rng(2).standard_normal((1, 2, 4 * comm.size, 4))),
                     requires_grad=True)
    out = mt.attention(x, x, x, sinks=np.array([0.0, 1.0]))
    out.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_a_torch_engine_call_with_a_softcap_is_refused_on_every_rank(comm):
    x = torch.tensor(mpiattn.shard(np.zeros((1, 2, 4 * comm.size, 8))))
    with pytest.raises(ValueError, match="no softcap"):
        mt.attention(x, x, x, softcap=5.0, engine="torch")


def test_a_layer_with_learnable_sinks_trains_them_as_one_process_would(comm):
    """The layer's sinks parameter gets the single-process gradient after reduce_gradients."""
    torch.manual_seed(0)
    X = torch.randn(1, 5 * comm.size + 1, 8, dtype=torch.float64)
    layers = [mt.MultiheadAttention(8, 2, batch_first=True, dtype=torch.float64, sinks=True,
                                    comm=comm.mpi, causal=True) for _ in range(2)]
    with torch.no_grad():
        for layer in layers:
            layer.sinks.copy_(torch.tensor([0.3, -0.7], dtype=torch.float64))
    x = mt.shard(X, dim=1, comm=comm.mpi)
    y, _ = layers[0](x, x, x)
    (y ** 2).sum().backward()
    mt.reduce_gradients(layers[0], comm=comm.mpi)
    from mpi4py import MPI

    whole, _ = layers[1](X, X, X, comm=MPI.COMM_SELF)
    (whole ** 2).sum().backward()
    np.testing.assert_allclose(layers[0].sinks.grad.numpy(), layers[1].sinks.grad.numpy(),
                               rtol=1e-10, atol=1e-12)
    assert layers[0].sinks.grad.abs().sum() > 0
