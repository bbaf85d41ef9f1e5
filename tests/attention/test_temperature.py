"""A per-head temperature (``mpiattn.Score(temperature=tau)``), the worked example of a new score
modifier: every strategy at the run's rank count, and decode, against the tests' float64 torch
reference (``y = x / tau[h]`` written there as a score function); its errors on every rank alike."""

import numpy as np
import pytest
from mpi4py import MPI

import mpiattn
from mpiattn.strategies import registry

from helpers import host, torch_reference, uneven_heads, visible_matrix

torch = pytest.importorskip("torch")

B, H, HKV, E = 2, 4, 2, 8
TAU = np.array([1.0, 0.5, 2.0, 0.8])
STRATEGIES = registry.variants(MPI.COMM_WORLD.Get_size())


def _data(N, M, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal(shape) for shape in
                 ((B, H, N, E), (B, HKV, M, E), (B, HKV, M, E), (B, H, N, E)))


def _divides(strategy, P):
    return uneven_heads(strategy, P, H, HKV) is None


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_temperature_on_every_strategy(comm, strategy):
    if not _divides(strategy, comm.size):
        pytest.skip("the heads do not divide among the ranks")
    N = 9 * comm.size + 5
    data = _data(N, N)
    sinks = np.linspace(-1, 1, H)
    q, k, v, do = (mpiattn.shard(x) for x in data)
    score = mpiattn.Score(temperature=TAU, sinks=sinks)
    kw = dict(causal=True, window=(11, 0), strategy=strategy, block_size=8, score=score)
    out, lse = mpiattn.attention(q, k, v, **kw)
    dq, dk, dv, _ = mpiattn.attention_backward(do, q, k, v, out, lse, **kw)
    g = lambda x, axis=-2: host(mpiattn.gather(x, axis=axis, root=None))  # noqa: E731
    got = (g(out), g(lse, -1), g(dq), g(dk), g(dv))
    vis = visible_matrix(B, N, N, True, (11, 0))[:, None]
    tau = torch.tensor(TAU)
    ref = torch_reference(*data, vis, sinks=sinks, score_mod=lambda x, b, h, i, j: x / tau[h])
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, ref):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-10, err_msg=name)


def test_a_decode_step_with_a_temperature(comm):
    rng = np.random.default_rng(3)
    L, t = 23, 2
    Q = rng.standard_normal((B, H, L, E))
    K, V = (rng.standard_normal((B, HKV, L, E)) for _ in range(2))
    cache = mpiattn.KVCache.from_shards(mpiattn.shard(K), mpiattn.shard(V), page=4)
    out, lse = cache.attend(Q[:, :, -t:], score=mpiattn.Score(temperature=TAU))
    vis = visible_matrix(B, t, L, "bottom-right", None)[:, None]
    tau = torch.tensor(TAU)
    ref = torch_reference(Q[:, :, -t:], K, V, np.zeros((B, H, t, E)), vis,
                          score_mod=lambda x, b, h, i, j: x / tau[h])
    np.testing.assert_allclose(host(out), ref[0], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(host(lse), ref[1], rtol=1e-12, atol=1e-12)


def _agreed_error(comm, exc, match, call):
    with pytest.raises(exc, match=match) as info:
        call()
    assert comm.allgather_obj(str(info.value)) == [str(info.value)] * comm.size


def test_bad_temperatures_are_refused_on_every_rank(comm):
    q, k, v, _ = (mpiattn.shard(x) for x in _data(4 * comm.size, 4 * comm.size))
    mine = TAU * (1 + (comm.rank == comm.size - 1))
    for score, exc, match in [
            (mpiattn.Score(temperature=np.array([1.0, 0.0, 1.0, 1.0])), ValueError, "finite numbers > 0"),
            (mpiattn.Score(temperature=TAU[:3]), ValueError, r"shape \(H,\) = \(4,\)"),
            (mpiattn.Score(temperature=TAU, softcap=3.0), ValueError, "softcap and temperature"),
            (mpiattn.Score(temperature=mine), ValueError,
             "ranks disagree on temperature" if comm.size > 1 else None)]:
        if match is None:
            continue
        _agreed_error(comm, exc, match, lambda: mpiattn.attention(q, k, v, score=score))
    with pytest.raises(ValueError, match="temperature is given twice"):
        mpiattn.Score.of(mpiattn.Score(temperature=TAU), temperature=TAU)
