"""Deterministic synthetic inputs, generated rank by rank.

``make-data`` must give the same file for a seed whatever the number of
ranks, without any rank generating (or holding) the whole sequence. The
sequence axis is therefore cut into fixed chunks of :data:`CHUNK_ROWS` rows;
chunk ``c`` of dataset ``name`` is drawn from its own generator seeded by
``(seed, dataset id, c)``. A rank producing global rows ``[a, b)`` draws only
the chunks that overlap them and keeps the rows it needs.

Values: ``q``, ``k``, ``v``, ``dout`` are standard normal (drawn in float64,
then cast); ``key_padding_mask[b, j]`` is True (padding) with probability
``padding``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

__all__ = ["CHUNK_ROWS", "DATASET_IDS", "Spec", "rows", "local_rows"]

#: Rows per independently seeded chunk (part of the file format's determinism: never change).
CHUNK_ROWS = 256

#: Stable numeric id of each generated dataset (part of the seed).
DATASET_IDS = {"q": 1, "k": 2, "v": 3, "dout": 4, "key_padding_mask": 5}


@dataclass(frozen=True)
class Spec:
    """Global shapes of a synthetic problem.

    Attributes
    ----------
    batch, heads, kv_heads : int
        ``B``, ``H``, ``Hkv`` (``H`` a multiple of ``Hkv``).
    seq, kv_seq : int
        ``N`` query rows, ``M`` key/value rows.
    dim, value_dim : int
        ``E`` (queries and keys), ``Ev`` (values).
    dtype : str
        Stored dtype of the float datasets.
    with_dout : bool
        Also generate ``dout`` (B, H, N, Ev).
    padding : float
        Probability that a key is padding; 0 means no mask dataset.
    seed : int
    """

    batch: int = 1
    heads: int = 4
    kv_heads: int = 4
    seq: int = 1024
    kv_seq: int = 1024
    dim: int = 64
    value_dim: int = 64
    dtype: str = "float32"
    with_dout: bool = False
    padding: float = 0.0
    seed: int = 0

    def datasets(self) -> dict[str, tuple[tuple[int, ...], int]]:
        """``name -> (global shape, sequence axis)`` for every dataset to generate."""
        B, H, Hkv = self.batch, self.heads, self.kv_heads
        out = {"q": ((B, H, self.seq, self.dim), 2),
               "k": ((B, Hkv, self.kv_seq, self.dim), 2),
               "v": ((B, Hkv, self.kv_seq, self.value_dim), 2)}
        if self.with_dout:
            out["dout"] = ((B, H, self.seq, self.value_dim), 2)
        if self.padding > 0:
            out["key_padding_mask"] = ((B, self.kv_seq), 1)
        return out


def _chunk(spec: Spec, name: str, shape: tuple[int, ...], axis: int, c: int) -> np.ndarray:
    """Chunk ``c`` (rows ``[c*CHUNK_ROWS, ...)`` along ``axis``) of dataset ``name``."""
    n = shape[axis]
    lo, hi = c * CHUNK_ROWS, min(n, (c + 1) * CHUNK_ROWS)
    cshape = shape[:axis] + (hi - lo,) + shape[axis + 1:]
    rng = np.random.default_rng([int(spec.seed), DATASET_IDS[name], c])
    if name == "key_padding_mask":
        return rng.random(cshape) < spec.padding
    return rng.standard_normal(cshape).astype(spec.dtype)


def rows(spec: Spec, name: str, start: int, stop: int) -> np.ndarray:
    """Global rows ``[start, stop)`` of dataset ``name`` along its sequence axis.

    Returns
    -------
    numpy.ndarray
        The dataset's global shape with the sequence axis cut to ``stop - start``.
    """
    shape, axis = spec.datasets()[name]
    if not 0 <= start <= stop <= shape[axis]:
        raise ValueError(f"rows [{start}, {stop}) out of range for {name} of length {shape[axis]}")
    parts = []
    for c in range(start // CHUNK_ROWS, -(-stop // CHUNK_ROWS)):
        lo = c * CHUNK_ROWS
        block = _chunk(spec, name, shape, axis, c)
        sl = [slice(None)] * len(shape)
        sl[axis] = slice(max(start, lo) - lo, min(stop, lo + CHUNK_ROWS) - lo)
        parts.append(block[tuple(sl)])
    if not parts:
        dtype = bool if name == "key_padding_mask" else spec.dtype
        return np.empty(shape[:axis] + (0,) + shape[axis + 1:], dtype=dtype)
    return np.concatenate(parts, axis=axis)


def local_rows(spec: Spec, name: str, segs: Sequence[tuple[int, int]]) -> np.ndarray:
    """This rank's rows of ``name`` for its layout segments ``[(global_start, length), ...]``."""
    shape, axis = spec.datasets()[name]
    if not segs:
        return rows(spec, name, 0, 0)
    return np.concatenate([rows(spec, name, g, g + ln) for g, ln in segs], axis=axis)
