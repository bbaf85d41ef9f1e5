"""NumPy twins of mpiattn's CUDA kernels for the fake CuPy (``tests/fake_cupy.py``).

Each twin reads its arguments as the kernel does: device arrays arrive as raw
pointers and are viewed with the layout the kernel assumes (written here from
the kernels' documented contract in ``mpiattn/kernels/fused.py``, not from its
array code), one block per row. A caller that passes a wrong stride, offset
or count gets wrong numbers, as on a GPU.
"""

import numpy as np

import fake_cupy
from fake_cupy import view

def _scores(S, R, K, ld, rows, acc, bias, ld_bias, hkv, band, q0, k0, lo, hi, group):
    """The (rows, K) scores with the padding bias and the band applied."""
    s = view(S, acc, (rows, K), (ld, 1)).astype(acc)
    idx = np.arange(rows)
    bh, r = idx // R, idx % R
    if bias:
        b = bh // hkv
        s = s + view(bias, acc, (int(b.max()) + 1, K), (ld_bias, 1))[b]
    if band:
        d = (k0 + np.arange(K))[None, :] - (q0 + r // group)[:, None]
        s = np.where((d >= lo) & (d <= hi), s, acc(-np.inf))
    return s, bh, r


def _softmax_fwd(grid, block, args, acc, op):
    (S, P, m, l, O, bias, R, K, ld, ld_m, Ev, ld_o, ld_obh, hkv, ld_bias,
     q0, k0, lo, hi, group, band) = args
    rows = int(grid[0])
    R, K, ld, ld_m, Ev, ld_o, ld_obh, hkv, ld_bias = (int(x) for x in (R, K, ld, ld_m, Ev, ld_o, ld_obh,
                                                                      hkv, ld_bias))
    s, bh, r = _scores(S, R, K, ld, rows, acc, int(bias), ld_bias, hkv, int(band), int(q0), int(k0),
                       int(lo), int(hi), int(group))
    mi = bh * ld_m + r
    mv = view(m, acc, (int(mi.max()) + 1,))
    lv = view(l, acc, (int(mi.max()) + 1,))
    m_old = mv[mi].copy()
    with np.errstate(invalid="ignore", over="ignore"):
        m_new = np.maximum(m_old, s.max(axis=1) if K else np.full(rows, -np.inf, acc))
        shift = np.where(np.isneginf(m_new), acc(0), m_new)
        e = np.exp(s - shift[:, None])
        alpha = np.exp(m_old - shift)
    view(P, op, (rows, K), (ld, 1))[...] = e.astype(op)
    oi = bh[:, None] * ld_obh + r[:, None] * ld_o + np.arange(Ev)[None, :]
    ov = view(O, acc, (int(oi.max()) + 1,)) if Ev else None
    if Ev:
        ov[oi] = ov[oi] * alpha[:, None]
    lv[mi] = alpha * lv[mi] + e.sum(axis=1)
    mv[mi] = m_new


def _softmax_bwd(grid, block, args, acc, op):
    (S, dP, P, dS, lse, D, bias, R, K, ld, ld_m, hkv, ld_bias, q0, k0, lo, hi, group, band) = args
    rows = int(grid[0])
    R, K, ld, ld_m, hkv, ld_bias = (int(x) for x in (R, K, ld, ld_m, hkv, ld_bias))
    s, bh, r = _scores(S, R, K, ld, rows, acc, int(bias), ld_bias, hkv, int(band), int(q0), int(k0),
                       int(lo), int(hi), int(group))
    mi = bh * ld_m + r
    L = view(lse, acc, (int(mi.max()) + 1,))[mi]
    d = view(D, acc, (int(mi.max()) + 1,))[mi]
    dead = np.isneginf(L)
    with np.errstate(invalid="ignore", over="ignore"):
        e = np.where(dead[:, None], acc(0), np.exp(s - np.where(dead, acc(0), L)[:, None]))
    dp = view(dP, acc, (rows, K), (ld, 1)).astype(acc)
    g = e * (dp - d[:, None])
    view(P, op, (rows, K), (ld, 1))[...] = e.astype(op)
    view(dS, op, (rows, K), (ld, 1))[...] = g.astype(op)


_OPS = {"__half": np.float16, "float": np.float32, "double": np.float64}


def _register():
    def make(fn):
        def run(grid, block, args, kernel=None):
            code = kernel.code
            t = "double" if "typedef double T;" in code else "float"
            tp = next(k for k in _OPS if f"typedef {k} TP;" in code)
            return fn(grid, block, args, _OPS[t], _OPS[tp])
        return run

    fake_cupy.KERNELS["mpiattn_softmax_fwd"] = make(_softmax_fwd)
    fake_cupy.KERNELS["mpiattn_softmax_bwd"] = make(_softmax_bwd)


_register()
