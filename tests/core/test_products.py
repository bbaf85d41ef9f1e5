"""Distributed products matmul_nt / matmul_nn / matmul_tn and their backward.

Every check compares this rank's rows with a float64 NumPy reference computed
on the global arrays (which every rank builds from the same seed).
"""

import subprocess
import sys
import textwrap

import numpy as np
import pytest

import mpiattn
from mpiattn import products
from mpiattn.sharding import partition

from helpers import host

LAYOUTS = ["contiguous", "zigzag"]
OPS = ["nt", "nn", "tn"]
FORWARD = {"nt": mpiattn.matmul_nt, "nn": mpiattn.matmul_nn, "tn": mpiattn.matmul_tn}
BACKWARD = {"nt": mpiattn.matmul_nt_backward, "nn": mpiattn.matmul_nn_backward,
            "tn": mpiattn.matmul_tn_backward}


def T(x):
    return np.swapaxes(x, -1, -2)


def global_shapes(op, N, M, d, lead_a=(), lead_b=()):
    """Global shapes of A and B, and the output's row count, for one product."""
    sa = {"nt": (N, d), "nn": (N, M), "tn": (M, N)}[op]
    sb = {"nt": (M, d), "nn": (M, d), "tn": (M, d)}[op]
    return tuple(lead_a) + sa, tuple(lead_b) + sb


def reference(op, A, B):
    return {"nt": lambda: A @ T(B), "nn": lambda: A @ B, "tn": lambda: T(A) @ B}[op]()


def rows(x, layout):
    """This rank's rows (axis -2) of a global array."""
    return x[..., partition(x.shape[-2], layout=layout), :]


def make(op, N, M, d, lead_a=(), lead_b=(), dtype=np.float64, integer=True, seed=0):
    rng = np.random.default_rng(seed)
    sa, sb = global_shapes(op, N, M, d, lead_a, lead_b)
    if integer:
        A, B = rng.integers(-4, 5, sa), rng.integers(-4, 5, sb)
    else:
        A, B = rng.standard_normal(sa), rng.standard_normal(sb)
    return A.astype(dtype), B.astype(dtype)


def run(op, A, B, xp, layout, block_size=None, **kw):
    a, b = xp.asarray(rows(A, layout)), xp.asarray(rows(B, layout))
    return FORWARD[op](a, b, layout=layout, block_size=block_size, **kw)


# --------------------------------------------------------------- exactness
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("block_size", [None, 1, 3])
@pytest.mark.parametrize("N,M,d", [(7, 5, 3), (2, 3, 4), (0, 4, 2), (5, 0, 2), (1, 6, 0)])
@pytest.mark.parametrize("op", OPS)
def test_integer_inputs_give_the_exact_product(comm, xp, op, N, M, d, block_size, layout):
    A, B = make(op, N, M, d, seed=N * 100 + M * 10 + d)
    got = host(run(op, A, B, xp, layout, block_size))
    want = rows(reference(op, A, B), layout)
    assert got.dtype == np.float64
    assert got.shape == want.shape
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("lead_a,lead_b", [((2, 1), (3,)), ((), (2,)), ((2,), ()), ((0,), (1,))])
@pytest.mark.parametrize("op", OPS)
def test_leading_axes_broadcast_like_numpy_matmul(comm, xp, op, lead_a, lead_b, layout):
    A, B = make(op, 6, 5, 3, lead_a, lead_b, seed=7)
    got = host(run(op, A, B, xp, layout, block_size=2))
    want = rows(reference(op, A, B), layout)
    assert got.shape == want.shape
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("op", OPS)
def test_non_contiguous_inputs_are_accepted(comm, xp, op):
    A, B = make(op, 9, 7, 4, (2,), (), seed=3)
    a, b = rows(A, "zigzag"), rows(B, "zigzag")
    # strided views: every other element of wider arrays, and reversed leading axes
    a_wide = np.zeros(a.shape[:-1] + (2 * a.shape[-1],))
    a_wide[..., ::2] = a
    b_fortran = np.asfortranarray(b)
    a_v, b_v = xp.asarray(a_wide)[..., ::2], xp.asarray(b_fortran)
    assert not a_v.flags.c_contiguous
    got = host(FORWARD[op](a_v, b_v, layout="zigzag", block_size=2))
    np.testing.assert_array_equal(got, rows(reference(op, A, B), "zigzag"))


def test_default_block_size_splits_big_shards(comm, xp, monkeypatch):
    assert products.default_block_size(1000, 1024, piece_bytes=16 * 1024) == 16
    assert products.default_block_size(10, 1024, piece_bytes=1 << 30) == 10
    assert products.default_block_size(10, 1 << 40, piece_bytes=1024) == 1
    assert products.default_block_size(0, 8) == 1
    assert products.default_block_size(5, 0) == 5
    # 24-byte rows, 64-byte pieces: blocks of 2 rows; results unchanged
    monkeypatch.setattr(products, "PIECE_BYTES", 64)
    for op in OPS:
        A, B = make(op, 11, 9, 3, seed=5)
        for layout in LAYOUTS:
            got = host(run(op, A, B, xp, layout))
            np.testing.assert_array_equal(got, rows(reference(op, A, B), layout))


def scrambled_layout(n, P):
    """An explicit Layout of n rows: uneven shares, every rank's ranges stored last-first.

    Rows are cut into 2P uneven chunks; rank r holds chunk 2P-1-r, then chunk r
    (so at P = 1 the local order is not the global one), and with P > 1 the
    last rank owns nothing.
    """
    cuts = sorted({0, n, *(min(n, (i * i * n) // (4 * P * P)) for i in range(1, 2 * P))})
    chunks = [(a, b) for a, b in zip(cuts[:-1], cuts[1:])]
    chunks += [(n, n)] * (2 * P - len(chunks))
    ranges = [[chunks[2 * P - 1 - r], chunks[r]] for r in range(P)]
    if P > 1:  # hand the last rank's rows to rank 0, so one rank is empty
        ranges[0] += ranges[-1]
        ranges[-1] = []
    return mpiattn.Layout(ranges)


def ordered_layout(n, P):
    """An explicit Layout of n rows in global order with uneven shares (rank 0 the most)."""
    cuts = [0] + [n - (P - r) * (n // (2 * P)) for r in range(1, P)] + [n]
    return mpiattn.Layout([[(a, b)] for a, b in zip(cuts[:-1], cuts[1:])])


@pytest.mark.parametrize("kind", ["scrambled", "ordered"])
@pytest.mark.parametrize("block_size", [None, 2])
@pytest.mark.parametrize("op", OPS)
def test_explicit_layouts(comm, xp, op, block_size, kind):
    n = 13
    layout = (scrambled_layout if kind == "scrambled" else ordered_layout)(n, comm.size)
    for dtype in (np.float64, np.float32):
        A, B = make(op, n, n, 4, (2,), (), dtype=dtype, seed=31)
        got = host(run(op, A, B, xp, layout, block_size))
        assert got.dtype == dtype
        np.testing.assert_array_equal(got, rows(reference(op, A, B), layout))


@pytest.mark.parametrize("op", OPS)
def test_the_ring_and_one_local_matmul_agree(comm, xp, op, monkeypatch):
    """With the one-matmul shortcut switched off, the ring gives the same exact results (any P)."""
    from mpiattn.products import matmul as mm
    cases = [((9, 8, 5), (), (), "contiguous", None), ((9, 8, 5), (2, 1), (3,), "zigzag", 2),
             ((0, 3, 2), (), (), "contiguous", 1), ((4, 0, 2), (), (), "zigzag", 1),
             ((12, 11, 4), (2,), (), "contiguous", 5)]
    results = []
    for switched_off in (False, True):
        if switched_off:
            monkeypatch.setattr(mm, "_one_matmul", lambda *args: False)
        results.append([host(run(op, *make(op, *nmd, la, lb, seed=41), xp, layout, blk))
                        for nmd, la, lb, layout, blk in cases])
    for (nmd, la, lb, layout, _), x, y in zip(cases, *results):
        A, B = make(op, *nmd, la, lb, seed=41)
        want = rows(reference(op, A, B), layout)
        np.testing.assert_array_equal(x, want)
        np.testing.assert_array_equal(y, want)


@pytest.mark.parametrize("op", OPS)
def test_one_rank_float32_runs_no_ring(comm, xp, op, monkeypatch):
    """P = 1, float32/float64, rows in global order: one local matmul; float16 and a
    scrambled explicit Layout still take the ring."""
    from mpiattn.products import matmul as mm
    calls = []
    real = mm.circulate

    def counting(*args, **kw):
        calls.append(1)
        return real(*args, **kw)

    monkeypatch.setattr(mm, "circulate", counting)
    for dtype, layout, ring in ((np.float32, "contiguous", False), (np.float64, "zigzag", False),
                                (np.float16, "contiguous", True),
                                (np.float32, scrambled_layout(10, comm.size), True)):
        calls.clear()
        A, B = make(op, 10, 10, 3, dtype=dtype, seed=43)
        got = host(run(op, A, B, xp, layout, block_size=3))
        np.testing.assert_array_equal(got, rows(reference(op, A, B), layout))
        assert bool(calls) == (ring or comm.size > 1), (dtype, layout)


def test_uneven_pieces_short_first(comm, xp):
    """A short first piece, then longer ones (nn's first piece writes the accumulator; results exact)."""
    n = 15
    P = comm.size
    cuts = [0, 1] + [1 + (r * (n - 1)) // max(1, P - 1) for r in range(1, P)]
    layout = mpiattn.Layout([[(a, b)] for a, b in zip(cuts[:-1], cuts[1:])] if P > 1 else [[(0, n)]])
    for op in OPS:
        A, B = make(op, n, n, 3, (2,), (), seed=47)
        got = host(run(op, A, B, xp, layout))
        np.testing.assert_array_equal(got, rows(reference(op, A, B), layout))


# ---------------------------------------------------------------- rounding
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("op", OPS)
def test_float32_within_rounding_of_float64(comm, xp, op, layout):
    A, B = make(op, 37, 29, 16, (2,), (), dtype=np.float32, integer=False, seed=11)
    got = host(run(op, A, B, xp, layout, block_size=8))
    assert got.dtype == np.float32
    A64, B64 = A.astype(np.float64), B.astype(np.float64)
    want = rows(reference(op, A64, B64), layout)
    scale = rows(reference(op, np.abs(A64), np.abs(B64)), layout)
    inner = {"nt": 16, "nn": 29, "tn": 29}[op]
    bound = inner * np.finfo(np.float32).eps * scale  # gamma_k * |A||B|, with margin 2
    assert np.all(np.abs(got - want) <= bound)


@pytest.mark.parametrize("op", OPS)
def test_float16_accumulates_in_float32(comm, xp, op):
    A, B = make(op, 21, 40, 48, dtype=np.float16, integer=False, seed=13)
    got = host(run(op, A, B, xp, "contiguous", block_size=5))
    assert got.dtype == np.float16
    A64, B64 = A.astype(np.float64), B.astype(np.float64)
    want = rows(reference(op, A64, B64), "contiguous")
    scale = rows(reference(op, np.abs(A64), np.abs(B64)), "contiguous")
    inner = {"nt": 48, "nn": 40, "tn": 40}[op]
    # one float16 rounding of the float32-accumulated value
    bound = np.finfo(np.float16).eps / 2 * np.abs(want) + inner * np.finfo(np.float32).eps * scale
    assert np.all(np.abs(got.astype(np.float64) - want) <= bound * 1.0001)


# --------------------------------------------------------------------- out=
@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("op", OPS)
def test_out_receives_the_same_result(comm, xp, op, layout, dtype):
    """``out=`` returns ``out`` itself, holding what the call without it returns, bit for bit,
    whatever ``out`` held before (filled with NaN here), also when it is reused."""
    A, B = make(op, 9, 7, 5, lead_a=(2,), dtype=dtype, integer=False, seed=3)
    a, b = xp.asarray(rows(A, layout)), xp.asarray(rows(B, layout))
    want = host(FORWARD[op](a, b, layout=layout, block_size=2))
    out = xp.full(want.shape, np.nan, dtype=dtype)
    for _ in range(2):
        got = FORWARD[op](a, b, layout=layout, block_size=2, out=out)
        assert got is out
        np.testing.assert_array_equal(host(out), want)
        out[...] = np.nan


@pytest.mark.parametrize("op", OPS)
def test_a_wrong_out_is_refused_on_every_rank(comm, xp, op):
    """Each fault on the last rank only; every rank raises the same error, nothing is computed."""
    a, b = _shards(op, xp)
    good = FORWARD[op](a, b)
    last = comm.rank == comm.size - 1

    def refused(exc_type, match, bad, a=a):
        out = bad if last else xp.empty_like(good)
        raises_everywhere(comm, exc_type, match, lambda: FORWARD[op](a, b, out=out))

    rows_, cols = good.shape[-2:]
    # (the message names the last rank's shapes; its rows may differ from this rank's)
    refused(ValueError, rf"matmul_{op}: out has shape \(\d+, {cols}\) on rank {comm.size - 1}",
            xp.empty((rows_ + 1, cols)))
    # (at one rank the plan's check says it; at several, the check of every rank's shapes first)
    refused(ValueError, "out has shape|only axis -2", xp.empty((rows_, cols + 1)))
    refused(TypeError, "same dtype", xp.empty(good.shape, dtype=np.float32))
    refused(ValueError, "not C-contiguous", xp.empty(good.shape + (2,))[..., 0])
    # out overlapping a by one element of one buffer
    base = xp.empty(a.size + good.size)
    a_in = base[:a.size].reshape(a.shape)
    a_in[...] = a
    refused(ValueError, "out shares memory with a", base[a.size - 1:a.size - 1 + good.size].reshape(good.shape),
            a=a_in if last else a)
    if xp is np:
        read_only = np.empty_like(good)
        read_only.flags.writeable = False
        refused(ValueError, "out is read-only", read_only)
    if comm.size > 1:
        out = None if comm.rank == 1 else xp.empty_like(good)
        raises_everywhere(comm, ValueError, f"ranks disagree on whether matmul_{op} is given an out "
                          "array: rank 0 has one, rank 1 has none", lambda: FORWARD[op](a, b, out=out))


# ---------------------------------------------------------------- backward
def _unbroadcast(g, shape):
    """Reference: sum a gradient over the axes where an operand was broadcast."""
    while g.ndim > len(shape):
        g = g.sum(axis=0)
    for ax, s in enumerate(shape):
        if s == 1 and g.shape[ax] != 1:
            g = g.sum(axis=ax, keepdims=True)
    return g


def _analytic(op, dC, A, B):
    if op == "nt":   # C = A B^T
        return dC @ B, T(dC) @ A
    if op == "nn":   # C = A B
        return dC @ T(B), T(A) @ dC
    return B @ T(dC), A @ dC  # C = A^T B


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("lead_a,lead_b", [((), ()), ((2, 1), (3,))])
@pytest.mark.parametrize("op", OPS)
def test_backward_matches_the_analytic_formula(comm, xp, op, lead_a, lead_b, layout):
    A, B = make(op, 7, 6, 3, lead_a, lead_b, seed=17)
    C = reference(op, A, B)
    dC = np.random.default_rng(18).integers(-3, 4, C.shape).astype(np.float64)
    da, db = BACKWARD[op](xp.asarray(rows(dC, layout)), xp.asarray(rows(A, layout)),
                          xp.asarray(rows(B, layout)), layout=layout, block_size=2)
    dA, dB = _analytic(op, dC, A, B)
    np.testing.assert_array_equal(host(da), rows(_unbroadcast(dA, A.shape), layout))
    np.testing.assert_array_equal(host(db), rows(_unbroadcast(dB, B.shape), layout))
    assert host(da).dtype == np.float64 and host(db).dtype == np.float64


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("op", OPS)
def test_backward_matches_finite_differences(comm, xp, op, layout):
    """dL/dA and dL/dB of L = sum(W * C) against central differences (float64)."""
    A, B = make(op, 6, 5, 3, (2, 1), (3,), integer=False, seed=23)
    W = np.random.default_rng(24).standard_normal(reference(op, A, B).shape)
    w = rows(W, layout)

    def loss(A_, B_):
        c = host(run(op, A_, B_, xp, layout, block_size=2))
        return comm.mpi.allreduce(float(np.sum(w * c)))

    da, db = BACKWARD[op](xp.asarray(w), xp.asarray(rows(A, layout)), xp.asarray(rows(B, layout)),
                          layout=layout, block_size=2)
    dA = host(mpiattn.gather(da, layout=layout, root=None))
    dB = host(mpiattn.gather(db, layout=layout, root=None))
    assert dA.shape == A.shape and dB.shape == B.shape
    rng = np.random.default_rng(25)
    h = 1e-3
    for X, dX, which in ((A, dA, 0), (B, dB, 1)):
        for _ in range(3):
            idx = tuple(int(rng.integers(s)) for s in X.shape)
            plus, minus = X.copy(), X.copy()
            plus[idx] += h
            minus[idx] -= h
            args_p = (plus, B) if which == 0 else (A, plus)
            args_m = (minus, B) if which == 0 else (A, minus)
            fd = (loss(*args_p) - loss(*args_m)) / (2 * h)
            assert abs(fd - dX[idx]) <= 1e-8 * (1 + abs(dX[idx])), (which, idx, fd, dX[idx])


# --------------------------------------------------------------- bad input
def raises_everywhere(comm, exc_type, match, fn):
    """``fn`` raises ``exc_type`` matching ``match`` on this rank, with the same message on all."""
    with pytest.raises(exc_type, match=match) as info:
        fn()
    seen = comm.allgather_obj((type(info.value).__name__, str(info.value)))
    assert all(s == seen[0] for s in seen), seen


def _shards(op, xp, N=6, M=5, d=3, layout="contiguous", dtype=np.float64):
    A, B = make(op, N, M, d, dtype=dtype)
    return xp.asarray(rows(A, layout)), xp.asarray(rows(B, layout))


def test_bad_inner_dimensions(comm, xp):
    a = xp.asarray(rows(np.ones((6, 3)), "contiguous"))
    b = xp.asarray(rows(np.ones((5, 4)), "contiguous"))
    raises_everywhere(comm, ValueError, "inner dimensions differ", lambda: mpiattn.matmul_nt(a, b))
    a = xp.asarray(rows(np.ones((6, 6)), "contiguous"))  # 6 columns, but B has 5 rows
    b = xp.asarray(rows(np.ones((5, 3)), "contiguous"))
    raises_everywhere(comm, ValueError, "inner dimensions differ", lambda: mpiattn.matmul_nn(a, b))
    a = xp.asarray(rows(np.ones((5, 6)), "contiguous"))  # A has M=5 rows, B has 6
    b = xp.asarray(rows(np.ones((6, 3)), "contiguous"))
    # (the layout's shares of 5 and 6 rows differ on some rank at every rank count)
    raises_everywhere(comm, ValueError, "inner dimensions differ", lambda: mpiattn.matmul_tn(a, b))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("which", ["a", "b"])
@pytest.mark.parametrize("op", OPS)
def test_shard_lengths_must_match_the_layout(comm, xp, op, which):
    A, B = make(op, 8, 8, 3)
    X = A if which == "a" else B
    idx = list(partition(8, layout="contiguous"))
    if comm.rank == 0:  # move one row from the last rank to rank 0
        idx.append(7)
    elif comm.rank == comm.size - 1:
        idx = idx[:-1]
    x = xp.asarray(X[..., idx, :])
    other = xp.asarray(rows(B if which == "a" else A, "contiguous"))
    args = (x, other) if which == "a" else (other, x)
    if op == "tn":
        # tn also needs the same rows of a and b on each rank: report either problem
        raises_everywhere(comm, ValueError, "rows", lambda: FORWARD[op](*args))
    else:
        raises_everywhere(comm, ValueError, "layout of 8 rows", lambda: FORWARD[op](*args))


@pytest.mark.parametrize("op", OPS)
def test_bad_dtypes(comm, xp, op):
    a, b = _shards(op, xp)
    raises_everywhere(comm, TypeError, "same dtype", lambda: FORWARD[op](a.astype(np.float32), b))
    raises_everywhere(comm, TypeError, "dtype int64", lambda: FORWARD[op](a.astype(np.int64), b.astype(np.int64)))
    raises_everywhere(comm, TypeError, "dtype complex",
                      lambda: FORWARD[op](a.astype(np.complex128), b.astype(np.complex128)))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("op", OPS)
def test_dtype_differs_between_ranks(comm, xp, op):
    dtype = np.float32 if comm.rank == 0 else np.float64
    a, b = _shards(op, xp, dtype=dtype)
    raises_everywhere(comm, ValueError, f"ranks disagree on matmul_{op}'s dtype", lambda: FORWARD[op](a, b))


@pytest.mark.parametrize("op", OPS)
def test_non_array_inputs(comm, xp, op):
    a, b = _shards(op, xp)
    last = comm.rank == comm.size - 1
    b_bad = host(b).tolist() if last else b  # only the last rank passes a list
    raises_everywhere(comm, TypeError, "expected a numpy.ndarray", lambda: FORWARD[op](a, b_bad))
    a_masked = np.ma.masked_array(host(a)) if last else a
    raises_everywhere(comm, TypeError, "MaskedArray", lambda: FORWARD[op](a_masked, b))
    raises_everywhere(comm, ValueError, "at least 2 dimensions", lambda: FORWARD[op](a[..., 0], b))


@pytest.mark.parametrize("op", OPS)
def test_bad_layout_and_block_size(comm, xp, op):
    a, b = _shards(op, xp)
    raises_everywhere(comm, ValueError, "unknown layout", lambda: FORWARD[op](a, b, layout="striped"))
    raises_everywhere(comm, ValueError, "block_size must be >= 1", lambda: FORWARD[op](a, b, block_size=0))
    raises_everywhere(comm, TypeError, "block_size must be a positive integer",
                      lambda: FORWARD[op](a, b, block_size=2.5))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("op", OPS)
def test_layout_or_block_size_differs_between_ranks(comm, xp, op):
    # 8 rows over 2..4 ranks: both layouts give the same shard lengths, so only the names differ
    layout = "contiguous" if comm.rank == 0 else "zigzag"
    A, B = make(op, 8, 8, 3)
    a, b = xp.asarray(rows(A, layout)), xp.asarray(rows(B, layout))
    raises_everywhere(comm, ValueError, f"ranks disagree on matmul_{op}'s layout",
                      lambda: FORWARD[op](a, b, layout=layout))
    a, b = _shards(op, xp)
    raises_everywhere(comm, ValueError, f"ranks disagree on matmul_{op}'s block_size",
                      lambda: FORWARD[op](a, b, block_size=comm.rank + 1))


@pytest.mark.parametrize("op", OPS)
def test_leading_axes_must_broadcast_and_agree(comm, xp, op):
    A, B = make(op, 6, 5, 3, (2,), (3,))
    a, b = xp.asarray(rows(A, "contiguous")), xp.asarray(rows(B, "contiguous"))
    raises_everywhere(comm, ValueError, "do not broadcast", lambda: FORWARD[op](a, b))
    if comm.size > 1:
        A, B = make(op, 6, 5, 3, (2 if comm.rank == 0 else 3,), ())
        a, b = xp.asarray(rows(A, "contiguous")), xp.asarray(rows(B, "contiguous"))
        raises_everywhere(comm, ValueError, "only axis -2", lambda: FORWARD[op](a, b))


@pytest.mark.parametrize("op", OPS)
def test_backward_rejects_a_wrong_dc(comm, xp, op):
    A, B = make(op, 6, 5, 3)
    C = reference(op, A, B)
    a, b = xp.asarray(rows(A, "contiguous")), xp.asarray(rows(B, "contiguous"))
    dc = xp.asarray(rows(C[..., :-1], "contiguous"))
    raises_everywhere(comm, ValueError, "dc has shape", lambda: BACKWARD[op](dc, a, b))
    dc = xp.asarray(rows(C, "contiguous")).astype(np.float32)
    raises_everywhere(comm, TypeError, "same dtype", lambda: BACKWARD[op](dc, a, b))


def test_numpy_path_imports_no_cupy(serial_only):
    code = textwrap.dedent("""
        import sys, numpy as np, mpiattn
        a = np.ones((4, 3)); b = np.ones((5, 3))
        c = mpiattn.matmul_nt(a, b)
        mpiattn.matmul_nt_backward(c, a, b)
        assert c.shape == (4, 5) and (c == 3).all()
        assert "cupy" not in sys.modules
        print("clean")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "clean" in proc.stdout
