"""Distributed attention against an independent float64 single-process reference.

The reference below materialises the scores on the gathered (global) arrays;
it shares no code with mpiattn. Gradients are checked against the analytic
softmax backward of that reference and against finite differences.
"""


import numpy as np
import pytest

import mpiattn
from mpiattn.kernels import engines, native

from helpers import (dense_attention, host, registered_strategies, strategy_refusal,
                     strategy_runs_engines)

STRATS = registered_strategies()
TOL = {np.float64: 1e-10, np.float32: 2e-5, np.float16: 4e-3}


def reference(Q, K, V, causal=False, scale=None, mask=None, dO=None):
    """float64 attention on global arrays: (out, lse) and, with dO, (dq, dk, dv)."""
    N, M = Q.shape[2], K.shape[2]
    vis = np.ones((Q.shape[0], 1, N, M), dtype=bool)
    if causal:
        vis &= np.arange(M)[None, :] <= np.arange(N)[:, None]
    if mask is not None:
        vis &= ~mask[:, None, None, :]
    return dense_attention(Q, K, V, vis, scale, dO)


def make_case(seed, B, H, Hkv, N, M, E, Ev, dtype, padding):
    rng = np.random.default_rng(seed)
    cast = lambda x: x.astype(dtype)  # noqa: E731 - inputs rounded to the dtype under test
    Q = cast(rng.standard_normal((B, H, N, E)))
    K = cast(rng.standard_normal((B, Hkv, M, E)))
    V = cast(rng.standard_normal((B, Hkv, M, Ev)))
    dO = cast(rng.standard_normal((B, H, N, Ev)))
    mask = None
    if padding == "random":
        mask = rng.random((B, M)) < 0.3
    elif padding == "one-batch-all":
        mask = rng.random((B, M)) < 0.3
        mask[0] = True
    return Q, K, V, dO, mask


def run(xp, Q, K, V, dO, mask, layout, **kw):
    sh = lambda x, axis=-2: xp.asarray(mpiattn.shard(x, axis=axis, layout=layout))  # noqa: E731
    q, k, v, do = sh(Q), sh(K), sh(V), sh(dO)
    mk = None if mask is None else sh(mask, -1)
    out, lse = mpiattn.attention(q, k, v, key_padding_mask=mk, layout=layout, **kw)
    dq, dk, dv = mpiattn.attention_backward(do, q, k, v, out, lse, key_padding_mask=mk, layout=layout, **kw)
    assert out.dtype == q.dtype and dq.dtype == q.dtype and dk.dtype == k.dtype and dv.dtype == v.dtype
    assert lse.dtype == (np.float64 if q.dtype == np.float64 else np.float32)
    assert out.shape == q.shape[:3] + (V.shape[-1],) and lse.shape == q.shape[:3]
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    g = lambda x, axis=-2: mpiattn.gather(x, axis=axis, layout=layout, root=None)  # noqa: E731
    return g(out), g(lse, -1), g(dq), g(dk), g(dv)


def _numpy_engines():
    """The registry's engines that run NumPy arrays here, and each other one's reason."""
    runs, left_out = [], {}
    for name, e in engines.ENGINES.items():
        why = (None if "numpy" in e.capabilities.dtypes else f"the {name} engine takes no NumPy arrays")
        why = why or e.usable("numpy")
        if why is None:
            runs.append(name)
        else:
            left_out[name] = why
    return runs, left_out


#: The engines of :data:`mpiattn.kernels.engines.ENGINES` these tests run (their arrays are NumPy's,
#: or CuPy's under ``MPIATTN_TEST_BACKEND=cupy``), and the others, left out at collection (a
#: skipped test costs pytest's whole protocol), each with its reason (e.g. ``fused``: CuPy only).
ENGINES, LEFT_OUT_ENGINES = _numpy_engines()


def engine_or_skip(engine, strategy, dtype=np.float64, xp=np):
    """Skip (with the reason) where the engine does not apply or cannot run here."""
    if engine == engines.AUTO[0]:  # the reference engine: every call
        return
    if not strategy_runs_engines(strategy):
        pytest.skip(f"the {strategy} strategy runs the products, not an engine")
    from mpiattn.strategies import AttentionSpec, Options
    spec = AttentionSpec.from_shapes((1, 1, 8, 8), (1, 1, 8, 8), (1, 1, 8, 8), dtype,
                                     Options(causal=True), device=xp.__name__, padding=True)
    e = engines.get(engine)
    why = e.supports(spec) or e.usable(xp.__name__)
    if why is not None:
        pytest.skip(f"{engine} engine: {why}")


def assert_close(got, want, tol, what):
    got = host(got).astype(np.float64)
    scale = max(1.0, float(np.abs(want).max(initial=0)))
    err = float(np.abs(got - want).max(initial=0)) / scale
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol:.1g}"


def check_all(res, ref, tol):
    out, lse, dq, dk, dv = res
    rout, rlse, rdq, rdk, rdv = ref
    assert_close(out, rout, tol, "out")
    lse = host(lse)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(rlse))
    fin = np.isfinite(rlse)
    assert_close(lse[fin], rlse[fin], tol, "lse")
    for name, a, b in (("dq", dq, rdq), ("dk", dk, rdk), ("dv", dv, rdv)):
        assert np.isfinite(host(a)).all(), f"{name} has NaN/Inf"
        assert_close(a, b, 4 * tol, name)


@pytest.mark.parametrize("strategy", STRATS)
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padding", [None, "random", "one-batch-all"])
@pytest.mark.parametrize("engine", ENGINES)
def test_float64_matrix(comm, xp, strategy, layout, causal, padding, engine):
    """Every strategy x layout x causal x padding x engine, GQA, N != M, lengths not divisible by P or 2P."""
    B, H, Hkv, N, M, E, Ev = 2, 4, 2, 23, 19, 8, 6
    if (why := strategy_refusal(strategy, comm, H, Hkv)) is not None:
        pytest.skip(why)
    engine_or_skip(engine, strategy, np.float64, xp)
    Q, K, V, dO, mask = make_case(1, B, H, Hkv, N, M, E, Ev, np.float64, padding)
    res = run(xp, Q, K, V, dO, mask, layout, causal=causal, strategy=strategy, block_size=4,
              engine=engine)
    ref = reference(Q, K, V, causal, None, mask, dO)
    check_all(res, ref, TOL[np.float64])
    if padding == "one-batch-all":  # every key of batch 0 masked: zeros, -inf, zero grads
        assert np.all(host(res[0])[0] == 0) and np.all(np.isneginf(host(res[1])[0]))
        assert np.all(host(res[2])[0] == 0)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("strategy", STRATS)
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("engine", ENGINES)
def test_low_precision(comm, xp, dtype, strategy, layout, engine):
    B, H, Hkv, N, M, E, Ev = 1, 4, 4, 30, 30, 16, 16
    if (why := strategy_refusal(strategy, comm, H, Hkv)) is not None:
        pytest.skip(why)
    engine_or_skip(engine, strategy, dtype, xp)
    Q, K, V, dO, mask = make_case(2, B, H, Hkv, N, M, E, Ev, dtype, "random")
    res = run(xp, Q, K, V, dO, mask, layout, causal=True, strategy=strategy, block_size=8,
              engine=engine)
    check_all(res, reference(Q, K, V, True, None, mask, dO), TOL[dtype])


@pytest.mark.parametrize("N,M", [(0, 5), (5, 0), (1, 1), (3, 11)])
@pytest.mark.parametrize("engine", ENGINES)
def test_tiny_and_empty_shards(comm, xp, N, M, engine):
    """Fewer rows than ranks: some ranks own nothing; M = 0 means no visible key."""
    engine_or_skip(engine, "ring", np.float64, xp)
    Q, K, V, dO, _ = make_case(3, 1, 2, 1, N, M, 4, 3, np.float64, None)
    for strategy in ("ring", "allgather"):
        res = run(xp, Q, K, V, dO, None, "zigzag", strategy=strategy, block_size=2, engine=engine)
        check_all(res, reference(Q, K, V, False, None, None, dO), TOL[np.float64])


def test_mqa_scale_and_defaults(comm, xp):
    Q, K, V, dO, _ = make_case(4, 2, 3, 1, 17, 13, 5, 7, np.float64, None)
    res = run(xp, Q, K, V, dO, None, "contiguous", scale=0.7)  # strategy auto, default block
    check_all(res, reference(Q, K, V, False, 0.7, None, dO), TOL[np.float64])


def test_strategies_agree_and_repeat_bitwise(comm, xp):
    Q, K, V, dO, mask = make_case(5, 1, 4, 2, 26, 26, 8, 8, np.float64, "random")
    results = {}
    for strategy in STRATS:
        if strategy_refusal(strategy, comm, 4, 2) is None:
            results[strategy] = run(xp, Q, K, V, dO, mask, "zigzag", causal=True, strategy=strategy, block_size=5)
    base = results.pop("ring")
    for name, res in results.items():
        for a, b in zip(base, res):
            a, b = host(a), host(b)
            fin = np.isfinite(a)
            assert np.array_equal(fin, np.isfinite(b)), name
            np.testing.assert_allclose(b[fin], a[fin], rtol=1e-12, atol=1e-12, err_msg=name)
    again = run(xp, Q, K, V, dO, mask, "zigzag", causal=True, strategy="ring", block_size=5)
    for a, b in zip(base, again):
        assert host(a).tobytes() == host(b).tobytes()


@pytest.mark.parametrize("strategy", STRATS)
@pytest.mark.parametrize("engine", ENGINES)
def test_gradients_by_finite_differences(comm, xp, strategy, engine):
    """d/dx of L = sum(W * out) for a few entries of q, k, v, by central differences."""
    B, H, Hkv, N, M, E, Ev = 1, 2, 2, 7, 6, 3, 2
    if (why := strategy_refusal(strategy, comm, H, Hkv)) is not None:
        pytest.skip(why)
    engine_or_skip(engine, strategy, np.float64, xp)
    Q, K, V, W, mask = make_case(6, B, H, Hkv, N, M, E, Ev, np.float64, "random")
    mask[:, 0] = False
    layout = "zigzag"
    kw = dict(causal=True, strategy=strategy, layout=layout, block_size=2, engine=engine)

    def loss(Qx, Kx, Vx):
        sh = lambda x, axis=-2: xp.asarray(mpiattn.shard(x, axis=axis, layout=layout))  # noqa: E731
        out, _ = mpiattn.attention(sh(Qx), sh(Kx), sh(Vx), key_padding_mask=sh(mask, -1), **kw)
        return float(np.sum(host(mpiattn.gather(out, layout=layout, root=None)) * W))

    _, _, dq, dk, dv = run(xp, Q, K, V, W, mask, layout, **{k: v for k, v in kw.items() if k != "layout"})
    rng = np.random.default_rng(7)
    h = 1e-6
    for name, X, grad in (("q", Q, dq), ("k", K, dk), ("v", V, dv)):
        for idx in [tuple(rng.integers(0, s) for s in X.shape) for _ in range(4)]:
            Xp, Xm = X.copy(), X.copy()
            Xp[idx] += h
            Xm[idx] -= h
            args_p = [Xp if n == name else A for n, A in (("q", Q), ("k", K), ("v", V))]
            args_m = [Xm if n == name else A for n, A in (("q", Q), ("k", K), ("v", V))]
            fd = (loss(*args_p) - loss(*args_m)) / (2 * h)
            assert abs(fd - host(grad)[idx]) < 1e-6 * max(1.0, abs(fd)), (name, idx, fd, host(grad)[idx])


def test_zigzag_balances_causal_work(comm, monkeypatch):
    """Causal + zigzag: every rank computes about half of its non-causal score tiles."""
    computed = [0]
    real = native._tile_generic

    def counting(*args, **kw):
        computed[0] += 1
        return real(*args, **kw)

    monkeypatch.setattr(native, "_tile_generic", counting)
    N, tile = 64 * comm.size, 8
    Q, K, V, _, _ = make_case(8, 1, 1, 1, N, N, 4, 4, np.float32, None)
    sh = lambda x: mpiattn.shard(x, layout="zigzag")  # noqa: E731
    q = sh(Q)
    mpiattn.attention(q, sh(K), sh(V), causal=True, layout="zigzag", strategy="ring", block_size=tile,
                      engine="native")
    every = -(-q.shape[2] // tile) * (N // tile)  # zigzag chunks are multiples of the tile here
    fracs = comm.allgather_obj(computed[0] / every)
    assert all(0.4 <= f <= 0.65 for f in fracs), fracs


# ----------------------------------------------------------------- bad input
def _good(xp, layout="contiguous", N=12, M=10, dtype=np.float64):
    Q, K, V, dO, _ = make_case(9, 1, 2, 1, N, M, 4, 3, dtype, None)
    sh = lambda x: xp.asarray(mpiattn.shard(x, layout=layout))  # noqa: E731
    return sh(Q), sh(K), sh(V), sh(dO)


@pytest.mark.parametrize("case", ["E", "mkv", "heads", "mask_shape", "mask_dtype", "strategy",
                                  "layout", "dtype_mix", "ndim", "not_array", "nan", "ulysses",
                                  "block", "scale"])
def test_bad_input_same_error_everywhere(comm, xp, case):
    q, k, v, _ = _good(xp)
    kw = {}
    err, match = ValueError, None
    if case == "E":
        k = k[..., :3]
        match = "feature size"
    elif case == "mkv":
        v = v[:, :, :0] if v.shape[2] else xp.zeros(v.shape[:2] + (1, v.shape[3]))
        match = "must agree"
    elif case == "heads":
        q = xp.concatenate([q, q[:, :1]], axis=1)
        k, v = xp.concatenate([k, k], axis=1), xp.concatenate([v, v], axis=1)
        match = "multiple"
    elif case == "mask_shape":
        kw["key_padding_mask"] = xp.zeros((1, k.shape[2] + 1), dtype=bool)
        match = "key_padding_mask must have shape"
    elif case == "mask_dtype":
        kw["key_padding_mask"] = xp.zeros((1, k.shape[2]), dtype=np.int8)
        err, match = TypeError, "bool"
    elif case == "strategy":
        kw["strategy"] = "flash"
        match = "unknown strategy"
    elif case == "layout":
        kw["layout"] = "striped"
        match = "unknown layout"
    elif case == "dtype_mix":
        k = k.astype(np.float32)
        err, match = TypeError, "one dtype"
    elif case == "ndim":
        q = q[0]
        match = "4-D"
    elif case == "not_array":
        q = host(q).tolist()
        err, match = TypeError, "ndarray"
    elif case == "nan":
        if comm.rank == comm.size - 1 and q.size:
            q = q.copy()
            q[(0,) * q.ndim] = np.nan
        elif comm.rank == comm.size - 1:
            k = k.copy()
            k[(0,) * k.ndim] = np.inf
        match = "NaN or Inf"
    elif case == "ulysses":
        kw["strategy"] = "ulysses"
        # H = P + 1 query heads over P ranks, Hkv = 1: an uneven split, the exact result
        wide = xp.concatenate([q[:, :1]] * (comm.size + 1), axis=1)
        out, lse = mpiattn.attention(wide, k, v, **kw)
        ref = mpiattn.attention(wide, k, v, strategy="ring")  # (this rank's rows, exact)
        np.testing.assert_allclose(host(out), host(ref[0]), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(host(lse), host(ref[1]), rtol=1e-12, atol=1e-12)
        if comm.size == 1:  # one head a rank always
            return
        q = xp.concatenate([q[:, :1]] * (comm.size - 1), axis=1)  # H = P - 1: a rank without a head
        match = "at least one query head per rank"
    elif case == "block":
        kw["block_size"] = 0
        match = "block_size"
    elif case == "scale":
        kw["scale"] = float("nan")
        match = "scale"
    with pytest.raises(err, match=match):
        mpiattn.attention(q, k, v, **kw)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("strategy", STRATS)
@pytest.mark.parametrize("where", ["nan-key", "nan-query", "inf-query"])
def test_nonfinite_allowed_when_asked(comm, xp, strategy, where, engine):
    """check_finite=False: a NaN key makes every row that sees it non-finite, a NaN or Inf query its
    own row; rows the value cannot reach (other heads, other queries) are the exact result.

    (Rows of the same head that do not see the NaN key are not checked: whether a masked NaN
    score reaches them depends on the tiling, and nothing is promised about it.)
    """
    engine_or_skip(engine, strategy, np.float64, xp)
    P = comm.size
    Q, K, V, _, _ = make_case(21, 1, 4 * P, 2 * P, 12, 12, 4, 3, np.float64, None)  # ulysses: P | H, Hkv
    if where == "nan-key":
        K[0, 0, 7, 1] = np.nan  # key/value head 0: query heads 0 and 1, causal rows 7..11
    else:
        Q[0, 1, 5, 0] = np.nan if where == "nan-query" else np.inf  # query head 1, row 5
    with np.errstate(all="ignore"):
        ref_out, ref_lse = reference(Q, K, V, causal=True)
    bad = ~np.isfinite(ref_out).all(-1)  # (B, H, N): the rows the value reaches
    assert bad.sum() == (10 if where == "nan-key" else 1) and np.array_equal(bad, ~np.isfinite(ref_lse))
    trusted = np.zeros_like(bad)
    if where == "nan-key":
        trusted[:, 2:] = True  # query heads of the other key/value heads
    else:
        trusted = ~bad
    zz = lambda x, axis=-2: mpiattn.shard(x, axis=axis, layout="zigzag")  # noqa: E731
    sh = lambda x: xp.asarray(zz(x))  # noqa: E731
    kw = dict(causal=True, layout="zigzag", strategy=strategy, engine=engine)
    with pytest.raises(ValueError, match="NaN or Inf"):  # by default it is refused
        mpiattn.attention(sh(Q), sh(K), sh(V), **kw)
    with np.errstate(all="ignore"):
        out, lse = mpiattn.attention(sh(Q), sh(K), sh(V), block_size=2, check_finite=False, **kw)
    out, lse = host(out), host(lse)
    bad, trusted = zz(bad, -1), zz(trusted, -1)
    assert not np.isfinite(out[bad]).any() and not np.isfinite(lse[bad]).any()
    np.testing.assert_allclose(out[trusted], zz(ref_out)[trusted], rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(lse[trusted], zz(ref_lse, -1)[trusted], rtol=1e-10, atol=1e-10)


@pytest.mark.mpi(min_size=2)
def test_rank_dependent_mistakes(comm, xp):
    """Errors only one rank can see are raised, identically, on every rank."""
    q, k, v, _ = _good(xp)
    last = comm.rank == comm.size - 1
    with pytest.raises(ValueError, match="layout of"):
        mpiattn.attention(q if not last else xp.concatenate([q, q], axis=2), k, v)
    with pytest.raises(ValueError, match="ranks disagree on causal"):
        mpiattn.attention(q, k, v, causal=last)
    with pytest.raises(ValueError, match="ranks disagree on layout"):
        mpiattn.attention(q, k, v, layout="zigzag" if last else "contiguous")
    with pytest.raises(ValueError, match="ranks disagree on dtype"):
        mpiattn.attention(*(x.astype(np.float32) if last else x for x in (q, k, v)))


def test_backward_shape_checks(comm, xp):
    q, k, v, do = _good(xp)
    out, lse = mpiattn.attention(q, k, v)
    with pytest.raises(ValueError, match="dout must have shape"):
        mpiattn.attention_backward(do[..., :1], q, k, v, out, lse)
    with pytest.raises(ValueError, match="lse must have shape"):
        mpiattn.attention_backward(do, q, k, v, out, lse[..., None])


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("growth", ["rising", "falling"])
@pytest.mark.parametrize("engine", ENGINES)
def test_large_scores_move_the_softmax_reference(comm, xp, dtype, growth, engine):
    """Scores of +-hundreds whose row maxima jump between key tiles (the lazy rescale, and the
    native engine's exact redo of tiles whose scores grew past its shift)."""
    engine_or_skip(engine, "ring", dtype, xp)
    B, H, Hkv, N, M, E, Ev = 1, 2, 1, 24, 40, 8, 4
    Q, K, V, dO, mask = make_case(11, B, H, Hkv, N, M, E, Ev, np.float64, "random")
    ramp = np.linspace(0.2, 3.0, M) if growth == "rising" else np.linspace(3.0, 0.2, M)
    K = (K * ramp[None, None, :, None]).astype(dtype)
    Q, V, dO = Q.astype(dtype), V.astype(dtype), dO.astype(dtype)
    for strategy in ("ring", "allgather"):
        res = run(xp, Q, K, V, dO, mask, "zigzag", causal=True, strategy=strategy, block_size=3, scale=25.0,
                  engine=engine)
        check_all(res, reference(Q, K, V, True, 25.0, mask, dO), 10 * TOL[dtype])
