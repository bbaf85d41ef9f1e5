"""The score modifiers (softcap, ALiBi, attn_mask, mask_mod, sinks, max_logit) on every strategy.

Each case is compared, on the gathered arrays, with a float64 reference written here in torch
with autograd (the gradients, the sinks' included, come from torch, not from the formulas the
library uses), the formulas of the modifiers written out once:

    x = s q.k;  y = c tanh(x / c);  y += -slope |i + d - j| + float mask;  hidden -> -inf
    lse = log(exp(sink) + sum_j exp(y));  out = sum_j exp(y - lse) v_j
"""

import functools
import zlib

import numpy as np
import pytest

import mpiattn
from mpiattn.strategies import registry

from helpers import host, torch_reference, visible_matrix

torch = pytest.importorskip("torch")

STRATEGIES = list(dict.fromkeys(name for P in range(1, 5) for name in registry.variants(P)))


def _mask_mod(b, h, i, j):
    """Block-diagonal documents of 9 rows per head-dependent phase, and every fifth key of batch 1
    hidden: it reads every index."""
    return ((i + h) // 9 == (j + h) // 9) & ~((b == 1) & (j % 5 == 0))


def _mask_mod_dense(B, H, N, M):
    b, h, i, j = np.ix_(np.arange(B), np.arange(H), np.arange(N), np.arange(M))
    return _mask_mod(b, h, i, j)


MODS = {
    "softcap": dict(softcap=1.5),
    "alibi": dict(alibi=True),
    "bool-mask": dict(attn_mask="bool"),
    "float-mask": dict(attn_mask="float"),
    "mask-mod": dict(mask_mod=True),
    "sinks": dict(sinks=True),
    "max-logit": dict(max_logit=True),
    "all": dict(softcap=2.0, alibi=True, attn_mask="float", mask_mod=True, sinks=True, max_logit=True),
    "sinks-softcap-bool": dict(softcap=0.7, attn_mask="bool", sinks=True),
}

CASES = [  # (name, dtype, B, H, Hkv, N, M, causal, window, layout)
    ("f64-causal", "float64", 2, 4, 2, 37, 37, True, None, "contiguous"),
    ("f64-zigzag-window", "float64", 2, 4, 4, 29, 29, False, (6, 3), "zigzag"),
    ("f32-bottom-right-mqa", "float32", 2, 4, 1, 13, 31, "bottom-right", None, "contiguous"),
]


def _inputs(case, mods):
    name, dt, B, H, Hkv, N, M, causal, window, layout = case
    rng = np.random.default_rng(zlib.crc32(repr((name, sorted(mods.items()))).encode()))
    Q = rng.standard_normal((B, H, N, 8)).astype(dt)
    K = rng.standard_normal((B, Hkv, M, 8)).astype(dt)
    V = rng.standard_normal((B, Hkv, M, 8)).astype(dt)
    dO = rng.standard_normal((B, H, N, 8)).astype(dt)
    vis = visible_matrix(B, N, M, causal, window)[:, None]
    kw, bias = {}, None
    if mods.get("alibi"):
        slopes = rng.uniform(0.05, 0.5, (B, H))
        kw["alibi_slopes"] = slopes
        d = M - N if causal == "bottom-right" else 0
        dist = np.abs(np.arange(N)[:, None] + d - np.arange(M)[None, :])
        bias = -slopes[:, :, None, None] * dist
    if mods.get("attn_mask") == "bool":
        full = rng.random((B, 1, N, M)) < 0.7
        full[0, 0, 3] = False  # a query that sees nothing
        kw["attn_mask"] = full
        vis = vis & full
    if mods.get("attn_mask") == "float":
        full = rng.standard_normal((1, H, N, M))
        full[0, 1, :, :4] = -np.inf
        kw["attn_mask"] = full
        bias = full if bias is None else bias + full
    if mods.get("mask_mod"):
        kw["mask_mod"] = _mask_mod
        vis = vis & _mask_mod_dense(B, H, N, M)
    if mods.get("sinks"):
        kw["sinks"] = rng.standard_normal(H)
    if mods.get("softcap"):
        kw["softcap"] = mods["softcap"]
    if mods.get("max_logit"):
        kw["max_logit"] = True
    return (Q, K, V, dO), vis, bias, kw, dict(causal=causal, window=window, layout=layout)


#: Every modifier alone and combined on the ring; the combinations on every strategy.
GRID = ([("ring", case, mods) for case in CASES for mods in MODS]
        + [(strategy, case, mods) for strategy in STRATEGIES if strategy != "ring" for case in CASES
           for mods in ("all", "sinks-softcap-bool")])


@functools.lru_cache(maxsize=None)
def _expected(case, mods):
    """The inputs and the torch reference of a case, once per process (every strategy reuses it)."""
    arrays, vis, bias, kw, opts = _inputs(case, MODS[mods])
    ref = torch_reference(*arrays, vis, softcap=kw.get("softcap"), bias=bias, sinks=kw.get("sinks"))
    return arrays, kw, opts, ref


@pytest.mark.parametrize("strategy, case, mods", GRID,
                         ids=[f"{s}-{c[0]}-{m}" for s, c, m in GRID])
def test_every_modifier_on_every_strategy(comm, strategy, case, mods):
    P = comm.size
    if strategy.startswith("hybrid:"):
        u, r = (int(x) for x in strategy.split(":")[1].split("x"))
        if u * r != P:
            pytest.skip(f"{strategy} needs {u * r} ranks")
    (Q, K, V, dO), kw, opts, ref = _expected(case, mods)
    B, H, N = Q.shape[:3]
    Hkv, M = K.shape[1], K.shape[2]
    lay = opts["layout"]
    if strategy == "ulysses" and (H % P or Hkv % P):
        pytest.skip("ulysses needs the heads divisible by P")
    if strategy.startswith("hybrid:") and (H % u or (Hkv % u and u % Hkv)):
        pytest.skip("the heads do not divide into the groups")
    sq = lambda x, axis=-2: mpiattn.shard(x, axis=axis, layout=lay)  # noqa: E731
    args = dict(kw)
    if "attn_mask" in args:
        args["attn_mask"] = sq(args["attn_mask"])
    if "softcap" in args or "max_logit" in args:
        opts = dict(opts, **{k: args.pop(k) for k in ("softcap", "max_logit") if k in args})
    q, k, v, do = sq(Q), sq(K), sq(V), sq(dO)
    refuses = ("attn_mask" in kw and P > 1 and (strategy == "ulysses" or (
        strategy.startswith("hybrid:") and u > 1)))
    if refuses:
        with pytest.raises(ValueError, match="attn_mask"):
            mpiattn.attention(q, k, v, strategy=strategy, block_size=5, **args, **opts)
        return
    used = {}
    out, lse = mpiattn.attention(q, k, v, strategy=strategy, block_size=5, details=used, **args,
                                 **opts)
    grads = mpiattn.attention_backward(do, q, k, v, out, lse, strategy=strategy, block_size=5,
                                       **args, **opts)
    assert len(grads) == (4 if "sinks" in kw else 3)
    g = lambda x, axis=-2: host(mpiattn.gather(x, axis=axis, layout=lay, root=None))  # noqa: E731
    got = [g(out), g(lse, -1), g(grads[0]), g(grads[1]), g(grads[2])]
    tol = 1e-10 if Q.dtype == np.float64 else 2e-4
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, ref[:5]):
        fin = np.isfinite(b)
        assert np.array_equal(np.isfinite(a), fin), name
        scale = max(1.0, float(np.abs(b[fin]).max(initial=0)))
        assert np.abs(a[fin] - b[fin]).max(initial=0) <= tol * scale, name
    if "sinks" in kw:
        assert np.allclose(grads[3], ref[5], rtol=tol * 10, atol=tol * 10)
        assert grads[3].dtype == np.float64 and grads[3].shape == (H,)
    if "max_logit" in kw:
        assert used["max_logit"].shape == (H,)
        np.testing.assert_allclose(used["max_logit"], ref[6], rtol=tol, atol=tol)


def test_a_row_with_nothing_visible_gets_the_sink_alone(comm):
    """A query that sees no key: ``out = 0``, ``lse = sinks[h]``, zero gradients."""
    x = np.random.default_rng(3).standard_normal((1, 2, 4 * comm.size, 4))
    sinks = np.array([0.5, -2.0])
    none = lambda b, h, i, j: (j < 0)  # noqa: E731 - hides everything
    x_r = mpiattn.shard(x)
    out, lse = mpiattn.attention(x_r, x_r, x_r, mask_mod=none, sinks=sinks)
    assert np.all(out == 0)
    assert np.array_equal(lse, np.broadcast_to(sinks[None, :, None], lse.shape))
    dq, dk, dv, ds = mpiattn.attention_backward(np.ones_like(out), x_r, x_r, x_r, out, lse,
                                                mask_mod=none, sinks=sinks)
    assert not dq.any() and not dk.any() and not dv.any() and not ds.any()


def test_bad_modifiers_are_refused_on_every_rank(comm):
    x = mpiattn.shard(np.zeros((2, 4, 4 * comm.size, 8)))
    n = x.shape[2]
    bad = [
        (dict(softcap=0.0), ValueError, "softcap"),
        (dict(softcap="2"), TypeError, "softcap"),
        (dict(alibi_slopes=np.ones(3)), ValueError, "alibi_slopes"),
        (dict(sinks=np.ones((2, 4))), ValueError, "sinks"),
        (dict(sinks=np.array([0, 1, np.nan, 0.0])), ValueError, "sinks"),
        (dict(attn_mask=np.ones((2, 4, n, 3), dtype=bool)), ValueError, "attn_mask"),
        (dict(attn_mask=np.ones((2, 4, n + 1, 4 * comm.size), dtype=bool)), ValueError, "attn_mask"),
        (dict(attn_mask=np.ones((2, 4, n, 4 * comm.size), dtype=np.int32)), TypeError, "attn_mask"),
        (dict(mask_mod=lambda b, h, i, j: i - j), TypeError, "mask_mod"),
        (dict(mask_mod=3), TypeError, "mask_mod"),
        (dict(max_logit=1), TypeError, "max_logit"),
    ]
    for kw, err, word in bad:
        with pytest.raises(err, match=word):
            mpiattn.attention(x, x, x, **kw)


def test_an_engine_without_a_modifier_is_not_chosen_and_is_refused_by_name(comm):
    x = mpiattn.shard(np.random.default_rng(0).standard_normal((1, 2, 4 * comm.size, 8)))
    used = {}
    mpiattn.attention(x, x, x, softcap=3.0, details=used)
    assert used["engine"] == "native"
    pytest.importorskip("torch")
    with pytest.raises(ValueError, match="torch engine has no softcap"):
        mpiattn.attention(x, x, x, softcap=3.0, engine="torch")


def test_a_plan_takes_new_sinks_per_call_and_refuses_sinks_it_was_not_made_for(comm):
    rng = np.random.default_rng(5)
    X = rng.standard_normal((1, 2, 6 * comm.size, 4))
    x = mpiattn.shard(X)
    s0, s1 = np.array([0.0, 1.0]), np.array([2.0, -1.0])
    plan = mpiattn.plan_attention(x, x, x, causal=True, sinks=s0)
    a = plan.forward(x, x, x, sinks=s1)
    b = mpiattn.attention(x, x, x, causal=True, sinks=s1)
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    plain = mpiattn.plan_attention(x, x, x, causal=True)
    with pytest.raises(ValueError, match="without sinks"):
        plain.forward(x, x, x, sinks=s1)


@pytest.mark.mpi(min_size=2)
def test_one_rank_with_bad_modifiers_fails_every_rank_alike(comm):
    """A bad mask on one rank, or ranks passing a plan different sinks: one error everywhere."""
    x = mpiattn.shard(np.random.default_rng(6).standard_normal((1, 2, 4 * comm.size, 4)))
    n, N = x.shape[2], 4 * comm.size
    mask = np.ones((1, 1, n if comm.rank else n + 1, N), dtype=bool)
    with pytest.raises(ValueError, match="attn_mask must have shape") as info:
        mpiattn.attention(x, x, x, attn_mask=mask)
    assert comm.allgather_obj(str(info.value)) == [str(info.value)] * comm.size
    plan = mpiattn.plan_attention(x, x, x, sinks=np.zeros(2))
    with pytest.raises(ValueError, match="ranks disagree on the sinks"):
        plan.forward(x, x, x, sinks=np.array([float(comm.rank), 0.0]))
