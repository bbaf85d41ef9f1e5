"""Deterministic synthetic inputs, generated rank by rank.

``make-data`` must give the same file for a seed whatever the number of
ranks, without any rank generating (or holding) the whole sequence. The
sequence axis is therefore cut into fixed chunks of :data:`CHUNK_ROWS` rows;
chunk ``c`` of dataset ``name`` is drawn from its own generator seeded by
``(seed, dataset id, c)``. A rank producing global rows ``[a, b)`` draws only
the chunks that overlap them and keeps the rows it needs.

Values: ``q``, ``k``, ``v``, ``dout`` are standard normal (drawn in float64,
then cast); ``key_padding_mask[b, j]`` is True (padding) with probability
``padding``. Packed documents (``docs`` = mean length ``L``): row ``i`` of
batch entry ``b`` starts a new document with probability ``1/L`` (row 0
always), so lengths are geometric with mean ``L``; ``segment_ids[b, i]`` is
the position of the first row of its document. A rank finds the start before
its rows by drawing earlier chunks' starts only (about ``L`` rows back).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

__all__ = ["CHUNK_ROWS", "DATASET_IDS", "Spec", "rows", "local_rows"]

#: Rows per independently seeded chunk (part of the file format's determinism: never change).
CHUNK_ROWS = 256

#: Stable numeric id of each generated dataset (part of the seed).
DATASET_IDS = {"q": 1, "k": 2, "v": 3, "dout": 4, "key_padding_mask": 5, "segment_ids": 6}


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
    docs : int
        Mean document length of packed documents (dataset ``segment_ids``
        (B, N); needs ``seq == kv_seq``); 0 means none.
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
    docs: int = 0

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
        if self.docs > 0:
            out["segment_ids"] = ((B, self.seq), 1)
        return out


def _chunk(spec: Spec, name: str, shape: tuple[int, ...], axis: int, c: int) -> np.ndarray:
    """Chunk ``c`` (rows ``[c*CHUNK_ROWS, ...)`` along ``axis``) of dataset ``name``."""
    n = shape[axis]
    lo, hi = c * CHUNK_ROWS, min(n, (c + 1) * CHUNK_ROWS)
    cshape = shape[:axis] + (hi - lo,) + shape[axis + 1:]
    rng = np.random.default_rng([int(spec.seed), DATASET_IDS[name], c])
    if name == "segment_ids":  # True where a document starts
        starts = rng.random(cshape) < 1.0 / spec.docs
        if c == 0 and starts.size:
            starts[:, 0] = True
        return starts
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
    if name == "segment_ids":
        return _document_ids(spec, shape, start, stop)
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


def _document_ids(spec: Spec, shape: tuple[int, ...], start: int, stop: int) -> np.ndarray:
    """``segment_ids`` rows ``[start, stop)``: the position of each row's document start."""
    B = shape[0]
    first = start // CHUNK_ROWS
    lo = first * CHUNK_ROWS
    c_stop = -(-stop // CHUNK_ROWS)
    if c_stop <= first:
        return np.zeros((B, 0), dtype=np.int64)
    starts = np.concatenate([_chunk(spec, "segment_ids", shape, 1, c) for c in range(first, c_stop)], axis=1)
    pos = np.arange(lo, lo + starts.shape[1], dtype=np.int64)
    ids = np.maximum.accumulate(np.where(starts, pos[None, :], -1), axis=1)
    before = np.full(B, -1, dtype=np.int64)  # the last start before chunk `first`, per batch entry
    c = first - 1
    while (before < 0).any() and c >= 0:
        s = _chunk(spec, "segment_ids", shape, 1, c)
        last = np.where(s.any(axis=1), c * CHUNK_ROWS + s.shape[1] - 1 - np.argmax(s[:, ::-1], axis=1), -1)
        before = np.where(before < 0, last, before)
        c -= 1
    ids = np.maximum(ids, before[:, None])
    return ids[:, start - lo:stop - lo]


def local_rows(spec: Spec, name: str, segs: Sequence[tuple[int, int]]) -> np.ndarray:
    """This rank's rows of ``name`` for its layout segments ``[(global_start, length), ...]``."""
    shape, axis = spec.datasets()[name]
    if not segs:
        return rows(spec, name, 0, 0)
    return np.concatenate([rows(spec, name, g, g + ln) for g, ln in segs], axis=axis)
