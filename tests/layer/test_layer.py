"""MultiheadAttention against an independent float64 NumPy layer and finite differences.

The reference (``RefMHA``) runs in one process on global (gathered) arrays:
explicit projections, a materialised softmax with explicit masks, and its own
hand-written backward, itself checked by finite differences. The distributed
layer is compared with it at every rank count, so the results are the same
for every P up to rounding.
"""

import math
import os

import numpy as np
import pytest

import mpiattn
from mpiattn import MultiheadAttention

from helpers import count_validations, host, install_fake_cupy


# ----------------------------------------------------------------- reference
class RefMHA:
    """Single-process float64 multi-head attention on global arrays."""

    def __init__(self, params, num_heads, num_kv_heads):
        self.p = {k: np.asarray(host(v), dtype=np.float64) for k, v in params.items()}
        self.H, self.Hkv = num_heads, num_kv_heads

    def forward(self, xq, xk, xv, causal=False, pad=None):
        p, H, Hkv = self.p, self.H, self.Hkv
        B, N, E = xq.shape
        M = xk.shape[1]
        D = E // H
        bias = lambda name: p.get(name, 0.0)
        Q = (np.einsum("bne,ef->bnf", xq, p["wq"]) + bias("bq")).reshape(B, N, H, D)
        K = (np.einsum("bme,ef->bmf", xk, p["wk"]) + bias("bk")).reshape(B, M, Hkv, D)
        V = (np.einsum("bme,ef->bmf", xv, p["wv"]) + bias("bv")).reshape(B, M, Hkv, D)
        group = np.arange(H) // (H // Hkv)  # kv head of each query head
        Kh, Vh = K[:, :, group, :], V[:, :, group, :]  # (B, M, H, D)
        visible = np.ones((B, H, N, M), dtype=bool)
        if causal:
            visible &= np.arange(M)[None, :] <= np.arange(N)[:, None]
        if pad is not None:
            visible &= ~pad[:, None, None, :]
        S = np.einsum("bnhd,bmhd->bhnm", Q, Kh) / math.sqrt(D)
        S = np.where(visible, S, -np.inf)
        A = np.zeros_like(S)
        for idx in np.ndindex(B, H, N):  # softmax row by row, empty rows stay 0
            row, vis = S[idx], visible[idx]
            if vis.any():
                e = np.exp(row[vis] - row[vis].max())
                A[idx][vis] = e / e.sum()
        O = np.einsum("bhnm,bmhd->bnhd", A, Vh).reshape(B, N, E)
        y = O @ p["wo"] + bias("bo")
        self.saved = (xq, xk, xv, Q, Kh, Vh, A, O, group)
        return y

    def backward(self, dy):
        """Returns (grads dict, dxq, dxk, dxv) for dy (B, N, E)."""
        p, H, Hkv = self.p, self.H, self.Hkv
        xq, xk, xv, Q, Kh, Vh, A, O, group = self.saved
        B, N, E = xq.shape
        M, D = xk.shape[1], E // H
        g = {"wo": np.einsum("bnf,bne->fe", O, dy)}
        dO = (dy @ p["wo"].T).reshape(B, N, H, D)
        dA = np.einsum("bnhd,bmhd->bhnm", dO, Vh)
        dVh = np.einsum("bhnm,bnhd->bmhd", A, dO)
        dS = A * (dA - (dA * A).sum(-1, keepdims=True)) / math.sqrt(D)
        dQ = np.einsum("bhnm,bmhd->bnhd", dS, Kh).reshape(B, N, E)
        dKh = np.einsum("bhnm,bnhd->bmhd", dS, Q)
        dK = np.zeros((B, M, Hkv, D))
        dV = np.zeros((B, M, Hkv, D))
        for h in range(H):
            dK[:, :, group[h]] += dKh[:, :, h]
            dV[:, :, group[h]] += dVh[:, :, h]
        dK, dV = dK.reshape(B, M, -1), dV.reshape(B, M, -1)
        for name, x, d in (("q", xq, dQ), ("k", xk, dK), ("v", xv, dV)):
            g["w" + name] = np.einsum("bni,bnf->if", x, d)
            if "b" + name in p:
                g["b" + name] = d.sum((0, 1))
        if "bo" in p:
            g["bo"] = dy.sum((0, 1))
        return g, dQ @ p["wq"].T, dK @ p["wk"].T, dV @ p["wv"].T


# ------------------------------------------------------------------- helpers
def make_layer(xp, E=8, H=2, Hkv=None, kdim=None, vdim=None, bias=True, dtype=np.float64, seed=1):
    """A layer with random non-zero parameters (biases too), moved to xp."""
    layer = MultiheadAttention(E, H, num_kv_heads=Hkv, kdim=kdim, vdim=vdim, bias=bias,
                               dtype=dtype, seed=seed)
    rng = np.random.default_rng(seed + 100)
    for name, shape in layer.param_shapes().items():
        layer.params[name] = (0.6 * rng.standard_normal(shape)).astype(dtype)
    return layer.to(xp)


def make_inputs(layer, B, N, M, self_attn, seed, pad_frac=0.0):
    """Global float64 inputs (and padding mask) the same on every rank."""
    rng = np.random.default_rng(seed)
    xq = rng.standard_normal((B, N, layer.embed_dim))
    if self_attn:
        xk = xv = xq
        M = N
    else:
        xk = rng.standard_normal((B, M, layer.kdim))
        xv = rng.standard_normal((B, M, layer.vdim))
    pad = rng.random((B, M)) < pad_frac if pad_frac else None
    if pad is not None:
        pad[:, 0] = False  # keep one key visible in every batch row
    dy = rng.standard_normal((B, N, layer.embed_dim))
    return xq, xk, xv, pad, dy


def run_layer(layer, xp, xq, xk, xv, pad, dy, self_attn, causal=False, layout="contiguous", comm=None,
              engine="auto"):
    """Shard global inputs, run forward and backward; return gathered host results."""
    dt = layer.dtype
    sh = lambda a: mpiattn.shard(xp.asarray(a.astype(dt)), comm, axis=1, layout=layout)
    q = sh(xq)
    k, v = (None, None) if self_attn else (sh(xk), sh(xv))
    mask = None if pad is None else mpiattn.shard(xp.asarray(pad), comm, axis=1, layout=layout)
    y = layer.forward(q, k, v, comm, causal=causal, key_padding_mask=mask, layout=layout, engine=engine)
    assert y.shape == q.shape and y.dtype == dt
    dq, dk, dv = layer.backward(sh(dy))
    gat = lambda a: host(mpiattn.gather(a, comm, axis=1, layout=layout, root=None))
    out = {"y": gat(y), "dxq": gat(dq)}
    if self_attn:
        assert dk is None and dv is None
    else:
        assert dk.shape == k.shape and dv.shape == v.shape and dk.dtype == dt
        out.update(dxk=gat(dk), dxv=gat(dv))
    return out


def reference(layer, xq, xk, xv, pad, dy, self_attn, causal=False):
    ref = RefMHA(layer.params, layer.num_heads, layer.num_kv_heads)
    f64 = lambda a: a.astype(layer.dtype).astype(np.float64)  # the inputs the layer saw
    y = ref.forward(f64(xq), f64(xk), f64(xv), causal=causal, pad=pad)
    g, dxq, dxk, dxv = ref.backward(f64(dy))
    out = {"y": y, "dxq": dxq + dxk + dxv if self_attn else dxq}
    if not self_attn:
        out.update(dxk=dxk, dxv=dxv)
    return out, g


def assert_close(got, want, rtol, atol, what):
    err = np.max(np.abs(got - want) / (atol + rtol * np.abs(want)), initial=0.0)
    assert err <= 1.0, f"{what}: error {err:.3g} x tolerance (max |diff| {np.max(np.abs(got - want)):.3g})"


# --------------------------------------------------------------- reference FD
def test_reference_matches_finite_differences():
    """The reference's own backward, entry by entry (one process, float64)."""
    layer = make_layer(np, E=4, H=2, Hkv=1, kdim=3, vdim=5)
    xq, xk, xv, pad, dy = make_inputs(layer, 2, 4, 5, False, seed=3, pad_frac=0.3)
    ref = RefMHA(layer.params, 2, 1)
    loss = lambda: float(np.sum(ref.forward(xq, xk, xv, causal=True, pad=pad) * dy))
    loss()
    g, dxq, dxk, dxv = ref.backward(dy)
    arrays = dict(ref.p, xq=xq, xk=xk, xv=xv)
    analytic = dict(g, xq=dxq, xk=dxk, xv=dxv)
    h = 1e-6
    for name, a in arrays.items():
        fd = np.zeros_like(a)
        for i in np.ndindex(a.shape):
            a0 = a[i]
            a[i] = a0 + h
            lp = loss()
            a[i] = a0 - h
            lm = loss()
            a[i] = a0
            fd[i] = (lp - lm) / (2 * h)
        assert_close(analytic[name], fd, 1e-6, 1e-8, f"reference d{name}")


# ------------------------------------------------------------ against the reference
CASES = {
    # name: (layer kwargs, B, N, M, self_attn, causal, pad_frac, layout)
    "self": (dict(), 2, 11, None, True, False, 0.0, "contiguous"),
    "self-causal-zigzag": (dict(), 1, 13, None, True, True, 0.0, "zigzag"),
    "cross-kdim-vdim": (dict(kdim=5, vdim=3), 2, 7, 10, False, False, 0.0, "contiguous"),
    "gqa-padding": (dict(E=8, H=4, Hkv=2), 2, 9, 12, False, False, 0.4, "contiguous"),
    "mqa-nobias-causal": (dict(E=12, H=3, Hkv=1, bias=False), 1, 10, 10, False, True, 0.2, "zigzag"),
    "tiny-N": (dict(), 1, 3, 2, False, False, 0.0, "contiguous"),  # some ranks own no rows
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference_float64(comm, xp, case):
    kw, B, N, M, self_attn, causal, pad_frac, layout = CASES[case]
    layer = make_layer(xp, **kw)
    args = make_inputs(layer, B, N, M, self_attn, seed=7, pad_frac=pad_frac)
    got = run_layer(layer, xp, *args, self_attn, causal=causal, layout=layout)
    want, g_want = reference(layer, *args, self_attn, causal=causal)
    for key in want:
        assert_close(got[key], want[key], 1e-10, 1e-12, key)
    assert set(layer.grads) == set(layer.params)
    for name, g in layer.grads.items():
        assert g.dtype == np.float64 and g.shape == layer.params[name].shape
        assert_close(host(g), g_want[name], 1e-10, 1e-12, f"grad {name}")


@pytest.mark.parametrize("strategy", ["ring", "allgather", "ulysses", "materialized"])
def test_strategies_and_small_blocks(comm, xp, strategy):
    """Every attention strategy under the layer (ring with several blocks per rank)."""
    layer = make_layer(xp, E=8, H=4, Hkv=4)
    if strategy == "ulysses" and 4 % comm.size:
        pytest.skip("ulysses needs the head counts divisible by P")
    xq, xk, xv, pad, dy = make_inputs(layer, 1, 14, 14, True, seed=21)
    sh = lambda a: mpiattn.shard(xp.asarray(a), axis=1, layout="zigzag")
    y = layer.forward(sh(xq), causal=True, layout="zigzag", strategy=strategy, block_size=2)
    dq, _, _ = layer.backward(sh(dy))
    gat = lambda a: host(mpiattn.gather(a, axis=1, layout="zigzag", root=None))
    want, g_want = reference(layer, xq, xk, xv, pad, dy, True, causal=True)
    assert_close(gat(y), want["y"], 1e-10, 1e-12, "y")
    assert_close(gat(dq), want["dxq"], 1e-10, 1e-12, "dxq")
    for name, g in layer.grads.items():
        assert_close(host(g), g_want[name], 1e-10, 1e-12, f"grad {name}")


@pytest.mark.parametrize("dtype,rtol,atol", [(np.float32, 2e-4, 2e-5), (np.float16, 2e-2, 2e-2)])
def test_matches_reference_low_precision(comm, xp, dtype, rtol, atol):
    layer = make_layer(xp, E=8, H=2, Hkv=1, kdim=6, dtype=dtype)
    args = make_inputs(layer, 2, 10, 9, False, seed=11, pad_frac=0.2)
    got = run_layer(layer, xp, *args, False, causal=True)
    want, g_want = reference(layer, *args, False, causal=True)
    for key in want:
        assert_close(got[key], want[key], rtol, atol * max(1.0, np.max(np.abs(want[key]))), key)
    for name, g in layer.grads.items():  # (d bk is exactly 0: softmax ignores a per-row shift)
        assert g.dtype == np.float32
        scale = max(1.0, np.max(np.abs(g_want[name])))
        assert_close(host(g), g_want[name], rtol, atol * scale, f"grad {name}")


def test_param_grads_identical_on_all_ranks(comm, xp):
    layer = make_layer(xp, E=8, H=4, Hkv=2, dtype=np.float32)
    args = make_inputs(layer, 2, 17, 17, True, seed=5)
    run_layer(layer, xp, *args, True, causal=True)
    mine = {k: host(g).copy() for k, g in layer.grads.items()}
    everyone = comm.allgather_obj(mine)
    for r, theirs in enumerate(everyone):
        for k in mine:
            assert np.array_equal(theirs[k], mine[k]), f"grad {k} differs between rank {r} and {comm.rank}"
            assert theirs[k].tobytes() == mine[k].tobytes()


def test_a_call_of_the_last_shapes_is_not_validated_again(comm, monkeypatch):
    """The layer keeps the plan of its last call while every rank's arrays fit it
    (:func:`mpiattn.strategies.plan.reuse_or_plan`): forwards and backwards of the same shapes
    validate once; other shapes make a new plan."""
    validations = count_validations(monkeypatch)
    layer = MultiheadAttention(8, 2, dtype=np.float64, seed=1)
    x = mpiattn.shard(np.random.default_rng(3).standard_normal((2, 10, 8)), axis=1)
    for step in range(3):
        y = layer.forward(x * (1 + step), causal=True)
        layer.backward(np.ones_like(y))
    assert len(validations) == 1
    longer = mpiattn.shard(np.random.default_rng(4).standard_normal((2, 12, 8)), axis=1)
    layer.forward(longer, causal=True)
    assert len(validations) == 2


# --------------------------------------------------------- finite differences
@pytest.mark.parametrize("self_attn", [True, False])
def test_finite_differences_distributed(comm, xp, self_attn):
    """Every parameter and input entry of the distributed float64 layer, central differences."""
    from mpi4py import MPI

    kw = dict(E=4, H=2, Hkv=1) if self_attn else dict(E=4, H=2, Hkv=1, kdim=3, vdim=2)
    layer = make_layer(xp, **kw)
    N, M = 5, 6
    xq, xk, xv, pad, dy = make_inputs(layer, 1, N, M, self_attn, seed=13, pad_frac=0.0 if self_attn else 0.3)
    causal = self_attn
    sh = lambda a: mpiattn.shard(xp.asarray(a), axis=1)
    mask = None if pad is None else sh(pad)
    dy_r = host(sh(dy))

    def loss(xq_, xk_, xv_):
        k, v = (None, None) if self_attn else (sh(xk_), sh(xv_))
        y = layer.forward(sh(xq_), k, v, causal=causal, key_padding_mask=mask)
        return comm.mpi.allreduce(float(np.sum(host(y) * dy_r)), op=MPI.SUM)

    loss(xq, xk, xv)
    dq, dk, dv = layer.backward(xp.asarray(dy_r))
    gat = lambda a: host(mpiattn.gather(a, axis=1, root=None))
    analytic = {k: host(g).copy() for k, g in layer.grads.items()}
    analytic["xq"] = gat(dq)
    if not self_attn:
        analytic["xk"], analytic["xv"] = gat(dk), gat(dv)
    h = 1e-6
    inputs = {"xq": xq} if self_attn else {"xq": xq, "xk": xk, "xv": xv}
    for name in list(layer.params) + list(inputs):
        fd = np.zeros(analytic[name].shape)
        for i in np.ndindex(fd.shape):
            vals = []
            for step in (h, -h):
                if name in inputs:
                    moved = {k: a.copy() for k, a in inputs.items()}
                    moved[name][i] += step
                    xs = (moved["xq"],) * 3 if self_attn else (moved["xq"], moved["xk"], moved["xv"])
                    vals.append(loss(*xs))
                else:
                    p = host(layer.params[name]).copy()
                    p[i] += step
                    old, layer.params[name] = layer.params[name], xp.asarray(p)
                    vals.append(loss(xq, xk, xv))
                    layer.params[name] = old
            fd[i] = (vals[0] - vals[1]) / (2 * h)
        assert_close(analytic[name], fd, 1e-6, 1e-8, f"d{name}")


# ------------------------------------------------------------------- errors
def test_bad_inputs_raise_on_every_rank(comm, xp):
    layer = make_layer(xp, E=8, H=2, kdim=5, dtype=np.float32)
    n = mpiattn.partition(6).size
    good = xp.zeros((1, n, 8), dtype=np.float32)
    key = xp.zeros((1, n, 5), dtype=np.float32)
    val = xp.zeros((1, n, 8), dtype=np.float32)
    last = comm.rank == comm.size - 1
    wide = xp.zeros((1, n, 9 if last else 8), dtype=np.float32)
    with pytest.raises(ValueError, match="embed_dim=8"):
        layer.forward(wide, key, val)
    f64 = xp.zeros((1, n, 8), dtype=np.float64 if last else np.float32)
    with pytest.raises(TypeError, match="dtype"):
        layer.forward(f64, key, val)
    with pytest.raises(ValueError, match="both key and value"):
        layer.forward(good, key, None)
    with pytest.raises(ValueError, match="kdim == vdim == embed_dim"):
        layer.forward(good)
    with pytest.raises(RuntimeError, match="forward"):
        layer.backward(good)
    layer.forward(good, key, val)
    bad_dy = xp.zeros((1, n, 7 if last else 8), dtype=np.float32)
    with pytest.raises(ValueError, match="dy has shape"):
        layer.backward(bad_dy)
    layer.params["wo"] = layer.params["wo"].astype(np.float64)  # e.g. a careless optimiser
    with pytest.raises(TypeError, match=r"params\['wo'\]"):
        layer.forward(good, key, val)


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match="divisible by num_heads"):
        MultiheadAttention(10, 4)
    with pytest.raises(ValueError, match="divisible by num_kv_heads"):
        MultiheadAttention(12, 4, num_kv_heads=3)
    with pytest.raises(TypeError, match=r"float16, bfloat16 \(ml_dtypes\), float32 or float64"):
        MultiheadAttention(8, 2, dtype=np.int32)
    with pytest.raises(ValueError, match="positive integer"):
        MultiheadAttention(0, 1)


def test_init_is_seeded_and_rank_independent(comm):
    a = MultiheadAttention(8, 2, num_kv_heads=1, kdim=3, seed=4)
    b = MultiheadAttention(8, 2, num_kv_heads=1, kdim=3, seed=4)
    c = MultiheadAttention(8, 2, num_kv_heads=1, kdim=3, seed=5)
    assert list(a.params) == ["wq", "wk", "wv", "wo", "bq", "bk", "bv", "bo"]
    assert a.params["wk"].shape == (3, 4) and a.params["bk"].shape == (4,)
    for k in a.params:
        assert a.params[k].dtype == np.float32
        assert np.array_equal(a.params[k], b.params[k])
    assert not np.array_equal(a.params["wq"], c.params["wq"])
    # independent draw: numpy's default_rng(seed), float64, xavier bounds, in order
    rng = np.random.default_rng(4)
    for name, (fi, fo) in [("wq", (8, 8)), ("wk", (3, 4)), ("wv", (8, 4)), ("wo", (8, 8))]:
        want = rng.uniform(-1, 1, size=(fi, fo)) * math.sqrt(6 / (fi + fo))
        np.testing.assert_allclose(a.params[name], want.astype(np.float32), rtol=1e-6, atol=1e-7)
    everyone = comm.allgather_obj(a.params["wq"].tobytes())
    assert all(x == everyone[0] for x in everyone)


# ---------------------------------------------------------------- save / load
def test_save_load_round_trip(comm, xp, shared_dir):
    layer = make_layer(xp, E=8, H=4, Hkv=2, kdim=5, vdim=3, dtype=np.float32, seed=9)
    path = os.path.join(shared_dir, "mha.h5")
    layer.save(path)
    assert os.path.exists(path)
    assert not [f for f in os.listdir(os.path.dirname(path)) if ".tmp" in f]
    back = MultiheadAttention.load(path)
    assert repr(back) == repr(layer.to(np))
    for k in layer.params:
        assert back.params[k].dtype == np.float32
        assert np.array_equal(back.params[k], host(layer.params[k]))
    comm.barrier()  # nobody removes the directory while others read


def test_load_errors_on_every_rank(comm, shared_dir):
    import h5py

    d = shared_dir
    with pytest.raises(FileNotFoundError):
        MultiheadAttention.load(os.path.join(d, "missing.h5"))
    path = os.path.join(d, "bad.h5")
    MultiheadAttention(8, 2, dtype=np.float64).save(path)
    if comm.rank == 0:
        with h5py.File(path, "r+") as f:
            del f["params/wk"]
            f["params/wk"] = np.zeros((8, 5))
    comm.barrier()
    with pytest.raises(ValueError, match="'wk' has shape"):
        MultiheadAttention.load(path)
    if comm.rank == 0:
        with open(os.path.join(d, "junk.h5"), "w") as fh:
            fh.write("not hdf5")
    comm.barrier()
    with pytest.raises(ValueError, match="cannot read"):
        MultiheadAttention.load(os.path.join(d, "junk.h5"))
    comm.barrier()


# ------------------------------------------------------------ CuPy code path
def test_device_arrays_with_fake_cupy(comm, xp, monkeypatch):
    """layer.to('cupy') and CuPy-typed inputs, on machines without a GPU (tests/fake_cupy.py).

    The fake's arrays are NumPy memory behind CuPy's interface; the device
    path of the native engine (exact running maximum, GEMMs through cuBLAS's
    interface) rounds differently from the host's, so the results equal a
    NumPy run of the same layer to float32 rounding.
    """
    if xp is not np:
        pytest.skip("the real CuPy backend runs every other test of this file")
    import fake_cupy
    from mpi4py import MPI

    from mpiattn.comm import Comm

    cp = install_fake_cupy(monkeypatch)
    own = Comm(MPI.COMM_WORLD.Dup())  # its device transport dies with the fake
    try:
        layer = make_layer(np, E=8, H=4, Hkv=2, kdim=6, dtype=np.float32)
        args = make_inputs(layer, 2, 9, 7, False, seed=31, pad_frac=0.3)
        want = run_layer(layer, np, *args, False, causal=True, engine="native")  # the CuPy run is native
        g_want = {k: g.copy() for k, g in layer.grads.items()}
        assert layer.to("cupy") is layer and layer.xp is cp
        assert all(type(p).__module__ == "cupy" for p in layer.params.values())
        with pytest.raises(TypeError, match=r"layer.to\('numpy'\)"):
            layer.forward(np.zeros((1, 0, 8), dtype=np.float32))
        got = run_layer(layer, cp, *args, False, causal=True, comm=own)
        for key in want:
            np.testing.assert_allclose(got[key], want[key], rtol=2e-5, atol=2e-6, err_msg=key)
        for k, g in layer.grads.items():
            assert type(g).__module__ == "cupy"
            np.testing.assert_allclose(host(g), g_want[k], rtol=2e-5, atol=2e-5, err_msg=k)  # bk is 0 up to rounding
        layer.to("numpy")
        assert all(type(p) is np.ndarray for p in layer.params.values())
    finally:
        if own.device_transport is not None:
            own.device_transport.close()
        own.mpi.Free()
        fake_cupy.shutdown()
