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
from mpiattn.layouts import all_segments
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
    "alibi-bool": dict(alibi=True, attn_mask="bool"),
    "torch-all": dict(alibi=True, attn_mask="float", mask_mod=True, sinks=True),
}

CASES = [  # (name, dtype, B, H, Hkv, N, M, causal, window, layout)
    ("f64-causal", "float64", 2, 4, 2, 37, 37, True, None, "contiguous"),
    ("f64-zigzag-window", "float64", 2, 4, 4, 29, 29, False, (6, 3), "zigzag"),
    ("f32-bottom-right-mqa", "float32", 2, 4, 1, 13, 31, "bottom-right", None, "contiguous"),
]

#: The torch engine's cases (it has no window): GQA, MQA, N != M, both causal alignments, and
#: zigzag runs with uneven shards at 2 ranks.
TORCH_CASES = [CASES[0], CASES[2],
               ("f32-zigzag-gqa", "float32", 2, 4, 2, 23, 23, False, None, "zigzag")]
#: What SDPA expresses as a float bias (not the softcap, nor max_logit).
TORCH_MODS = ("alibi", "bool-mask", "float-mask", "mask-mod", "alibi-bool", "torch-all")


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
        full[0, 2, 5] = -np.inf  # a query of head 2 that sees nothing
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


#: Every modifier alone and combined on the ring; the combinations on every strategy; the torch
#: engine's modifiers on the ring (``(strategy, case, mods, engine)``).
GRID = ([("ring", case, mods, "auto") for case in CASES for mods in MODS]
        + [(strategy, case, mods, "auto") for strategy in STRATEGIES if strategy != "ring"
           for case in CASES for mods in ("all", "sinks-softcap-bool")]
        + [("ring", case, mods, "torch") for case in TORCH_CASES for mods in TORCH_MODS])


@functools.lru_cache(maxsize=None)
def _expected(case, mods):
    """The inputs and the torch reference of a case, once per process (every strategy reuses it)."""
    arrays, vis, bias, kw, opts = _inputs(case, MODS[mods])
    ref = torch_reference(*arrays, vis, softcap=kw.get("softcap"), bias=bias, sinks=kw.get("sinks"))
    return arrays, kw, opts, ref


@pytest.mark.parametrize("strategy, case, mods, engine", GRID,
                         ids=[f"{s}-{c[0]}-{m}" + ("" if e == "auto" else f"-{e}")
                              for s, c, m, e in GRID])
def test_every_modifier_on_every_strategy(comm, strategy, case, mods, engine):
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
        pytest.skip("uneven head splits: the contract's heads cases and the search cover them")
    if strategy.startswith("hybrid:") and (H % u or (Hkv % u and u % Hkv)):
        pytest.skip("uneven head splits: the contract's heads cases and the search cover them")
    sq = lambda x, axis=-2: mpiattn.shard(x, axis=axis, layout=lay)  # noqa: E731
    args = dict(kw)
    if "attn_mask" in args:
        args["attn_mask"] = sq(args["attn_mask"])
    if "softcap" in args or "max_logit" in args:
        opts = dict(opts, **{k: args.pop(k) for k in ("softcap", "max_logit") if k in args})
    q, k, v, do = sq(Q), sq(K), sq(V), sq(dO)
    used = {}
    out, lse = mpiattn.attention(q, k, v, strategy=strategy, block_size=5, details=used, **args,
                                 engine=engine, **opts)
    assert used["engine"] == ("native" if engine == "auto" else engine)
    grads = mpiattn.attention_backward(do, q, k, v, out, lse, strategy=strategy, block_size=5,
                                       engine=engine, **args, **opts)
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


@pytest.mark.parametrize("strategy", ["materialized", "ring", "ulysses"])
@pytest.mark.parametrize("mods", ["all", "sinks-softcap-bool"])
def test_an_attn_mask_follows_the_queries_layout(comm, strategy, mods):
    """Queries zigzag, keys contiguous: the mask's rows are the queries' (a strategy that moves
    queries, to one layout or to heads, moves them too)."""
    case = CASES[1]  # (no window here: zigzag queries against contiguous keys, every rule)
    case = (case[0] + "-mixed", case[1], *case[2:8], None, "zigzag")
    (Q, K, V, dO), kw, opts, ref = _expected(case, mods)
    if strategy == "ulysses" and Q.shape[1] % comm.size:
        pytest.skip("uneven head splits: the contract's heads cases and the search cover them")
    sq = lambda x, axis=-2: mpiattn.shard(x, axis=axis, layout="zigzag")  # noqa: E731
    sk = lambda x: mpiattn.shard(x, layout="contiguous")  # noqa: E731
    args = dict(kw, attn_mask=sq(kw["attn_mask"]))
    opts = dict(opts, kv_layout="contiguous",
                **{k: args.pop(k) for k in ("softcap", "max_logit") if k in args})
    q, k, v, do = sq(Q), sk(K), sk(V), sq(dO)
    out, lse = mpiattn.attention(q, k, v, strategy=strategy, **args, **opts)
    grads = mpiattn.attention_backward(do, q, k, v, out, lse, strategy=strategy, **args, **opts)
    gq = lambda x, axis=-2: host(mpiattn.gather(x, axis=axis, layout="zigzag", root=None))  # noqa: E731
    gk = lambda x: host(mpiattn.gather(x, layout="contiguous", root=None))  # noqa: E731
    got = [gq(out), gq(lse, -1), gq(grads[0]), gk(grads[1]), gk(grads[2])]
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, ref[:5]):
        fin = np.isfinite(b)
        assert np.array_equal(np.isfinite(a), fin), name
        np.testing.assert_allclose(a[fin], b[fin], rtol=1e-9, atol=1e-10, err_msg=name)
    np.testing.assert_allclose(grads[3], ref[5], rtol=1e-9, atol=1e-10)


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
    slopes = np.array([0.25, 0.5])
    used = {}
    mpiattn.attention(x, x, x, softcap=3.0, alibi_slopes=slopes, details=used)
    assert used["engine"] == "native"
    pytest.importorskip("torch")
    with pytest.raises(ValueError, match="torch engine has no softcap;"):
        mpiattn.attention(x, x, x, softcap=3.0, alibi_slopes=slopes, engine="torch")
    with pytest.raises(ValueError, match="torch engine has no max_logit"):
        mpiattn.attention(x, x, x, max_logit=True, engine="torch")
    mpiattn.attention(x, x, x, alibi_slopes=slopes, engine="torch", details=used)
    assert used["engine"] == "torch"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_torch_engine_modifiers_in_half_precision(comm, dtype):
    """ALiBi, a float mask and a bool one on float16 and bfloat16: the torch engine's error
    against float64 is within a few times the native engine's (its bias is float32)."""
    dt = np.dtype(np.float16) if dtype == "float16" else pytest.importorskip("ml_dtypes").bfloat16
    (Q, K, V, dO), kw, opts, ref = _expected(CASES[0], "torch-all")
    sq = lambda x: mpiattn.shard(np.asarray(x, dtype=dt) if x.dtype != bool else x)  # noqa: E731
    args = dict(kw, attn_mask=mpiattn.shard(kw["attn_mask"]))
    q, k, v, do = (sq(x) for x in (Q, K, V, dO))
    err = {}
    for engine in ("native", "torch"):
        out, lse = mpiattn.attention(q, k, v, engine=engine, block_size=9, causal=True, **args)
        grads = mpiattn.attention_backward(do, q, k, v, out, lse, engine=engine, block_size=9,
                                           causal=True, **args)
        got = [host(mpiattn.gather(x, axis=ax, root=None)).astype(np.float64)
               for x, ax in zip((out, lse, *grads[:3]), (-2, -1, -2, -2, -2))]
        err[engine] = []
        for a, b in zip(got, ref[:5]):
            fin = np.isfinite(b)
            assert np.array_equal(np.isfinite(a), fin)
            scale = max(1.0, float(np.abs(b[fin]).max()))
            err[engine].append(np.abs(a[fin] - b[fin]).max(initial=0) / scale)
    ulp = float(np.finfo(np.float16).eps) if dtype == "float16" else 2.0 ** -7
    for name, t, n in zip(("out", "lse", "dq", "dk", "dv"), err["torch"], err["native"]):
        assert t <= 3 * n + ulp, (name, t, n)


def test_the_torch_engine_cuts_a_block_into_bias_tiles(comm, monkeypatch):
    """Tiny bias tiles (several per block, some hidden whole and skipped): the same answer."""
    from mpiattn.kernels import torch_engine

    monkeypatch.setattr(torch_engine, "BIAS_ENTRIES", 4 * 2 * 3)  # 3 pairs per (batch, head)
    for n, m, width in ((7, 5, 3), (1, 9, 1), (600, 3, 1), (5, 7, 100), (0, 4, 2), (4, 0, 2)):
        seen = np.zeros((n, m), int)
        for i0, i1, j0, j1 in torch_engine._tiles(n, m, width):
            assert (i1 - i0) * (j1 - j0) <= max(torch_engine.BIAS_ENTRIES // width, 1)
            seen[i0:i1, j0:j1] += 1
        assert np.all(seen == 1)
    case = CASES[2]
    (Q, K, V, dO), kw, opts, ref = _expected(case, "alibi-bool")
    sq = lambda x: mpiattn.shard(x)  # noqa: E731
    q, k, v, do = sq(Q), sq(K), sq(V), sq(dO)
    args = dict(kw, attn_mask=sq(kw["attn_mask"]), causal=opts["causal"], engine="torch")
    out, lse = mpiattn.attention(q, k, v, block_size=7, **args)
    grads = mpiattn.attention_backward(do, q, k, v, out, lse, block_size=7, **args)
    for x, ax, b in zip((out, lse, *grads), (-2, -1, -2, -2, -2), ref[:5]):
        a = host(mpiattn.gather(x, axis=ax, root=None))
        fin = np.isfinite(b)
        assert np.array_equal(np.isfinite(a), fin)
        assert np.abs(a[fin] - b[fin]).max(initial=0) <= 2e-4 * max(1.0, np.abs(b[fin]).max())


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


def _explicit_out_of_order(n, P):
    """Every rank's rows in two ranges, the later one first (rank r: ranges r + P, then r)."""
    cuts = np.linspace(0, n, 2 * P + 1).astype(int)
    ranges = [(int(a), int(b)) for a, b in zip(cuts[:-1], cuts[1:])]
    return mpiattn.Layout([ranges[r::P][::-1] for r in range(P)])


@pytest.mark.parametrize("strategy", ["auto", *registry.variants(1), "double-ring"])
@pytest.mark.parametrize("kind", ["float", "bool"])
def test_an_attn_mask_with_rows_out_of_order(comm, strategy, kind):
    """An explicit layout whose ranges are out of global order: the mask's rows are in this
    rank's local order (ulysses at one rank read them in global order)."""
    B, H, Hkv, N = 1, 4, 2, 57
    if strategy == "ulysses" and (H % comm.size or Hkv % comm.size):
        pytest.skip("uneven head splits: the contract's heads cases and the search cover them")
    if strategy.startswith("hybrid:") and comm.size != 1:
        pytest.skip("one rank's split")
    rng = np.random.default_rng(11)
    Q, K, V, dO = (rng.standard_normal((B, h, N, 8)) for h in (H, Hkv, Hkv, H))
    mask = rng.standard_normal((B, H, N, N))
    if kind == "bool":
        mask = mask > -0.5
    lay = _explicit_out_of_order(N, comm.size)
    sh = lambda x, axis=-2: mpiattn.shard(x, axis=axis, layout=lay)  # noqa: E731
    q, k, v, do = sh(Q), sh(K), sh(V), sh(dO)
    kw = dict(attn_mask=sh(mask), strategy=strategy, layout=lay)
    out, lse = mpiattn.attention(q, k, v, **kw)
    grads = mpiattn.attention_backward(do, q, k, v, out, lse, **kw)
    g = lambda x, axis=-2: host(mpiattn.gather(x, axis=axis, layout=lay, root=None))  # noqa: E731
    vis = mask if kind == "bool" else np.ones((1, 1, N, N), dtype=bool)
    ref = torch_reference(Q, K, V, dO, vis, bias=None if kind == "bool" else mask)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), (g(out), g(lse, -1), g(grads[0]),
                                                             g(grads[1]), g(grads[2])), ref):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-10, err_msg=name)


@pytest.mark.parametrize("strategy", ["auto", "ring", "allgather"])
def test_a_float_mask_hiding_pairs_on_some_ranks_only(comm, strategy):
    """-inf in the last rank's rows only: whether a pair is hidden is agreed (the cost model's
    count of visible pairs, a collective, ran on that rank alone and the default call hung)."""
    B, H, N = 1, 2, 12 * comm.size
    rng = np.random.default_rng(12)
    Q, K, V, dO = (rng.standard_normal((B, H, N, 8)) for _ in range(4))
    mask = rng.standard_normal((B, 1, N, N))
    last = all_segments(N, comm.size)[-1][0]
    mask[:, :, last[0]:last[0] + last[1], ::3] = -np.inf
    q, k, v, do = (mpiattn.shard(x) for x in (Q, K, V, dO))
    kw = dict(attn_mask=mpiattn.shard(mask), strategy=strategy)
    out, lse = mpiattn.attention(q, k, v, **kw)
    grads = mpiattn.attention_backward(do, q, k, v, out, lse, **kw)
    g = lambda x, axis=-2: host(mpiattn.gather(x, axis=axis, root=None))  # noqa: E731
    ref = torch_reference(Q, K, V, dO, np.ones((1, 1, N, N), dtype=bool), bias=mask)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), (g(out), g(lse, -1), g(grads[0]),
                                                             g(grads[1]), g(grads[2])), ref):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-10, err_msg=name)


def test_the_keywords_and_one_score_object_are_the_same_call(comm):
    """softcap, max_logit, ALiBi and sinks given as keywords, or as one ``mpiattn.Score``, or
    split between the two: the same bits (out, lse, gradients, max_logit) on every rank; a
    modifier given to ``Options`` is refused with the place it belongs."""
    rng = np.random.default_rng(12)
    B, H, N, E = 1, 2, 6 * comm.size + 1, 4
    X = [rng.standard_normal((B, H, N, E)) for _ in range(4)]
    q, k, v, do = (mpiattn.shard(x) for x in X)
    mods = dict(softcap=1.5, max_logit=True, alibi_slopes=np.array([0.5, 0.25]),
                sinks=np.array([0.1, -0.2]))

    def run(**kw):
        used = {}
        out, lse = mpiattn.attention(q, k, v, causal=True, details=used, **kw)
        grads = mpiattn.attention_backward(do, q, k, v, out, lse, causal=True, **kw)
        return (out, lse, *grads, used["max_logit"])

    one = run(**mods)
    for kw in (dict(score=mpiattn.Score(**mods)),
               dict(score=mpiattn.Score(softcap=1.5, sinks=mods["sinks"]), max_logit=True,
                    alibi_slopes=mods["alibi_slopes"])):
        for a, b in zip(one, run(**kw)):
            assert np.array_equal(a, b)
    with pytest.raises(TypeError, match="softcap is a score modifier, not an option"):
        mpiattn.Options.of(None, softcap=1.5)
