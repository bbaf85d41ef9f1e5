"""KVCache's checks (issue 26): NaN or Inf refused, the same result at every rank count when allowed,
bounded pages, an append's allocation failure agreed, a save's arguments agreed, a grown file
replaced only while it is the one read. Any rank count."""

import os

import numpy as np
import pytest

from mpiattn import KVCache
from mpiattn.comm import errors
from mpiattn.inference import merge, shard
from mpiattn.io import ChangedError
from mpiattn.layouts import all_segments


def _mine(x, comm, axis=2):
    segs = all_segments(x.shape[axis], comm.size, "contiguous")[comm.rank]
    parts = [np.take(x, range(g, g + n), axis=axis) for g, n in segs]
    return np.concatenate(parts, axis=axis) if parts else np.take(x, [], axis=axis)


def _kv(seed=0, M=10, nan_at=None):
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((1, 2, M, 4))
    v = rng.standard_normal((1, 2, M, 4))
    if nan_at is not None:
        k[0, 1, nan_at, 2] = np.nan
    return k, v


def test_a_nan_key_is_refused_on_every_rank(comm):
    k, v = _kv(nan_at=7)
    with pytest.raises(ValueError, match="k holds NaN or Inf") as info:
        KVCache.from_shards(_mine(k, comm), _mine(v, comm), comm)
    assert isinstance(info.value, errors.Agreed)
    k, v = _kv()
    cache = KVCache.from_shards(_mine(k, comm), _mine(v, comm), comm)
    bad = np.full((1, 2, 1, 4), np.inf)
    with pytest.raises(ValueError, match="k_new holds NaN or Inf"):
        cache.append(bad, bad)
    assert cache.length == 10


def test_allowed_nan_gives_the_same_result_at_every_rank_count(comm):
    """At P = 1 a NaN key makes every query that sees it NaN; the tree merge keeps that at any P."""
    from mpi4py import MPI

    k, v = _kv(nan_at=3)
    q = np.random.default_rng(1).standard_normal((1, 4, 2, 4))
    alone = KVCache.from_shards(k, v, MPI.COMM_SELF, check_finite=False)
    want, want_lse = alone.attend(q, causal=False)
    cache = KVCache.from_shards(_mine(k, comm), _mine(v, comm), comm, check_finite=False)
    got, lse = cache.attend(q, causal=False)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(np.isnan(lse), np.isnan(want_lse))
    assert np.isnan(got[0, 2:]).all() and np.isfinite(got[0, :2]).all()  # heads 2, 3 use kv head 1
    np.testing.assert_allclose(got[0, :2], want[0, :2], rtol=1e-12)


def test_merge_keeps_nan_and_empty_apart():
    o = np.ones((3, 2))
    lse_a, lse_b = np.array([0.0, -np.inf, np.nan]), np.array([-np.inf, -np.inf, 1.0])
    mo, ml = merge.merge(o, lse_a, 2 * o, lse_b)
    np.testing.assert_array_equal(ml[:2], [0.0, -np.inf])
    np.testing.assert_array_equal(mo[:2], [[1, 1], [0, 0]])
    assert np.isnan(ml[2]) and np.isnan(mo[2]).all()
    mo, ml = merge.merge(o, np.array([np.inf, 0, 0]), o, lse_a)  # +inf: a key of infinite score
    assert np.isnan(ml[0]) and np.isnan(mo[0]).all()


def test_pages_are_bounded_on_every_rank(comm):
    k, v = _kv()
    for page in (0, 2**40, True):
        with pytest.raises((ValueError, TypeError), match="page must") as info:
            KVCache.from_shards(_mine(k, comm), _mine(v, comm), comm, page=page)
        assert isinstance(info.value, errors.Agreed)
    assert comm.allgather_obj(comm.rank) == list(range(comm.size))  # every rank still in step


def test_an_append_that_cannot_allocate_fails_on_every_rank_and_changes_nothing(comm, monkeypatch):
    k, v = _kv()
    cache = KVCache.from_shards(_mine(k, comm), _mine(v, comm), comm, page=2)
    owner = cache.placement.place(1)[0][0][0]  # the rank that gets the next page
    real = shard.Shard.reserve

    def no_memory(self, t):
        if comm.rank == owner and t:
            raise MemoryError("cannot allocate a page")
        return real(self, t)
    monkeypatch.setattr(shard.Shard, "reserve", no_memory)
    new = np.ones((1, 2, 1, 4))
    with pytest.raises(MemoryError, match=f"cannot allocate a page \\(raised on rank {owner}\\)"
                       if owner else "cannot allocate a page") as info:
        cache.append(new, new)
    assert isinstance(info.value, errors.Agreed)
    assert cache.length == 10 and cache.rows == _mine(k, comm).shape[2]
    monkeypatch.setattr(shard.Shard, "reserve", real)
    cache.append(new, new)
    assert cache.length == 11 and comm.allgather_obj(cache.rows) == list(cache.placement.counts)


def test_save_agrees_on_its_arguments(comm, shared_dir):
    k, v = _kv()
    cache = KVCache.from_shards(_mine(k, comm), _mine(v, comm), comm)
    path = os.path.join(shared_dir, f"c{comm.rank if comm.size > 1 else 'x'}.h5")
    if comm.size > 1:
        with pytest.raises(ValueError, match="ranks disagree on save's path") as info:
            cache.save(path)
        assert isinstance(info.value, errors.Agreed)
        with pytest.raises(ValueError, match="ranks disagree on save's force"):
            cache.save(os.path.join(shared_dir, "c.h5"), force=comm.rank == 0)
    with pytest.raises(ValueError, match="not loaded from a file"):
        cache.save(os.path.join(shared_dir, "c.h5"), grow=True)
    assert os.listdir(shared_dir) == []


def test_save_grow_replaces_only_the_file_read(comm, shared_dir):
    k, v = _kv()
    path = os.path.join(shared_dir, "c.h5")
    KVCache.from_shards(_mine(k, comm), _mine(v, comm), comm).save(path)
    first, second = KVCache.load(path, comm), KVCache.load(path, comm)
    new = np.ones((1, 2, 1, 4))
    first.append(new, new)
    second.append(2 * new, 2 * new)
    first.save(path, grow=True)
    with pytest.raises(ChangedError, match="replaced by another file") as info:
        second.save(path, grow=True)  # the second would drop the first one's row
    assert isinstance(info.value, errors.Agreed)
    again = KVCache.load(path, comm)
    assert again.length == 11
    whole = again.comm.allgather_obj(again.local()[0])
    np.testing.assert_array_equal(np.concatenate(whole, axis=2)[0, 0, 10], new[0, 0, 0])
    assert sorted(os.listdir(shared_dir)) == ["c.h5"]
