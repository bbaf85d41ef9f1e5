"""balance(): explicit layouts with an equal share of visible pairs; the Layout class; cu_seqlens."""

import numpy as np
import pytest

import mpiattn
from mpiattn import balancing
from mpiattn.layouts import all_segments, check_shares, local_lengths, positions, to_global_order

from helpers import host, visible_matrix

N = 4096


def packed(mean, B=1, n=N, seed=0):
    """(B, n) ids of documents with exponential lengths of the given mean (at least 1 row)."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(B):
        lens = []
        while sum(lens) < n:
            lens.append(int(rng.exponential(mean)) + 1)
        cu = np.unique(np.minimum(np.concatenate([[0], np.cumsum(lens)]), n))
        rows.append(balancing.segment_ids_from_cu_seqlens(cu))
    return np.stack(rows)


CASES = {
    "causal": dict(causal=True),
    "causal-docs-256": dict(causal=True, segment_ids=packed(256, seed=1)),
    "causal-docs-2048": dict(causal=True, segment_ids=packed(2048, seed=2)),
    "causal-docs-batch": dict(causal=True, segment_ids=packed(600, B=3, seed=3)),
    "docs-1d": dict(segment_ids=packed(900, seed=4)[0]),
    "window-causal": dict(causal=True, window=(512, 0)),
    "window-sym": dict(window=(300, 300)),
    "window-one-sided": dict(window=(None, 100)),
    "window-docs-causal": dict(causal=True, window=(700, None), segment_ids=packed(1000, seed=5)),
    "full": dict(),
}


def dense_visible(n, causal=False, window=None, segment_ids=None):
    """(B, n, n) visibility of self-attention (B = 1 without documents)."""
    seg = None if segment_ids is None else np.atleast_2d(segment_ids)
    return visible_matrix(1 if seg is None else len(seg), n, n, causal, window, seg, seg)


def brute_work(n, causal=False, window=None, segment_ids=None):
    return dense_visible(n, causal, window, segment_ids).sum(axis=(0, 2))


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("P", [2, 3, 4])
def test_goal_max_over_mean_work(name, P):
    kw = CASES[name]
    lay = mpiattn.balance(N, P, **kw)
    assert isinstance(lay, mpiattn.Layout) and lay.n == N and lay.size == P
    work = balancing.rank_work(lay, N, P, **kw)
    assert work.max() / work.mean() <= 1.10, (name, P, work)
    assert all(len(r) <= 2 * balancing.MAX_CHUNKS_PER_RANK for r in lay.ranges)
    # never worse than the named layouts
    for named in ("contiguous", "zigzag"):
        other = balancing.rank_work(named, N, P, **kw)
        assert work.max() <= other.max() * 1.001 + 1


@pytest.mark.parametrize("name", list(CASES))
def test_deterministic_and_a_partition(name):
    kw = CASES[name]
    a, b = mpiattn.balance(N, 3, **kw), mpiattn.balance(N, 3, **kw)
    assert a == b and a.ranges == b.ranges and hash(a) == hash(b)
    owned = np.concatenate([positions(s) for s in all_segments(N, 3, a)])
    assert np.array_equal(np.sort(owned), np.arange(N))
    for r in a.ranges:  # increasing local order, merged ranges
        assert all(x[1] < y[0] for x, y in zip(r, r[1:]))


def test_plain_causal_is_zigzag_like():
    lay = mpiattn.balance(1000, 4, causal=True)
    assert [sum(b - a for a, b in r) for r in lay.ranges] == local_lengths(1000, 4, "zigzag")


@pytest.mark.parametrize("n", [0, 1, 2, 7, 50])
@pytest.mark.parametrize("P", [1, 2, 5])
def test_small_and_degenerate(n, P):
    for kw in ({}, dict(causal=True), dict(window=(0, 0)), dict(causal=True, segment_ids=np.arange(n) % 3)):
        lay = mpiattn.balance(n, P, **kw)
        assert lay.n == n and lay.size == P
        check_shares(local_lengths(n, P, lay), lay, "test")


@pytest.mark.parametrize("kw", [dict(causal=True), dict(window=(3, 1)), dict(window=(None, 0)),
                                dict(causal=True, window=(2, None), segment_ids=[[0, 0, 5, 5, 5, 1, 1, 5, 2, 2, 2]]),
                                dict(segment_ids=[7, 7, -1, 7, 3, 3, 3, 3, 0, 0, 9])])
def test_row_work_matches_brute_force(kw):
    n = 11
    args = dict(kw)
    if "segment_ids" in args:
        args["segment_ids"] = np.asarray(args["segment_ids"])
    assert np.array_equal(balancing.row_work(n, **args), brute_work(n, **args))


def brute_tiles(n, T, causal=False, window=None, segment_ids=None):
    """Visible tiles per block of T query rows, from the dense visible matrix."""
    nb = -(-n // T)
    out = np.zeros(nb, dtype=np.int64)
    for v in dense_visible(n, causal, window, segment_ids):
        out += [sum(v[a * T:(a + 1) * T, b * T:(b + 1) * T].any() for b in range(nb)) for a in range(nb)]
    return out


def test_tile_work_matches_brute_force():
    rng = np.random.default_rng(11)
    for _ in range(60):
        n, T = int(rng.integers(1, 90)), int(rng.integers(1, 17))
        kw = dict(causal=bool(rng.integers(2)))
        if rng.integers(2):
            kw["window"] = tuple(None if rng.integers(3) == 0 else int(rng.integers(0, 25)) for _ in "lr")
        if rng.integers(2):
            kw["segment_ids"] = packed(6, B=int(rng.integers(1, 3)), n=n, seed=int(rng.integers(99))) * 5 - 2
        assert np.array_equal(balancing.tile_work(n, T, **kw), brute_tiles(n, T, **kw)), (n, T, kw)
    # an id in two runs of rows: not counted (balance then weighs the blocks' pairs)
    assert balancing.tile_work(6, 2, segment_ids=np.array([0, 0, 1, 1, 0, 0])) is None


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("P", [2, 3, 4])
@pytest.mark.parametrize("T", [256, 512])
def test_tile_balance_is_aligned_and_even_in_tiles(name, P, T):
    kw = CASES[name]
    lay = mpiattn.balance(N, P, block_size=T, **kw)
    for r in lay.ranges:
        assert all(a % T == 0 and (b % T == 0 or b == N) for a, b in r), lay.ranges
    owned = np.concatenate([positions(s) for s in all_segments(N, P, lay)])
    assert np.array_equal(np.sort(owned), np.arange(N))
    tiles = balancing.tile_work(N, T, **kw)
    per = np.array([sum(int(tiles[a // T:-(-b // T)].sum()) for a, b in r) for r in lay.ranges])
    # the tiles of a block are indivisible: within 10 % of the mean, or one block's worth
    assert per.max() <= max(1.10 * per.mean(), per.mean() + tiles.max()), (name, P, T, per)


def test_tile_balance_beats_pair_balance_on_documents():
    """Causal documents of mean 2048 at 32k rows, P = 2: the case of the masks benchmark."""
    n, T = 32768, 512
    seg = packed(2048, n=n, seed=1)
    tiles = balancing.tile_work(n, T, causal=True, segment_ids=seg)
    lay = mpiattn.balance(n, 2, causal=True, segment_ids=seg, block_size=T)
    per = [sum(int(tiles[a // T:-(-b // T)].sum()) for a, b in r) for r in lay.ranges]
    assert max(per) / np.mean(per) <= 1.02, per


def test_bad_arguments():
    with pytest.raises(ValueError, match="size >= 1"):
        mpiattn.balance(10, 0)
    with pytest.raises(ValueError, match="size >= 1"):
        mpiattn.balance(10, -2)
    with pytest.raises(TypeError):
        mpiattn.balance(10, 2.5)
    with pytest.raises(ValueError, match="n >= 0"):
        mpiattn.balance(-1, 2)
    with pytest.raises(ValueError, match="window left bound must be >= 0"):
        mpiattn.balance(10, 2, window=(-1, 0))
    with pytest.raises(TypeError, match="must hold integers"):
        mpiattn.balance(10, 2, segment_ids=np.zeros(10))
    with pytest.raises(ValueError, match=r"shape \(N,\) or \(B, N\)"):
        mpiattn.balance(10, 2, segment_ids=np.zeros(9, dtype=int))
    with pytest.raises(ValueError, match="balance: block_size must be >= 1"):
        mpiattn.balance(10, 2, block_size=0)
    with pytest.raises(TypeError, match="balance: block_size must be a positive integer or None"):
        mpiattn.balance(10, 2, block_size=2.0)
    with pytest.raises(TypeError, match="balance: block_size must be a positive integer or None"):
        mpiattn.balance(10, 2, block_size=True)


def test_segment_ids_from_cu_seqlens():
    ids = mpiattn.segment_ids_from_cu_seqlens([0, 3, 4, 4, 8])
    assert ids.tolist() == [0, 0, 0, 1, 3, 3, 3, 3]  # document 2 is empty
    assert mpiattn.segment_ids_from_cu_seqlens(np.array([0, 2]), n=5).tolist() == [0, 0, 1, 1, 1]
    assert mpiattn.segment_ids_from_cu_seqlens([0]).size == 0
    for bad in ([1, 3], [0, 3, 2], [[0, 1]], [0.0, 1.0]):
        with pytest.raises(ValueError):
            mpiattn.segment_ids_from_cu_seqlens(bad)
    with pytest.raises(ValueError, match="shorter"):
        mpiattn.segment_ids_from_cu_seqlens([0, 4], n=3)


# ------------------------------------------------------------------ Layout in the layout helpers
def test_layout_attributes_and_segments():
    lay = mpiattn.Layout([[(4, 6), (0, 2)], [(2, 4), (6, 6)], []])
    assert lay.n == 6 and lay.size == 3
    assert lay.ranges == (((4, 6), (0, 2)), ((2, 4), (6, 6)), ())
    assert all_segments(6, 3, lay) == [[(4, 2), (0, 2)], [(2, 2)], []]
    assert local_lengths(6, 3, lay) == [4, 2, 0]
    assert mpiattn.Layout([[(0, 2), (2, 5)]]).segments() == [[(0, 5)]]  # adjacent ranges merge
    rows = np.arange(6)[[4, 5, 0, 1, 2, 3]]
    assert to_global_order(rows, 6, 3, lay).tolist() == list(range(6))
    with pytest.raises(ValueError, match="covers 6 rows"):
        all_segments(7, 3, lay)
    with pytest.raises(ValueError, match="ranges for 3 ranks"):
        all_segments(6, 2, lay)
    assert mpiattn.Layout([[(0, 1)]]) != mpiattn.Layout([[(0, 1)], []])
    assert "Layout(n=6" in repr(lay)


def _layout(comm, n):
    return mpiattn.balance(n, comm.size, causal=True) if n % 2 else \
        mpiattn.Layout([[(n - (r + 1) * (n // comm.size), n - r * (n // comm.size))] if r < comm.size - 1
                        else [(0, n - r * (n // comm.size))] for r in range(comm.size)])


@pytest.mark.parametrize("n", [0, 5, 16, 33])
def test_partition_shard_gather_roundtrip(comm, xp, n):
    lay = _layout(comm, n)
    x_host = np.random.default_rng(n).standard_normal((2, n, 3))
    idx = mpiattn.partition(n, layout=lay)
    part = mpiattn.shard(xp.asarray(x_host), axis=1, layout=lay)
    np.testing.assert_array_equal(host(part), x_host[:, idx, :])
    back = mpiattn.gather(part, axis=1, layout=lay, root=None)
    np.testing.assert_array_equal(host(back), x_host)
    with pytest.raises(ValueError, match="covers"):
        mpiattn.partition(n + 1, layout=lay)


@pytest.mark.parametrize("n", [0, 7, 20])
def test_relayout_rows(comm, xp, n):
    from mpiattn.sharding import relayout_rows

    src, dst = _layout(comm, n), "zigzag"
    X = np.random.default_rng(1).standard_normal((2, n, 3))
    got = relayout_rows(comm, xp.asarray(mpiattn.shard(X, layout=src)), n, src, dst)
    np.testing.assert_array_equal(host(got), mpiattn.shard(X, layout=dst))


def test_products_take_an_explicit_layout(comm, xp):
    n = 13
    lay = mpiattn.balance(n, comm.size, causal=True)
    rng = np.random.default_rng(2)
    A, Bm = rng.standard_normal((n, 4)), rng.standard_normal((n, 4))
    a, b = (xp.asarray(mpiattn.shard(x, layout=lay)) for x in (A, Bm))
    got = mpiattn.matmul_nt(a, b, layout=lay, block_size=2)
    np.testing.assert_allclose(host(got), mpiattn.shard(A @ Bm.T, layout=lay), rtol=1e-12, atol=1e-12)
    S = rng.standard_normal((n, n))
    got = mpiattn.matmul_tn(xp.asarray(mpiattn.shard(S, layout=lay)), b, layout=lay, block_size=3)
    np.testing.assert_allclose(host(got), mpiattn.shard(S.T @ Bm, layout=lay), rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="Layout covers"):
        mpiattn.matmul_nt(a, xp.asarray(mpiattn.shard(rng.standard_normal((n + 1, 4)))), layout=lay)


def _diagonal_blocks(b, h, i, j):
    """Blocks of 40 rows, shifted by 7 rows on head 1 and batch entry 1."""
    return (i + 7 * h + 7 * b) // 40 == (j + 7 * h + 7 * b) // 40


def _dense_scored(n, m, causal, am, B, H):
    """(B, H, n, m) visible pairs of the rules, a bool attn_mask and _diagonal_blocks, written out."""
    b, h, i, j = np.ix_(np.arange(B), np.arange(H), np.arange(n), np.arange(m))
    d = m - n if causal == "bottom-right" else 0
    ok = _diagonal_blocks(b, h, i, j) & (am if am is not None else True)
    return ok & ((j <= i + d) if causal else True)


@pytest.mark.parametrize("causal", [False, True, "bottom-right"])
def test_work_counts_the_pairs_a_mask_hides(causal):
    n, m, B, H, T = 97, 131 if causal == "bottom-right" else 97, 2, 3, 16
    am = np.random.default_rng(5).random((B, 1, n, m)) < 0.8
    dense = _dense_scored(n, m, causal, am, B, H)
    kw = dict(causal=causal, m=m, attn_mask=am, mask_mod=_diagonal_blocks, batch=B, heads=H)
    assert np.array_equal(balancing.row_work(n, **kw), np.rint(dense.sum(-1).mean((0, 1))))
    nb, nkb = -(-n // T), -(-m // T)
    seen = dense.any((0, 1))
    tiles = [sum(seen[a * T:(a + 1) * T, c * T:(c + 1) * T].any() for c in range(nkb)) for a in range(nb)]
    assert np.array_equal(balancing.tile_work(n, T, **kw), tiles)
    float_mask = np.where(am, 0.5, -np.inf)  # a float mask hides where it is -inf
    assert np.array_equal(balancing.row_work(n, **dict(kw, attn_mask=float_mask)),
                          balancing.row_work(n, **kw))


def test_balance_evens_the_work_a_mask_leaves():
    n, P = 4096, 4

    def prefix_heavy(b, h, i, j):  # the first quarter of the queries sees every key, the rest 64
        return (i < 1024) | (np.abs(i - j) < 32)

    lay = balancing.balance(n, P, mask_mod=prefix_heavy)
    work = balancing.rank_work(lay, n, P, mask_mod=prefix_heavy)
    plain = balancing.rank_work("contiguous", n, P, mask_mod=prefix_heavy)
    assert work.max() / work.mean() <= balancing.TARGET + 1e-9 < plain.max() / plain.mean()
    assert balancing.balance(n, P) != lay  # without the mask: another layout
    with pytest.raises(ValueError, match="last axis must be m"):
        balancing.row_work(8, attn_mask=np.ones((1, 1, 8, 9), bool))
    with pytest.raises(TypeError, match="mask_mod"):
        balancing.row_work(8, mask_mod=lambda b, h, i, j: i - j)
