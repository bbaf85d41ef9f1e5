"""Sliding windows, packed documents, explicit and balanced layouts, and the work they skip.

Every result is compared with an independent float64 reference written here:
it materialises the visible matrix from global positions (the rules written
out directly, one at a time) and runs a plain softmax on the gathered arrays.
"""

import numpy as np
import pytest

import mpiattn
from mpiattn.comm.ring import row_pieces
from mpiattn.kernels import native
from mpiattn.layouts import all_segments, positions

from helpers import dense_attention, host, registered_strategies, strategy_refusal, visible_matrix

STRATS = registered_strategies()


# ------------------------------------------------------------------ reference
def reference(Q, K, V, dO, vis, scale=None):
    """float64 (out, lse, dq, dk, dv) of attention restricted to ``vis`` (B, N, M)."""
    return dense_attention(Q, K, V, vis[:, None], scale, dO)


# ------------------------------------------------------------------ inputs
def shuffled_layout(n, P, seed=0):
    """An explicit Layout: ~3P random pieces, dealt out at random, stored in a random local order."""
    rng = np.random.default_rng(seed)
    cuts = np.unique(np.concatenate([[0, n], rng.integers(0, n + 1, 3 * P)]))
    pieces = list(zip(cuts[:-1].tolist(), cuts[1:].tolist()))
    owner = rng.integers(0, P, len(pieces))
    ranges = [[pieces[i] for i in rng.permutation(len(pieces)) if owner[i] == r] for r in range(P)]
    return mpiattn.Layout(ranges)


def documents(B, N, seed, lengths=(1, 2, 5, 9)):
    """(B, N) ids: documents of the given lengths (incl. length 1) in random order, ids not 0..D-1."""
    rng = np.random.default_rng(seed)
    out = np.empty((B, N), dtype=np.int64)
    for b in range(B):
        lens, total = [], 0
        while total < N:
            lens.append(int(rng.choice(lengths)))
            total += lens[-1]
        cu = np.minimum(np.concatenate([[0], np.cumsum(lens)]), N)
        ids = mpiattn.segment_ids_from_cu_seqlens(np.unique(cu))
        out[b] = 1000 - 7 * ids  # arbitrary integers
    return out


def make_layout(kind, n, P, mask_kw=None):
    if kind in ("contiguous", "zigzag"):
        return kind
    if kind == "shuffled":
        return shuffled_layout(n, P, seed=n)
    kw = dict(mask_kw or {})
    tiles = dict(block_size=3) if kind == "balanced-tiles" else {}  # (the tests' block_size)
    return mpiattn.balance(n, P, causal=kw.get("causal", False), window=kw.get("window"),
                           segment_ids=kw.get("segment_ids"), **tiles)


def case(seed, B=2, H=2, Hkv=1, N=23, M=None, E=4, Ev=3):
    rng = np.random.default_rng(seed)
    M = N if M is None else M
    return (rng.standard_normal((B, H, N, E)), rng.standard_normal((B, Hkv, M, E)),
            rng.standard_normal((B, Hkv, M, Ev)), rng.standard_normal((B, H, N, Ev)))


def run(xp, Q, K, V, dO, layout, kv_layout=None, pad=None, seg_q=None, seg_k=None, **kw):
    """Shard, run forward and backward, gather: (out, lse, dq, dk, dv) global (host)."""
    kl = layout if kv_layout is None else kv_layout
    sq = lambda x, axis=-2: xp.asarray(mpiattn.shard(x, axis=axis, layout=layout))  # noqa: E731
    sk = lambda x, axis=-2: xp.asarray(mpiattn.shard(x, axis=axis, layout=kl))  # noqa: E731
    q, k, v, do = sq(Q), sk(K), sk(V), sq(dO)
    extra = dict(kw)
    if pad is not None:
        extra["key_padding_mask"] = sk(pad, -1)
    if seg_q is not None:
        extra["segment_ids"] = mpiattn.shard(seg_q, axis=-1, layout=layout)
    if seg_k is not None:
        extra["kv_segment_ids"] = mpiattn.shard(seg_k, axis=-1, layout=kl)
    if kv_layout is not None:
        extra["kv_layout"] = kv_layout
    out, lse = mpiattn.attention(q, k, v, layout=layout, **extra)
    dq, dk, dv = mpiattn.attention_backward(do, q, k, v, out, lse, layout=layout, **extra)
    gq = lambda x, axis=-2: host(mpiattn.gather(x, axis=axis, layout=layout, root=None))  # noqa: E731
    gk = lambda x: host(mpiattn.gather(x, layout=kl, root=None))  # noqa: E731
    return gq(out), gq(lse, -1), gq(dq), gk(dk), gk(dv)


def check(got, want, tol=1e-10):
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        fin = np.isfinite(w)
        np.testing.assert_array_equal(np.isfinite(g), fin, err_msg=f"{name}: infinities differ")
        np.testing.assert_array_equal(g[~fin], w[~fin], err_msg=f"{name}: infinities differ")
        np.testing.assert_allclose(g[fin], w[fin], rtol=tol, atol=tol, err_msg=name)


MASKS = {
    "window-causal": dict(causal=True, window=(3, 0)),
    "window-0-0": dict(window=(0, 0)),
    "window-right-only": dict(window=(None, 2)),
    "window-left-only": dict(window=(4, None)),
    "window-both-causal": dict(causal=True, window=(6, 2)),
    "documents-causal": dict(causal=True, docs=True),
    "documents": dict(docs=True),
    "documents-window-padding": dict(causal=True, window=(4, 1), docs=True, pad=True),
}


def mask_args(name, B, N, seed=0):
    spec = dict(MASKS[name])
    kw = {k: spec[k] for k in ("causal", "window") if k in spec}
    seg = documents(B, N, seed) if spec.get("docs") else None
    pad = np.random.default_rng(seed + 1).random((B, N)) < 0.25 if spec.get("pad") else None
    return kw, seg, pad


# ------------------------------------------------------------------ correctness
@pytest.mark.parametrize("strategy", STRATS)
@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "shuffled", "balanced", "balanced-tiles"])
@pytest.mark.parametrize("mask", list(MASKS))
def test_matches_dense_reference(comm, xp, strategy, layout, mask):
    P = comm.size
    B, H, Hkv, N = 2, 2 * P, P, 23
    if (why := strategy_refusal(strategy, comm, H, Hkv)) is not None:
        pytest.skip(why)
    if layout == "balanced-tiles" and strategy != "ring":
        pytest.skip("the tile-aligned balance is checked with the ring, whose tiles it aligns")
    Q, K, V, dO = case(3, B, H, Hkv, N)
    kw, seg, pad = mask_args(mask, B, N)
    lay = make_layout(layout, N, P, dict(kw, segment_ids=seg))
    vis = visible_matrix(B, N, N, kw.get("causal", False), kw.get("window"), seg, seg, pad)
    got = run(xp, Q, K, V, dO, lay, pad=pad, seg_q=seg, strategy=strategy, block_size=3, **kw)
    check(got, reference(Q, K, V, dO, vis))


@pytest.mark.parametrize("strategy", STRATS)
@pytest.mark.parametrize("layouts", ["names", "explicit"])
def test_cross_attention_with_separate_ids(comm, xp, strategy, layouts):
    """N != M, queries and keys in different layouts, their own document ids, GQA."""
    P = comm.size
    B, H, Hkv, N, M = 2, 2 * P, P, 19, 26
    if (why := strategy_refusal(strategy, comm, H, Hkv)) is not None:
        pytest.skip(why)
    Q, K, V, dO = case(5, B, H, Hkv, N, M)
    rng = np.random.default_rng(6)
    seg_q, seg_k = rng.integers(-2, 3, (B, N)), rng.integers(-2, 3, (B, M))
    seg_q[0, :4] = 99  # ids no key has: fully masked rows
    if layouts == "names":
        lay, kl = "zigzag", "contiguous"
    else:
        lay, kl = mpiattn.balance(N, P, segment_ids=seg_q), shuffled_layout(M, P, seed=1)
    kw = dict(window=(12, 3))
    vis = visible_matrix(B, N, M, False, kw["window"], seg_q, seg_k)
    assert not vis[0, :4].any()
    got = run(xp, Q, K, V, dO, lay, kv_layout=kl, seg_q=seg_q, seg_k=seg_k, strategy=strategy,
              block_size=4, **kw)
    check(got, reference(Q, K, V, dO, vis))


@pytest.mark.parametrize("strategy", STRATS)
def test_fully_masked_rows(comm, xp, strategy):
    """Rows that see no key (window + documents + padding): out 0, lse -inf, zero gradients."""
    P = comm.size
    B, H, Hkv, N = 1, P, P, 17
    if (why := strategy_refusal(strategy, comm, H, Hkv)) is not None:
        pytest.skip(why)
    Q, K, V, dO = case(8, B, H, Hkv, N)
    seg = np.repeat(np.arange(N // 2 + 1), 2)[None, :N]  # documents of 2 rows
    pad = np.zeros((B, N), dtype=bool)
    pad[0, 0::2] = True  # the first row of every document is padding ...
    kw = dict(causal=True, window=(0, None))  # ... and a query sees only itself
    vis = visible_matrix(B, N, N, True, (0, None), seg, seg, pad)
    dead = ~vis.any(-1)[0]
    assert dead[0::2].all() and not dead[1::2].any()
    got = run(xp, Q, K, V, dO, "zigzag", pad=pad, seg_q=seg, strategy=strategy, block_size=2, **kw)
    out, lse, dq, dk, dv = got
    assert (out[0, :, dead] == 0).all() and np.isneginf(lse[0, :, dead]).all()
    assert (dq[0, :, dead] == 0).all()
    check(got, reference(Q, K, V, dO, vis))


def test_mqa_gqa_low_precision_and_cupy_ids(comm, xp):
    """float32, GQA (H = 3 Hkv), ids given on the array backend, window with documents."""
    B, H, Hkv, N = 2, 3, 1, 30
    Q, K, V, dO = case(9, B, H, Hkv, N)
    seg = documents(B, N, 2, lengths=(3, 7, 11))
    sh = lambda x, axis=-2: xp.asarray(mpiattn.shard(x.astype(np.float32), axis=axis))  # noqa: E731
    ids = xp.asarray(mpiattn.shard(seg, axis=-1))
    kw = dict(causal=True, window=(5, 0), segment_ids=ids, block_size=4)
    out, lse = mpiattn.attention(sh(Q), sh(K), sh(V), **kw)
    vis = visible_matrix(B, N, N, True, (5, 0), seg, seg)
    ref = reference(Q, K, V, dO, vis)
    got = host(mpiattn.gather(out, root=None))
    np.testing.assert_allclose(got, ref[0], rtol=2e-5, atol=2e-5)
    got_lse = host(mpiattn.gather(lse, axis=-1, root=None))
    np.testing.assert_allclose(got_lse, ref[1], rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("strategy", ["ring", "allgather"])
def test_gradients_by_finite_differences(comm, xp, strategy):
    """d(sum(out * R))/dx by central differences in float64, window + documents + causal."""
    P = comm.size
    B, H, Hkv, N = 1, 2, 1, 11
    Q, K, V, _ = case(11, B, H, Hkv, N, E=3, Ev=2)
    R = np.random.default_rng(12).standard_normal((B, H, N, 2))
    seg = documents(B, N, 4, lengths=(1, 3, 4))
    lay = shuffled_layout(N, P, seed=3)
    kw = dict(causal=True, window=(3, None), strategy=strategy, block_size=2, layout=lay,
              segment_ids=mpiattn.shard(seg, axis=-1, layout=lay))
    sh = lambda x: xp.asarray(mpiattn.shard(x, layout=lay))  # noqa: E731

    def loss(Qx, Kx, Vx):
        out, _ = mpiattn.attention(sh(Qx), sh(Kx), sh(Vx), **kw)
        part = float((host(out) * mpiattn.shard(R, layout=lay)).sum())
        return sum(comm.allgather_obj(part))

    q, k, v = sh(Q), sh(K), sh(V)
    out, lse = mpiattn.attention(q, k, v, **kw)
    grads = mpiattn.attention_backward(xp.asarray(mpiattn.shard(R, layout=lay)), q, k, v, out, lse, **kw)
    grads = [host(mpiattn.gather(g, layout=lay, root=None)) for g in grads]
    rng = np.random.default_rng(13)
    eps = 1e-6
    for which, X in enumerate((Q, K, V)):
        for _ in range(4):
            idx = tuple(int(rng.integers(0, s)) for s in X.shape)
            plus, minus = [A.copy() for A in (Q, K, V)], [A.copy() for A in (Q, K, V)]
            plus[which][idx] += eps
            minus[which][idx] -= eps
            fd = (loss(*plus) - loss(*minus)) / (2 * eps)
            assert abs(fd - grads[which][idx]) < 1e-6, (which, idx, fd, grads[which][idx])


# ------------------------------------------------------------------ BlockMask on its own
def test_block_mask_rules_and_tile_classification():
    """Random positions (runs and shuffles), windows, ids: "none" and "all" are never wrong, and
    tiles of at most REFINE_LIMIT pairs are classified exactly."""
    from mpiattn.masks import BlockMask

    m = BlockMask(np.arange(4), np.arange(4), True, None, (2, None))
    assert m.rules == ("causal", "window") and m.positional
    assert BlockMask(np.arange(4), np.arange(4), True, np.zeros((1, 4), bool)).rules == ("causal", "padding")
    assert not BlockMask(np.arange(2), np.arange(2)).positional
    assert BlockMask(np.arange(2), np.arange(2), window=(None, None)).rules == ()
    with pytest.raises(ValueError, match="both queries and keys"):
        BlockMask(np.arange(2), np.arange(2), q_seg=np.zeros((1, 2), np.int64))
    rng = np.random.default_rng(0)
    seen = set()
    for trial in range(300):
        n, k = (int(x) for x in rng.integers(1, 60, 2))
        qp = rng.permutation(200)[:n] if trial % 3 == 0 else np.arange(n) + int(rng.integers(0, 20))
        kp = rng.permutation(200)[:k] if trial % 2 == 0 else np.arange(k) + int(rng.integers(0, 40))
        causal = bool(rng.integers(2))
        window = [None, (3, 0), (0, 0), (None, 2), (5, None), (2, 7)][int(rng.integers(6))]
        kind = int(rng.integers(3))
        ids = None if kind == 0 else (np.sort(rng.integers(0, 6, (2, 200)), axis=1) if kind == 1
                                      else rng.integers(0, 3, (2, 200)))
        qs, ks = (None, None) if ids is None else (ids[:, qp], ids[:, kp])
        m = BlockMask(qp.astype(np.int64), kp.astype(np.int64), causal, None, window, qs, ks)
        for _ in range(5):
            i0, i1 = sorted(int(x) for x in rng.integers(0, n + 1, 2))
            j0, j1 = sorted(int(x) for x in rng.integers(0, k + 1, 2))
            vis = m.visibility(i0, i1, j0, j1)
            B = 1 if ids is None else 2
            want = visible_matrix(B, 200, 200, causal, window, ids, ids)[:, qp[i0:i1]][:, :, kp[j0:j1]]
            seen.add(vis)
            if vis == "none":
                assert not want.any()
            elif vis == "all":
                assert want.all()
            else:
                assert want.any() and not want.all()  # exact at this size
    assert seen == {"none", "all", "some"}


# ------------------------------------------------------------------ work skipping
def _expected_tiles(q_pos, key_blocks, tile, vis):
    """(query tile, key tile) pairs with at least one visible pair, per the kernels' tiling."""
    count = 0
    for kb in key_blocks:
        for j0 in range(0, kb.size, tile):
            kt = kb[j0:j0 + tile]
            for i0 in range(0, q_pos.size, tile):
                qt = q_pos[i0:i0 + tile]
                count += bool(vis[:, qt][:, :, kt].any())
    return count


@pytest.mark.parametrize("strategy", ["ring", "allgather", "ulysses"])
@pytest.mark.parametrize("mask", ["window-causal", "documents-causal", "window-0-0"])
@pytest.mark.parametrize("layout", ["zigzag", "shuffled"])
def test_tiles_without_visible_pairs_are_never_computed(comm, monkeypatch, strategy, mask, layout):
    P = comm.size
    B, H, Hkv, N, tile = 1, P, P, 64, 4
    kw, seg, _ = mask_args(mask, B, N)
    lay = make_layout(layout, N, P)
    vis = visible_matrix(B, N, N, kw.get("causal", False), kw.get("window"), seg, seg)
    calls, blocks = [0], [0]
    real_tile, real_few, real_block = native._tile_generic, native._tile_few, native.forward_block

    def counting(*a, **k):
        calls[0] += 1
        return real_tile(*a, **k)

    def counting_few(*a, **k):  # a few query rows (decode-sized shards): tiles read in place
        calls[0] += 1
        return real_few(*a, **k)

    def block(st, group, k, v, mask, *rest):
        blocks[0] += not mask.visible_pairs(0, mask.q_pos.size, 0, mask.k_pos.size).any()
        return real_block(st, group, k, v, mask, *rest)

    monkeypatch.setattr(native, "_tile_generic", counting)
    monkeypatch.setattr(native, "_tile_few", counting_few)
    monkeypatch.setattr(native, "forward_block", block)
    Q, K, V, _ = case(1, B, H, Hkv, N)
    sh = lambda x: mpiattn.shard(x, layout=lay)  # noqa: E731
    ids = None if seg is None else mpiattn.shard(seg, axis=-1, layout=lay)
    mpiattn.attention(sh(Q), sh(K), sh(V), layout=lay, strategy=strategy, block_size=tile,
                      segment_ids=ids, engine="native", **kw)
    if strategy == "ulysses":
        q_pos, key_blocks = np.arange(N), [np.arange(N)]
    else:
        q_pos = mpiattn.partition(N, layout=lay)
        pos = [positions(s) for s in all_segments(N, P, lay)]
        if strategy == "ring":
            key_blocks = [np.arange(g, g + ln) for s in all_segments(N, P, lay)
                          for g, _, ln in row_pieces(s, tile)]
        else:
            rounds = max(-(-p.size // tile) for p in pos)
            key_blocks = [np.concatenate([p[t * tile:(t + 1) * tile] for p in pos]) for t in range(rounds)]
    assert calls[0] == _expected_tiles(q_pos, key_blocks, tile, vis)
    assert blocks[0] == 0  # a block with nothing visible never reaches the kernels
    total = comm.allgather_obj(calls[0])
    full = (N // tile) ** 2 * (1 if strategy != "ulysses" else P)
    assert sum(total) < full / 2  # the mask saves most of the work here


# ------------------------------------------------------------------ bad input
def _raises_everywhere(comm, exc, match, fn):
    with pytest.raises(exc, match=match) as info:
        fn()
    seen = comm.allgather_obj((type(info.value).__name__, str(info.value)))
    assert all(s == seen[0] for s in seen), seen


BAD = {
    "negative-left": (ValueError, "window left bound must be >= 0", dict(window=(-1, 0))),
    "negative-right": (ValueError, "window right bound must be >= 0", dict(window=(2, -3))),
    "window-not-pair": (TypeError, "window must be a pair", dict(window=5)),
    "window-float": (TypeError, "window left bound", dict(window=(1.5, 0))),
    "window-bool": (TypeError, "window right bound", dict(window=(1, True))),
    "window-past-int64": (ValueError, r"window left bound must be at most 2\*\*63 - 1",
                          dict(window=(2**63, 0))),
    "ids-float": (TypeError, "segment_ids must hold integers", "float"),
    "ids-bool": (TypeError, "segment_ids must hold integers", "bool"),
    "ids-shape": (ValueError, r"segment_ids must have shape \(B, rows\)", "shape"),
    "kv-ids-shape": (ValueError, r"kv_segment_ids must have shape", "kvshape"),
    "kv-ids-without-ids": (ValueError, "kv_segment_ids needs segment_ids", "kvonly"),
    "kv-ids-omitted-N-ne-M": (ValueError, "kv_segment_ids omitted", "cross"),
    "ids-not-array": (TypeError, "segment_ids must be an integer array", "list"),
    "layout-wrong-n": (ValueError, "explicit Layout covers", "layout-n"),
    "layout-for-keys-of-other-length": (ValueError, "pass kv_layout=", "layout-kv"),
    "kv-layout-bad": (ValueError, "unknown layout", dict(kv_layout="striped")),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_same_error_everywhere(comm, xp, name):
    exc, match, what = BAD[name]
    P = comm.size
    N = 2 * P + 3
    M = N + 2 if what in ("cross", "layout-kv") else N
    Q, K, V, _ = case(2, 2, 1, 1, N, M)
    sh = lambda x, n: xp.asarray(mpiattn.shard(x))  # noqa: E731
    q, k, v = sh(Q, N), sh(K, M), sh(V, M)
    n_r, m_r = q.shape[2], k.shape[2]
    kw = dict(what) if isinstance(what, dict) else {}
    ids = np.zeros((2, n_r), dtype=np.int32)
    if what == "float":
        kw["segment_ids"] = ids.astype(np.float64)
    elif what == "bool":
        kw["segment_ids"] = ids.astype(bool)
    elif what == "shape":
        kw["segment_ids"] = np.zeros((2, n_r + 1), dtype=np.int64)
    elif what == "kvshape":
        kw.update(segment_ids=ids, kv_segment_ids=np.zeros((1, m_r), dtype=np.int64))
    elif what == "kvonly":
        kw["kv_segment_ids"] = np.zeros((2, m_r), dtype=np.int64)
    elif what == "cross":
        kw["segment_ids"] = ids
    elif what == "list":
        kw["segment_ids"] = ids.tolist()
    elif what == "layout-n":
        kw["layout"] = mpiattn.Layout([[(0, N + 1)]] + [[]] * (P - 1))
    elif what == "layout-kv":  # an explicit layout of the N query rows; the keys have M rows
        kw["layout"] = mpiattn.Layout([[(g, g + ln) for g, ln in s] for s in all_segments(N, P, "contiguous")])
    _raises_everywhere(comm, exc, match, lambda: mpiattn.attention(q, k, v, **kw))


@pytest.mark.mpi(min_size=2)
def test_rank_dependent_masks_and_layouts(comm, xp):
    P = comm.size
    N = 3 * P
    Q, K, V, _ = case(2, 1, 1, 1, N)
    q = xp.asarray(mpiattn.shard(Q))
    with pytest.raises(ValueError, match="ranks disagree on window: rank 0 has"):
        mpiattn.attention(q, q, q, window=(1, 0) if comm.rank == 0 else (2, 0))
    with pytest.raises(ValueError, match="ranks disagree on segment_ids .* presence"):
        ids = np.zeros((1, q.shape[2]), dtype=np.int64)
        mpiattn.attention(q, q, q, segment_ids=ids if comm.rank == 0 else None)
    # an explicit layout that differs between ranks (same row counts on every rank)
    base = [[(g, g + ln) for g, ln in s] for s in all_segments(N, P, "contiguous")]
    other = [list(reversed(r)) for r in base]
    other[0] = [(base[0][0][0] + 1, base[0][0][1]), (base[0][0][0], base[0][0][0] + 1)]
    lay = mpiattn.Layout(base if comm.rank == 0 else other)
    with pytest.raises(ValueError, match="ranks disagree on layout"):
        mpiattn.attention(q, q, q, layout=lay)
    with pytest.raises(ValueError, match="ranks disagree on gather's layout"):
        mpiattn.gather(q, layout=lay)
    with pytest.raises(ValueError, match="ranks disagree on shard's layout"):
        mpiattn.shard(Q, layout=lay)


def test_layout_must_partition():
    with pytest.raises(ValueError, match="owned twice"):
        mpiattn.Layout([[(0, 5)], [(4, 8)]])
    with pytest.raises(ValueError, match="belong to no rank"):
        mpiattn.Layout([[(0, 3)], [(4, 8)]])
    with pytest.raises(ValueError, match="belong to no rank"):
        mpiattn.Layout([[(2, 8)]])
    with pytest.raises(ValueError, match="start <= stop"):
        mpiattn.Layout([[(3, 1)]])
    with pytest.raises(ValueError, match="at least one rank"):
        mpiattn.Layout([])
    with pytest.raises(TypeError, match="pair of integers"):
        mpiattn.Layout([[(0, 2.5)]])
    with pytest.raises(TypeError):
        mpiattn.Layout("0-5")


# ------------------------------------------------------------------ the layer
def test_multihead_attention_takes_the_mask_keywords(comm, xp):
    """MultiheadAttention(window=, segment_ids=, layout=Layout) against projections + the dense reference."""
    P = comm.size
    B, N, E, H = 2, 21, 8, 2
    x = np.random.default_rng(14).standard_normal((B, N, E))
    seg = documents(B, N, 6)
    lay = mpiattn.balance(N, P, causal=True, segment_ids=seg)
    layer = mpiattn.MultiheadAttention(E, H, dtype=np.float64, seed=3).to(xp)
    kw = dict(causal=True, window=(4, 0), layout=lay, segment_ids=mpiattn.shard(seg, axis=-1, layout=lay))
    y = layer(xp.asarray(mpiattn.shard(x, layout=lay)), **kw)
    p = {k: host(v) for k, v in layer.params.items()}
    heads = lambda z: z.reshape(B, N, H, E // H).transpose(0, 2, 1, 3)  # noqa: E731
    Q, K, V = heads(x @ p["wq"]), heads(x @ p["wk"]), heads(x @ p["wv"])
    vis = visible_matrix(B, N, N, True, (4, 0), seg, seg)
    out = reference(Q, K, V, np.zeros_like(Q), vis)[0]
    want = out.transpose(0, 2, 1, 3).reshape(B, N, E) @ p["wo"]
    np.testing.assert_allclose(host(mpiattn.gather(y, layout=lay, root=None)), want, rtol=1e-10, atol=1e-10)
    dx = layer.backward(xp.ones_like(y))[0]
    assert host(dx).shape == (B, y.shape[1], E) and np.isfinite(host(dx)).all()


# ------------------------------------------------------------------ the CuPy path (on a fake device)
@pytest.mark.parametrize("strategy", STRATS)
def test_masks_on_a_fake_device(comm, monkeypatch, strategy):
    """Window + documents + padding with "device" arrays (tests/fake_cupy.py) equal the dense reference.

    Ids are given as NumPy for the queries and on the device for the keys; the
    explicit layouts differ between queries and keys (the materialized strategy
    then moves rows between layouts on the device).
    """
    from mpi4py import MPI

    import fake_cupy
    from helpers import install_fake_cupy
    from mpiattn.comm import Comm

    fake = install_fake_cupy(monkeypatch)
    c = Comm(MPI.COMM_WORLD.Dup())
    try:
        fake_cupy._state.bus_id = f"0000:{c.rank:02x}:00.0"
        monkeypatch.setenv("MPIATTN_GPU_TRANSPORT", "staged")
        P = c.size
        B, H, Hkv, N = 2, 2 * P, P, 17
        Q, K, V, dO = case(21, B, H, Hkv, N)
        seg = documents(B, N, 8)
        pad = np.random.default_rng(3).random((B, N)) < 0.2
        lay, kl = mpiattn.balance(N, P, causal=True, segment_ids=seg), shuffled_layout(N, P, seed=5)
        rows_q, rows_k = (mpiattn.partition(N, c.mpi, layout=x) for x in (lay, kl))
        dev = lambda x, r: fake.asarray(x[..., r, :])  # noqa: E731
        q, k, v, do = dev(Q, rows_q), dev(K, rows_k), dev(V, rows_k), dev(dO, rows_q)
        kw = dict(causal=True, window=(5, 1), layout=lay, kv_layout=kl, strategy=strategy, block_size=3,
                  segment_ids=seg[:, rows_q], kv_segment_ids=fake.asarray(seg[:, rows_k]),
                  key_padding_mask=fake.asarray(pad[:, rows_k]), engine="native")
        out, lse = mpiattn.attention(q, k, v, c, **kw)
        grads = mpiattn.attention_backward(do, q, k, v, out, lse, c, **kw)
        ref = reference(Q, K, V, dO, visible_matrix(B, N, N, True, (5, 1), seg, seg, pad))
        got = [host(out), host(lse)] + [host(g) for g in grads]
        want = [ref[0][..., rows_q, :], ref[1][..., rows_q], ref[2][..., rows_q, :],
                ref[3][..., rows_k, :], ref[4][..., rows_k, :]]
        for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
            fin = np.isfinite(w)
            np.testing.assert_array_equal(np.isfinite(g), fin, err_msg=name)
            np.testing.assert_allclose(g[fin], w[fin], rtol=1e-10, atol=1e-10, err_msg=name)
    finally:
        if c.device_transport is not None:
            c.device_transport.close()
        c.mpi.Free()
        fake_cupy.shutdown()
