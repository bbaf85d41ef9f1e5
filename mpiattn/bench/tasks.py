"""What one benchmark case is: a :class:`Task`, the run :class:`Settings`, the nominal FLOPs.

A :class:`Task` names one workload and its global sizes; the launcher writes
a list of them, with the :class:`Settings` of the run, to the JSON file that
a worker job (``python -m mpiattn.bench --worker FILE``) reads back
(:func:`write_job` / :func:`read_job`). Every record a workload returns starts
from :meth:`Task.to_dict`, so the task's fields are the keys that identify a
case in the results.

Workloads
---------
``attention``
    ``impl`` is an mpiattn strategy (:data:`STRATEGY_IMPLS`), ``dense`` (a
    single-process attention that materialises the scores, written the
    plain way) or ``torch`` (``torch.nn.functional.scaled_dot_product_attention``);
    ``engine`` the local engine passed to :func:`mpiattn.attention`
    (``None``: the keyword is not passed at all).
``gemm_square``, ``gemm_tile``
    GEMM ceilings: a square ``numpy.matmul`` and attention's own tile shapes.
``product``
    :func:`mpiattn.matmul_nt` / ``nn`` / ``tn`` beside a local matmul.
``overlap``
    one ring step of ``matmul_nt``: transfer alone, matmul alone, both.
``baseline``
    the resident size of a worker before any large input (memory floor).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

__all__ = ["Task", "Settings", "STRATEGY_IMPLS", "SINGLE_PROCESS", "IMPLS", "ENGINES", "ENGINE_IMPLS",
           "OLD_NAMES", "PASSES", "WORKLOADS", "visible_pairs", "attention_flops", "tile_key",
           "write_job", "read_job"]

#: mpiattn strategies the bench can time.
STRATEGY_IMPLS = ("ring", "allgather", "ulysses", "materialized", "auto")
#: Single-process peers: they compute the whole problem in one process (run at P = 1 only).
SINGLE_PROCESS = ("dense", "torch")
IMPLS = STRATEGY_IMPLS + SINGLE_PROCESS
#: Local engines of issue 11 (``attention(..., engine=...)``).
ENGINES = ("auto", "native", "torch")
#: Strategies that hand their blocks to an engine (materialized goes through the products).
ENGINE_IMPLS = ("ring", "allgather", "ulysses", "auto")
#: Names of earlier releases, mapped when read (CLI values and saved records).
OLD_NAMES = {"reference": "dense"}
PASSES = ("fwd", "fwdbwd")

_SHAPE = ("B", "H", "Hkv", "N", "M", "E", "Ev", "dtype", "causal", "layout", "block", "device")
#: The fields that belong to each workload (and so to its records).
WORKLOADS: dict[str, tuple[str, ...]] = {
    "attention": ("workload", "impl", "engine") + _SHAPE + ("passes", "repeat", "warmup", "check_finite",
                                                            "ceilings", "gemm_size", "plan"),
    "gemm_square": ("workload", "dtype", "gemm_size", "repeat", "device", "plan"),
    "gemm_tile": ("workload", "impl", "engine") + _SHAPE + ("repeat", "tile_key", "plan"),
    "product": ("workload", "op", "N", "M", "d", "dtype", "layout", "block", "repeat", "warmup", "device",
                "plan"),
    "overlap": ("workload", "N", "d", "dtype", "layout", "block", "rows", "repeat", "device", "plan"),
    "baseline": ("workload", "engine", "B", "H", "Hkv", "E", "Ev", "dtype", "layout", "block", "device"),
}


@dataclass(frozen=True)
class Task:
    """One benchmark case (global sizes; every rank of the job runs it).

    Parameters
    ----------
    workload : str
        One of :data:`WORKLOADS`.
    impl : str
        For ``attention``: one of :data:`IMPLS`.
    engine : str, optional
        Local engine for the mpiattn strategies (``None``: not passed).
    B, H, Hkv, N, M, E, Ev : int
        Batch, query heads, key/value heads (default ``H``), query and key
        rows (``M`` default ``N``), head dims (``Ev`` default ``E``).
    dtype : str
    causal : bool
    layout : str
    block : int, optional
        Block size passed to mpiattn (default: the library's).
    passes : tuple of str
        Subset of :data:`PASSES`.
    repeat, warmup : int
        Timed calls (median) and untimed full-size calls before them.
    device : {"cpu", "gpu"}
    check_finite : bool
        Keep the NaN/Inf check in timed calls.
    ceilings : bool
        Measure the GEMM ceilings right after the attention timings.
    gemm_size : int
        Edge of the square GEMM ceiling.
    op, d : str, int
        ``product``/``overlap``: which product, and its width.
    rows : int, optional
        ``overlap``: rows of ``a`` (default this rank's share of ``N``).
    tile_key : tuple, optional
        ``gemm_tile``: the key that attention records are matched with.
    plan : str
        The preset plan the task came from (informative).
    """

    workload: str = "attention"
    impl: str = "ring"
    engine: str | None = None
    B: int = 1
    H: int = 1
    Hkv: int | None = None
    N: int = 4096
    M: int | None = None
    E: int = 64
    Ev: int | None = None
    dtype: str = "float32"
    causal: bool = False
    layout: str = "contiguous"
    block: int | None = None
    passes: tuple[str, ...] = PASSES
    repeat: int = 5
    warmup: int = 1
    device: str = "cpu"
    check_finite: bool = False
    ceilings: bool = False
    gemm_size: int = 2048
    op: str | None = None
    d: int = 64
    rows: int | None = None
    tile_key: tuple | None = field(default=None, compare=False)
    plan: str = ""

    def __post_init__(self) -> None:
        if self.workload not in WORKLOADS:
            raise ValueError(f"unknown benchmark workload {self.workload!r}; expected one of {', '.join(WORKLOADS)}")
        impl = OLD_NAMES.get(self.impl, self.impl)
        if impl not in IMPLS:
            raise ValueError(f"unknown implementation {self.impl!r}; expected one of {', '.join(IMPLS)}")
        if self.engine is not None and self.engine not in ENGINES:
            raise ValueError(f"unknown engine {self.engine!r}; expected one of {', '.join(ENGINES)}")
        bad = [p for p in self.passes if p not in PASSES]
        if bad:
            raise ValueError(f"unknown pass {bad[0]!r}; expected {' or '.join(PASSES)}")
        set_ = object.__setattr__          # frozen: defaults resolved once, here
        set_(self, "impl", impl)
        set_(self, "passes", tuple(self.passes))
        set_(self, "Hkv", self.H if self.Hkv is None else self.Hkv)
        set_(self, "M", self.N if self.M is None else self.M)
        set_(self, "Ev", self.E if self.Ev is None else self.Ev)
        if self.tile_key is not None:
            set_(self, "tile_key", tuple(self.tile_key))

    @property
    def single_process(self) -> bool:
        """True for the peers that compute the whole problem in one process."""
        return self.impl in SINGLE_PROCESS

    def replace(self, **changes: Any) -> "Task":
        """A copy with ``changes`` applied (:func:`dataclasses.replace`)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        """The fields of this task's workload, JSON-ready (tuples as lists)."""
        out = {}
        for name in WORKLOADS[self.workload]:
            value = getattr(self, name)
            out[name] = list(value) if isinstance(value, tuple) else value
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Task":
        """Inverse of :meth:`to_dict`; unknown keys raise ``ValueError``."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown task field(s): {', '.join(unknown)}")
        return cls(**dict(d))


@dataclass(frozen=True)
class Settings:
    """How a worker job runs its tasks (the same for every task of a job).

    Parameters
    ----------
    seed : int
        Seed of the random inputs (a generator per rank).
    device : {"cpu", "gpu"}
    threads : int
        BLAS (and torch) threads per rank.
    cores : int
        Usable cores of the launching machine (marks oversubscribed records).
    max_memory : int, optional
        Per-rank byte limit: a case whose estimate exceeds it is skipped.
    fresh : bool
        True when the job runs a single case (its memory high-water is its own).
    timeout : float
        Seconds the launcher waits for the job.
    """

    seed: int = 0
    device: str = "cpu"
    threads: int = 1
    cores: int = 1
    max_memory: int | None = None
    fresh: bool = False
    timeout: float = 4 * 3600.0

    def replace(self, **changes: Any) -> "Settings":
        return dataclasses.replace(self, **changes)


def write_job(path: str, settings: Settings, tasks: Sequence[Task], out: str) -> None:
    """Write a worker's configuration: settings, tasks and the JSON-lines file for its records."""
    with open(path, "w") as f:
        json.dump({"settings": dataclasses.asdict(settings), "tasks": [t.to_dict() for t in tasks],
                   "out": out}, f)


def read_job(path: str) -> tuple[Settings, list[Task], str]:
    """Inverse of :func:`write_job`."""
    with open(path) as f:
        doc = json.load(f)
    return Settings(**doc["settings"]), [Task.from_dict(t) for t in doc["tasks"]], doc["out"]


# ----------------------------------------------------------------- FLOPs
def visible_pairs(N: int, M: int, causal: bool) -> int:
    """Number of (query i, key j) pairs attended: ``N*M``, or ``#{j <= i}`` when causal."""
    if not causal:
        return N * M
    full = max(0, min(N, M))        # rows i < M see i + 1 keys
    return full * (full + 1) // 2 + max(0, N - M) * M


def attention_flops(t: Task, pass_: str) -> float:
    """Nominal FLOPs of attention task ``t`` for ``pass_`` in {"fwd", "bwd", "fwdbwd"} (whole job).

    Forward ``2 V (E + Ev)``, backward ``2 V (3 E + 2 Ev)`` (five GEMMs, the
    scores recomputed), ``V`` the visible pairs times ``B H``; the same for
    every implementation, so GFLOP/s compare times, not algorithms.
    """
    V = visible_pairs(t.N, t.M, t.causal) * t.B * t.H
    fwd = 2.0 * V * (t.E + t.Ev)
    bwd = 2.0 * V * (3 * t.E + 2 * t.Ev)
    return {"fwd": fwd, "bwd": bwd, "fwdbwd": fwd + bwd}[pass_]


def tile_key(r: Mapping[str, Any], P: int) -> tuple:
    """Key of the tile-GEMM ceiling that applies to an attention task or record ``r`` at ``P`` ranks."""
    T = int(r.get("block") or 512)
    single = OLD_NAMES.get(r.get("impl"), r.get("impl")) in SINGLE_PROCESS
    n = r["N"] if single else -(-r["N"] // P)
    m = r["M"] if single else -(-r["M"] // P)
    return (P, r["dtype"], r["B"], r["Hkv"], r["H"] // r["Hkv"], r["E"], r["Ev"], min(T, n), min(T, m),
            r.get("device") or "cpu")
