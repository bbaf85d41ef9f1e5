import numpy as np
import pytest

import mpiattn
from mpiattn.layouts import all_segments, local_length, split_sizes

from helpers import host


@pytest.mark.parametrize("n", [0, 1, 5, 7, 16, 33])
@pytest.mark.parametrize("P", [1, 2, 3, 4, 7])
def test_contiguous_matches_array_split(n, P):
    want = np.array_split(np.arange(n), P)
    for r in range(P):
        got = [i for g, ln in all_segments(n, P, "contiguous")[r] for i in range(g, g + ln)]
        assert got == want[r].tolist()


@pytest.mark.parametrize("n", [0, 1, 5, 8, 13, 40])
@pytest.mark.parametrize("P", [1, 2, 3, 4])
def test_zigzag_definition(n, P):
    chunks = np.array_split(np.arange(n), 2 * P)
    owned = []
    for r in range(P):
        got = [i for g, ln in all_segments(n, P, "zigzag")[r] for i in range(g, g + ln)]
        assert got == chunks[r].tolist() + chunks[2 * P - 1 - r].tolist()
        assert len(got) == local_length(n, r, P, "zigzag")
        owned += got
    assert sorted(owned) == list(range(n))


def test_split_sizes():
    assert split_sizes(10, 4) == [3, 3, 2, 2]
    assert split_sizes(2, 4) == [1, 1, 0, 0]


def test_bad_layout(comm):
    with pytest.raises(ValueError, match="unknown layout"):
        mpiattn.partition(10, layout="striped")


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("n", [0, 3, 10, 17])
def test_partition_shard_gather_roundtrip(comm, xp, layout, n):
    rng = np.random.default_rng(n)
    x_host = rng.standard_normal((2, n, 3))
    x = xp.asarray(x_host)
    idx = mpiattn.partition(n, layout=layout)
    assert idx.dtype == np.int64
    part = mpiattn.shard(x, axis=1, layout=layout)
    np.testing.assert_array_equal(host(part), x_host[:, idx, :])
    back = mpiattn.gather(part, axis=1, layout=layout, root=0)
    if comm.rank == 0:
        np.testing.assert_array_equal(host(back), x_host)
    else:
        assert back is None
    every = mpiattn.gather(part, axis=-2, layout=layout, root=None)
    np.testing.assert_array_equal(host(every), x_host)


def test_gather_wrong_length_raises_everywhere(comm, xp):
    if comm.size == 1:
        pytest.skip("needs 2 ranks to have a wrong length")
    rows = 3 if comm.rank == comm.size - 1 else 1  # last rank holds too many
    x = xp.zeros((rows, 2))
    with pytest.raises(ValueError, match="layout of"):
        mpiattn.gather(x, axis=0)


def test_gather_dtype_mismatch(comm, xp):
    if comm.size == 1:
        pytest.skip("one rank has one dtype: a mismatch between ranks needs 2 ranks")
    dt = np.float32 if comm.rank == 0 else np.float64
    x = xp.zeros((mpiattn.partition(4).size, 2), dtype=dt)
    with pytest.raises(ValueError, match="dtype"):
        mpiattn.gather(x, axis=0)
