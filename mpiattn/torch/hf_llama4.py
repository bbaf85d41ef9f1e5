"""Llama 4's NoPE query scales on sequence shards, made those of the global positions.

Llama 4's layers without RoPE (``no_rope_layers``), when the config sets
``attn_temperature_tuning``, multiply each query row by a scale of its position
``p``, in float32::

    s(p) = log1p(floor((p + 1) / floor_scale)) * attn_scale + 1

and cast the product back to the query's dtype. The model takes ``p`` from
``arange`` of the rows it holds, not from ``position_ids``: on a rank's shard,
row ``i`` is scaled as position ``i``, not as its global position ``g``.

:func:`retuned` puts that right inside the attention function, before the
queries reach :func:`mpiattn.torch.attention`. Where the model's local scale was
exactly 1 (``s(i) == 1`` for ``i <= floor_scale - 2``: ``log1p(0)`` is 0) the
query it handed over is the unscaled one, bit for bit, and the adapter computes
``(query * s(g)).to(dtype)``: the same product of the same float32 scale and the
same query, elementwise, that the single-process model computes (the order of a
transpose does not change an elementwise product), so the result is exact, not
close. Where ``s(i) == s(g)`` (one rank; a row whose local and global positions
fall in one bucket of ``floor_scale``) nothing is to be done. Any other row is
refused (:func:`check`): the local scale cannot be divided out exactly. A rank
that holds at most ``floor_scale - 1`` rows (Llama 4 ships ``floor_scale=8192``)
never meets one.

Decoding (:func:`mpiattn.torch.hf.generate`) runs each new token alone, at local
position 0 (scale 1): it is scaled for its global position the same way.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["tuning", "scales", "check", "check_tuned", "rescales", "retuned"]


def tuning(config: Any) -> tuple | None:
    """``(floor_scale, attn_scale)`` where some layer of the model scales its queries by their
    positions without RoPE (Llama 4's NoPE layers with ``attn_temperature_tuning``), else None."""
    nope = not all(getattr(config, "no_rope_layers", None) or [1])
    tuned = nope and getattr(config, "attn_temperature_tuning", False)
    return (config.floor_scale, config.attn_scale) if tuned else None


def scales(rows: torch.Tensor, floor_scale: Any, attn_scale: Any) -> torch.Tensor:
    """Llama 4's query scale (float32) of the rows at positions ``rows``, as its model writes it."""
    return torch.log1p(torch.floor((rows.float() + 1.0) / floor_scale)) * attn_scale + 1.0


def check(config: Any, want: torch.Tensor) -> None:
    """Raise where a NoPE layer's local scale of a row (global positions ``want``) is neither 1
    nor its global one's (which :func:`retuned` could not make exact)."""
    check_tuned(tuning(config), want)


def check_tuned(tuned: tuple | None, want: torch.Tensor) -> None:
    """:func:`check` from the config's :func:`tuning` (None: no NoPE scales)."""
    if tuned is None:
        return
    here = scales(torch.arange(len(want)), *tuned)
    bad = ((here != 1) & (here != scales(want, *tuned))).nonzero()
    if len(bad):
        i = int(bad[0, 0])
        raise ValueError(f"mpiattn.torch.hf: the NoPE layers scale the queries by their positions "
                         f"(attn_temperature_tuning, floor_scale={tuned[0]}) and take them as "
                         f"local: this rank's row {i} (global position {int(want[i])}) is scaled "
                         f"as position {i}, which the adapter cannot undo exactly; hold at most "
                         f"{tuned[0] - 1} rows per rank (more ranks)")


def rescales(module: Any) -> bool:
    """Whether ``module`` is a Llama 4 NoPE layer whose queries :func:`retuned` scales."""
    return bool(getattr(module, "attn_temperature_tuning", False)) and not getattr(module, "use_rope", True)


def retuned(module: Any, query: torch.Tensor, rows: Any) -> torch.Tensor:
    """``query`` (B, H, n, E) of a Llama 4 NoPE layer scaled for its rows' global positions
    ``rows`` (or a function giving them) where the model's local scale was 1; else ``query``."""
    if not rescales(module):
        return query
    rows = rows() if callable(rows) else rows
    n = int(query.shape[2])
    here = scales(torch.arange(n, device=query.device), module.floor_scale, module.attn_scale)
    there = scales(rows.to(query.device), module.floor_scale, module.attn_scale)
    factor = torch.where(here == 1, there, torch.ones_like(there))
    if bool((factor == 1).all()):
        return query
    return (query * factor.view(1, 1, n, 1)).to(query.dtype)
