"""A named mask rule as one object: ``mask_mod`` with its parameters and its own tile rule.

A ``mask_mod`` (FlexAttention's convention, :mod:`mpiattn.masks.modifiers`) is any
vectorised function ``mask_mod(b, h, q_idx, kv_idx) -> bool`` of global indices
(True = the pair takes part). A plain function can only be evaluated pair by pair,
and the ranks can only compare its name. A :class:`MaskMod` is such a function
that also says

* what it is, as text (:attr:`MaskMod.key`, e.g. ``chunked:4096``): the ranks agree on
  it, the command line reads it (``run --mask-mod chunked:4096``), an output
  file records it;
* for a whole tile or key block, from the hulls of its query and key indices alone,
  whether it hides every pair, shows every pair, or cannot tell
  (:meth:`MaskMod.hull`): a ring block or tile it hides whole is skipped without
  evaluating a pair, however large.

A new rule is one module in :mod:`mpiattn.masks.mods` holding one subclass (its
``name``, its fields, ``__call__``, ``hull`` and ``example``); the registry there finds
it, and every strategy, engine, the balancer, the cost model, the references and
the command line take it through ``mask_mod=``, with no other change.

Host NumPy only.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, ClassVar

import numpy as np

__all__ = ["MaskMod", "check_count", "MAX_PARAM"]

#: Largest parameter of a rule: an int64, as the indices it is compared with.
MAX_PARAM = int(np.iinfo(np.int64).max)


def check_count(owner: str, name: str, value: Any, least: int = 0) -> int:
    """``value`` as an int in ``[least, MAX_PARAM]`` (a parameter of a rule), else TypeError /
    ValueError."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{owner}: {name} must be an integer >= {least}, got {value!r}")
    if int(value) < least:
        raise ValueError(f"{owner}: {name} must be >= {least}, got {value}")
    if int(value) > MAX_PARAM:
        raise ValueError(f"{owner}: {name} must be <= {MAX_PARAM} (an int64, as the indices it "
                         f"meets), got {value}")
    return int(value)


class MaskMod:
    """A ``mask_mod`` with a name, parameters and a tile rule (the module docstring).

    Subclasses are frozen dataclasses whose fields are the parameters (integers), with

    ``name``
        The registry's name (class attribute), lower case, e.g. ``"chunked"``.
    ``__call__(b, h, q_idx, kv_idx)``
        Bool array broadcasting with the four int64 index arrays (True = visible).
    ``hull(q0, q1, k0, k1)``
        ``"none"`` or ``"all"`` when that holds for every pair ``q0 <= i <= q1``,
        ``k0 <= j <= k1`` of every batch entry and head, else ``"some"`` (or None: cannot
        tell). It must be sound: the kernels skip a tile it calls ``"none"``.
    ``example(n)`` (classmethod)
        An instance for ``n`` query and key rows that hides some pairs and shows others
        (the registry-driven tests and the docs use it).
    """

    name: ClassVar[str] = ""

    # -------------------------------------------------------------- what it is
    @property
    def params(self) -> tuple[int, ...]:
        """The parameters, in the order of the fields."""
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self))

    @property
    def key(self) -> str:
        """The rule as text, ``name:p1,p2`` (or ``name`` without parameters): what the ranks
        compare, what ``--mask-mod`` reads and an output file records."""
        p = ",".join(str(x) for x in self.params)
        return f"{self.name}:{p}" if p else self.name

    @classmethod
    def parse(cls, args: str) -> "MaskMod":
        """The rule from the text after ``name:`` (comma-separated integers)."""
        parts = [a.strip() for a in args.split(",")] if args.strip() else []
        fields = [f.name for f in dataclasses.fields(cls)]
        if len(parts) != len(fields):
            raise ValueError(f"mask_mod {cls.name!r} takes {len(fields)} parameter(s) "
                             f"({', '.join(fields) or 'none'}), written {cls.name}:"
                             f"{','.join(fields).upper()}; got {args!r}")
        values = []
        for field, text in zip(fields, parts):
            try:
                values.append(int(text))
            except ValueError:
                raise ValueError(f"mask_mod {cls.name!r}: {field} must be an integer, got {text!r}") from None
        return cls(*values)

    @classmethod
    def example(cls, n: int) -> "MaskMod":
        """An instance for ``n`` rows that hides some pairs and shows others."""
        raise NotImplementedError

    # -------------------------------------------------------------- the rule
    def __call__(self, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        raise NotImplementedError

    def hull(self, q0: int, q1: int, k0: int, k1: int) -> str | None:
        """``"none"``, ``"all"`` or ``"some"`` for every pair of ``[q0, q1] x [k0, k1]``
        (inclusive), or None when it cannot tell (the pairs are then evaluated)."""
        return None
