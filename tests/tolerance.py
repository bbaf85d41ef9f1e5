"""The contract's tolerance rule (FlashAttention's), shared by the contract suite and the search.

A result is right when the error of each output against the float64 reference is at most 2x
(float64) or 3x (float32, float16, bfloat16) the error of a plain same-dtype attention (the
*baseline*: torch autograd, NumPy where torch is absent), plus one rounding step of the output
and the allowances of :func:`allowances` (``lse``, ``D = rowsum(dout * out)``), the ranks'
partial sums (``hops``) and the blocked kernels' partial sums (``partials``): see
:func:`check` and the contract suite's docstring (tests/attention/test_contract.py), where
each term's evidence is told. Additive terms (ALiBi, a float ``attn_mask``: ``bias``) and a
softcap enter the baseline and the allowances as they enter the scores.

Shared pieces of the tests (imported as ``tolerance``; no test module imports another).
"""

import numpy as np

def dtype_of(name):
    """The numpy dtype named ``name`` (``bfloat16``: ml_dtypes', imported here)."""
    if name == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def eps_of(dt):
    """The machine epsilon of ``dt`` (bfloat16 too)."""
    if dt.name == "bfloat16":
        import ml_dtypes
        return float(ml_dtypes.finfo(dt).eps)
    return float(np.finfo(dt).eps)


def baseline(Q, K, V, dO, vis, dt, softcap=None, sinks=None, bias=None, scale=None,
             score_mod=None):
    """Plain attention in the inputs' dtype (torch autograd, else NumPy): the error to beat; with
    a ``softcap``, ``sinks``, an additive ``bias`` (float64 ``(B|1, H|1, N, M)``, -inf hides) or a
    ``score_mod`` (torch ops on the whole scores, as ``helpers.torch_reference`` takes it; its
    result kept in the dtype) too (torch only), and then also ``dsinks``."""
    try:
        import torch
    except ImportError:
        if softcap is not None or sinks is not None or bias is not None or score_mod is not None:
            raise
        return numpy_baseline(Q, K, V, dO, vis, dt)
    G = Q.shape[1] // K.shape[1]
    tdt = torch.bfloat16 if dt.name == "bfloat16" else None  # via float32: exact for bfloat16
    as_t = (lambda x: torch.from_numpy(x.astype(np.float32)).to(tdt)) if tdt is not None else (
        lambda x: torch.from_numpy(np.ascontiguousarray(x)))
    t = [as_t(x).requires_grad_(True) for x in (Q, K, V)]
    s = 1 / np.sqrt(Q.shape[-1]) if scale is None else scale
    Kr, Vr = t[1].repeat_interleave(G, dim=1), t[2].repeat_interleave(G, dim=1)
    S = (t[0] @ Kr.transpose(-1, -2)) * s
    if softcap is not None:
        S = softcap * torch.tanh(S / softcap)
    if score_mod is not None:
        idx = [torch.arange(n).reshape([-1 if a == axis else 1 for a in range(4)])
               for axis, n in enumerate(S.shape)]
        S = score_mod(S, *idx).to(S.dtype)
    vis = np.broadcast_to(vis, S.shape)
    if bias is not None:  # added in the inputs' dtype, as a same-dtype model would
        vis = vis & np.isfinite(bias)
        S = S + as_t(np.where(np.isfinite(bias), bias, 0.0).astype(np.float64 if tdt is None else np.float32)).to(S.dtype)
    mask = torch.from_numpy(vis.copy())
    S = S.masked_fill(~mask, float("-inf"))
    host_ = lambda x: x.detach().to(torch.float64).numpy() if tdt is not None else x.numpy()  # noqa: E731
    if sinks is not None:  # one more column in each row's softmax, not a key
        sk = as_t(np.asarray(sinks, dtype=dt)).requires_grad_(True)
        col = sk.view(1, -1, 1, 1).expand(*S.shape[:3], 1)
        lse = torch.logsumexp(torch.cat([S, col], -1), -1)
        out = torch.exp(S - lse[..., None]) @ Vr
        out.backward(as_t(dO))
        return (host_(out.detach()), host_(lse.detach()), host_(t[0].grad), host_(t[1].grad),
                host_(t[2].grad), host_(sk.grad))
    lse = torch.logsumexp(S.detach(), dim=-1)
    P = torch.softmax(S, dim=-1).nan_to_num(0.0)
    out = P @ Vr
    out.backward(as_t(dO))
    return (host_(out.detach()), host_(lse), host_(t[0].grad), host_(t[1].grad), host_(t[2].grad))


def numpy_baseline(Q, K, V, dO, vis, dt):
    """Plain attention in the inputs' dtype without torch: what a naive same-dtype autograd does.

    Every product is an unblocked ``einsum`` (float32 accumulation for float16, as torch's
    CPU kernels), every intermediate (scores, probabilities, ``dP``, ``dS``, row sums) is
    stored in ``dt``; the softmax subtracts the row maximum. Written apart from
    :func:`dense_attention` (float64 throughout), whose error would otherwise be the
    baseline's too.
    """
    acc = np.dtype(np.float32) if dt == np.float16 else dt
    G = Q.shape[1] // K.shape[1]
    Kr, Vr = np.repeat(K, G, axis=1), np.repeat(V, G, axis=1)
    one = lambda x: np.asarray(x).astype(dt)  # noqa: E731 - a value stored in the dtype

    def mm(sub, a, b):
        return one(np.einsum(sub, a.astype(acc), b.astype(acc)))

    s = dt.type(1 / np.sqrt(Q.shape[-1]))
    v4 = np.broadcast_to(vis, Q.shape[:3] + (K.shape[2],))
    seen = v4.any(-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        S = one(np.where(v4, mm("bhnd,bhmd->bhnm", Q, Kr) * s, -np.inf))
        m = one(np.where(seen, S.max(-1, keepdims=True, initial=-np.inf), 0))
        Pe = one(np.where(v4, np.exp(S - m), 0))
        l = one(Pe.sum(-1, keepdims=True))
        P = one(np.where(seen, Pe / np.where(seen, l, 1), 0))
        lse = one(np.where(seen, m + np.log(np.where(seen, l, 1)), -np.inf))[..., 0]
    out = mm("bhnm,bhme->bhne", P, Vr)
    dP = mm("bhne,bhme->bhnm", dO, Vr)
    D = one((dP * P).sum(-1, keepdims=True))
    dS = one(P * one(dP - D))
    dq = one(mm("bhnm,bhmd->bhnd", dS, Kr) * s)
    fold = lambda x: one(x.reshape(x.shape[0], K.shape[1], G, *x.shape[2:]).astype(acc).sum(2))  # noqa: E731
    dk = fold(one(mm("bhnm,bhnd->bhmd", dS, Q) * s))
    dv = fold(mm("bhnm,bhne->bhme", P, dO))
    return out, lse, dq, dk, dv


def allowances(Q, K, V, dO, vis, lse, softcap=None, sinks=None, bias=None, scale=None,
               score_mod=None):
    """What one rounding step moves, beyond the outputs' own (float64, per unit epsilon).

    In steps of the accumulation dtype:

    * ``lse``: ``1 + s |q| |k| + |bias| + 2 |lse|`` (a score's rounding: the rows' largest
      2-norms, the largest finite term added; and ``m + log(l)`` rounded twice at its own
      magnitude, which ``P = exp(y - lse)`` and ``exp(sink - lse)`` inherit: the search, a
      float64 ``dsinks`` of two queries 2 steps past the rule without it);
    * the backward's ``P = exp(y - lse)``, recomputed from ``lse`` (which the one-graph baseline
      never does), is off by one ``lse`` step relatively: ``dv`` moves by ``lse P^T |dO|``, and
      ``dS = P (dP - D)`` by ``lse P (|dO| |V| + |D|)`` (the rounding of a difference that may
      cancel), so ``dq`` by ``s |dS_err| |K|``, ``dk`` by ``s |dS_err|^T |Q|``, ``dsinks`` (its
      ``exp(sink - lse)``) by ``lse sum exp(sink - lse) |D|`` (seen by the search: float64
      ``dv`` of 4 queries on one key 2 steps off where the baseline was exact; ``dq`` of one
      query and key, with a sink, near 0 by cancellation);
    * the forward's online softmax rescales its terms by ``exp(m - m')``, the same step:
      ``out`` by ``lse P |V|`` (the search: an ``out`` near 0 by cancellation, 8 steps of its
      own tiny magnitude off).

    In steps of the inputs' dtype (keys ``"D:..."``): ``D = rowsum(dO * out)`` is formed from
    the ``out`` the forward returned, rounded to that dtype: one step of it per row,
    ``sum |dO * out|``, moves ``dq`` (``s D_err P |K|``), ``dk`` (``s P^T D_err |Q|``) and
    ``dsinks`` (``sum exp(sink - lse) D_err``; a softcap's ``1 - tanh^2 <= 1`` moves less)
    (the search: float16 ``dq`` of one query and key with a sink, 2.5 steps off).

    A ``score_mod`` (a ``mpiattn.ScoreMod``, its function and derivative on NumPy arrays) forms
    ``y = f(x)``: a score's rounding step is ``|f'| s |q| |k| + |y|``, and ``dS``'s error passes
    through ``f'``: the gradients' terms are multiplied by ``max |f'|``.
    """
    B, H, N, E = Q.shape
    G = H // K.shape[1]
    s = 1 / np.sqrt(E) if scale is None else scale
    Kr, Vr = (np.repeat(x.astype(np.float64), G, axis=1) for x in (K, V))
    Q, dO = Q.astype(np.float64), dO.astype(np.float64)
    added, slope = 0.0, 1.0
    with np.errstate(invalid="ignore", over="ignore"):
        S = s * Q @ Kr.swapaxes(-1, -2)
        if softcap is not None:
            S = softcap * np.tanh(S / softcap)
        if score_mod is not None:
            idx = np.ix_(*(np.arange(n) for n in S.shape))
            slope = float(np.abs(np.where(vis, score_mod.grad(S, *idx), 0.0)).max(initial=0.0))
            S = np.broadcast_to(score_mod.fn(S, *idx), S.shape)
            added = float(np.abs(np.where(vis, S, 0.0)).max(initial=0.0))
        if bias is not None:
            finite = np.isfinite(bias)
            vis = vis & finite
            S = S + np.where(finite, bias, 0.0)
            added += float(np.abs(np.where(finite, bias, 0.0)).max(initial=0.0))
        P = np.where(vis, np.exp(S - np.where(np.isfinite(lse), lse, 0)[..., None]), 0.0)
    d_row = np.abs(dO * (P @ Vr)).sum(-1, keepdims=True)
    fold = lambda x: x.reshape(B, K.shape[1], G, *x.shape[2:]).sum(2)  # noqa: E731
    top = lambda x: float(np.max(x, initial=0.0))  # noqa: E731
    qn, kn = np.sqrt((Q ** 2).sum(-1)).max(initial=0), np.sqrt((Kr ** 2).sum(-1)).max(initial=0)
    # (and lse = m + log(l) rounds twice at its own magnitude: P's and exp(sink - lse)'s share)
    lse_mag = float(np.abs(lse[np.isfinite(lse)]).max(initial=0.0))
    step = 1.0 + max(slope, 1.0) * s * qn * kn + added + 2 * lse_mag
    # dS = P (dP - D): its rounding is relative to |dP| + |D| (which may cancel), not to dS
    g = P * (np.abs(dO) @ np.abs(Vr).swapaxes(-1, -2) + d_row) * max(slope, 1.0)
    pd = P * d_row * max(slope, 1.0)
    out = {"lse": step, "out": step * top(P @ np.abs(Vr)),
           "dq": step * s * top(g @ np.abs(Kr)), "D:dq": s * top(pd @ np.abs(Kr)),
           "dk": step * s * top(fold(g.swapaxes(-1, -2) @ np.abs(Q))),
           "D:dk": s * top(fold(pd.swapaxes(-1, -2) @ np.abs(Q))),
           "dv": step * top(fold(P.swapaxes(-1, -2) @ np.abs(dO)))}
    if sinks is not None:
        ds = top((np.exp(sinks[None, :, None] - lse) * d_row[..., 0]).sum((0, 2)))
        out["dsinks"], out["D:dsinks"] = step * ds, ds
    return out


def check(dtype, got, ref, base, extra, *, N, M, H, Hkv, block=None, hops=0, sinks=None):
    """FlashAttention's rule: one rounding step of an output is the dtype's epsilon at its
    largest magnitude (``lse``, ``D``: :func:`allowances`); ``hops`` more steps of the
    accumulation dtype for ``dk``, ``dv`` and ``dsinks`` (summed on that many more ranks), and
    one for each partial sum of a gradient beyond the first (its blocks of ``block`` rows, its
    heads). ``got``, ``ref``, ``base``: ``(out, lse, dq, dk, dv[, dsinks])`` of the call, the
    float64 reference and :func:`baseline`. Raises AssertionError naming the output."""
    dt = dtype_of(dtype) if isinstance(dtype, str) else np.dtype(dtype)
    factor = 2.0 if dt == np.float64 else 3.0
    eps = eps_of(dt)
    eps_acc = float(np.finfo(np.float64 if dt == np.float64 else np.float32).eps)
    out, lse, dq, dk, dv = got[:5]
    r_out, r_lse, r_dq, r_dk, r_dv = ref[:5]
    b_out, b_lse, b_dq, b_dk, b_dv = (np.asarray(x, dtype=np.float64) for x in base[:5])
    # Blocked sums: each key block's part of dq, each query block's and (GQA) each query head's
    # part of dk and dv, is rounded once in the accumulation dtype before it is added (the plain
    # baseline sums in one kernel); one step of each beyond the first
    blocks = lambda n: -(-n // block) if block else 1  # noqa: E731
    kv_parts = blocks(N) - 1 + H // Hkv - 1
    partials = {"out": 0, "dq": blocks(M) - 1, "dk": kv_parts, "dv": kv_parts, "dsinks": 0}
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(r_lse))
    fin = np.isfinite(r_lse)
    lse_err = float(np.abs(lse[fin] - r_lse[fin]).max(initial=0.0))
    lse_base = float(np.abs(b_lse[fin] - r_lse[fin]).max(initial=0.0))
    lse_step = eps_acc * extra["lse"]  # lse is float32 at least (two steps of its own magnitude
    # included: m + log(l), the search's 3 keys 2 steps off an exact baseline); one more for each
    # merge of partial rows (key blocks, ranks: m + log(l) rounded again; the search: 3 ranks'
    # 34 keys, 4 steps off)
    merged = (hops + partials["dq"]) * float(np.abs(r_lse[fin]).max(initial=0.0))
    lse_step += eps_acc * merged
    # what inherits lse's error (P = exp(y - lse), exp(sink - lse)) inherits the merges' too (the
    # search: dsinks of one query over 35 key blocks of one row)
    grow = 1.0 + merged / extra["lse"]
    assert lse_err <= factor * lse_base + lse_step, \
        f"lse: error {lse_err:.3g} > {factor:g} x baseline {lse_base:.3g} + rounding {lse_step:.3g}"
    named = [("out", out, r_out, b_out), ("dq", dq, r_dq, b_dq), ("dk", dk, r_dk, b_dk),
             ("dv", dv, r_dv, b_dv)]
    if sinks is not None:
        named.append(("dsinks", got[5], ref[5], np.asarray(base[5], dtype=np.float64)))
    for name, x, r, b in named:
        x = np.asarray(x, dtype=np.float64)
        assert np.isfinite(x).all(), f"{name} has NaN/Inf"
        err = float(np.abs(x - r).max(initial=0.0))
        base_err = float(np.abs(b - r).max(initial=0.0))
        step = eps * float(np.abs(r).max(initial=0.0))
        d_step = eps_acc * grow * extra.get(name, 0.0) + eps * extra.get(f"D:{name}", 0.0)
        if name in ("dk", "dv", "dsinks"):
            d_step += hops * eps_acc * float(np.abs(r).max(initial=0.0))
        d_step += partials[name] * eps_acc * float(np.abs(r).max(initial=0.0))
        assert err <= factor * base_err + step + d_step, (
            f"{name}: error {err:.3g} > {factor:g} x baseline {base_err:.3g} + rounding {step:.3g}"
            f" + D step {d_step:.3g}")
