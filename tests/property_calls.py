"""Calls of the whole contract, drawn by hypothesis; each run on every rank and judged there.

:func:`calls` draws a :class:`Call`: shapes (GQA and MQA, ``N != M``, ``Ev != E``, empty
shards), a dtype, the rules (causal both ways, windows, documents, padding), every score
modifier alone or together (softcap, ALiBi, a bool or float ``attn_mask`` of every broadcast
shape, ``mask_mod`` of every broadcast form and the named rules, sinks, ``max_logit``), the
layouts (named, balanced, explicit with ranges out of order and empty shards), the block
size, the one-shot call or a plan, and last a strategy and an engine that declare they run
it. Some draws make ranks differ in what their own rows hide: an ``attn_mask`` hiding every
row of one rank, a rank with no rows.

:func:`judge` runs a call on this rank (forward, backward, ``max_logit``) and compares the
gathered results with the float64 reference of the tests (torch autograd,
``helpers.torch_reference``) under the contract's tolerance rule (``tolerance.check``); it
returns None or the reason the call failed here, and never raises, so that the caller can
agree on the verdict of every rank before the test framework sees it.

A failing call prints as a runnable reproduction::

    mpiexec -n P python tests/property_calls.py "Call(...)"

Shared pieces of the tests (no test module imports another).
"""

from __future__ import annotations

import sys
import traceback
from dataclasses import dataclass, replace

import numpy as np

#: ``mask_mod`` functions by name, each reading some indices only (a rule may ignore any), and
#: the named rules (``"chunked:7"``: :func:`mpiattn.masks.mods.parse`).
MASK_MODS = {
    "key-only": lambda b, h, q, kv: kv % 3 != 0,
    "head-key": lambda b, h, q, kv: (kv + h) % 3 != 0,
    "query-only": lambda b, h, q, kv: q % 4 != 1,
    "batch-query": lambda b, h, q, kv: (q + b) % 3 != 0,
    "batch-head": lambda b, h, q, kv: (b + h) % 2 == 0,
    "noop": lambda b, h, q, kv: np.asarray(True),
    "none-visible": lambda b, h, q, kv: kv < 0,
    "every-index": lambda b, h, q, kv: ((q - kv) % 5 != 0) | (b == h),
}
NAMED_RULES = ("chunked", "prefix_lm", "streaming")


def _score_mods():
    """``score_mod``s by name: ``(mpiattn.ScoreMod on NumPy, the same in torch ops)`` (built on
    first use: torch imported then)."""
    import torch

    from mpiattn import ScoreMod

    from mpiattn.backend import array_module

    temp = 0.5 + 0.2 * np.arange(9)
    tab = np.sin(np.arange(9 * 128, dtype=np.float64)).reshape(9, 128)  # a relative-position bias
    t_temp, t_tab, t_tau = torch.tensor(temp), torch.tensor(tab), torch.tensor(TAU)
    rel, t_rel = REL_TABLE, torch.tensor(REL_TABLE)
    tau = TAU

    def here(table, like):  # the table where the scores are (NumPy, or the device under CuPy)
        return array_module(like).asarray(table)

    return {
        "temperature": (ScoreMod(lambda s, b, h, q, kv: s * here(temp, s)[h],
                                 lambda s, b, h, q, kv: here(temp, s)[h] + 0 * s),
                        lambda s, b, h, q, kv: s * t_temp[h]),
        "relative-bias": (ScoreMod(lambda s, b, h, q, kv: s + here(tab, s)[h, (q - kv) % 128],
                                   lambda s, b, h, q, kv: np.ones_like(s)),
                          lambda s, b, h, q, kv: s + t_tab[h, (q - kv) % 128]),
        "cap": (ScoreMod(lambda s, b, h, q, kv: 3 * np.tanh(s / 3), lambda s, b, h, q, kv: 1 - np.tanh(s / 3) ** 2),
                lambda s, b, h, q, kv: 3 * torch.tanh(s / 3)),
        "per-head-temperature": (ScoreMod(lambda s, b, h, q, kv: s / here(tau, s)[h],
                                          lambda s, b, h, q, kv: 1 / here(tau, s)[h] + 0 * s),
                                 lambda s, b, h, q, kv: s / t_tau[h]),
        "batch-square": (ScoreMod(lambda s, b, h, q, kv: s * (1 + b) - 0.05 * s * s,
                                  lambda s, b, h, q, kv: (1 + b) - 0.1 * s),
                         lambda s, b, h, q, kv: s * (1 + b) - 0.05 * s * s),
        "relative-bias-table": (ScoreMod(lambda s, b, h, q, kv: s + here(rel, s)[h, q - kv + REL_OFFSET],
                                         lambda s, b, h, q, kv: np.ones_like(s)),
                                lambda s, b, h, q, kv: s + t_rel[h, q - kv + REL_OFFSET]),
    }


SCORE_MODS = ("temperature", "relative-bias", "cap", "batch-square", "per-head-temperature",
              "relative-bias-table")
#: Per-head temperatures of at most 9 heads (the draws' most).
TAU = 0.6 + 0.15 * np.arange(9)
#: A relative-position bias of at most 9 heads covering every ``q - kv`` of the draws (N, M <= 40).
REL_OFFSET = 40
REL_TABLE = np.cos(0.37 * np.arange(9 * 80, dtype=np.float64)).reshape(9, 80)


def _relative_bias(call):
    from mpiattn import RelativeBias

    return {"score_mod": RelativeBias(REL_TABLE[:call.H], REL_OFFSET)}


#: score_mods the library is given in a form of its own (a :class:`mpiattn.Score` field, or a
#: library transform; the ScoreMod of the same name is the reference's and the tolerance's form
#: of it).
AS_MODIFIER = {"per-head-temperature": lambda call: {"temperature": TAU[:call.H]},
               "relative-bias-table": _relative_bias}
_SCORE_MOD_OBJECTS: dict = {}


def score_mod(call):
    """The call's ``(ScoreMod, torch form)``, or None (the same objects for every call)."""
    if call.score_mod is None:
        return None
    if not _SCORE_MOD_OBJECTS:
        _SCORE_MOD_OBJECTS.update(_score_mods())
    return _SCORE_MOD_OBJECTS[call.score_mod]


@dataclass(frozen=True)
class Call:
    """One drawn call (global sizes; ``layout``/``kv_layout``: a name or explicit ranges per rank)."""

    P: int
    seed: int
    dtype: str = "float64"
    B: int = 1
    H: int = 1
    Hkv: int = 1
    N: int = 8
    M: int = 8
    E: int = 4
    Ev: int = 4
    scale: float | None = None
    causal: bool | str = False
    window: tuple | None = None
    docs: bool = False
    pad: bool = False
    layout: object = "contiguous"
    kv_layout: object = None
    block: int | None = None
    softcap: float | None = None
    alibi: str | None = None            # None, "H" or "BH": the slopes' shape
    attn_mask: tuple | None = None      # (kind, batch axis, head axis, what it hides)
    mask_mod: str | None = None         # a key of MASK_MODS or "rule:PARAMS"
    score_mod: str | None = None        # a name of SCORE_MODS (not with a softcap)
    sinks: bool = False
    max_logit: bool = False
    api: str = "call"                   # the one-shot calls, or a plan made once
    strategy: str = "auto"
    engine: str = "auto"


# ------------------------------------------------------------------ the draw
def calls(topology):
    """The hypothesis strategy of a :class:`Call` on ``topology`` (a
    :class:`mpiattn.comm.topology.Topology`: its rank count, and its nodes for the strategies
    placed by node)."""
    from hypothesis import strategies as st

    return st.composite(_draw)(topology)


def _ranges(draw, st, n, P):
    """Explicit ranges of ``n`` rows for ``P`` ranks: cut into up to 3P pieces (some ranks may get
    none), dealt to the ranks at random, each rank's pieces in global order, reversed (out of
    order) or shuffled."""
    pieces = draw(st.integers(min_value=1, max_value=3 * P))
    cuts = sorted(draw(st.lists(st.integers(0, n), min_size=pieces - 1, max_size=pieces - 1)))
    bounds = [0, *cuts, n]
    spans = [(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    owners = draw(st.lists(st.integers(0, P - 1), min_size=len(spans), max_size=len(spans)))
    out = []
    for r in range(P):
        mine = [s for s, o in zip(spans, owners) if o == r]
        order = draw(st.sampled_from(["reversed", "sorted", "shuffled"]))
        if order == "reversed":
            mine = mine[::-1]
        elif order == "shuffled" and len(mine) > 1:
            mine = list(draw(st.permutations(mine)))
        out.append(tuple(mine))
    return tuple(out)


def _layout(draw, st, n, P, balanced):
    kinds = ["contiguous", "zigzag", "explicit"] + (["balanced"] if balanced else [])
    kind = draw(st.sampled_from(kinds))
    return _ranges(draw, st, n, P) if kind == "explicit" else kind


def _draw(draw, topology):
    from hypothesis import strategies as st

    P = topology.P
    dtype = draw(st.sampled_from(["float64", "float64", "float32", "float16", "bfloat16"]))
    Hkv = draw(st.integers(1, 3))
    H = Hkv * draw(st.integers(1, 3))
    B = draw(st.integers(1, 2))
    N = draw(st.integers(1, 40))
    M = N if draw(st.booleans()) else draw(st.integers(1, 40))
    E = draw(st.sampled_from([1, 3, 4, 8, 16]))
    Ev = E if draw(st.booleans()) else draw(st.sampled_from([1, 2, 5, 8]))
    causal = draw(st.sampled_from([False, True, "bottom-right"]))
    # a quarter of the draws keep to what every engine declares (the torch engine: causal and
    # padding, ALiBi, attn_mask, mask_mod), so that it is drawn too
    every_engine = draw(st.integers(0, 3)) == 0
    window = None
    if not every_engine and draw(st.booleans()):
        bound = st.one_of(st.none(), st.integers(0, 12))
        window = (draw(bound), draw(bound))
        if window == (None, None):
            window = None
    docs, pad = not every_engine and draw(st.booleans()), draw(st.booleans())
    layout = _layout(draw, st, N, P, balanced=True)
    kv_layout = None
    if N != M or not isinstance(layout, str) or layout == "balanced" or draw(st.booleans()):
        kv_layout = _layout(draw, st, M, P, balanced=False)
        if N == M and kv_layout == layout:
            kv_layout = None
    mask = None
    if draw(st.booleans()):
        kind = draw(st.sampled_from(["float", "bool"]))
        # (a float mask hides only where it is -inf: on one rank's rows, the kind of call whose
        # hiding some ranks alone can see; drawn most)
        hides = draw(st.sampled_from(["rank", "some", "rank", "none"] if kind == "float" else ["some", "rank"]))
        mask = (kind, draw(st.sampled_from([1, B])), draw(st.sampled_from([1, H])), hides,
                draw(st.integers(0, P - 1)))
    mod = None
    if draw(st.booleans()):
        mod = draw(st.sampled_from(sorted(MASK_MODS) + list(NAMED_RULES)))
        if mod == "chunked":
            mod = f"chunked:{draw(st.integers(1, 12))}"
        elif mod == "prefix_lm":
            mod = f"prefix_lm:{draw(st.integers(0, 12))}"
        elif mod == "streaming":
            mod = f"streaming:{draw(st.integers(0, 4))},{draw(st.integers(0, 8))}"
    softcap = None if every_engine else draw(st.one_of(st.none(), st.sampled_from([0.5, 2.0, 20.0])))
    smod = None
    if softcap is None and not every_engine and draw(st.integers(0, 2)) == 0:
        smod = draw(st.sampled_from(SCORE_MODS))
    call = Call(
        P=P, seed=draw(st.integers(0, 2**31 - 1)), dtype=dtype, B=B, H=H, Hkv=Hkv, N=N, M=M, E=E,
        Ev=Ev, scale=draw(st.one_of(st.none(), st.sampled_from([0.3, 1.0, 2.0]))), causal=causal,
        window=window, docs=docs, pad=pad, layout=layout, kv_layout=kv_layout,
        block=draw(st.one_of(st.none(), st.integers(1, 16))),
        softcap=softcap, score_mod=smod,
        alibi=draw(st.sampled_from([None, "H", "BH"])), attn_mask=mask, mask_mod=mod,
        sinks=draw(st.booleans()), max_logit=not every_engine and draw(st.booleans()),
        api=draw(st.sampled_from(["call", "plan"])))
    strategy = draw(st.sampled_from(_supported_strategies(call, topology)))
    engines = _supported_engines(call)
    return replace(call, strategy=strategy, engine=draw(st.sampled_from(engines)))


def _spec(call, strategy="auto", engine="auto"):
    from mpiattn.strategies import AttentionSpec, Options
    from tolerance import dtype_of

    opts = Options(causal=call.causal, window=call.window, strategy=strategy, engine=engine,
                   block_size=call.block, scale=call.scale)
    return AttentionSpec.from_shapes(
        (call.B, call.H, call.N, call.E), (call.B, call.Hkv, call.M, call.E),
        (call.B, call.Hkv, call.M, call.Ev), dtype_of(call.dtype),
        opts, padding=call.pad, segments=call.docs, kv_segments=call.docs and _kv_ids(call),
        alibi=call.alibi is not None, attn_mask=None if call.attn_mask is None else call.attn_mask[0],
        mask_mod=call.mask_mod is not None, sinks=call.sinks, score_mod=call.score_mod is not None,
        softcap=call.softcap, max_logit=call.max_logit)


def _supported_strategies(call, topology):
    from mpiattn.strategies import registry

    spec = _spec(call)
    ok = [s for s in registry.variants(call.P) if ("ring-first" not in s or topology.n_nodes > 1)
          and registry.get(s).supports(spec, topology) is None]
    return ["auto", *ok]


def _supported_engines(call):
    from mpiattn.kernels import engines

    spec = _spec(call)
    names = ["auto"]
    for name, e in engines.ENGINES.items():
        if e.supports(spec) is None and e.usable("numpy") is None:
            names.append(name)
    return names


def _kv_ids(call):
    """The keys need ids of their own (else they take the queries')."""
    return call.N != call.M or call.kv_layout is not None


# ------------------------------------------------------------------ the arrays and the reference
def arrays(call):
    """The call's global arrays (the same on every rank): a dict."""
    from tolerance import dtype_of

    rng = np.random.default_rng(call.seed)
    dt = dtype_of(call.dtype)
    B, H, Hkv, N, M = call.B, call.H, call.Hkv, call.N, call.M
    a = {"Q": rng.standard_normal((B, H, N, call.E)).astype(dt),
         "K": rng.standard_normal((B, Hkv, M, call.E)).astype(dt),
         "V": rng.standard_normal((B, Hkv, M, call.Ev)).astype(dt),
         "dO": rng.standard_normal((B, H, N, call.Ev)).astype(dt)}
    if call.docs:
        a["seg_q"] = np.sort(rng.integers(0, max(2, N // 5), (B, N)), axis=1)
        a["seg_k"] = np.sort(rng.integers(0, max(2, M // 5), (B, M)), axis=1) if _kv_ids(call) else a["seg_q"]
    if call.pad:
        a["pad"] = rng.random((B, M)) < 0.3
        if B > 1:
            a["pad"][-1] = True  # a batch entry with no key at all
    if call.attn_mask is not None:
        kind, mb, mh, hides, who = call.attn_mask
        shape = (mb, mh, N, M)
        m = rng.random(shape) > 0.3 if kind == "bool" else rng.standard_normal(shape)
        if kind == "float" and hides == "some":
            m[rng.random(shape) < 0.25] = -np.inf
        if hides == "rank":  # every row of one rank hidden: a decision its own rows make
            for g, ln in _segments(call, N, call.layout)[who]:
                m[:, :, g:g + ln] = False if kind == "bool" else -np.inf
        a["mask"] = m
    if call.alibi is not None:
        a["slopes"] = rng.uniform(0.05, 0.6, (H,) if call.alibi == "H" else (B, H))
    if call.sinks:
        a["sinks"] = rng.standard_normal(H)
    return a


def mask_mod(call):
    """The call's ``mask_mod`` (the same object's code on every rank), or None."""
    if call.mask_mod is None:
        return None
    if call.mask_mod in MASK_MODS:
        return MASK_MODS[call.mask_mod]
    from mpiattn.masks import mods

    return mods.parse(call.mask_mod)


def _layout_of(call, spec, n):
    import mpiattn

    if spec is None:
        return None
    if isinstance(spec, tuple):
        return mpiattn.Layout([list(r) for r in spec])
    if spec == "balanced":
        seg = arrays(call).get("seg_q") if call.docs and not _kv_ids(call) else None
        return mpiattn.balance(n, call.P, causal=call.causal, window=call.window, segment_ids=seg,
                               **({"m": call.M} if call.M != call.N else {}))
    return spec


def _segments(call, n, spec):
    from mpiattn.layouts import all_segments

    return all_segments(n, call.P, _layout_of(call, spec, n))


def reference(call, a):
    """``(ref, base, extra, vis, bias)``: torch autograd's float64 reference (out, lse, dq, dk, dv,
    dsinks, max_logit), the same-dtype baseline and the rule's allowances."""
    from helpers import torch_reference, visible_matrix
    from tolerance import allowances, baseline, dtype_of

    B, H, N, M = call.B, call.H, call.N, call.M
    vis = visible_matrix(B, N, M, call.causal, call.window, a.get("seg_q"), a.get("seg_k"),
                         a.get("pad"))[:, None]
    fn = mask_mod(call)
    if fn is not None:
        b, h, i, j = np.ix_(np.arange(B), np.arange(H), np.arange(N), np.arange(M))
        vis = vis & np.broadcast_to(fn(b, h, i, j), (B, H, N, M))
    bias = None
    if "mask" in a:
        if a["mask"].dtype == np.bool_:
            vis = vis & a["mask"]
        else:
            bias = a["mask"]
    if "slopes" in a:
        d = M - N if call.causal == "bottom-right" else 0
        dist = np.abs(np.arange(N)[:, None] + d - np.arange(M)[None, :])
        slopes = a["slopes"] if a["slopes"].ndim == 2 else a["slopes"][None]
        alibi = -slopes[:, :, None, None] * dist
        bias = alibi if bias is None else bias + alibi
    vis = np.broadcast_to(vis, (B, H, N, M))
    sinks = a.get("sinks")
    smod = score_mod(call)
    ref = torch_reference(a["Q"], a["K"], a["V"], a["dO"], vis, scale=call.scale,
                          softcap=call.softcap, bias=bias, sinks=sinks,
                          score_mod=None if smod is None else smod[1])
    dt = dtype_of(call.dtype)
    base = baseline(a["Q"], a["K"], a["V"], a["dO"], vis, dt, call.softcap, sinks, bias, call.scale,
                    None if smod is None else smod[1])
    extra = allowances(a["Q"], a["K"], a["V"], a["dO"], vis, ref[1], call.softcap, sinks, bias,
                       call.scale, None if smod is None else smod[0])
    return ref, base, extra


# ------------------------------------------------------------------ one run, judged
def _run(call, comm, a):
    """This rank's part of the call; the gathered ``(out, lse, dq, dk, dv[, dsinks])`` and
    ``max_logit`` (or None)."""
    import mpiattn

    from helpers import host

    lay = _layout_of(call, call.layout, call.N)
    kv_lay = _layout_of(call, call.kv_layout, call.M)
    kl = lay if kv_lay is None else kv_lay
    sq = lambda x, axis=-2: mpiattn.shard(x, axis=axis, layout=lay, comm=comm)  # noqa: E731
    sk = lambda x, axis=-2: mpiattn.shard(x, axis=axis, layout=kl, comm=comm)  # noqa: E731
    q, k, v, do = sq(a["Q"]), sk(a["K"]), sk(a["V"]), sq(a["dO"])
    kw = dict(causal=call.causal, window=call.window, scale=call.scale, layout=lay,
              kv_layout=kv_lay, strategy=call.strategy, engine=call.engine,
              block_size=call.block, softcap=call.softcap, max_logit=call.max_logit)
    scores = {}
    if "pad" in a:
        scores["key_padding_mask"] = sk(a["pad"], -1)
    if "seg_q" in a:
        scores["segment_ids"] = sq(a["seg_q"], -1)
        if _kv_ids(call):
            scores["kv_segment_ids"] = sk(a["seg_k"], -1)
    if "mask" in a:
        scores["attn_mask"] = sq(a["mask"])
    if "slopes" in a:
        scores["alibi_slopes"] = a["slopes"]
    if "sinks" in a:
        scores["sinks"] = a["sinks"]
    if call.mask_mod is not None:
        scores["mask_mod"] = mask_mod(call)
    if call.score_mod in AS_MODIFIER:
        scores["score"] = mpiattn.Score(**AS_MODIFIER[call.score_mod](call))
    elif call.score_mod is not None:
        scores["score_mod"] = score_mod(call)[0]
    used: dict = {}
    if call.api == "plan":
        plan = mpiattn.plan_attention(q, k, v, comm, **scores, **kw)
        pad = {"key_padding_mask": scores["key_padding_mask"]} if "pad" in a else {}
        out, lse = plan.forward(q, k, v, details=used, **pad)
        grads = plan.backward(do, q, k, v, out, lse, **pad)
    else:
        out, lse = mpiattn.attention(q, k, v, comm, details=used, **scores, **kw)
        grads = mpiattn.attention_backward(do, q, k, v, out, lse, comm, **scores, **kw)
    gq = lambda x, axis=-2: host(mpiattn.gather(x, axis=axis, layout=lay, root=None, comm=comm))  # noqa: E731
    gk = lambda x: host(mpiattn.gather(x, layout=kl, root=None, comm=comm))  # noqa: E731
    got = (gq(out), gq(lse, -1), gq(grads[0]), gk(grads[1]), gk(grads[2]), *map(host, grads[3:]))
    return got, used.get("max_logit")


def judge(call, comm):
    """None when the call is right on this rank, else why not (never raises)."""
    try:
        a = arrays(call)
        got, top = _run(call, comm, a)
        return verdict(call, a, got, top)
    except Exception as exc:  # noqa: BLE001 - a verdict, agreed by the caller
        return f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=-6)}"


def verdict(call, a, got, top):
    """Compare ``got`` (gathered) and ``max_logit`` with the reference: None or the failure."""
    from tolerance import check, eps_of, dtype_of

    ref, base, extra = reference(call, a)
    try:
        assert len(got) == 5 + call.sinks, f"{len(got)} results"
        check(call.dtype, got, ref, base, extra, N=call.N, M=call.M, H=call.H, Hkv=call.Hkv,
              block=call.block, hops=call.P - 1, sinks=a.get("sinks"))
        if call.max_logit:
            want = ref[6]
            assert top is not None and top.shape == (call.H,), "no max_logit"
            assert np.array_equal(np.isneginf(top), np.isneginf(want)), ("max_logit", top, want)
            fin = np.isfinite(want)
            acc = eps_of(np.dtype(np.float64 if dtype_of(call.dtype) == np.float64 else np.float32))
            err = float(np.abs(top[fin] - want[fin]).max(initial=0.0))
            assert err <= 4 * acc * extra["lse"] * max(call.E, 1), f"max_logit: error {err:.3g}"
    except AssertionError as exc:
        return f"AssertionError: {exc}"
    return None


def reproduction(call):
    """The command that runs ``call`` again (from the checkout's root)."""
    return f'mpiexec -n {call.P} python tests/property_calls.py "{call!r}"'


def main(text):
    """Run one call (its repr) on every rank of COMM_WORLD and print each rank's verdict."""
    import os

    from mpi4py import MPI

    from mpiattn.comm import get_comm

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    call = eval(text, {"Call": Call})  # noqa: S307 - the reproduction of a test's own draw
    comm = get_comm(MPI.COMM_WORLD)
    print(f"rank {comm.rank}: {judge(call, comm) or 'right'}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
