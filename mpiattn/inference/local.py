"""One rank's partial attention: queries at known global positions against its own cache rows.

Decode (:mod:`mpiattn.inference.decode`) and pass-Q prefill
(:mod:`mpiattn.inference.prefill`) both need, on every rank, the partial
``(o, lse)`` of some queries over the keys this rank holds; the lse merge
(:mod:`mpiattn.inference.merge`) then makes them whole. Queries and keys are
placed by their *absolute* positions in the sequence, so the causal rule
(``j <= i``) is bottom-right alignment by construction (the rules' diagonal
is 0), and the window is measured from the query's own position. Each stored
block (:class:`mpiattn.inference.shard.Shard`) goes through the blocked
runner (:func:`mpiattn.strategies.blocked.run_forward`), like any strategy's
blocks: a block no query sees is skipped (a rank whose keys all lie outside
every query's window computes nothing).
"""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np

from ..kernels import DEFAULT_TILE
from ..kernels.call import KernelCall
from ..kernels.engine import Engine
from ..masks import MaskSpec, QuerySide
from ..masks.modifiers import Modifiers
from ..strategies.blocked import Attend, KeyBlock, run_forward
from ..strategies.spec import AttentionSpec

__all__ = ["step_attend", "partial_attention"]


def step_attend(engine: Engine, spec: AttentionSpec, q_pos: np.ndarray, finite: bool,
                mods: Modifiers | None = None) -> Attend:
    """The blocked runner's view of queries at absolute positions ``q_pos`` of the call ``spec``
    (its rules, scale and value dim; key/value blocks then come at absolute positions);
    ``mods``: its softcap and ALiBi slopes (distances between absolute positions)."""
    call = KernelCall.of(spec, tile=spec.tile or DEFAULT_TILE, finite=finite)
    return Attend(engine, call, MaskSpec(causal=spec.mask.causal, window=spec.mask.window),
                  QuerySide(np.asarray(q_pos, dtype=np.int64), mods=mods,
                            heads=None if mods is None else np.arange(spec.H)))


def partial_attention(attend: Attend, q: Any, blocks: Iterable[tuple]) -> tuple[Any, Any, int]:
    """The partial ``(o, lse)`` of queries ``q (B, H, n, E)`` over this rank's key/value ``blocks``.

    Parameters
    ----------
    attend : Attend
        From :func:`step_attend`.
    q : array, shape (B, H, n, E)
    blocks : iterable of (k, v, pos)
        ``k (B, Hkv, m, E)``, ``v (B, Hkv, m, Ev)``, ``pos (m,)`` int64 absolute positions.

    Returns
    -------
    o : array, shape (B, H, n, Ev), the accumulation dtype
    lse : array, shape (B, H, n), the accumulation dtype (``-inf``: no key seen)
    blocks_used : int
        How many blocks held a visible key (0: nothing was computed).
    """
    keys = (KeyBlock(k, v, pos, None) for k, v, pos in blocks)
    return run_forward(attend, q, keys, 0)
