"""The library's dense reference (``--check``, the benchmark's peer): against loops and finite differences."""

import math

import numpy as np
import pytest

from mpiattn.kernels.reference import dense_attention
from mpiattn.masks import MaskSpec


def reference(*arrays, causal=False, **kw):
    return dense_attention(*arrays, mask=MaskSpec(causal=causal), **kw)


def _problem(seed, B=2, H=4, Hkv=2, N=5, M=7, E=3, Ev=2):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, H, N, E))
    k = rng.standard_normal((B, Hkv, M, E))
    v = rng.standard_normal((B, Hkv, M, Ev))
    dout = rng.standard_normal((B, H, N, Ev))
    mask = rng.random((B, M)) < 0.3
    mask[1, 0] = True  # with causal: query 0 of batch 1 sees no key
    return q, k, v, dout, mask


def _loops(q, k, v, causal, scale, mask):
    """out and lse by explicit loops over visible keys."""
    B, H, N, _ = q.shape
    Hkv, M, Ev = k.shape[1], k.shape[2], v.shape[3]
    out, lse = np.zeros((B, H, N, Ev)), np.full((B, H, N), -np.inf)
    for b in range(B):
        for h in range(H):
            kv = h // (H // Hkv)
            for i in range(N):
                js = [j for j in range(M) if not mask[b, j] and not (causal and j > i)]
                if not js:
                    continue
                s = [scale * float(q[b, h, i] @ k[b, kv, j]) for j in js]
                top = max(s)
                w = [math.exp(x - top) for x in s]
                lse[b, h, i] = top + math.log(sum(w))
                out[b, h, i] = sum(wj * v[b, kv, j] for wj, j in zip(w, js)) / sum(w)
    return out, lse


@pytest.mark.parametrize("causal", [False, True])
def test_forward_matches_loops(causal):
    q, k, v, _, mask = _problem(1)
    got = reference(q, k, v, causal=causal, key_padding_mask=mask, block_rows=2)
    out, lse = _loops(q, k, v, causal, 1 / math.sqrt(3), mask)
    np.testing.assert_allclose(got.out, out, atol=1e-13)
    assert np.array_equal(np.isinf(got.lse), np.isinf(lse))
    np.testing.assert_allclose(got.lse[np.isfinite(lse)], lse[np.isfinite(lse)], atol=1e-13)
    assert got.dq is None
    if causal:
        assert np.isinf(got.lse[1, :, 0]).all() and not got.out[1, :, 0].any()


@pytest.mark.parametrize("causal", [False, True])
def test_gradients_match_finite_differences(causal):
    q, k, v, dout, mask = _problem(2)
    scale = 0.7
    got = reference(q, k, v, dout, causal=causal, scale=scale, key_padding_mask=mask, block_rows=3)

    def loss(q, k, v):
        return float((reference(q, k, v, causal=causal, scale=scale, key_padding_mask=mask).out
                      * dout).sum())

    eps = 1e-6
    rng = np.random.default_rng(0)
    for which, grad in (("q", got.dq), ("k", got.dk), ("v", got.dv)):
        args = {"q": q, "k": k, "v": v}
        x = args[which]
        for flat in rng.choice(x.size, size=12, replace=False):
            idx = np.unravel_index(flat, x.shape)
            plus, minus = x.copy(), x.copy()
            plus[idx] += eps
            minus[idx] -= eps
            fd = (loss(**{**args, which: plus}) - loss(**{**args, which: minus})) / (2 * eps)
            assert abs(fd - grad[idx]) < 1e-7, (which, idx, fd, grad[idx])
    if causal:  # the query that sees nothing has zero gradient
        assert not got.dq[1, :, 0].any()


def test_rejects_bad_shapes():
    q, k, v, dout, mask = _problem(3)
    with pytest.raises(ValueError):
        reference(q, k[:, :, :-1], v)
    with pytest.raises(ValueError):
        reference(q[:, :3], k, v)  # 3 heads over 2 kv heads
    with pytest.raises(ValueError):
        reference(q, k, v, key_padding_mask=mask[:, :-1])
    with pytest.raises(ValueError):
        reference(q, k, v, dout[..., :1])


@pytest.mark.parametrize("block_rows", [None, 2])
def test_the_reference_with_every_score_modifier_matches_torch_autograd(block_rows):
    """The reference's modifiers (``--check``'s) against the tests' own torch reference."""
    pytest.importorskip("torch")
    from helpers import torch_reference, visible_matrix

    q, k, v, dout, _ = _problem(7, N=6, M=9)
    B, H, N, M = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    rng = np.random.default_rng(8)
    slopes, sinks = rng.uniform(0.1, 0.5, (B, H)), rng.standard_normal(H)
    fmask = rng.standard_normal((1, H, N, M))
    fmask[0, 0, :, :3] = -np.inf
    mod = lambda b, h, i, j: (j + h) % 3 != 0  # noqa: E731
    got = dense_attention(q, k, v, dout, mask=MaskSpec(causal=True, diagonal=M - N),
                          block_rows=block_rows, softcap=1.5, alibi_slopes=slopes,
                          attn_mask=fmask, mask_mod=mod, sinks=sinks)
    b, h, i, j = np.ix_(range(B), range(H), range(N), range(M))
    vis = visible_matrix(B, N, M, "bottom-right")[:, None] & mod(b, h, i, j)
    dist = np.abs(np.arange(N)[:, None] + M - N - np.arange(M)[None, :])
    ref = torch_reference(q, k, v, dout, vis, softcap=1.5, bias=-slopes[:, :, None, None] * dist + fmask,
                          sinks=sinks)
    for name, a, r in zip(("out", "lse", "dq", "dk", "dv", "dsinks", "max_logit"),
                          (*got[:6], got.max_logit), ref):
        np.testing.assert_allclose(a, r, rtol=1e-12, atol=1e-12, err_msg=name)
