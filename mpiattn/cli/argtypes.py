"""The command line's argument types: each word checked, bounds included, as argparse reads it.

Every subcommand takes its numbers through these, so one kind of argument is
refused the same way everywhere: one line naming the option, exit code 2,
before any work (:class:`mpiattn.cli.common.Parser`). Sizes are C ints
(:data:`MAX_SIZE`), floats finite, and what the library would only refuse
later (a named mask rule's parameters, a strategy's configuration, a page
size) is parsed by the library's own parser here.
"""

from __future__ import annotations

import argparse
import math
from typing import Any, Callable

from ..comm.watchdog import MIN_TIMEOUT_S
from ..inference.placement import check_page
from ..masks import ALIGNMENTS, check_causal, mods
from ..strategies import registry

__all__ = ["MAX_SIZE", "MAX_SEED", "int_in", "positive_int", "nonneg_int", "seed",
           "finite_float", "positive_float", "watchdog_seconds", "fraction", "window",
           "causal_alignment", "strategy", "engine_list", "mask_mod", "page"]

#: Largest value of a size option (rows, heads, features, block, threads, window): a C int.
MAX_SIZE = 2**31 - 1
#: Largest seed (stored as a 64-bit attribute).
MAX_SEED = 2**63 - 1


def _integer(text: str) -> int:
    """An integer written in decimal digits, else argparse's usage error."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {_short(text)!r}") from None


def int_in(low: int, high: int = MAX_SIZE) -> Callable[[str], int]:
    """An argparse type: an integer in ``[low, high]`` (decimal digits only)."""
    def parse(text: str) -> int:
        value = _integer(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        if value > high:
            raise argparse.ArgumentTypeError(f"must be <= {high}, got {value}")
        return value
    return parse


positive_int = int_in(1)
nonneg_int = int_in(0)
seed = int_in(0, MAX_SEED)


def finite_float(text: str) -> float:
    """An argparse type: a finite number (``nan``, ``inf`` and overflowing literals refused)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {_short(text)!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be finite, got {_short(text)}")
    return value


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0."""
    value = finite_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def watchdog_seconds(text: str) -> float:
    """An argparse type: a finite number of seconds >= the watchdog's shortest timeout
    (:data:`mpiattn.comm.watchdog.MIN_TIMEOUT_S`: a shorter silence is a busy rank's pause, not
    a lost host)."""
    value = finite_float(text)
    if value < MIN_TIMEOUT_S:
        raise argparse.ArgumentTypeError(f"must be >= {MIN_TIMEOUT_S:g} s (a shorter silence is a busy "
                                         f"rank's pause, not a lost host), got {value:g}")
    return value


def fraction(text: str) -> float:
    """An argparse type: a number in ``[0, 1)``."""
    value = finite_float(text)
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {value}")
    return value


def window(text: str) -> tuple:
    """``L,R`` -> (left, right): ints in ``[0, MAX_SIZE]``, ``none`` (or empty) for no bound on
    that side."""
    parts = text.split(",")
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(f"expected LEFT,RIGHT (e.g. 1024,0 or none,16), "
                                         f"got {_short(text)!r}")
    out = []
    for side, part in zip(("left", "right"), parts):
        part = part.strip().lower()
        if part in ("", "none"):
            out.append(None)
            continue
        try:
            value = int(part)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"window {side}: expected an integer or none, got {_short(part)!r}") from None
        if not 0 <= value <= MAX_SIZE:
            raise argparse.ArgumentTypeError(f"window {side} must be >= 0 and <= {MAX_SIZE} "
                                             f"(none: unbounded), got {value}")
        out.append(value)
    return tuple(out)


def causal_alignment(text: str) -> bool | str:
    """An argparse type: ``top-left`` (True) or ``bottom-right`` (:data:`mpiattn.masks.ALIGNMENTS`)."""
    if text not in ALIGNMENTS:
        raise argparse.ArgumentTypeError(f"expected {' or '.join(ALIGNMENTS)}, got {_short(text)!r}")
    return check_causal(text)


def strategy(text: str) -> str:
    """``auto``, a registered strategy, or one with its configuration (``hybrid:2x2``)."""
    if text != "auto":
        _library(registry.get, text)
    return text


def engine_list(text: str) -> list[str]:
    """Engine names, comma-separated (:data:`mpiattn.kernels.engines.ENGINES`; not ``auto``)."""
    from ..kernels import engines

    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise argparse.ArgumentTypeError("expected engine names, comma-separated")
    for n in names:
        if n not in engines.ENGINES:
            raise argparse.ArgumentTypeError(f"unknown engine {_short(n)!r}; expected "
                                             f"{', '.join(engines.ENGINES)}")
    return names


def mask_mod(text: str) -> Any:
    """``NAME:PARAMS``: a rule of :mod:`mpiattn.masks.mods` (e.g. ``chunked:4096``), its
    parameters range-checked by the rule."""
    return _library(mods.parse, text)


def page(text: str) -> int:
    """Rows per page of a cache's appends (:func:`mpiattn.inference.placement.check_page`)."""
    return _library(check_page, _integer(text))


def _library(parse: Callable[[Any], Any], value: Any) -> Any:
    """``parse(value)`` with the library's TypeError or ValueError as argparse's usage error."""
    try:
        return parse(value)
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _short(text: str, limit: int = 40) -> str:
    """``text`` for a message, cut to ``limit`` characters (a pasted megabyte stays one line)."""
    return text if len(text) <= limit else text[:limit] + "..."
