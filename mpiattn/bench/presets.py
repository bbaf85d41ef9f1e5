"""Presets (``--suite``) and how a plan becomes the list of tasks to run.

A suite is a list of :class:`Plan`\\ s; every option given on the command
line overrides the same field of every plan of the suite. :func:`build_tasks`
expands the plans into ``(P, Task)`` pairs (one fresh job each when
launched) and the memory-curve plans.
"""

from __future__ import annotations

import dataclasses
import types
from dataclasses import dataclass
from typing import Any, Mapping

from ..kernels import engines
from ..strategies import registry
from .tasks import DENSE, PEERS, SDPA, MiB, Task

__all__ = ["K", "Plan", "SUITES", "WARMUP_FULL_MAX_N", "plans_for", "build_tasks"]

K = 1024
#: With ``warmup=None``: one full-size warm-up call up to this N, none above (a call then lasts
#: seconds, and the small warm-up problem has already run in the same process).
WARMUP_FULL_MAX_N = 16 * K


@dataclass(frozen=True)
class Plan:
    """One sweep: sizes x rank counts x implementations x engines, peers, products, a memory curve.

    The fields are named as the ``bench`` options (``--seq`` sets ``n``,
    ``--block-size`` sets ``block``); ``impl`` holds strategy names of the
    registry (``auto``: the library's choice), ``engines`` engine names or
    ``None`` for "do not pass ``engine=``".
    """

    name: str = "custom"
    n: tuple[int, ...] = (4 * K,)
    ranks: tuple[int, ...] = (1,)
    impl: tuple[str, ...] = ("auto",)
    engines: tuple[str | None, ...] = (None,)
    peers: tuple[str, ...] = ("gemm",)
    peers_n: tuple[int, ...] | None = None
    passes: tuple[str, ...] = ("fwd", "fwdbwd")
    batch: int = 1
    heads: int = 1
    kv_heads: int | None = None
    head_dim: int = 64
    v_dim: int | None = None
    dtype: str = "float32"
    causal: str = "off"
    layout: str = "contiguous"
    block: int | None = None
    repeat: int = 5
    warmup: int | None = None
    products: tuple[str, ...] = ()
    product_n: tuple[int, ...] = ()
    product_dim: int = 64
    memory_curve: bool = False
    memory_cap: int = 100 * MiB
    memory_ranks: tuple[int, ...] = (1, 2, 4)
    memory_pass: str = "fwdbwd"

    def attention_task(self, N: int, causal: bool, device: str, check_finite: bool, **kw: Any) -> Task:
        """The attention task of this plan at length ``N`` (``kw``: further Task fields)."""
        warmup = self.warmup if self.warmup is not None else int(N <= WARMUP_FULL_MAX_N)
        return Task(workload="attention", B=self.batch, H=self.heads, Hkv=self.kv_heads or self.heads, N=N,
                    E=self.head_dim, Ev=self.v_dim or self.head_dim, dtype=self.dtype, causal=causal,
                    layout=self.layout, block=self.block, passes=tuple(self.passes), repeat=self.repeat,
                    warmup=warmup, device=device, check_finite=check_finite, plan=self.name, **kw)


def _plan(**kw: Any) -> Plan:
    return Plan(**{k: tuple(v) if isinstance(v, list) else v for k, v in kw.items()})


def _suites() -> dict[str, tuple[Plan, ...]]:
    every_strategy = tuple(registry.STRATEGIES)
    every_engine = tuple(n for n, e in engines.ENGINES.items() if "numpy" in e.capabilities.dtypes)
    suites = {
        "quick": (_plan(name="quick", n=[4 * K, 8 * K], ranks=[1, 2], peers=["gemm", DENSE, SDPA],
                        peers_n=[4 * K], products=["nt", "nn", "tn"], product_n=[4 * K]),),
        "issue3": (_plan(name="issue3", n=[16 * K, 32 * K, 64 * K], ranks=[1, 2], peers=["gemm", DENSE]),),
        "targets": (_plan(name="targets", n=[32 * K, 64 * K], ranks=[1, 2], peers=["gemm", DENSE, SDPA],
                          peers_n=[32 * K]),),
        "engines": (_plan(name="engines", n=[16 * K, 32 * K], ranks=[1, 2], engines=every_engine,
                          peers=["gemm", SDPA]),
                    _plan(name="engines-causal", n=[16 * K], ranks=[1, 2], engines=every_engine, causal="on",
                          layout="zigzag", peers=[SDPA])),
        "scaling": (_plan(name="scaling", n=[8 * K, 16 * K, 32 * K], ranks=[1, 2], peers=["gemm"]),),
        "strategies": (_plan(name="strategies", n=[8 * K], ranks=[2], heads=2, kv_heads=2, impl=every_strategy,
                             peers=["gemm"]),
                       _plan(name="causal", n=[16 * K], ranks=[1, 2], causal="on", layout="zigzag",
                             peers=["gemm"])),
        "products": (_plan(name="products", n=[], ranks=[1, 2], products=["nt", "nn", "tn"],
                           product_n=[8 * K, 16 * K], peers=["gemm"]),),
        # the library's default engine: the torch engine's library alone (about 190 MiB) exceeds the 100 MiB cap
        "memory": (_plan(name="memory", n=[], ranks=[], peers=[], memory_curve=True),),
    }
    # everything the committed results need (issue 3's table, the targets, scaling, strategies,
    # products, the memory curve) in one command that fits a 2-core, 24 GiB machine
    suites["full"] = (_plan(name="issue3+targets", n=[16 * K, 32 * K, 64 * K], ranks=[1, 2],
                            peers=["gemm", DENSE, SDPA], peers_n=[16 * K, 32 * K]),
                      *suites["strategies"], *suites["products"], *suites["memory"])
    return suites


#: Presets: each suite is a tuple of plans; explicit command-line options override every plan.
SUITES: Mapping[str, tuple[Plan, ...]] = types.MappingProxyType(_suites())

_FIELDS = tuple(f.name for f in dataclasses.fields(Plan) if f.name not in ("name", "peers_n"))


def plans_for(suite: str, overrides: dict[str, Any]) -> list[Plan]:
    """The plans of ``suite`` with ``overrides`` (fields of :class:`Plan`; None = keep the preset's)."""
    given = {k: (tuple(v) if isinstance(v, list) else v) for k, v in overrides.items()
             if k in _FIELDS and v is not None}
    out = []
    for preset in SUITES[suite]:
        plan = dataclasses.replace(preset, **given)
        if "n" in given:   # the user's sizes also apply where the suite had no attention runs
            plan = dataclasses.replace(plan, peers_n=None)
        out.append(plan)
    return out


def build_tasks(plans: list[Plan], device: str = "cpu", check_finite: bool = False,
                gemm_size: int = 2048) -> tuple[list[tuple[int, Task]], list[Plan]]:
    """``[(P, task), ...]`` to run, and the memory-curve plans.

    Each strategy runs once per engine of the plan. With the
    ``gemm`` peer every attention task measures its GEMM ceilings itself, in
    the same process right after its timings, so that a change of load on
    the machine cannot skew the fractions. Products with ``nt`` at ``P >= 2``
    add the ring-step overlap measurement.
    """
    tasks: list[tuple[int, Task]] = []
    curves = []
    for plan in plans:
        peers = [p for p in plan.peers if p != "none"]
        causals = {"off": [False], "on": [True], "both": [False, True]}[plan.causal]
        for N in plan.n:
            for causal in causals:
                base = plan.attention_task(N, causal, device, check_finite, ceilings="gemm" in peers,
                                           gemm_size=gemm_size)
                for P in plan.ranks:
                    for impl in plan.impl:
                        # a strategy that runs no engine (the products) once, with the first
                        uses = impl == "auto" or registry.get(impl).uses_engine
                        for engine in tuple(dict.fromkeys(plan.engines))[:None if uses else 1]:
                            tasks.append((P, base.replace(impl=impl, engine=engine)))
                if plan.peers_n is None or N in plan.peers_n:
                    for peer in PEERS:
                        if peer in peers:
                            tasks.append((1, base.replace(impl=peer)))
        ops = [o for o in plan.products if o != "none"]
        warmup = 1 if plan.warmup is None else plan.warmup
        for N in plan.product_n if ops else []:
            for P in plan.ranks:
                for op in ops:
                    tasks.append((P, Task(workload="product", op=op, N=N, d=plan.product_dim, dtype=plan.dtype,
                                          layout=plan.layout, block=plan.block, repeat=plan.repeat,
                                          warmup=warmup, device=device, plan=plan.name)))
                if "nt" in ops and P >= 2:
                    tasks.append((P, Task(workload="overlap", N=N, d=plan.product_dim, dtype=plan.dtype,
                                          layout=plan.layout, block=plan.block, repeat=max(3, plan.repeat),
                                          device=device, plan=plan.name)))
        if plan.memory_curve:
            curves.append(plan)
    return tasks, curves
