"""One rank's partial attention: queries at known global positions against its own cache rows.

Decode (:mod:`mpiattn.inference.decode`) and pass-Q prefill
(:mod:`mpiattn.inference.prefill`) both need, on every rank, the partial
``(o, lse)`` of some queries over the keys this rank holds; the lse merge
(:mod:`mpiattn.inference.merge`) then makes them whole. Queries and keys are
placed by their *absolute* positions in the sequence, so the causal rule
(``j <= i``) is bottom-right alignment by construction, and the window is
measured from the query's own position. Each stored block
(:class:`mpiattn.inference.shard.Shard`) goes to the engine with its
:class:`~mpiattn.masks.BlockMask`; a block no query sees is skipped (a rank
whose keys all lie outside every query's window computes nothing).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np

from .. import backend
from ..kernels.engine import Engine
from ..masks import BlockMask

__all__ = ["Rules", "partial_attention"]


@dataclass(frozen=True)
class Rules:
    """What the queries of a step may see, in absolute positions.

    Attributes
    ----------
    causal : bool
        Query at position ``i`` sees keys ``j <= i`` only.
    window : (left, right) or None
        Only keys ``i - left <= j <= i + right``.
    scale : float
    """

    causal: bool
    window: tuple | None
    scale: float


def partial_attention(engine: Engine, q: Any, q_pos: np.ndarray, blocks: Iterable[tuple],
                      hkv: int, ev: int, rules: Rules, *, tile: int, finite: bool = True,
                      fused: bool = False) -> tuple[Any, Any, int]:
    """The partial ``(o, lse)`` of queries ``q`` over this rank's key/value ``blocks``.

    Parameters
    ----------
    engine : Engine
    q : array, shape (B, H, n, E)
    q_pos : (n,) int64
        The queries' absolute positions.
    blocks : iterable of (k, v, pos)
        ``k (B, Hkv, m, E)``, ``v (B, Hkv, m, Ev)``, ``pos (m,)`` int64.
    hkv, ev : int
        Key/value heads and value head dim.
    rules : Rules
    tile : int
        The native engine's score tile rows.
    finite, fused : bool
        As :meth:`mpiattn.kernels.engine.Engine.forward`.

    Returns
    -------
    o : array, shape (B, H, n, Ev), the accumulation dtype
    lse : array, shape (B, H, n), the accumulation dtype (``-inf``: no key seen)
    blocks_used : int
        How many blocks held a visible key (0: nothing was computed).
    """
    acc = backend.accum_dtype(q.dtype)
    xp = backend.array_module(q)
    f = None
    used = 0
    for k, v, pos in blocks:
        bm = BlockMask(q_pos, pos, rules.causal, None, rules.window)
        if bm.visibility(0, q_pos.size, 0, pos.size) == "none":
            continue
        if f is None:
            f = engine.forward(q=q, hkv=hkv, scale=rules.scale, acc_dtype=acc, ev=ev, tile=tile,
                               finite=finite, fused=fused)
        f.add(k, v, bm)
        used += 1
    if f is None:
        B, H, n = q.shape[:3]
        return xp.zeros((B, H, n, ev), acc), xp.full((B, H, n), -np.inf, acc), 0
    o, lse = f.result()
    return o, lse, used
