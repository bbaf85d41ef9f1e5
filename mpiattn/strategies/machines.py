"""What the cost model knows of a machine: its links and its compute rates, named or calibrated.

A :class:`Machine` has an alpha-beta :class:`Link` for each link class
(``inside`` a node, ``between`` nodes: what one rank gets alone), the
bandwidth a whole node sends to the others with all its ranks at once
(``node_bandwidth``, where they share a network link), a compute rate for attention per
dtype (FLOP/s of one rank, forward; the backward runs at
``backward_ratio`` of it), and how much of a ring step's transfer can hide
behind compute, inside a node (``overlap``) and between nodes
(``overlap_between``: there a network adapter, or the kernel's network stack,
moves the bytes, while inside a CPU node MPI's shared-memory copies are the
CPU's own work). Named profiles (:data:`PROFILES`) give documented
defaults for machine classes, each number with its source;
``python -m mpiattn calibrate`` measures one on the current allocation and
writes it as JSON (:meth:`Machine.save`), which :func:`load` reads back,
checked whole: a file that is not JSON, not an object, or has a key missing,
null, of the wrong type or out of range raises one :class:`MachineFileError`
naming the file and every such key (``--machine``: exit code 2).

Which machine a call uses (:func:`resolve_name`): the ``machine`` option (a
profile name or a JSON file), else the environment variable
``MPIATTN_MACHINE`` (read once per call, agreed by every rank), else the
default profile of the arrays' device.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from ..io.jsonfile import read_json, write_json

__all__ = ["Link", "Machine", "MachineFileError", "PROFILES", "DEFAULT_FOR_DEVICE",
           "MACHINE_VARIABLE", "load", "resolve_name"]

#: The environment variable naming a profile or a calibration file (read once per call).
MACHINE_VARIABLE = "MPIATTN_MACHINE"


class MachineFileError(ValueError):
    """A machine that names no profile and no usable machine file (:func:`load`).

    The message names the file and every defect found in it. A library call raises it alike
    on every rank; the command line exits with code 2 (bad input).
    """


@dataclass(frozen=True)
class Link:
    """One link class: a message of ``b`` bytes takes ``latency_s + b / bandwidth`` seconds.

    Attributes
    ----------
    latency_s : float
        Seconds per message (alpha).
    bandwidth : float
        Bytes per second one rank can send over it (1/beta).
    """

    latency_s: float
    bandwidth: float

    def __post_init__(self) -> None:
        _check("latency_s", self.latency_s, low=0.0)
        _check("bandwidth", self.bandwidth, low=0.0, above=True)

    def time(self, nbytes: float, messages: float = 1) -> float:
        return messages * self.latency_s + nbytes / self.bandwidth


@dataclass(frozen=True)
class Machine:
    """A machine class for the cost model (see the module docstring).

    Attributes
    ----------
    name : str
    inside, between : Link
        Links inside a node and between nodes.
    rates : dict of str to float
        dtype name -> attention forward FLOP/s of one rank.
    backward_ratio : float
        The backward's FLOP/s relative to the forward's.
    overlap : float
        The fraction of a ring step's transfer inside a node that can hide
        behind compute.
    memory : float
        Bytes one rank may use (0: unknown, everything fits).
    memory_bandwidth : float
        Bytes per second one rank reads from its memory while every rank does
        (what bounds a decode step; 0: unknown, compute alone).
    sources : dict of str to str
        Where each number comes from.
    node_bandwidth : float
        Bytes per second one node sends to other nodes with all its ranks
        sending at once (0: unknown, each rank as fast as ``between`` alone).
        Ranks that send between nodes in the same phase share it
        (:attr:`mpiattn.strategies.base.Phase.sharing`).
    overlap_between : float or None
        The same fraction for a transfer between nodes (None: as ``overlap``).
    engines : dict
        Measured speeds of the engines (``calibrate``): engine name -> dtype name ->
        ``[forward FLOP/s, backward FLOP/s]`` of one rank. ``engine="auto"`` runs the fastest
        engine measured for the call's dtype and direction that can run it
        (:func:`mpiattn.kernels.engines.local_choice`); empty: the native engine.
    """

    name: str
    inside: Link
    between: Link
    rates: dict
    backward_ratio: float = 0.8
    overlap: float = 1.0
    memory: float = 0.0
    memory_bandwidth: float = 0.0
    sources: dict = field(default_factory=dict, compare=False)
    node_bandwidth: float = 0.0
    overlap_between: float | None = None
    engines: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.rates:
            raise ValueError("rates: no compute rate (FLOP/s per dtype)")
        for key, value in self.rates.items():
            _check(f"rates.{key}", value, low=0.0, above=True)
        _check("backward_ratio", self.backward_ratio, low=0.0, above=True)
        _check("overlap", self.overlap, low=0.0, high=1.0)
        _check("memory", self.memory, low=0.0)
        _check("memory_bandwidth", self.memory_bandwidth, low=0.0)
        _check("node_bandwidth", self.node_bandwidth, low=0.0)
        if self.overlap_between is not None:
            _check("overlap_between", self.overlap_between, low=0.0, high=1.0)
        for engine, by_dtype in self.engines.items():
            for dtype, pair in by_dtype.items():
                if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                    raise ValueError(f"engines.{engine}.{dtype} must be [forward FLOP/s, backward "
                                     f"FLOP/s], got {pair!r}")
                for i, value in enumerate(pair):
                    _check(f"engines.{engine}.{dtype}[{i}]", value, low=0.0, above=True)

    @property
    def between_overlap(self) -> float:
        """The overlap of a transfer between nodes (``overlap_between``, else ``overlap``)."""
        return self.overlap if self.overlap_between is None else self.overlap_between

    def fits(self, nbytes: float) -> bool:
        """Whether ``nbytes`` per rank fit (always, when the memory is unknown)."""
        return self.memory <= 0 or nbytes <= self.memory

    def rate(self, dtype: Any) -> float:
        """Forward FLOP/s of one rank for ``dtype`` (a name or a dtype)."""
        key = getattr(dtype, "name", str(dtype))
        if key not in self.rates:
            raise ValueError(f"machine {self.name!r} has no compute rate for {key}; it has "
                             f"{', '.join(self.rates)}")
        return float(self.rates[key])

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> "Machine":
        """The machine a JSON document describes (:meth:`to_dict`'s keys; the optional ones may
        be left out).

        Raises
        ------
        ValueError
            "not a machine description: " and every defect, each naming its key: not an
            object, a key missing, unknown, null or of the wrong type, a value out of range.
        """
        defects = _defects(d)
        if defects:
            raise ValueError("not a machine description: " + "; ".join(defects))
        try:
            return cls(name=d["name"], inside=_link("inside", d), between=_link("between", d),
                       rates={k: float(v) for k, v in d["rates"].items()},
                       backward_ratio=float(d.get("backward_ratio", 0.8)),
                       overlap=float(d.get("overlap", 1.0)), memory=float(d.get("memory", 0.0)),
                       memory_bandwidth=float(d.get("memory_bandwidth", 0.0)),
                       sources=dict(d.get("sources", {})),
                       node_bandwidth=float(d.get("node_bandwidth", 0.0)),
                       overlap_between=_optional(d.get("overlap_between")),
                       engines={e: {t: [float(x) for x in pair] for t, pair in by.items()}
                                for e, by in d.get("engines", {}).items()})
        except ValueError as exc:  # a value out of range, named by __post_init__
            raise ValueError(f"not a machine description: {exc}") from None

    def save(self, path: str) -> None:
        """Write this machine as JSON (whole or not at all)."""
        write_json(path, self.to_dict())


def _optional(value: Any) -> float | None:
    return None if value is None else float(value)


def _link(name: str, d: dict) -> Link:
    try:
        return Link(**{key: float(value) for key, value in d[name].items()})
    except ValueError as exc:
        raise ValueError(f"{name}.{exc}") from None


# ------------------------------------------------------- a machine file's keys, checked whole
def _kind(value: Any) -> str:
    """What a JSON value is, in words."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"the boolean {str(value).lower()}"
    if isinstance(value, (int, float)):
        return f"the number {value!r}"
    if isinstance(value, str):
        return f"the string {value!r}"
    return "an array" if isinstance(value, list) else "an object"


def _defect(key: str, value: Any, holds: str) -> str:
    """The words for ``key`` holding ``value`` where it must hold ``holds``."""
    if value is None:
        return f"key {key!r} is null (it must be {holds})"
    return f"key {key!r} must be {holds}, not {_kind(value)}"


def _number(key: str, value: Any) -> list[str]:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return []
    return [_defect(key, value, "a number")]


def _number_or_null(key: str, value: Any) -> list[str]:
    return [] if value is None else _number(key, value)


def _text(key: str, value: Any) -> list[str]:
    return [] if isinstance(value, str) else [_defect(key, value, "a string")]


def _object(key: str, value: Any, holds: str, known: tuple = (), each: Any = None) -> list[str]:
    """Defects of an object: its type, then its ``known`` keys (all required, nothing else),
    or, without ``known``, ``each(key.k, value)`` of every entry."""
    if not isinstance(value, dict):
        return [_defect(key, value, holds)]
    out: list[str] = []
    for k in known:
        out += [f"key '{key}.{k}' is missing"] if k not in value else _number(f"{key}.{k}", value[k])
    out += [f"unknown key '{key}.{k}'" for k in value if known and k not in known]
    if each is not None:
        for k, v in value.items():
            out += each(f"{key}.{k}", v)
    return out


def _a_link(key: str, value: Any) -> list[str]:
    return _object(key, value, 'an object {"latency_s": seconds, "bandwidth": bytes/s}',
                   known=("latency_s", "bandwidth"))


def _the_rates(key: str, value: Any) -> list[str]:
    return _object(key, value, 'an object of FLOP/s by dtype name, e.g. {"float32": 8e10}',
                   each=_number)


def _a_pair(key: str, value: Any) -> list[str]:
    if isinstance(value, list) and len(value) == 2 and not any(_number(key, x) for x in value):
        return []
    return [_defect(key, value, "[forward FLOP/s, backward FLOP/s]")]


def _by_dtype(key: str, value: Any) -> list[str]:
    return _object(key, value, "an object of [forward, backward] FLOP/s by dtype name", each=_a_pair)


def _the_engines(key: str, value: Any) -> list[str]:
    return _object(key, value, 'an object by engine name, e.g. {"torch": {"bfloat16": [2e11, 1e11]}}',
                   each=_by_dtype)


def _the_sources(key: str, value: Any) -> list[str]:
    return _object(key, value, "an object of strings by key", each=_text)


#: A machine file's keys: whether one must be there, and how its value is checked.
_KEYS = {"name": (True, _text), "inside": (True, _a_link), "between": (True, _a_link),
         "rates": (True, _the_rates), "backward_ratio": (False, _number),
         "overlap": (False, _number), "memory": (False, _number),
         "memory_bandwidth": (False, _number), "sources": (False, _the_sources),
         "node_bandwidth": (False, _number), "overlap_between": (False, _number_or_null),
         "engines": (False, _the_engines)}


def _defects(doc: Any) -> list[str]:
    """Every defect of a machine's JSON document, each naming its key (none: an empty list)."""
    if not isinstance(doc, dict):
        return [f"it must be a JSON object with keys {', '.join(_KEYS)}, not {_kind(doc)}"]
    out = [f"unknown key {key!r}" for key in doc if key not in _KEYS]
    for key, (required, check) in _KEYS.items():
        if key in doc:
            out += check(key, doc[key])
        elif required:
            out.append(f"key {key!r} is missing")
    return out


def _check(name: str, value: Any, low: float, above: bool = False, high: float = math.inf) -> None:
    """Raise ValueError unless ``value`` is a finite real number in range (``above``: > ``low``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if value < low or (above and value == low) or value > high:
        bound = f"> {low:g}" if above else f">= {low:g}"
        if high < math.inf:
            bound += f" and <= {high:g}"
        raise ValueError(f"{name} must be {bound}, got {value!r}")


_ENV = "shared/environment.md (measured on this project's 2-core machines, 2026-11-30/12-01)"

#: Documented machine classes. Every number cites its source.
PROFILES: dict[str, Machine] = {
    "h200-nvlink-ndr": Machine(
        name="h200-nvlink-ndr",
        inside=Link(3e-6, 350e9), between=Link(5e-6, 45e9),
        rates={"bfloat16": 600e12, "float16": 600e12, "float32": 60e12, "float64": 30e12},
        backward_ratio=0.75, overlap=0.9, memory=141e9 * 0.9, memory_bandwidth=4.3e12,
        sources={
            "memory_bandwidth": "4.8 TB/s HBM3e per H200 (NVIDIA H200 datasheet); 90 % of it "
                                "as a streaming read achieves",
            "memory": "141 GB HBM3e per H200 (NVIDIA H200 datasheet); 90 % usable",
            "inside": "NVLink 4 on H200 SXM: 900 GB/s bidirectional per GPU (NVIDIA H200 "
                      "datasheet); 350 GB/s one way as achievable all-to-all bus bandwidth "
                      "(nccl-tests on 8-GPU Hopper nodes report 350-400 GB/s); 3 us per "
                      "message (NCCL's launch and protocol latency)",
            "between": "InfiniBand NDR, one 400 Gb/s ConnectX-7 per GPU (NVIDIA DGX H200 "
                       "user guide): 50 GB/s, 45 GB/s achievable; 5 us per message",
            "rates": "bf16/fp16: FlashAttention-3 reaches 600-740 TFLOP/s forward on H100 "
                     "(Shah et al. 2024) and this project measured bf16 GEMMs at 770-800 "
                     "TFLOP/s on the H200 it may use (" + _ENV + "); 600 TFLOP/s forward. "
                     "fp32 (TF32 off): 67 TFLOP/s FP32 peak (H200 datasheet), 60 "
                     "sustained; fp64: 34 TFLOP/s peak, 30 sustained",
            "backward_ratio": "FlashAttention-3's backward runs at about 3/4 of its forward's "
                              "FLOP/s (Shah et al. 2024)",
            "overlap": "a ring step's transfer overlaps compute on separate copy engines and "
                       "NICs; 10 % kept exposed for launch and synchronisation",
        }),
    "cpu-node": Machine(
        name="cpu-node",
        inside=Link(2e-6, 8e9), between=Link(2e-6, 12e9),
        rates={"bfloat16": 60e9, "float16": 40e9, "float32": 80e9, "float64": 40e9},
        backward_ratio=0.85, overlap=0.0, memory=8 * 2**30, memory_bandwidth=13e9,
        sources={
            "memory_bandwidth": "an assumption, not a measurement: a dual-socket node with 16 "
                                "DDR5-4800 channels (38.4 GB/s each by JEDEC's rate, 614 GB/s), "
                                "70 % achievable, shared by 32 ranks: 13 GB/s each",
            "memory": "an assumption, not a measurement: a dual-socket node of 256 GiB with one "
                      "rank per core on 32 cores, 8 GiB each (calibrate measures the real one)",
            "inside": "shared-memory MPI point-to-point: about 2 us and 7-10 GB/s (" + _ENV + ")",
            "between": "InfiniBand HDR 100 Gb/s (12.5 GB/s), a common CPU-cluster fabric; "
                       "about 2 us per message",
            "rates": "one rank, one BLAS thread: torch's CPU flash attention forward runs at "
                     "79 GFLOP/s in float32, the native engine at 0.9x of it; float64 GEMM at "
                     "half the float32 rate; float16 through float32 copies (" + _ENV + "); "
                     "bfloat16 likewise, through float32",
            "backward_ratio": "native engine forward+backward 1.38x the forward time at 2.5x "
                              "its FLOPs (" + _ENV + "): about 0.85",
            "overlap": "no transfer hides behind compute when every core computes: MPI's "
                       "shared-memory copies are CPU memcpy (" + _ENV + ")",
        }),
}

#: The profile a call uses when none is named, by the arrays' device.
DEFAULT_FOR_DEVICE = {"numpy": "cpu-node", "cupy": "h200-nvlink-ndr"}


def load(name_or_path: str) -> Machine:
    """A named profile, or a machine written by ``python -m mpiattn calibrate`` (JSON).

    The file is checked whole (:meth:`Machine.from_dict`).

    Raises
    ------
    MachineFileError
        Neither a profile nor a file; a file that cannot be read, is not JSON, or does
        not describe a machine (the message names the file and each defect).
    """
    if name_or_path in PROFILES:
        return PROFILES[name_or_path]
    try:
        doc = read_json(name_or_path)
    except FileNotFoundError:
        raise MachineFileError(f"machine {name_or_path!r} is neither a profile "
                               f"({', '.join(PROFILES)}) nor a file") from None
    except ValueError as exc:
        raise MachineFileError(f"machine file {name_or_path}: {_unreadable(exc, name_or_path)}") \
            from None
    try:
        return Machine.from_dict(doc)
    except ValueError as exc:
        raise MachineFileError(f"machine file {name_or_path}: {exc}") from None


def _unreadable(exc: ValueError, path: str) -> str:
    """Why :func:`mpiattn.io.jsonfile.read_json` could not read ``path``, without its path."""
    why = str(exc).removeprefix(f"cannot read {path}: ")
    if isinstance(exc.__context__, ValueError):  # json's or the UTF-8 decoder's (both ValueErrors)
        return f"cannot read it as JSON ({why})"
    return f"cannot read it ({why})"


def resolve_name(requested: str | None, device: str) -> str:
    """The machine a call uses: ``requested``, else ``$MPIATTN_MACHINE``, else the device's default."""
    if requested:
        return requested
    return os.environ.get(MACHINE_VARIABLE, "").strip() or DEFAULT_FOR_DEVICE.get(device, "cpu-node")
