"""``mpiattn.RelativeBias``: a relative-position bias from a table, without a per-score gather.

Each call is run twice, with ``RelativeBias(table, offset)`` and with the same formula as a
plain ``ScoreMod`` that gathers ``table[h, q - kv + offset]`` (float64: the same bits), and
compared with the tests' float64 torch reference (``helpers.torch_reference``: the whole
``(B, H, N, M)`` scores, every gradient by autograd), on every strategy, causal or not, GQA and
MHA, zigzag and explicit out-of-order layouts with uneven shards, decode and prefill; the
checks of the table and of its range, and what the ranks compare of it.
"""

import numpy as np
import pytest
from mpi4py import MPI

import mpiattn
from mpiattn import RelativeBias, ScoreMod
from mpiattn.masks import fingerprint
from mpiattn.masks.relbias import runs
from mpiattn.masks.scoremod import TileIndex, shift_score_mod
from mpiattn.strategies import registry

from helpers import host, torch_reference, uneven_heads, visible_matrix

torch = pytest.importorskip("torch")

B, H, E = 2, 4, 8
STRATEGIES = registry.variants(MPI.COMM_WORLD.Get_size())


def _table(W, seed=4):
    return np.random.default_rng(seed).standard_normal((H, W)) * 0.5


def _gather(table, offset):
    """The same bias as a plain ScoreMod: NumPy's gather per score."""
    return ScoreMod(lambda s, b, h, q, kv: s + table[h, q - kv + offset],
                    lambda s, b, h, q, kv: np.ones_like(s))


def _torch_form(table, offset):
    t = torch.tensor(table)
    return lambda s, b, h, q, kv: s + t[h, q - kv + offset]


def _data(N, M, hkv, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal(shape) for shape in
                 ((B, H, N, E), (B, hkv, M, E), (B, hkv, M, E), (B, H, N, E)))


def _run(data, mod, layout=None, kv_layout=None, **kw):
    q_layout = layout or "contiguous"
    k_layout = kv_layout or q_layout
    sq = lambda x: mpiattn.shard(x, layout=q_layout)  # noqa: E731
    sk = lambda x: mpiattn.shard(x, layout=k_layout)  # noqa: E731
    q, k, v, do = sq(data[0]), sk(data[1]), sk(data[2]), sq(data[3])
    lay = dict(layout=q_layout, **({} if kv_layout is None else {"kv_layout": kv_layout}))
    out, lse = mpiattn.attention(q, k, v, score_mod=mod, **lay, **kw)
    dq, dk, dv = mpiattn.attention_backward(do, q, k, v, out, lse, score_mod=mod, **lay, **kw)[:3]
    gq = lambda x, axis=-2: host(mpiattn.gather(x, axis=axis, layout=q_layout, root=None))  # noqa: E731
    gk = lambda x: host(mpiattn.gather(x, layout=k_layout, root=None))  # noqa: E731
    return gq(out), gq(lse, -1), gq(dq), gk(dk), gk(dv)


def _check(data, table, offset, vis, tol=1e-9, **kw):
    """RelativeBias against the gathering ScoreMod (bit for bit) and the torch reference."""
    got = _run(data, RelativeBias(table, offset), **kw)
    same = _run(data, _gather(table, offset), **kw)
    ref = torch_reference(*data, vis, score_mod=_torch_form(table, offset))[:5]
    for name, a, b, r in zip(("out", "lse", "dq", "dk", "dv"), got, same, ref):
        np.testing.assert_array_equal(a, b, err_msg=name)
        fin = np.isfinite(r)
        assert np.array_equal(np.isfinite(a), fin), name
        np.testing.assert_allclose(a[fin], r[fin], rtol=tol, atol=tol, err_msg=name)
    return got


def _skip(strategy, P, hkv):
    return uneven_heads(strategy, P, H, hkv)


@pytest.mark.parametrize("hkv", [2, 4], ids=["gqa", "mha"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_relative_bias_on_every_strategy(comm, strategy, causal, hkv):
    why = _skip(strategy, comm.size, hkv)
    if why:
        pytest.skip(why)
    N = 9 * comm.size + 5  # uneven shards
    table = _table(2 * N + 3)
    vis = visible_matrix(B, N, N, causal)[:, None]
    _check(_data(N, N, hkv, seed=hkv), table, N + 1, vis, causal=causal, strategy=strategy,
           layout="zigzag", block_size=8)


def _out_of_order(n, P, pieces):
    """Explicit ranges: ``n`` rows cut in ``pieces`` spans dealt round the ranks, each rank's spans
    in reversed global order."""
    bounds = np.linspace(0, n, pieces + 1).round().astype(int)
    spans = list(zip(bounds[:-1].tolist(), bounds[1:].tolist()))
    return mpiattn.Layout([spans[r::P][::-1] for r in range(P)])


@pytest.mark.parametrize("strategy", ["ring", "allgather", "materialized"])
def test_out_of_order_layouts_take_the_views_run_by_run(comm, strategy, monkeypatch):
    """Queries and keys in explicit out-of-order layouts (N != M): tiles whose positions are several
    runs take the strided views run pair by run pair (counted), the rest the gather; both equal
    the reference, bottom-right causal."""
    from mpiattn.masks import relbias

    taken = []
    strided = relbias.RelativeBias._strided
    monkeypatch.setattr(relbias.RelativeBias, "_strided",
                        lambda self, S, out, grid: taken.append(len(runs(grid.q_pos))) or
                        strided(self, S, out, grid))
    N, M, P = 70, 83, comm.size
    table = _table(N + M + 4)
    vis = visible_matrix(B, N, M, "bottom-right")[:, None]
    _check(_data(N, M, 2, seed=5), table, M + 1, vis, causal="bottom-right", strategy=strategy,
           layout=_out_of_order(N, P, 2 * P + 1), kv_layout=_out_of_order(M, P, 3 * P),
           block_size=48)
    assert taken
    if strategy != "materialized":  # (which moves the queries to a layout of its own)
        assert max(taken) >= 2  # some tile of several query runs was added by views


def test_a_contiguous_call_makes_no_index_arrays(comm, monkeypatch):
    """On the native engine tiles of consecutive positions read no index array: the bias is added
    by the views alone (the ranks' sample of answers, a tile with no layout, aside)."""
    from mpiattn.masks import relbias

    made, taken = [], []
    arrays, strided = TileIndex.arrays, relbias.RelativeBias._strided
    N = 16 * comm.size
    data, table = _data(N, N, 2, seed=2), _table(2 * N)
    with monkeypatch.context() as m:
        m.setattr(TileIndex, "arrays", lambda self: made.append(self.grid is not None) or arrays(self))
        m.setattr(relbias.RelativeBias, "_strided",
                  lambda self, S, out, grid: taken.append(1) or strided(self, S, out, grid))
        got = _run(data, RelativeBias(table, N), causal=True, strategy="ring", engine="native",
                   block_size=16)
    assert taken and not any(made)
    ref = torch_reference(*data, visible_matrix(B, N, N, True)[:, None], score_mod=_torch_form(table, N))
    for name, a, r in zip(("out", "lse", "dq", "dk", "dv"), got, ref):
        np.testing.assert_allclose(a, r, rtol=1e-9, atol=1e-9, err_msg=name)


def test_the_views_are_the_gather_on_one_tile_and_a_reversed_table_is_not():
    """One folded GQA tile of two query runs and two key runs, heads in order, reversed (one view
    with negative head strides) and in no affine order (a view per head): the views give the
    gather's bits (float64 and float32), and a test that compared with the table reversed would
    fail."""
    rng = np.random.default_rng(1)
    table = rng.standard_normal((4, 110))
    q_pos = np.r_[np.arange(40, 60), np.arange(0, 30)]
    k_pos = np.r_[np.arange(10, 45), np.arange(50, 60)]
    for heads in (np.arange(4), np.arange(4)[::-1], np.array([3, 1, 0, 2])):
        at = TileIndex.folded(2, heads, 2, q_pos, k_pos)
        b, h, q, kv = at.arrays()
        grid_only = TileIndex(lambda: 1 / 0, np, at.grid)  # the views must not need the arrays
        for dtype in (np.float64, np.float32):
            S = rng.standard_normal((2, 2, q_pos.size * 2, k_pos.size)).astype(dtype)
            want = S + table.astype(dtype)[h, q - kv + 60]
            got = RelativeBias(table, 60).forward_(S.copy(), grid_only)
            np.testing.assert_array_equal(got, want)
            out, raw = np.empty_like(S), S.copy()
            RelativeBias(table, 60).saving_(S, out, grid_only)
            np.testing.assert_array_equal(out, want)
            np.testing.assert_array_equal(S, raw)  # saving_ leaves the raw scores
            assert not np.allclose(RelativeBias(table[:, ::-1], 60).forward_(S.copy(), grid_only), want)


def test_the_dense_reference_takes_it():
    """``kernels.reference.dense_attention`` applies it by its formula (``fn``/``grad``)."""
    from mpiattn.kernels.reference import dense_attention

    N = 12
    data = _data(N, N, 2, seed=8)
    table = _table(2 * N)
    ex = dense_attention(*data[:3], data[3], score_mod=RelativeBias(table, N))
    vis = visible_matrix(B, N, N)[:, None]
    ref = torch_reference(*data, vis, score_mod=_torch_form(table, N))
    for a, r in zip((ex.out, ex.lse, ex.dq, ex.dk, ex.dv), ref):
        np.testing.assert_allclose(a, r, rtol=1e-12, atol=1e-12)


def test_decode_and_prefill_give_it_absolute_positions(comm):
    """Decode (query ``i`` of ``t`` at ``L - t + i``) and both prefill variants (chunk row ``i`` at
    ``n0 + i``; pass-kv shifts the bias, which stays a RelativeBias): the rows of the whole
    sequence's reference."""
    rng = np.random.default_rng(12)
    hkv, L, t = 2, 31, 3
    Q, dO = rng.standard_normal((B, H, L, E)), np.zeros((B, H, L, E))
    K, V = (rng.standard_normal((B, hkv, L, E)) for _ in range(2))
    table = _table(2 * L)
    bias = RelativeBias(table, L)
    assert isinstance(shift_score_mod(bias, 7), RelativeBias) and shift_score_mod(bias, 7).offset == L + 7
    ref = torch_reference(Q, K, V, dO, visible_matrix(B, L, L, True)[:, None],
                          score_mod=_torch_form(table, L))
    cache = mpiattn.KVCache.from_shards(mpiattn.shard(K), mpiattn.shard(V), page=4)
    out, lse = cache.attend(Q[:, :, -t:], score_mod=bias)
    np.testing.assert_allclose(host(out), ref[0][:, :, -t:], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(host(lse), ref[1][:, :, -t:], rtol=1e-12, atol=1e-12)
    n0, C = 19, 12
    zig = lambda x: mpiattn.shard(x, layout="zigzag")  # noqa: E731
    for variant in ("pass-kv", "pass-q"):
        pre = mpiattn.KVCache.from_shards(mpiattn.shard(K[:, :, :n0]), mpiattn.shard(V[:, :, :n0]), page=3)
        sl = slice(n0, n0 + C)
        out, lse = pre.prefill(*(zig(x[:, :, sl]) for x in (Q, K, V)), layout="zigzag",
                               variant=variant, score=mpiattn.Score(score_mod=bias), append=False)
        got = host(mpiattn.gather(out, layout="zigzag", root=None))
        np.testing.assert_allclose(got, ref[0][:, :, sl], rtol=1e-12, atol=1e-12, err_msg=variant)
        got = host(mpiattn.gather(lse, axis=-1, layout="zigzag", root=None))
        np.testing.assert_allclose(got, ref[1][:, :, sl], rtol=1e-12, atol=1e-12, err_msg=variant)


def _agreed_error(comm, exc, match, call):
    with pytest.raises(exc, match=match) as info:
        call()
    assert comm.allgather_obj(str(info.value)) == [str(info.value)] * comm.size


def test_a_table_too_small_for_the_call_is_refused_on_every_rank(comm):
    """Columns past the table's end, and negative ones (a gather would wrap them): IndexError
    before any tile, the same on every rank; one tile asked directly raises too."""
    N = 6 * comm.size
    q, k, v, _ = (mpiattn.shard(x) for x in _data(N, N, 2))
    for table, offset, cols in ((_table(2 * N - 1), N, rf"{1} to {2 * N - 1}"),
                                (_table(2 * N), N - 2, rf"-1 to {2 * N - 3}")):
        _agreed_error(comm, IndexError, rf"columns {cols} \(offset {offset}\), outside its "
                      rf"{table.shape[1]} columns",
                      lambda: mpiattn.attention(q, k, v, score_mod=RelativeBias(table, offset)))
    at = TileIndex.folded(1, np.arange(H), 1, np.arange(4), np.arange(9))
    with pytest.raises(IndexError, match="columns -1 to 10"):
        RelativeBias(_table(10), 7).forward_(np.zeros((1, H, 4, 9)), at)


def test_bad_tables_are_refused(comm):
    q, k, v, _ = (mpiattn.shard(x) for x in _data(4 * comm.size, 4 * comm.size, 2))
    with pytest.raises(ValueError, match=r"shape \(H, W\)"):
        RelativeBias(np.zeros(8), 0)
    with pytest.raises(TypeError, match="real floating-point"):
        RelativeBias(np.zeros((H, 8), dtype=np.int64), 0)
    with pytest.raises(ValueError, match="finite"):
        RelativeBias(np.full((H, 8), np.nan), 0)
    with pytest.raises(TypeError, match="offset must be an integer"):
        RelativeBias(np.zeros((H, 8)), 1.5)
    _agreed_error(comm, ValueError, r"table has 3 rows, one per query head: the call has H = 4",
                  lambda: mpiattn.attention(q, k, v, score_mod=RelativeBias(np.zeros((3, 99)), 50)))


def test_what_the_ranks_compare_covers_the_table_and_the_offset():
    table = _table(40)
    same = fingerprint.identity(RelativeBias(table.copy(), 20))
    assert fingerprint.identity(RelativeBias(table, 20)) == same
    assert fingerprint.identity(RelativeBias(table[:, ::-1], 20)) != same
    changed = table.copy()
    changed[3, 39] += 1e-12
    assert fingerprint.identity(RelativeBias(changed, 20)) != same
    assert fingerprint.identity(RelativeBias(table, 21)) != same
    answers = fingerprint.score_answers(RelativeBias(table, 20), B, H, 15, 18)
    plain = fingerprint.score_answers(_gather(table, 20), B, H, 15, 18)
    np.testing.assert_array_equal(answers, plain)


@pytest.mark.mpi(min_size=2)
def test_a_table_that_differs_between_ranks_is_refused(comm):
    q, k, v, _ = (mpiattn.shard(x) for x in _data(4 * comm.size, 4 * comm.size, 2))
    table = _table(8 * comm.size) * (1 + (comm.rank == comm.size - 1))
    _agreed_error(comm, ValueError, r"ranks disagree on score_mod \(its code and captured values\)",
                  lambda: mpiattn.attention(q, k, v, score_mod=RelativeBias(table, 4 * comm.size)))


def test_on_a_fake_device_it_gathers(comm, monkeypatch):
    """On CuPy (here the tests' strict stand-in) the bias is gathered on the device: the NumPy
    run's numbers, forward and backward, at one rank."""
    if comm.size > 1:
        pytest.skip("one rank: the device transport is another test's subject")
    import fake_cupy

    from helpers import install_fake_cupy

    fake = install_fake_cupy(monkeypatch)
    own = comm.mpi.Dup()  # (its device transport stays on a communicator of its own)
    try:
        N = 13
        data = _data(N, N, 2, seed=6)
        bias = RelativeBias(_table(2 * N), N)
        kw = dict(causal=True, strategy="ring", block_size=4, score_mod=bias, comm=own)
        out, lse = mpiattn.attention(*data[:3], **kw)
        grads = mpiattn.attention_backward(data[3], *data[:3], out, lse, **kw)
        dev = [fake.asarray(x) for x in data]
        d_out, d_lse = mpiattn.attention(*dev[:3], **kw)
        d_grads = mpiattn.attention_backward(dev[3], *dev[:3], d_out, d_lse, **kw)
        for a, b in zip((d_out, d_lse, *d_grads[:3]), (out, lse, *grads[:3])):
            np.testing.assert_allclose(host(a), b, rtol=1e-12, atol=1e-12)
    finally:
        own.Free()
        fake_cupy.shutdown()
