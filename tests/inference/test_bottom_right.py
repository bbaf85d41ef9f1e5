"""Bottom-right causal alignment: query i of N sees key j of M iff j <= i + M - N (windows alike).

Checked against the tests' own visibility (``helpers.visible_matrix``, written out
independently) at the level of the rules (MaskSpec.band, BlockMask per tile, the dense
visibility), of the public call (every layout, N < M, N = M, N > M, windows, both engines;
the contract suite runs every strategy) and of ``balance``.
"""

import numpy as np
import pytest

import mpiattn
from mpiattn.balancing import row_work
from mpiattn.kernels import engines
from mpiattn.masks import BlockMask, MaskSpec, check_causal, diagonal, visible
from mpiattn.strategies import Options

from helpers import host, reference, visible_matrix

SHAPES = [(7, 19), (13, 13), (19, 7), (1, 30), (30, 1)]
WINDOWS = [None, (3, 0), (0, 0), (2, 5), (None, 1)]


def test_alignment_values_and_errors():
    assert check_causal(True) is True and check_causal("top-left") is True
    assert check_causal("bottom-right") == "bottom-right" and check_causal(False) is False
    assert Options(causal="top-left").causal is True
    assert Options(causal="bottom-right").causal == "bottom-right"
    for bad in ("bottom-left", 1, None, "causal"):
        with pytest.raises(TypeError, match="causal must be"):
            Options(causal=bad)
    with pytest.raises(TypeError, match="diagonal"):
        MaskSpec(causal="bottom-right")
    assert diagonal("bottom-right", 5, 9) == 4 and diagonal(True, 5, 9) == 0 and diagonal(False, 5, 9) == 0


@pytest.mark.parametrize("N,M", SHAPES)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("causal", [True, "bottom-right", False])
def test_rules_match_the_written_out_matrix(N, M, window, causal):
    want = visible_matrix(1, N, M, causal, window)[0]
    spec = MaskSpec(bool(causal), window, diagonal=diagonal(causal, N, M))
    np.testing.assert_array_equal(visible(spec, np.arange(N), np.arange(M))[0], want)
    bm = BlockMask(np.arange(N), np.arange(M), bool(causal), None, window, diagonal=spec.diagonal)
    for i0, i1, j0, j1 in [(0, N, 0, M), (0, max(1, N // 2), M // 3, M), (N // 2, N, 0, M // 2 + 1)]:
        tile = want[i0:i1, j0:j1]
        vis = bm.visibility(i0, i1, j0, j1)
        expect = "none" if not tile.any() else "all" if tile.all() else "some"
        assert vis == expect, (i0, i1, j0, j1)
        np.testing.assert_array_equal(bm.visible_pairs(i0, i1, j0, j1)[0], tile)
    lo, hi = spec.band()  # the band of j - i is the whole rule without documents
    d = np.arange(M)[None, :] - np.arange(N)[:, None]
    np.testing.assert_array_equal((d >= lo) & (d <= hi), want)


@pytest.mark.parametrize("N,M", [(9, 40), (24, 24), (40, 9)])
@pytest.mark.parametrize("window", [None, (6, 0), (3, 2)])
@pytest.mark.parametrize("engine", list(engines.ENGINES))
def test_attention_bottom_right_matches_reference(comm, xp, N, M, window, engine):
    spec_why = engines.get(engine).supports(mpiattn.AttentionSpec.from_shapes(
        (2, 4, N, 8), (2, 2, M, 8), (2, 2, M, 8), "float64",
        Options(causal="bottom-right", window=window), device=xp.__name__)) \
        or engines.get(engine).usable(xp.__name__)
    if spec_why:
        pytest.skip(spec_why)
    rng = np.random.default_rng(N * 100 + M)
    Q = rng.standard_normal((2, 4, N, 8))
    K, V = rng.standard_normal((2, 2, M, 8)), rng.standard_normal((2, 2, M, 8))
    lay = "zigzag"
    out, lse = mpiattn.attention(xp.asarray(mpiattn.shard(Q, layout=lay)),
                                 xp.asarray(mpiattn.shard(K)), xp.asarray(mpiattn.shard(V)),
                                 causal="bottom-right", window=window, layout=lay,
                                 kv_layout="contiguous", engine=engine, block_size=5)
    got_o = host(mpiattn.gather(out, layout=lay, root=None))
    got_l = host(mpiattn.gather(lse, axis=-1, layout=lay, root=None))
    ref = reference(Q, K, V, causal="bottom-right", window=window)
    np.testing.assert_array_equal(np.isneginf(got_l), np.isneginf(ref.lse))
    np.testing.assert_allclose(got_o, ref.out, atol=1e-12)
    fin = np.isfinite(ref.lse)
    np.testing.assert_allclose(got_l[fin], ref.lse[fin], atol=1e-12)
    if N < M:  # the last query sees every key (all of them, without a window)
        assert window is not None or np.isfinite(got_l[..., -1]).all()
    if N > M:  # the first N - M queries see no key
        assert np.isneginf(got_l[..., : N - M]).all()


def test_bottom_right_is_top_left_when_n_equals_m(comm):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((1, 2, 21, 4))
    a = mpiattn.attention(*(mpiattn.shard(x),) * 3, causal="bottom-right", window=(4, 0))
    b = mpiattn.attention(*(mpiattn.shard(x),) * 3, causal=True, window=(4, 0))
    np.testing.assert_array_equal(a[0], b[0])


@pytest.mark.parametrize("n,m", [(40, 100), (100, 40), (64, 64)])
@pytest.mark.parametrize("window", [None, (10, 0)])
def test_balance_counts_bottom_right_pairs(n, m, window):
    want = visible_matrix(1, n, m, "bottom-right", window)[0].sum(axis=1)
    np.testing.assert_array_equal(row_work(n, causal="bottom-right", window=window, m=m), want)
    lay = mpiattn.balance(n, 3, causal="bottom-right", window=window, m=m)
    work = [int(want[np.concatenate([np.arange(a, b) for a, b in rs])].sum()) for rs in lay.ranges]
    assert max(work) <= 1.10 * np.mean(work) + max(want)
    tiled = mpiattn.balance(n, 2, causal="bottom-right", window=window, m=m, block_size=8)
    assert tiled.n == n


def test_bad_alignment_is_the_same_error_on_every_rank(comm):
    x = np.zeros((1, 1, 4, 2))
    msgs = []
    try:
        mpiattn.attention(x, x, x, causal="bottom-left" if comm.rank == comm.size - 1 else True)
    except TypeError as exc:
        msgs.append(str(exc))
    got = comm.allgather_obj(msgs)
    assert all(g == got[0] and len(g) == 1 for g in got), got
    assert "causal must be" in got[0][0]
