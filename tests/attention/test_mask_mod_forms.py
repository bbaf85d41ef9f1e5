"""A ``mask_mod`` may ignore any of its indices, and the ranks must pass one and the same rule.

FlexAttention's users write rules that read some indices only: a key-only rule
(``kv % 3 != 0``), a per-head rule that ignores the batch entry and the query, a
query-only rule (rows that see nothing), ``noop_mask`` (a 0-d True). Their answers do not
span every axis; each must give the same result as the rule written out densely here, on
every strategy and engine, with blocks cut into tiles (``block_size`` below ``N``, and
``N`` above the native engine's default tile). The reference is the tests' own float64
dense attention (``helpers.dense_attention``) per head, under the visibility built from the
rule's broadcast answer on every index.

A function that differs between ranks (a closure over another parameter, or one reading a
global set differently per rank) is refused on every rank with one error.
"""

import numpy as np
import pytest
from mpi4py import MPI

import mpiattn
from mpiattn.strategies import registry

from helpers import dense_attention, host, uneven_heads

#: name -> mask_mod(b, h, q_idx, kv_idx): each ignores some indices (noop: all of them).
FORMS = {
    "key-only": lambda b, h, q, kv: kv % 3 != 0,
    "head-key": lambda b, h, q, kv: (kv + h) % 3 != 0,
    "query-only": lambda b, h, q, kv: q % 4 != 1,
    "batch-query": lambda b, h, q, kv: (q + b) % 3 != 0,
    "noop-0d": lambda b, h, q, kv: np.asarray(True),
    "batch-head": lambda b, h, q, kv: (b + h) % 2 == 0,
    "every-index": lambda b, h, q, kv: ((q - kv) % 5 != 0) | (b == h),
}

STRATEGIES = registry.variants(MPI.COMM_WORLD.Get_size())


def _reference(fn, Q, K, V, dO):
    B, H, N, _ = Q.shape
    M, G = K.shape[2], H // K.shape[1]
    b, h, i, j = np.ix_(np.arange(B), np.arange(H), np.arange(N), np.arange(M))
    vis = np.broadcast_to(fn(b, h, i, j), (B, H, N, M))
    parts = [dense_attention(Q[:, x:x + 1], K[:, x // G:x // G + 1], V[:, x // G:x // G + 1],
                             vis[:, x:x + 1], dO=dO[:, x:x + 1]) for x in range(H)]
    out, lse, dq = (np.concatenate([p[t] for p in parts], 1) for t in range(3))
    dk = sum(np.concatenate([p[3] if x // G == y else 0 * p[3] for y in range(K.shape[1])], 1)
             for x, p in enumerate(parts))
    dv = sum(np.concatenate([p[4] if x // G == y else 0 * p[4] for y in range(K.shape[1])], 1)
             for x, p in enumerate(parts))
    return out, lse, dq, dk, dv


def _data(N, seed=0, B=2, H=4, Hkv=2, E=8):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((B, H, N, E)), rng.standard_normal((B, Hkv, N, E)),
            rng.standard_normal((B, Hkv, N, E)), rng.standard_normal((B, H, N, E)))


def _skip(strategy, P, H=4, Hkv=2):
    return uneven_heads(strategy, P, H, Hkv)


def _run(comm, fn, data, **kw):
    Q, K, V, dO = data
    q, k, v, do = (mpiattn.shard(x) for x in data)
    out, lse = mpiattn.attention(q, k, v, mask_mod=fn, **kw)
    grads = mpiattn.attention_backward(do, q, k, v, out, lse, mask_mod=fn, **kw)
    g = lambda x, axis=-2: host(mpiattn.gather(x, axis=axis, root=None))  # noqa: E731
    return g(out), g(lse, -1), g(grads[0]), g(grads[1]), g(grads[2])


def _compare(got, ref):
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, ref):
        fin = np.isfinite(b)
        assert np.array_equal(np.isfinite(a), fin), name
        np.testing.assert_allclose(a[fin], b[fin], rtol=1e-9, atol=1e-10, err_msg=name)


@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_rule_that_ignores_indices_in_tiles(comm, strategy, form):
    """Blocks of 16 rows cut into tiles of 16 (every tile a region of a cached answer)."""
    why = _skip(strategy, comm.size)
    if why:
        pytest.skip(why)
    data = _data(53, seed=len(form))
    got = _run(comm, FORMS[form], data, strategy=strategy, block_size=16)
    _compare(got, _reference(FORMS[form], *data))


@pytest.mark.parametrize("engine", ["native", "torch"])
@pytest.mark.parametrize("form", ["key-only", "noop-0d", "query-only"])
def test_a_rule_that_ignores_indices_past_the_default_tile(comm, engine, form):
    """``N`` above the native engine's default tile (512), default blocks: the issue's case."""
    if engine == "torch":
        pytest.importorskip("torch")
    data = _data(600, seed=7, B=1, H=2, Hkv=2, E=4)
    got = _run(comm, FORMS[form], data, engine=engine)
    _compare(got, _reference(FORMS[form], *data))


def test_a_rule_whose_answer_grows_the_indices_is_named(comm):
    """An answer of shape (3,) broadcasts with (B, H, 1, 1) but is not a rule's answer."""
    x = mpiattn.shard(_data(8 * comm.size)[0])
    with pytest.raises(ValueError, match=r"mask_mod returned shape \(3,\)"):
        mpiattn.attention(x, x, x, mask_mod=lambda b, h, q, kv: np.ones(3, dtype=bool))
    with pytest.raises(TypeError, match="mask_mod returned dtype"):
        mpiattn.attention(x, x, x, mask_mod=lambda b, h, q, kv: (q - kv).astype(np.int8))


def _closure(width):
    def near(b, h, q, kv):
        return np.abs(q - kv) <= width
    return near


SETTING = {"width": 3}


def _global_rule(b, h, q, kv):
    return np.abs(q - kv) <= SETTING["width"]


@pytest.mark.mpi(min_size=2)
def test_a_closure_over_another_parameter_per_rank_is_refused(comm):
    x = mpiattn.shard(_data(8 * comm.size)[0])
    with pytest.raises(ValueError, match="ranks disagree on mask_mod") as info:
        mpiattn.attention(x, x, x, mask_mod=_closure(2 + (comm.rank == comm.size - 1)))
    assert comm.allgather_obj(str(info.value)) == [str(info.value)] * comm.size
    out, _ = mpiattn.attention(x, x, x, mask_mod=_closure(2))  # one rule: runs
    assert np.isfinite(out).all()


@pytest.mark.mpi(min_size=2)
def test_a_rule_reading_a_global_set_per_rank_is_refused_by_its_answers(comm, monkeypatch):
    monkeypatch.setitem(SETTING, "width", 3 + (comm.rank == comm.size - 1))
    x = mpiattn.shard(_data(8 * comm.size)[0])
    with pytest.raises(ValueError, match="ranks disagree on mask_mod's answers") as info:
        mpiattn.attention(x, x, x, mask_mod=_global_rule)
    assert comm.allgather_obj(str(info.value)) == [str(info.value)] * comm.size


def test_the_fingerprint_tells_closures_apart_and_keeps_equal_ones_equal():
    from mpiattn.masks import fingerprint

    assert fingerprint.identity(_closure(2)) == fingerprint.identity(_closure(2))
    assert fingerprint.identity(_closure(2)) != fingerprint.identity(_closure(3))
    table = np.arange(10)
    assert (fingerprint.identity(lambda b, h, q, kv: table[q] > 3)
            == fingerprint.identity(lambda b, h, q, kv: table[q] > 3))
    assert (fingerprint.answers(_closure(2), 1, 2, 100, 90)
            != fingerprint.answers(_closure(3), 1, 2, 100, 90))
    assert fingerprint.answers(_closure(2), 1, 2, 1, 1) == fingerprint.answers(_closure(2), 1, 2, 1, 1)
