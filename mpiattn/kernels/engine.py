"""What a local attention engine is: one interface, and the capabilities it declares.

An engine computes one rank's attention against one key/value block at a
time; the blocked runner (:mod:`mpiattn.strategies.blocked`) brings the
blocks, for every strategy and for decode. One object carries what the
engine is told of the call, a :class:`~mpiattn.kernels.call.KernelCall`:

``engine.forward(call, q)`` -> ``f``
    ``f.add(k, v, mask)`` folds a block in (``mask`` a
    :class:`~mpiattn.masks.BlockMask`, which also forms the scores: softcap,
    ALiBi, ``attn_mask``, ``mask_mod``); ``f.result()`` returns ``out (B, H,
    n, Ev)`` and ``lse (B, H, n)`` in the accumulation dtype (rows that saw
    no key: ``out = 0``, ``lse = -inf``); with ``call.max_logit``,
    ``f.max_logit()`` returns the largest ``scale q . k`` of a visible pair
    per query head, float64 host ``(H,)`` (``-inf``: none).
``engine.backward(call, q, dout, out, lse, D)`` -> ``b``
    ``b.add(k, v, mask, dk, dv)`` adds the block's gradients into ``dk``,
    ``dv`` (``(B, Hkv, k, E/Ev)``, accumulation dtype) and keeps ``dq``;
    ``b.result()`` returns ``dq (B, H, n, E)``. The global ``lse`` and
    ``D = rowsum(dout * out)`` make each block's gradients exact
    (FlashAttention-2), whatever the order of the blocks; ``out`` is None
    unless the engine declares :attr:`Capabilities.needs_out`.

An engine declares what it can do (:class:`Capabilities`) and answers
:meth:`Engine.supports` for a call from those declarations alone; an engine
that needs an optional library says whether it is usable in
:meth:`Engine.usable` (which may import it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from ..masks.modifiers import ENGINE_MODIFIERS
from .call import KernelCall

__all__ = ["Capabilities", "Engine", "Forward", "Backward", "KernelCall"]


class Forward(Protocol):
    """A forward pass of one call (see the module docstring)."""

    def add(self, k: Any, v: Any, mask: Any) -> None: ...

    def result(self) -> tuple[Any, Any]: ...


class Backward(Protocol):
    """A backward pass of one call (see the module docstring)."""

    def add(self, k: Any, v: Any, mask: Any, dk: Any, dv: Any) -> None: ...

    def result(self) -> Any: ...


@dataclass(frozen=True)
class Capabilities:
    """What an engine declares it computes.

    Attributes
    ----------
    dtypes : dict of str to tuple of str
        Device (``"numpy"``, ``"cupy"``) -> the input dtypes it takes there;
        a device not listed is not supported.
    rules : tuple of str
        The mask rules it applies (:data:`mpiattn.masks.RULES`).
    needs_out : bool
        Its backward reads the forward's ``out`` (else ``D`` suffices).
    head_dim_multiple : dict of str to int
        Device -> the head dims ``E``, ``Ev`` must be multiples of (1: any).
    modifiers : tuple of str
        The score modifiers it applies (:data:`mpiattn.masks.modifiers.MODIFIERS`;
        ``sinks`` need none: they are added to the merged rows).
    """

    dtypes: dict
    rules: tuple
    needs_out: bool = False
    head_dim_multiple: dict | None = None
    modifiers: tuple = ()


class Engine:
    """An engine: a name, its capabilities, and the forward and backward of a call."""

    name: str = ""
    capabilities: Capabilities

    def supports(self, spec: Any) -> str | None:
        """None when the declared capabilities cover the call ``spec``, else why not (no import).

        ``spec`` is an :class:`mpiattn.strategies.spec.AttentionSpec`.
        """
        cap = self.capabilities
        dtypes = cap.dtypes.get(spec.device)
        if dtypes is None:
            return f"the {self.name} engine does not run on {spec.device} arrays"
        if np.dtype(spec.dtype).name not in dtypes:
            return (f"the {self.name} engine takes {', '.join(dtypes)} on {spec.device}, "
                    f"not {np.dtype(spec.dtype).name}")
        extra = [r for r in spec.mask.rules if r not in cap.rules]
        if extra:
            return f"the {self.name} engine has no {', '.join(extra)} masks"
        extra = [m for m in spec.mask.modifiers if m in ENGINE_MODIFIERS and m not in cap.modifiers]
        if extra:
            return f"the {self.name} engine has no {', '.join(extra)}"
        mult = (cap.head_dim_multiple or {}).get(spec.device, 1)
        if spec.E % mult or spec.Ev % mult:
            return f"the {self.name} engine on {spec.device} needs head dims that are multiples of {mult}"
        return None

    def usable(self, device: str) -> str | None:
        """None when the engine can run here on ``device`` (it may import a library), else why not."""
        return None

    def block_rows(self, spec: Any, max_rows: int) -> int:
        """Rows per exchanged key/value block when the caller gave none (``max_rows``: the longest shard)."""
        raise NotImplementedError

    def tile_rows(self, spec: Any) -> int | None:
        """This rank's preferred score tile for ``spec``, from its device (local), or None.

        The ranks' answers are gathered and the smallest becomes ``spec.tile``.
        """
        return None

    def forward(self, call: KernelCall, q: Any) -> Forward:
        """Start a forward pass for queries ``q (B, H, n, E)``."""
        raise NotImplementedError

    def backward(self, call: KernelCall, q: Any, dout: Any, out: Any, lse: Any, D: Any) -> Backward:
        """Start a backward pass (``lse``, ``D``: ``(B, H, n)``, global)."""
        raise NotImplementedError
