"""``score_mod``: a user's transform of the raw scores, on every strategy and rank count.

Each function is written twice, on NumPy arrays with its derivative for the library (a
``mpiattn.ScoreMod``) and with torch ops for the reference (``helpers.torch_reference``: the
whole ``(B, H, N, M)`` scores, every gradient by torch autograd), and the gathered results are
compared in float64. A softcap written as a score_mod gives the built-in softcap's bits.
"""

import numpy as np
import pytest
from mpi4py import MPI

import mpiattn
from mpiattn import ScoreMod
from mpiattn.strategies import registry

from helpers import host, torch_reference, uneven_heads, visible_matrix

torch = pytest.importorskip("torch")

B, H, HKV, E = 2, 4, 2, 8
TEMP = np.array([1.0, 0.5, 2.0, 0.8])
TABLE = np.random.default_rng(4).standard_normal((H, 200)) * 0.5  # a relative-position bias
CAP = 2.0

#: name -> (ScoreMod on NumPy, the same function in torch for the reference)
MODS = {
    "softcap": (ScoreMod(lambda s, b, h, q, kv: CAP * np.tanh(s / CAP),
                         lambda s, b, h, q, kv: 1 - np.tanh(s / CAP) ** 2),
                lambda s, b, h, q, kv: CAP * torch.tanh(s / CAP)),
    "temperature": (ScoreMod(lambda s, b, h, q, kv: s * TEMP[h], lambda s, b, h, q, kv: TEMP[h] + 0 * s),
                    lambda s, b, h, q, kv: s * torch.tensor(TEMP)[h]),
    "relative-bias": (ScoreMod(lambda s, b, h, q, kv: s + TABLE[h, q - kv + 100],
                               lambda s, b, h, q, kv: np.ones_like(s)),
                      lambda s, b, h, q, kv: s + torch.tensor(TABLE)[h, q - kv + 100]),
    "batch-and-square": (ScoreMod(lambda s, b, h, q, kv: s * (1 + b) - 0.1 * s * s,
                                  lambda s, b, h, q, kv: (1 + b) - 0.2 * s),
                         lambda s, b, h, q, kv: s * (1 + b) - 0.1 * s * s),
}

STRATEGIES = registry.variants(MPI.COMM_WORLD.Get_size())


def _data(N, M, seed=0, dtype="float64"):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal(shape).astype(dtype) for shape in
                 ((B, H, N, E), (B, HKV, M, E), (B, HKV, M, E), (B, H, N, E)))


def _skip(strategy, P):
    return uneven_heads(strategy, P, H, HKV)


def _run(comm, data, mod, **kw):
    q, k, v, do = (mpiattn.shard(x) for x in data)
    used = {}
    out, lse = mpiattn.attention(q, k, v, score_mod=mod, details=used, **kw)
    grads = mpiattn.attention_backward(do, q, k, v, out, lse, score_mod=mod, **kw)
    g = lambda x, axis=-2: host(mpiattn.gather(x, axis=axis, root=None))  # noqa: E731
    return (g(out), g(lse, -1), g(grads[0]), g(grads[1]), g(grads[2]), *grads[3:]), used


def _compare(got, ref, tol=1e-9):
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv", "dsinks"), got, ref):
        fin = np.isfinite(b)
        assert np.array_equal(np.isfinite(a), fin), name
        np.testing.assert_allclose(a[fin], b[fin], rtol=tol, atol=tol, err_msg=name)


@pytest.mark.parametrize("name", sorted(MODS))
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_score_mod_on_every_strategy(comm, strategy, name):
    why = _skip(strategy, comm.size)
    if why:
        pytest.skip(why)
    N = 37
    data = _data(N, N, seed=len(name))
    got, used = _run(comm, data, MODS[name][0], causal=True, strategy=strategy, block_size=8)
    assert used["strategy"] == strategy
    vis = visible_matrix(B, N, N, True)[:, None]
    _compare(got, torch_reference(*data, vis, score_mod=MODS[name][1])[:5])


@pytest.mark.parametrize("name", ["relative-bias", "temperature"])
def test_a_score_mod_with_every_other_modifier(comm, name):
    """Beside ALiBi, a float attn_mask with -inf, sinks, N != M (bottom-right): the order is
    scale, score_mod, then the additive terms and the rules."""
    N, M = 23, 41
    data = _data(N, M, seed=3)
    rng = np.random.default_rng(5)
    slopes = rng.uniform(0.1, 0.5, H)
    mask = rng.standard_normal((B, 1, N, M))
    mask[rng.random(mask.shape) < 0.2] = -np.inf
    sinks = rng.standard_normal(H)
    dist = np.abs(np.arange(N)[:, None] + (M - N) - np.arange(M)[None, :])
    bias = -slopes[None, :, None, None] * dist + mask
    kw = dict(causal="bottom-right", alibi_slopes=slopes, attn_mask=mpiattn.shard(mask), sinks=sinks,
              block_size=8)
    got, _ = _run(comm, data, MODS[name][0], **kw)
    vis = visible_matrix(B, N, M, "bottom-right")[:, None]
    ref = torch_reference(*data, vis, bias=bias, sinks=sinks, score_mod=MODS[name][1])
    _compare(got, ref[:6])


@pytest.mark.parametrize("name", ["relative-bias", "batch-and-square"])
def test_a_tile_given_to_the_function_in_row_pieces_is_the_whole_tile_bit_for_bit(comm, name,
                                                                                  monkeypatch):
    """The host cuts a tile into row pieces for the function (``scoremod.PIECE``): pieces of a
    few rows (some of them short) give the bits of one piece, forward and backward."""
    from mpiattn.masks import scoremod
    data = _data(31, 45, seed=11)
    kw = dict(causal=True, block_size=16)
    whole, _ = _run(comm, data, MODS[name][0], **kw)
    monkeypatch.setattr(scoremod, "PIECE", 3 * 45)  # three rows of a 45-key tile, or fewer
    cut, _ = _run(comm, data, MODS[name][0], **kw)
    for a, b in zip(whole, cut):
        assert np.array_equal(a, b)
    vis = visible_matrix(B, 31, 45, True)[:, None]
    _compare(cut, torch_reference(*data, vis, score_mod=MODS[name][1])[:5])


def test_a_softcap_written_as_a_score_mod_is_the_builtin_bit_for_bit(comm):
    data = _data(29, 29, seed=9, dtype="float32")
    mine, _ = _run(comm, data, MODS["softcap"][0], causal=True, block_size=8)
    q, k, v, do = (mpiattn.shard(x) for x in data)
    out, lse = mpiattn.attention(q, k, v, softcap=CAP, causal=True, block_size=8)
    grads = mpiattn.attention_backward(do, q, k, v, out, lse, softcap=CAP, causal=True, block_size=8)
    g = lambda x, axis=-2: host(mpiattn.gather(x, axis=axis, root=None))  # noqa: E731
    for a, b in zip(mine, (g(out), g(lse, -1), *(g(x) for x in grads))):
        assert np.array_equal(a, b)


def test_what_a_score_mod_cannot_be_given_with_is_refused_on_every_rank(comm):
    data = _data(4 * comm.size, 4 * comm.size)
    q, k, v, do = (mpiattn.shard(x) for x in data)
    with pytest.raises(ValueError, match="softcap and score_mod are both score transforms"):
        mpiattn.attention(q, k, v, score_mod=MODS["temperature"][0], softcap=2.0)
    with pytest.raises(ValueError, match="cannot run.*score_mod|score_mod.*torch"):
        mpiattn.attention(q, k, v, score_mod=MODS["temperature"][0], engine="torch")
    forward_only = lambda s, b, h, q, kv: s * 0.5  # noqa: E731
    out, lse = mpiattn.attention(q, k, v, score_mod=forward_only)  # a forward needs no derivative
    with pytest.raises(ValueError, match=r"score_mod has no derivative.*ScoreMod\(fn, grad\)"):
        mpiattn.attention_backward(do, q, k, v, out, lse, score_mod=forward_only)
    with pytest.raises(TypeError, match="score_mod must be a callable"):
        mpiattn.attention(q, k, v, score_mod=3)


@pytest.mark.mpi(min_size=2)
def test_a_score_mod_that_differs_between_ranks_is_refused(comm):
    data = _data(4 * comm.size, 4 * comm.size)
    q, k, v, _ = (mpiattn.shard(x) for x in data)
    table = TABLE * (1 + (comm.rank == comm.size - 1))  # the same code, another captured table
    mod = ScoreMod(lambda s, b, h, q, kv: s + table[h, q - kv + 100], lambda s, b, h, q, kv: np.ones_like(s))
    with pytest.raises(ValueError, match=r"ranks disagree on score_mod \(its code and captured values\)") as info:
        mpiattn.attention(q, k, v, score_mod=mod)
    assert comm.allgather_obj(str(info.value)) == [str(info.value)] * comm.size


SCALE = {"s": 1.0}


def _global_scale(s, b, h, q, kv):
    return s * SCALE["s"]


@pytest.mark.mpi(min_size=2)
def test_a_score_mod_reading_a_global_set_per_rank_is_refused_by_its_answers(comm, monkeypatch):
    monkeypatch.setitem(SCALE, "s", 1.0 + (comm.rank == comm.size - 1))
    q = mpiattn.shard(_data(4 * comm.size, 4 * comm.size)[0])
    with pytest.raises(ValueError, match="ranks disagree on score_mod's answers") as info:
        mpiattn.attention(q, q[:, :HKV], q[:, :HKV], score_mod=_global_scale)
    assert comm.allgather_obj(str(info.value)) == [str(info.value)] * comm.size
