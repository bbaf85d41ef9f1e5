"""What the ranks compare of a ``mask_mod``: its text, its code and captured values, its answers.

Every rank passes its own ``mask_mod`` (a function cannot be sent), and a
call is exact only when they are one rule. The ranks compare

* a :class:`~mpiattn.masks.maskmod.MaskMod` by its text (``chunked:4096``), which
  names the rule and every parameter;
* a plain function by :func:`identity`: its module and qualified name, a CRC-32
  of its bytecode and constants, and of the values it captures (closure cells
  and defaults: numbers, strings, NumPy or torch arrays by their bytes; other
  objects by their type), so that two closures of one function over different
  parameters differ;
* and, once the sequence lengths are agreed, by :func:`answers`: a CRC-32 of its
  answers on a fixed sample of pairs (a spread of queries and keys, and a band
  round the diagonal where windows and chunks change), which catches a rule
  that reads a global variable set differently per rank.

A ``score_mod`` (a transform of the scores) is compared the same way: by
:func:`identity` before the call, and by :func:`score_answers` once the lengths
are agreed, its answers on a fixed sample of scores and pairs, equal to a
relative ``1e-6`` (:func:`same_answers`).

Neither can prove two functions equal; both are cheap (host NumPy, about 10^5
evaluated pairs at most) and catch the mistakes seen in practice.
"""

from __future__ import annotations

import zlib
from typing import Any, Callable

import numpy as np

from .maskmod import MaskMod
from .modifiers import ask

__all__ = ["identity", "answers", "score_answers", "same_answers", "SAMPLE_ROWS", "SAMPLE_BAND"]

#: Query (and key) positions sampled evenly over the sequence by :func:`answers`.
SAMPLE_ROWS = 48
#: Keys either side of each sampled query's diagonal that :func:`answers` also asks.
SAMPLE_BAND = 24
#: How deep :func:`identity` follows captured values (tuples in tuples, functions they hold).
DEPTH = 6


def _crc(data: bytes, crc: int = 0) -> int:
    return zlib.crc32(data, crc)


def _value_crc(x: Any, crc: int, depth: int = 0) -> int:
    """Fold one captured value into ``crc``: its bytes where it has comparable ones, else its type."""
    if x is None or isinstance(x, (bool, int, float, complex, str, bytes)):
        return _crc(repr((type(x).__name__, x)).encode(), crc)
    if isinstance(x, MaskMod):
        return _crc(x.key.encode(), crc)
    if isinstance(x, (tuple, list)) and depth < DEPTH and len(x) <= 1024:
        crc = _crc(f"{type(x).__name__}{len(x)}".encode(), crc)
        for item in x:
            crc = _value_crc(item, crc, depth + 1)
        return crc
    if isinstance(x, np.ndarray) or isinstance(x, np.generic):
        a = np.ascontiguousarray(x)
        return _crc(a.tobytes(), _crc(f"{a.dtype.str}{a.shape}".encode(), crc))
    if type(x).__module__.split(".")[0] == "torch" and hasattr(x, "detach"):  # a tensor
        t = x.detach().cpu().contiguous()
        return _crc(t.view(-1).view(dtype=__import__("torch").uint8).numpy().tobytes(),
                    _crc(f"{t.dtype}{tuple(t.shape)}".encode(), crc))
    if callable(x) and depth < DEPTH:
        return _crc(repr(identity(x, depth + 1)).encode(), crc)
    return _crc(f"{type(x).__module__}.{type(x).__qualname__}".encode(), crc)


def _code_crc(code: Any, crc: int, depth: int) -> int:
    crc = _crc(code.co_code, crc)
    for c in code.co_consts:
        crc = _code_crc(c, crc, depth + 1) if hasattr(c, "co_code") and depth < DEPTH else _value_crc(c, crc, DEPTH)
    return _crc(repr(code.co_names).encode(), crc)


def identity(fn: Callable, depth: int = 0) -> tuple:
    """What the ranks compare of ``fn`` before a call (see the module docstring)."""
    if isinstance(fn, MaskMod):
        return (fn.key,)
    target = getattr(fn, "__func__", fn)  # a bound method: its function (and its object below)
    name = (getattr(target, "__module__", None), getattr(target, "__qualname__", type(fn).__name__))
    code = getattr(target, "__code__", None)
    if code is None:  # a callable object: its class, and its attributes' values
        crc = _value_crc(getattr(fn, "__dict__", None) and tuple(sorted(
            (k, v) for k, v in vars(fn).items() if not k.startswith("_"))), 0, depth)
        return name + (crc,)
    crc = _code_crc(code, 0, depth)
    cells = tuple(c.cell_contents for c in (getattr(target, "__closure__", None) or ())
                  if _filled(c))
    crc = _value_crc(cells, crc, depth)
    crc = _value_crc(tuple(getattr(target, "__defaults__", None) or ()), crc, depth)
    if hasattr(fn, "__self__"):
        crc = _value_crc(fn.__self__, crc, depth + 1)
    return name + (crc,)


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # an empty cell (a name not yet bound)
        return False
    return True


def _sample(n: int, rows: int) -> np.ndarray:
    """Up to ``rows`` positions spread evenly over ``0 .. n-1`` (both ends included)."""
    if n <= 0:
        return np.zeros(0, dtype=np.int64)
    return np.unique(np.linspace(0, n - 1, min(rows, n)).round().astype(np.int64))


def answers(fn: Callable, B: int, H: int, N: int, M: int, diagonal: int = 0) -> int:
    """CRC-32 of ``fn``'s answers (every batch entry and query head up to 8 each) on a fixed
    sample of (query, key) pairs of an ``N x M`` call: a spread grid, and a band of keys round
    each sampled query's diagonal (``j = i + diagonal``)."""
    q = _sample(N, SAMPLE_ROWS)
    if q.size == 0 or M <= 0:
        return 0
    b, h = np.arange(min(max(B, 1), 8)), np.arange(min(max(H, 1), 8))
    crc = _crc(np.packbits(ask(fn, b, h, q, _sample(M, SAMPLE_ROWS))).tobytes())
    band = np.arange(-SAMPLE_BAND, SAMPLE_BAND + 1)
    for i in q:
        k = np.unique(np.clip(i + diagonal + band, 0, M - 1))
        crc = _crc(np.packbits(ask(fn, b, h, [i], k)).tobytes(), crc)
    return crc


def score_answers(transform: Any, B: int, H: int, N: int, M: int, diagonal: int = 0) -> np.ndarray:
    """A score transform's (``score_mod``'s) answers, float64, on a fixed sample: raw scores
    spread over ``[-4, 4]`` at the pairs of :func:`answers`' spread grid, every batch entry and
    query head up to 8 each (compared with a tolerance, :func:`same_answers`: a transcendental
    function may round differently on another kind of CPU)."""
    from .scoremod import TileIndex

    q, k = _sample(N, SAMPLE_ROWS // 2), _sample(M, SAMPLE_ROWS // 2)
    if q.size == 0 or k.size == 0:
        return np.zeros(0)
    b, h = np.arange(min(max(B, 1), 8)), np.arange(min(max(H, 1), 8))
    shape = (b.size, h.size, q.size, k.size)
    S = np.linspace(-4.0, 4.0, int(np.prod(shape))).reshape(shape)
    at = TileIndex(lambda: (b.reshape(-1, 1, 1, 1), h.reshape(1, -1, 1, 1), q.reshape(1, 1, -1, 1),
                            k.reshape(1, 1, 1, -1)))
    return np.asarray(transform.forward_(S, at), dtype=np.float64).ravel()


def same_answers(a: np.ndarray, b: np.ndarray, rtol: float = 1e-6) -> bool:
    """Whether two ranks' :func:`score_answers` agree (NaN where the other has NaN too)."""
    if a.shape != b.shape:
        return False
    fin = np.isfinite(a) & np.isfinite(b)
    same_nonfinite = np.array_equal(np.isnan(a), np.isnan(b)) and np.array_equal(a[~fin], b[~fin])
    return bool(same_nonfinite and np.all(np.abs(a[fin] - b[fin]) <= rtol * (1 + np.abs(b[fin]))))
