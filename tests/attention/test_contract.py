"""The shared contract: every registered strategy, with every engine that declares the case.

Strategies and engines come from their registries (:data:`mpiattn.strategies.registry.STRATEGIES`,
:data:`mpiattn.kernels.engines.ENGINES`): one added there is tested here with no new
test code, on every case it declares it supports (the others are left out at collection,
each with its own reason: :data:`LEFT_OUT`). Each case runs forward and backward on sharded inputs and is compared, on the
gathered arrays, with the tests' float64 reference (``helpers.dense_attention``) under
FlashAttention's rule: the error of each output is at most 2x (float64) or 3x
(float32, float16, bfloat16) the error of a plain same-dtype attention computed by torch
(NumPy where torch is absent; bfloat16 cases need torch and ml_dtypes), plus one rounding
step of the output (``lse``: of float32 at least, its dtype for float16 inputs); for
``dq`` and ``dk`` also
one rounding step of ``D = rowsum(dout * out)``, which the plain baseline does not form
and which shows where a row's softmax is one-hot (e.g. ``window=(0, 0)``); for ``dk`` and
``dv`` also one rounding step of the accumulation dtype per rank their partial sums pass
through (``P - 1``: the ring's travelling accumulators, the gathers' reductions; seen on two
real hosts, 2 x 2 ranks in blocks, float64 ``dv`` of the double ring 6 steps off where the
rule without them allowed 5.2); and one such step for every partial sum of a gradient beyond
the first, which the blocked kernels round before adding and the one-kernel baseline does not
(``dq``: its key blocks; ``dk``, ``dv``: their query blocks and, with GQA, the query heads of
a key/value head). Seen on an Intel Xeon (AVX-512, OpenBLAS SkylakeX): the torch engine's
float64 ``dq`` 11 steps off at 4 ranks (``plain-f64``, 6 key blocks) where the rule without
them allowed 10.7, on the code before and after the score modifiers; the fake CuPy's float64
``dv`` of an MQA case (9 query heads) 5.3 steps off where it allowed 4.2.

The matrix: dtypes (bfloat16 as ``ml_dtypes.bfloat16`` arrays: the inputs rounded to
bfloat16, the reference computed from those rounded values in float64), masks (causal, windows, documents, padding, fully masked rows),
layouts (named, explicit, balanced), GQA/MQA, uneven and empty shards, N != M; and a
sample of FlashAttention's own test grid (sequence-length pairs, head dims 32..256,
9 query heads on 9, 3 or 1 key/value heads, random windows; arithmetic with no communication
path of its own, so at 1 and 2 ranks of one node, and on CI's two hosts), some of its cases again with a
softcap and learnable sinks (FlashAttention 3/4's ``softcap`` and ``learnable_sink``), whose
reference is torch autograd (``helpers.torch_reference``), ``dsinks`` included and held to
the same rule.
"""

import functools
import hashlib
import os
import pickle
from dataclasses import dataclass, field, replace

import numpy as np
import pytest

import mpiattn
from mpiattn.comm import get_comm
from mpiattn.kernels import engines
from mpiattn.strategies import AttentionSpec, Options, registry

from helpers import dense_attention, host, torch_reference, visible_matrix
from tolerance import allowances, baseline, check, dtype_of


@dataclass(frozen=True)
class Case:
    name: str
    dtype: str
    B: int = 2
    H: int = 4
    Hkv: int = 2
    N: int = 37
    M: int | None = None
    E: int = 8
    Ev: int | None = None
    causal: bool | str = False
    window: tuple | None = None
    docs: bool = False
    pad: bool = False
    layout: str = "contiguous"
    kv_layout: str | None = None
    block: int | None = 7
    seed: int = 0
    softcap: float | None = None
    score_mod: str | None = None  # a name of property_calls.SCORE_MODS
    sinks: bool = False
    heads: bool = False  # a case of head counts the ranks do not divide: head-sharded strategies only
    sweep: bool = False  # a case of FlashAttention's shape sweep: at 1 and 2 ranks of one node only
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def m(self):
        return self.N if self.M is None else self.M

    @property
    def ev(self):
        return self.E if self.Ev is None else self.Ev


BASE = [
    Case("plain-f64", "float64"),
    Case("causal-zigzag-f32", "float32", causal=True, layout="zigzag"),
    Case("padding-f16", "float16", pad=True, B=3),
    Case("causal-padding-f32-mqa", "float32", H=4, Hkv=1, causal=True, pad=True),
    Case("window-f32", "float32", window=(5, 0)),
    Case("window-0-0-f64", "float64", window=(0, 0), causal=True),
    Case("window-both-f16", "float16", window=(3, 4)),
    Case("documents-balanced-f64", "float64", docs=True, causal=True, layout="balanced"),
    Case("documents-padding-f32", "float32", docs=True, pad=True),
    Case("cross-explicit-f32", "float32", N=29, M=41, Ev=5, kv_layout="explicit", layout="zigzag"),
    Case("cross-causal-f64", "float64", N=41, M=23, causal=True),
    Case("tiny-empty-shards-f64", "float64", N=3, M=2, B=1),
    Case("uneven-f16-gqa", "float16", H=6, Hkv=2, N=31, E=16, causal=True, layout="zigzag"),
    # heads that 4 ranks divide (ulysses and hybrid:4x1 at 4 ranks: no other case has them)
    Case("heads-8x4-causal-f32", "float32", H=8, Hkv=4, N=43, causal=True, layout="zigzag", B=1),
    Case("balanced-tiles-f32", "float32", causal=True, N=64, layout="balanced-tiles", block=8),
    Case("causal-zigzag-bf16", "bfloat16", causal=True, layout="zigzag", N=53, E=16),
    Case("documents-padding-bf16-gqa", "bfloat16", H=4, Hkv=2, docs=True, pad=True),
    Case("padding-gqa-bf16", "bfloat16", H=4, Hkv=2, pad=True, B=3, N=45, block=16),
    Case("cross-window-bf16", "bfloat16", N=29, M=41, Ev=5, window=(4, 2), kv_layout="explicit"),
    # bottom-right causal (query i sees keys j <= i + M - N), windows measured from that diagonal
    Case("bottom-right-short-f32", "float32", N=13, M=41, causal="bottom-right"),
    Case("bottom-right-square-window-f64", "float64", N=37, causal="bottom-right", window=(6, 0),
         layout="zigzag"),
    Case("bottom-right-long-f64", "float64", N=41, M=23, causal="bottom-right", kv_layout="explicit"),
    Case("bottom-right-short-window-f16-gqa", "float16", H=6, Hkv=2, N=9, M=50, E=16,
         causal="bottom-right", window=(11, 2), block=8),
    Case("bottom-right-long-window-f32", "float32", N=47, M=19, causal="bottom-right", window=(4, 1),
         pad=True),
    Case("bottom-right-balanced-f32", "float32", N=24, M=64, causal="bottom-right",
         layout="balanced", kv_layout="contiguous", block=8),
]


def _flash_grid_sample():
    """A sample of FlashAttention's test grid (run at 1 and 2 ranks of one node: :func:`_skip_reason`)."""
    pairs = [(113, 203), (128, 217), (108, 256), (256, 512), (512, 256), (1023, 1024),
             (1024, 1023), (239, 1), (1, 239), (3, 799), (799, 3)]
    dims = [32, 40, 59, 64, 80, 96, 111, 128, 160, 192, 224, 256]
    rng = np.random.default_rng(2024)
    out = []
    for i, (N, M) in enumerate(pairs):
        big = N * M > 200_000
        E = dims[i % 3] if big else dims[(3 + 5 * i) % len(dims)]
        window = None
        if i % 2:
            window = (int(rng.integers(0, max(N, 2))), int(rng.integers(0, max(M, 2))))
        out.append(Case(f"flash-{N}x{M}-d{E}-hkv{(9, 3, 1)[i % 3]}", ("float32", "float16", "float64")[i % 3],
                        B=1, H=9, Hkv=(9, 3, 1)[i % 3], N=N, M=M, E=E, causal=bool(i % 4 == 2),
                        window=window, block=128, seed=i, sweep=True))
    return out


def _flash_scores_sample():
    """FlashAttention grid cases with a softcap and sinks (its tests' softcap 0 / 15 / 50 scaled to
    these small scores: 0.8 and 5)."""
    grid = {c.name: c for c in _flash_grid_sample()}
    out = []
    for name, softcap in (("flash-113x203-d64-hkv9", 5.0), ("flash-128x217-d160-hkv3", 0.8),
                          ("flash-108x256-d40-hkv1", 0.8), ("flash-239x1-d59-hkv3", None)):
        c = grid[name]
        out.append(replace(c, name=f"{name}-softcap{softcap}-sinks", softcap=softcap, sinks=True, sweep=False))
    for name, mod in (("flash-113x203-d64-hkv9", "relative-bias"), ("flash-108x256-d40-hkv1", "temperature")):
        out.append(replace(grid[name], name=f"{name}-score_mod-{mod}", score_mod=mod, sweep=False))
    return out


def _heads_sample():
    """Issue 41's head counts, H in {6, 12, 20} and Hkv in {1, 2, 3}, for ulysses and the hybrid's
    splits (uneven query heads, key/value heads replicated where several ranks use them)."""
    out = []
    for i, (H, Hkv) in enumerate([(6, 1), (6, 2), (6, 3), (12, 1), (12, 2), (12, 3), (20, 1), (20, 2)]):
        out.append(Case(f"heads-{H}x{Hkv}", ("float32", "float64")[i % 2], B=1, H=H, Hkv=Hkv,
                        N=19 + 2 * i, E=8, causal=bool(i % 3), layout=("zigzag", "contiguous")[i % 2],
                        block=8, seed=100 + i, heads=True, sinks=i == 4, pad=i == 5))
    return out


CASES = BASE + _flash_grid_sample() + _flash_scores_sample() + _heads_sample()
#: Every configured strategy for 1-4 ranks: the plain ones and every ``hybrid:UxR`` split in each
#: placement (a run skips the splits whose ``U x R`` is not its rank count).
STRATEGIES = list(dict.fromkeys(name for P in range(1, 5) for name in registry.variants(P)))
ENGINES = list(engines.ENGINES)


# ------------------------------------------------------------------ data and references
@functools.lru_cache(maxsize=1)
def _data(case, comm):
    """The case's global arrays, its reference, its baseline and :func:`tolerance.allowances` (computed
    once per case, by rank 0, and broadcast: every rank runs the cases in one order)."""
    return comm.bcast_obj(_kept(case) if comm.rank == 0 else None)


def _kept(case):
    """:func:`_compute` of ``case``, kept between the sessions of one ``tests/run_all.py``
    (``$MPIATTN_TEST_CACHE_DIR``, which it makes and removes: the data do not depend on the rank
    count, and computing them took about 10 s a session); computed anew without it."""
    root = os.environ.get("MPIATTN_TEST_CACHE_DIR")
    if not root or not os.path.isdir(root):
        return _compute(case)
    path = os.path.join(root, "contract-" + hashlib.sha256(repr(case).encode()).hexdigest()[:32] + ".pkl")
    try:
        with open(path, "rb") as fh:
            return pickle.load(fh)
    except (OSError, EOFError, pickle.UnpicklingError):
        pass
    data = _compute(case)
    tmp = f"{path}.{os.getpid()}"
    with open(tmp, "wb") as fh:
        pickle.dump(data, fh, protocol=pickle.HIGHEST_PROTOCOL)
    os.replace(tmp, path)
    return data


def _compute(case):
    rng = np.random.default_rng(case.seed)
    dt = dtype_of(case.dtype)
    Q = rng.standard_normal((case.B, case.H, case.N, case.E)).astype(dt)
    K = rng.standard_normal((case.B, case.Hkv, case.m, case.E)).astype(dt)
    V = rng.standard_normal((case.B, case.Hkv, case.m, case.ev)).astype(dt)
    dO = rng.standard_normal((case.B, case.H, case.N, case.ev)).astype(dt)
    seg = None
    if case.docs:
        seg = np.sort(rng.integers(0, max(2, case.N // 6), (case.B, case.N)), axis=1)
    pad = rng.random((case.B, case.m)) < 0.3 if case.pad else None
    if pad is not None:
        pad[-1] = True  # a batch entry with no key at all
    vis = visible_matrix(case.B, case.N, case.m, case.causal, case.window, seg, seg, pad)
    sinks = rng.standard_normal(case.H) if case.sinks else None
    mod = _score_mod(case)
    if case.sinks or case.softcap is not None or mod is not None:
        ref = torch_reference(Q, K, V, dO, vis[:, None], softcap=case.softcap, sinks=sinks,
                              score_mod=None if mod is None else mod[1])[:6]
    else:
        ref = dense_attention(Q, K, V, vis[:, None], None, dO)
    base = baseline(Q, K, V, dO, vis[:, None], dt, case.softcap, sinks,
                    score_mod=None if mod is None else mod[1])
    extra = allowances(Q, K, V, dO, vis[:, None], ref[1], case.softcap, sinks,
                       score_mod=None if mod is None else mod[0])
    return Q, K, V, dO, seg, pad, vis, ref, base, sinks, extra


def _score_mod(case):
    """The case's ``(mpiattn.ScoreMod, its torch form)`` (the search's menu), or None."""
    if case.score_mod is None:
        return None
    import property_calls

    return property_calls.score_mod(property_calls.Call(P=1, seed=0, score_mod=case.score_mod))


def _layouts(case, P, seg):
    def one(kind, n):
        if kind in ("contiguous", "zigzag"):
            return kind
        if kind == "explicit":  # every rank's rows shuffled into a few ranges
            cuts = np.linspace(0, n, 2 * P + 1).astype(int)
            ranges = [(int(a), int(b)) for a, b in zip(cuts[:-1], cuts[1:])]
            return mpiattn.Layout([ranges[r::P][::-1] for r in range(P)])
        tiles = dict(block_size=case.block) if kind == "balanced-tiles" else {}
        if case.causal == "bottom-right" and n == case.N:  # the queries of a longer key sequence
            tiles["m"] = case.m
        return mpiattn.balance(n, P, causal=case.causal, window=case.window, segment_ids=seg, **tiles)
    lay = one(case.layout, case.N)
    return lay, (None if case.kv_layout is None else one(case.kv_layout, case.m))


# ------------------------------------------------------------------ the suite
def _options(case, strategy, engine):
    return Options(causal=case.causal, window=case.window, strategy=strategy, engine=engine,
                   block_size=case.block)


def _skip_reason(topology, strategy, engine, case, device):
    """Why ``strategy`` with ``engine`` does not run ``case`` on ``topology`` (None: it does)."""
    s = registry.get(strategy)
    u = topology.P if s.name == "ulysses" else getattr(s, "u", None)  # its head group's ranks
    if case.heads and not (u and u > 1):
        return "a heads case: the head-sharded strategies (ulysses, hybrid:UxR with U > 1) only"
    if case.heads and engine != engines.AUTO[0]:
        return "a heads case: the split is the strategy's, whatever the engine (the native one runs it)"
    if not case.heads and u and u > 1 and (case.H % u or (case.Hkv % u and u % case.Hkv)):
        return "heads the group does not divide: the heads-* cases test those"
    if case.sweep and topology.P > 2 and topology.n_nodes == 1:
        return ("FlashAttention's shape sweep is arithmetic with no communication path of its own: it "
                "runs at 1 and 2 ranks (whole and sharded; two hosts x 2 ranks in CI's two_hosts lane)")
    if not s.uses_engine and engine != engines.AUTO[0]:
        return f"strategy {strategy!r} runs no engine (tested once, with the default)"
    if "ring-first" in strategy and topology.n_nodes == 1:
        return "the ring-first placement is for machines of several nodes"
    if case.dtype == "bfloat16":
        try:
            import ml_dtypes  # noqa: F401 - numpy's name "bfloat16"
        except ImportError:
            return "bfloat16 cases need ml_dtypes"
    spec = AttentionSpec.from_shapes((case.B, case.H, case.N, case.E), (case.B, case.Hkv, case.m, case.E),
                                     (case.B, case.Hkv, case.m, case.ev), case.dtype,
                                     _options(case, strategy, engine), device=device, padding=case.pad,
                                     segments=case.docs, sinks=case.sinks,
                                     score_mod=case.score_mod is not None, softcap=case.softcap)
    why = s.supports(spec, topology)
    if why is None:
        e = engines.get(engine)
        why = e.supports(spec) or e.usable(spec.device)
    return why


#: The (case name, engine, strategy) triples this session leaves out, with each one's reason
#: (filled at collection by :func:`pytest_generate_tests`).
LEFT_OUT: dict[tuple[str, str, str], str] = {}
#: The triples this session runs (filled with :data:`LEFT_OUT`).
RUNS: list[tuple[str, str, str]] = []


def pytest_generate_tests(metafunc):
    """``test_contract``'s cases: every case x engine x strategy that runs at this session's rank
    count, topology and backend; the others are left out at collection (a skipped test still costs
    pytest's whole protocol: about 2,100 of them per session) and listed with their reasons in
    :data:`LEFT_OUT`, which ``test_every_left_out_case_has_its_reason`` checks. Collective: the
    world's topology (every rank collects the same modules, in one order)."""
    if metafunc.function is not test_contract:
        return
    from mpi4py import MPI
    topology = get_comm(MPI.COMM_WORLD).topology
    device = "cupy" if os.environ.get("MPIATTN_TEST_BACKEND", "numpy") == "cupy" else "numpy"
    runs = []
    for case in CASES:  # slowest: one case's data, reused
        for engine in ENGINES:
            for strategy in STRATEGIES:
                why = _skip_reason(topology, strategy, engine, case, device)
                if why is None:
                    runs.append(pytest.param(case, engine, strategy, id=f"{case.name}-{engine}-{strategy}"))
                    RUNS.append((case.name, engine, strategy))
                else:
                    LEFT_OUT[(case.name, engine, strategy)] = why
    metafunc.parametrize("case,engine,strategy", runs)


def test_contract(comm, xp, strategy, engine, case):
    if case.dtype == "bfloat16":
        pytest.importorskip("ml_dtypes")
        pytest.importorskip("torch", reason="bfloat16's baseline is torch's bfloat16 attention")
    P = comm.size
    if case.sinks or case.softcap is not None or case.score_mod is not None:
        pytest.importorskip("torch", reason="the reference of the softcap and sinks is torch autograd")
    options = _options(case, strategy, engine)
    Q, K, V, dO, seg, pad, vis, ref, base, sinks, extra = _data(case, comm)
    lay, kv_lay = _layouts(case, P, seg)
    options = Options.of(options, layout=lay, kv_layout=kv_lay)
    kl = lay if kv_lay is None else kv_lay
    sq = lambda x, axis=-2: xp.asarray(mpiattn.shard(x, axis=axis, layout=lay))  # noqa: E731
    sk = lambda x, axis=-2: xp.asarray(mpiattn.shard(x, axis=axis, layout=kl))  # noqa: E731
    q, k, v, do = sq(Q), sk(K), sk(V), sq(dO)
    kw = dict(options=options,
              key_padding_mask=None if pad is None else sk(pad, -1),
              segment_ids=None if seg is None else mpiattn.shard(seg, axis=-1, layout=lay))
    if sinks is not None:
        kw["sinks"] = sinks
    if case.softcap is not None:
        kw["softcap"] = case.softcap
    if case.score_mod is not None:
        kw["score_mod"] = _score_mod(case)[0]
    used = {}
    out, lse = mpiattn.attention(q, k, v, details=used, **kw)
    grads = mpiattn.attention_backward(do, q, k, v, out, lse, **kw)
    assert (used["strategy"], used["engine"]) == (strategy, engine)
    gq = lambda x, axis=-2: host(mpiattn.gather(x, axis=axis, layout=lay, root=None))  # noqa: E731
    gk = lambda x: host(mpiattn.gather(x, layout=kl, root=None))  # noqa: E731
    got = (gq(out), gq(lse, -1), gq(grads[0]), gk(grads[1]), gk(grads[2]), *map(host, grads[3:]))
    assert len(got) == (6 if case.sinks else 5)
    check(case.dtype, got, ref, base, extra, N=case.N, M=case.m, H=case.H, Hkv=case.Hkv,
          block=case.block, hops=P - 1, sinks=sinks)


@pytest.mark.parametrize("engine", ENGINES)
def test_an_engine_runs_what_it_declares_and_refuses_the_rest(comm, engine):
    """What an engine declares (:class:`mpiattn.kernels.engine.Capabilities`) is what a call gets:
    a NumPy call it declares runs on it; one it does not is refused on every rank with its reason."""
    e = engines.get(engine)
    x = np.random.default_rng(0).standard_normal((1, 2, 4 * comm.size, 8))
    for rules in ({}, {"window": (2, 1)}, {"causal": True}):
        spec = AttentionSpec.from_shapes(x.shape, x.shape, x.shape, x.dtype, Options(**rules))
        why = e.supports(spec) or e.usable("numpy")
        if why is None:
            used = {}
            out, _ = mpiattn.attention(x, x, x, engine=engine, details=used, **rules)
            assert used["engine"] == engine and np.isfinite(out).all()
        else:
            with pytest.raises(ValueError, match=f"engine {engine!r} cannot run on rank 0") as info:
                mpiattn.attention(x, x, x, engine=engine, **rules)
            assert why in str(info.value)


def test_every_left_out_case_has_its_reason(comm):
    """Each case x engine x strategy left out says why (a registry's ``supports`` or an engine's
    ``usable`` that refuses with an empty text would leave it out unexplained), and every
    strategy this rank count can run, and each engine of the host (native, torch where it is
    installed), runs some case (a ``supports`` that refuses too much would test nothing)."""
    assert all(isinstance(why, str) and why for why in LEFT_OUT.values())
    ran = {(engine, strategy) for _, engine, strategy in RUNS}
    for strategy in registry.variants(comm.size):
        if "ring-first" not in strategy or comm.topology.n_nodes > 1:
            assert any(s == strategy for _, s in ran), f"{strategy} runs no case at {comm.size} ranks"
    host_engines = {"native"} | ({"torch"} if engines.get("torch").usable("numpy") is None else set())
    assert {engine for engine, _ in ran} >= host_engines
