"""What one benchmark case is: a :class:`Task`, the run's :class:`Settings`, its call and FLOPs.

A :class:`Task` names one workload and its global sizes; the launcher hands
a list of them, with the run's :class:`Settings`, to a worker job in a JSON
file (:func:`write_job` / :func:`read_job`). Every record starts from
:meth:`Task.to_dict`: the task's fields identify a case in the results.
Workloads: ``attention`` (a strategy of the registry or a peer), the GEMM
ceilings ``gemm_square`` and ``gemm_tile``, the products ``product`` and
``overlap`` (one ring step), and ``baseline`` (a worker's memory floor).
"""

from __future__ import annotations

import dataclasses
import json
import types
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from ..kernels import DEFAULT_TILE, engines
from ..strategies import registry
from ..strategies.spec import AttentionSpec, Options

__all__ = ["Task", "Settings", "DENSE", "SDPA", "PEERS", "IMPLS", "is_configured", "PASSES", "WORKLOADS", "MiB", "visible_pairs",
           "attention_flops", "tile_key", "write_job", "read_job"]

MiB = 2**20

#: The single-process peers (they compute the whole problem in one process, at P = 1 only):
#: the library's dense reference, and torch's ``scaled_dot_product_attention``.
DENSE, SDPA = "dense", "torch"
PEERS = (DENSE, SDPA)
#: What an ``attention`` task may time: the registry's strategies (``auto`` first), then the peers.
IMPLS = registry.NAMES + PEERS


def is_configured(name: Any) -> bool:
    """Whether ``name`` is a registered strategy with its configuration (``hybrid:2x2``)."""
    if not isinstance(name, str) or ":" not in name:
        return False
    try:
        registry.get(name)
    except ValueError:
        return False
    return True
PASSES = ("fwd", "fwdbwd")

_SHAPE = ("B", "H", "Hkv", "N", "M", "E", "Ev", "dtype", "causal", "layout", "block", "device")
#: The fields that belong to each workload (and so to its records).
WORKLOADS: Mapping[str, tuple[str, ...]] = types.MappingProxyType({
    "attention": ("workload", "impl", "engine") + _SHAPE + ("passes", "repeat", "warmup", "check_finite",
                                                            "ceilings", "gemm_size", "plan"),
    "gemm_square": ("workload", "dtype", "gemm_size", "repeat", "device", "plan"),
    "gemm_tile": ("workload", "impl", "engine") + _SHAPE + ("repeat", "tile_key", "plan"),
    "product": ("workload", "op", "N", "M", "d", "dtype", "layout", "block", "repeat", "warmup", "device",
                "plan"),
    "overlap": ("workload", "N", "d", "dtype", "layout", "block", "rows", "repeat", "device", "plan"),
    "baseline": ("workload", "engine", "B", "H", "Hkv", "E", "Ev", "dtype", "layout", "block", "device"),
})


@dataclass(frozen=True)
class Task:
    """One benchmark case in global sizes (every rank of the job runs it).

    Parameters
    ----------
    workload : str
        One of :data:`WORKLOADS`.
    impl, engine : str, str or None
        One of :data:`IMPLS`; an engine of :data:`mpiattn.kernels.engines.NAMES` (None: not passed).
    B, H, Hkv, N, M, E, Ev : int
        The call ``q (B, H, N, E)``, ``k (B, Hkv, M, E)``, ``v (B, Hkv, M, Ev)`` (``Hkv``
        default ``H``, ``M`` default ``N``, ``Ev`` default ``E``).
    dtype, causal, layout, block, device : str, bool, str, int or None, str
        ``block``: the ``block_size`` passed (None: the engine's); ``device``: "cpu" or "gpu".
    passes, repeat, warmup : tuple of str, int, int
        The passes timed (of :data:`PASSES`), timed calls (median), untimed full-size calls first.
    check_finite, ceilings, gemm_size : bool, bool, int
        Keep the NaN/Inf check; measure the GEMM ceilings right after (square edge ``gemm_size``).
    op, d, rows : str, int, int or None
        Products: "nt", "nn" or "tn", the width, the rows of ``a`` (``overlap``).
    tile_key : tuple, optional
        ``gemm_tile``: the key attention records are matched with (:func:`tile_key`).
    plan : str
        The preset plan the task came from (informative).
    """

    workload: str = "attention"
    impl: str = "auto"
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
        impls = IMPLS + ((self.impl,) if is_configured(self.impl) else ())
        checks = (("benchmark workload", [self.workload], tuple(WORKLOADS)), ("implementation", [self.impl], impls),
                  ("engine", [self.engine], (None, *engines.NAMES)), ("pass", list(self.passes), PASSES))
        for what, values, allowed in checks:
            bad = [v for v in values if v not in allowed]
            if bad:
                raise ValueError(f"unknown {what} {bad[0]!r}; expected one of {', '.join(filter(None, allowed))}")
        set_ = object.__setattr__  # frozen: defaults resolved once, here
        set_(self, "passes", tuple(self.passes))
        set_(self, "Hkv", self.H if self.Hkv is None else self.Hkv)
        set_(self, "M", self.N if self.M is None else self.M)
        set_(self, "Ev", self.E if self.Ev is None else self.Ev)
        if self.tile_key is not None:
            set_(self, "tile_key", tuple(self.tile_key))

    @property
    def single_process(self) -> bool:
        """True for the peers, which compute the whole problem in one process."""
        return self.impl in PEERS

    def replace(self, **changes: Any) -> "Task":
        """A copy with ``changes`` applied (:func:`dataclasses.replace`)."""
        return dataclasses.replace(self, **changes)

    def options(self) -> Options:
        """The keywords of the mpiattn call (a peer: ``strategy="auto"``, what a flash kernel resembles)."""
        return Options(causal=self.causal, layout=self.layout, block_size=self.block,
                       strategy="auto" if self.single_process else self.impl, engine=self.engine or "auto",
                       check_finite=self.check_finite)

    def spec(self) -> AttentionSpec:
        """The call on global shapes, without arrays (for the registry's cost and memory models)."""
        return AttentionSpec.from_shapes((self.B, self.H, self.N, self.E), (self.B, self.Hkv, self.M, self.E),
                                         (self.B, self.Hkv, self.M, self.Ev), self.dtype, self.options(),
                                         device="cupy" if self.device == "gpu" else "numpy")

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
        unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"unknown task field(s): {', '.join(unknown)}")
        return cls(**dict(d))


@dataclass(frozen=True)
class Settings:
    """How a worker job runs its tasks (the same for every task of a job).

    Parameters
    ----------
    seed, device, threads : int, str, int
        Seed of the inputs (a generator per rank); "cpu" or "gpu"; BLAS (and torch) threads per rank.
    cores : int
        Usable cores of the launching machine (marks oversubscribed records).
    max_memory : int, optional
        Per-rank bytes: a case whose estimate exceeds it is skipped.
    fresh, timeout : bool, float
        The job runs one case (its memory high-water is its own); seconds the launcher waits.
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


# ----------------------------------------------------------------- FLOPs and tiles
def visible_pairs(N: int, M: int, causal: bool) -> int:
    """Number of (query i, key j) pairs attended: ``N*M``, or ``#{j <= i}`` when causal."""
    if not causal:
        return N * M
    full = max(0, min(N, M))  # rows i < M see i + 1 keys
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
    """Key of the tile-GEMM ceiling for an attention task or record ``r`` at ``P`` ranks.

    The tile is the native engine's: ``block`` rows, else
    :data:`mpiattn.kernels.DEFAULT_TILE`, at most a rank's rows.
    """
    T = int(r.get("block") or DEFAULT_TILE)
    single = r.get("impl") in PEERS
    n = r["N"] if single else -(-r["N"] // P)
    m = r["M"] if single else -(-r["M"] // P)
    return (P, r["dtype"], r["B"], r["Hkv"], r["H"] // r["Hkv"], r["E"], r["Ev"], min(T, n), min(T, m),
            r.get("device") or "cpu")
