"""How a call's score modifiers are held in HDF5 files: the one vocabulary ``io`` and the command line read.

An input file (``docs/file-format.md``) may hold, beside ``q``, ``k`` and ``v``, the arrays of
a :class:`~mpiattn.masks.score.Score`; a key/value cache keeps those its prefill used, so that
decode applies them again:

==============  ============================================  ==================================
modifier        held as                                       read
==============  ============================================  ==================================
attn_mask       dataset ``(B or 1, H or 1, N, M)``, bool or   by query rows, like ``q``
                real floating point                           (:data:`ROWS`: axis from the end)
sinks           dataset ``(H,)``                              whole, by every rank (:data:`WHOLE`)
alibi_slopes    dataset ``(H,)`` or ``(B, H)``                whole, by every rank
softcap         root attribute, a number > 0 (a cache's)      with the metadata (:data:`ATTRIBUTES`)
==============  ============================================  ==================================

The functions (``mask_mod``, ``score_mod``) are code, not data: the command line names a rule
(``--mask-mod``), and no file holds one. :func:`from_file` makes the Score of what a file
holds, :func:`to_file` the datasets and attributes a cache keeps of a Score, and
:func:`joined` the rule for two sources of one call's modifiers (a cache and its queries).
A modifier that a file can hold is added here (and to :class:`~mpiattn.masks.score.Score`);
the readers and writers in :mod:`mpiattn.io` and :mod:`mpiattn.cli` take it from these names.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from .score import Score

__all__ = ["ROWS", "WHOLE", "ATTRIBUTES", "FLAGS", "check_dtype", "check_rows", "check_whole",
           "as_read", "read_attributes", "from_file", "to_file", "from_arguments", "output_attributes",
           "joined", "described"]

#: Datasets held by query rows, and the axis (from the end) along the queries.
ROWS = {"attn_mask": 2}
#: Small per-head datasets every rank reads whole (float64).
WHOLE = ("sinks", "alibi_slopes")
#: Root attributes of a cache (numbers) that belong to its score.
ATTRIBUTES = ("softcap",)


def check_dtype(name: str, dt: np.dtype, real: bool, floats: str) -> None:
    """TypeError unless the dataset ``name`` of :data:`ROWS` may hold dtype ``dt``: boolean (True =
    the pair takes part) or real floating point (``real``: the reader's verdict; ``floats``: the
    dtypes it reads, for the message)."""
    if dt != np.bool_ and not real:
        raise TypeError(f"dataset {name!r} has dtype {dt}; it must be boolean (True = the pair "
                        f"takes part) or real floating point ({floats}; added to the scores, "
                        "-inf hides)")


def check_rows(shapes: Mapping[str, tuple], B: int, H: int, N: int, M: int) -> None:
    """ValueError unless each dataset of :data:`ROWS` in ``shapes`` (name -> promoted 4-D shape)
    is ``(B or 1, H or 1, N, M)``."""
    for name in ROWS:
        a = shapes.get(name)
        if a is not None and (a[0] not in (1, B) or a[1] not in (1, H) or tuple(a[2:]) != (N, M)):
            raise ValueError(f"{name} has shape {a}, expected (B or 1, H or 1, N, M) with "
                             f"B = {B}, H = {H}, N = {N}, M = {M}")


def check_whole(shapes: Mapping[str, tuple], B: int, H: int) -> None:
    """ValueError unless the datasets of :data:`WHOLE` in ``shapes`` (name -> shape) fit queries of
    batch ``B`` and ``H`` heads: ``sinks`` ``(H,)``, ``alibi_slopes`` ``(H,)`` or ``(B, H)``."""
    if "sinks" in shapes and tuple(shapes["sinks"]) != (H,):
        raise ValueError(f"sinks has shape {tuple(shapes['sinks'])}, expected (H,) = ({H},)")
    if "alibi_slopes" in shapes and tuple(shapes["alibi_slopes"]) not in ((H,), (B, H)):
        raise ValueError(f"alibi_slopes has shape {tuple(shapes['alibi_slopes'])}, expected (H,) = "
                         f"({H},) or (B, H) = ({B}, {H})")


def as_read(name: str, x: np.ndarray) -> np.ndarray:
    """A dataset of :data:`ROWS` as the library takes it: boolean as stored, else float64."""
    return x if x.dtype == np.bool_ else x.astype(np.float64, copy=False)


def read_attributes(attrs: Mapping[str, Any], path: str) -> dict:
    """The :data:`ATTRIBUTES` among a file's root ``attrs`` (plain values), checked: ``softcap`` a
    finite number > 0. ValueError naming ``path`` otherwise."""
    out = {}
    for name in ATTRIBUTES:
        value = attrs.get(name)
        if value is None:
            continue
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer,
                                                                          np.floating)):
            raise ValueError(f"{path}: attribute {name!r} must be a number, got {value!r} "
                             f"({type(value).__name__})")
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"{path}: attribute {name!r} must be finite and > 0, got {value!r}")
        out[name] = float(value)
    return out


def from_file(datasets: Mapping[str, Any], attributes: Mapping[str, Any] | None = None) -> Score:
    """The :class:`Score` of what a file holds: the vocabulary's ``datasets`` (others ignored) and
    checked ``attributes`` (:func:`read_attributes`)."""
    held = {n: datasets[n] for n in (*ROWS, *WHOLE) if datasets.get(n) is not None}
    return Score.of(**held, **{n: v for n, v in (attributes or {}).items() if n in ATTRIBUTES})


def to_file(score: Score) -> tuple[dict, dict]:
    """What a cache keeps of ``score``: ``(datasets, attributes)``, the :data:`WHOLE` arrays as
    float64 and the :data:`ATTRIBUTES` (None where not given, so the attribute is absent).

    The :data:`ROWS` datasets are not kept (their rows are the prompt's queries: a decode step
    gives its own with its queries); a function (code, not data) is a ValueError.
    """
    code = [n for n in score.given() if n not in (*ROWS, *WHOLE, *ATTRIBUTES)]
    if code:
        raise ValueError(f"a cache keeps no {code[0]}: it keeps {', '.join((*WHOLE, *ATTRIBUTES))}")
    datasets = {n: np.asarray(getattr(score, n), dtype=np.float64) for n in WHOLE
                if getattr(score, n) is not None}
    return datasets, {n: getattr(score, n) for n in ATTRIBUTES}


#: The modifiers the command line gives as numbers or names (``--softcap``, ``--mask-mod``; the
#: arrays come from files): the attributes of the parsed arguments that join a Score.
FLAGS = ("softcap", "mask_mod")


def from_arguments(args: Any) -> Score:
    """The :class:`Score` of the parsed command-line arguments ``args`` (:data:`FLAGS` it has)."""
    return Score.of(**{n: getattr(args, n, None) for n in FLAGS})


def output_attributes(score: Score) -> dict:
    """The root attributes an output file records of the command line's modifiers (:data:`FLAGS`):
    the numbers as given, a named rule by its text; None where not given."""
    return {n: getattr(getattr(score, n), "key", getattr(score, n)) for n in FLAGS}


def joined(kept: Score, given: Score, kept_from: str, given_from: str) -> Score:
    """The modifiers of a call whose inputs come from two sources (a cache, ``kept``, and what is
    given with its queries, ``given``: a file's arrays or the command line's numbers): the union,
    a modifier both hold with equal values once. ValueError when they differ (a cache is decoded
    with the modifiers it was made with); ``kept_from``, ``given_from`` name the sources."""
    for name in given.given():
        mine, theirs = getattr(kept, name), getattr(given, name)
        if mine is None:
            continue
        if name in ATTRIBUTES:
            if theirs != mine:
                raise ValueError(f"{given_from}'s {name} {theirs:g} differs from the {name} {mine:g} "
                                 f"{kept_from} was made with; a cache is decoded with its own "
                                 "modifiers")
            continue
        a, b = np.asarray(mine), np.asarray(theirs)
        if a.size == b.size:
            a, b = a.ravel(), b.ravel()
        if a.shape != b.shape or not np.array_equal(a, b):
            raise ValueError(f"{given_from} holds {name} that differ from those {kept_from} was made "
                             f"with; a cache is decoded with its own modifiers (remove {name} from "
                             f"{given_from})")
    return Score.of(kept, **{n: getattr(given, n) for n in given.given() if getattr(kept, n) is None})


def described(score: Score) -> list[str]:
    """The modifiers of ``score`` as a report names them (``["sinks", "softcap 30"]``)."""
    out = []
    for name in score.given():
        value = getattr(score, name)
        if name in ATTRIBUTES:
            out.append(f"{name} {value:g}")
        elif hasattr(value, "key"):  # a named rule
            out.append(f"{name} {value.key}")
        else:
            out.append(name)
    return out
