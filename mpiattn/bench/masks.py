"""Benchmarks of issue 12: sliding windows, packed documents and balanced layouts.

The measured numbers and their commands are in ``benchmarks/masks/``. Two parts:

``single`` (one process, P = 1)
    N = 32k, H = 1, E = 64, float32, causal, native engine, forward (and with
    ``--backward`` the backward too). Times full causal attention, the window
    ``(1024, 0)`` and packed documents of mean length 2048, each the median of
    ``--repeats`` after one warm-up call, and prints the targets::

        window time / causal time                          <= 0.15
        documents time / (visible fraction * causal time)  <= 2.5

    where the visible fraction is visible pairs (causal documents) / visible
    pairs (causal).
``balance`` (under ``mpiexec -n P``, P = 2 for the issue)
    Causal packed documents through mpiattn (``strategy="auto"``: the
    library's choice, named in each record) with the ``balanced``
    (:func:`mpiattn.balance` counting visible tiles of ``--block`` rows),
    ``balanced-pairs`` (the same counting visible pairs), ``contiguous``
    and ``zigzag`` layouts. The
    per-rank *compute* time is the time spent inside the native engine's kernel calls
    (:func:`mpiattn.kernels.native.forward_block`, wrapped with a timer), so
    waiting for a neighbour does not count; printed per rank with the spread
    ``max / min - 1`` (target for ``balanced``: within 10 %), the visible pairs
    per rank and the computed tiles per rank.

Whole calls are timed with the package's one timer (:class:`mpiattn.timing.Timer`),
the per-rank compute time inside the kernels with :class:`KernelClock`; the inputs
and documents come from :mod:`mpiattn.io.datagen` (seed 1).

Usage::

    OMP_NUM_THREADS=1 python -m mpiattn.bench.masks single [--n 32768] [--json out.jsonl]
    OMP_NUM_THREADS=1 mpiexec -n 2 python -m mpiattn.bench.masks balance [--n 32768]
    python -m mpiattn.bench.masks single --n 2048 --repeats 1     # a smoke test, seconds

Every record is also written as one JSON object per line with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any, Callable

from .. import balancing
from ..comm.core import get_comm
from ..io import datagen
from ..kernels import DEFAULT_TILE, native
from ..kernels.native_engine import NativeEngine
from ..layouts import segments
from ..strategies import attention, attention_backward
from ..timing import Timer


Emit = Callable[[dict], None]


def _spec(args: argparse.Namespace) -> datagen.Spec:
    """The problem: ``(1, 1, n, 64)`` float32 and packed documents of mean length ``--mean-doc``."""
    return datagen.Spec(batch=1, heads=1, kv_heads=1, seq=args.n, kv_seq=args.n, dim=64, value_dim=64,
                        with_dout=True, docs=args.mean_doc, seed=1)


def _rows(c: Any, spec: datagen.Spec, layout: Any, *names: str) -> list:
    """This rank's rows of ``names`` under ``layout`` (:mod:`mpiattn.io.datagen`)."""
    return [datagen.local_rows(spec, name, segments(spec.seq, c.rank, c.size, layout)) for name in names]


class KernelClock:
    """Time and tiles inside the native engine's kernels on this rank (compute only, no waiting)."""

    def __init__(self) -> None:
        self.seconds, self.tiles = 0.0, 0
        self._block, self._tile = native.forward_block, native._tile_generic

    def __enter__(self) -> "KernelClock":
        def block(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return self._block(*a, **k)
            finally:
                self.seconds += time.perf_counter() - t0

        def tile(*a: Any, **k: Any) -> Any:
            self.tiles += 1
            return self._tile(*a, **k)

        native.forward_block, native._tile_generic = block, tile
        return self

    def __exit__(self, *exc: Any) -> None:
        native.forward_block, native._tile_generic = self._block, self._tile


def single(args: argparse.Namespace, emit: Emit) -> None:
    """Causal, window and documents on one process: times, visible pairs, tiles, the two targets."""
    c = get_comm()
    if c.size != 1:
        raise SystemExit("the 'single' part runs on one process (P = 1)")
    n, spec = args.n, _spec(args)
    q, k, v, do, seg = _rows(c, spec, "contiguous", "q", "k", "v", "dout", "segment_ids")
    cases = {"causal": {}, f"window {args.window[0]},{args.window[1]}": dict(window=tuple(args.window)),
             f"documents mean {args.mean_doc}": dict(segment_ids=seg)}
    results = []
    for name, extra in cases.items():
        kw = dict(causal=True, engine=NativeEngine.name, block_size=args.block, **extra)

        def step() -> None:
            out, lse = attention(q, k, v, **kw)
            if args.backward:
                attention_backward(do, q, k, v, out, lse, **kw)

        used: dict = {}
        with KernelClock() as clock:
            attention(q, k, v, details=used, **kw)
        t = Timer(c).measure(step, warmup=1, repeat=args.repeats).median
        pairs = int(balancing.row_work(n, causal=True, window=extra.get("window"),
                                       segment_ids=extra.get("segment_ids")).sum())
        results.append((t, pairs))
        emit({"part": "single", "case": name, "N": n, "time_s": t, "visible_pairs": pairs, "tiles": clock.tiles,
              "backward": args.backward, "block": args.block, "strategy": used["strategy"]})
    (t_c, p_c), (t_w, _), (t_d, p_d) = results
    frac = p_d / p_c
    emit({"part": "single", "target": "window / causal <= 0.15", "value": t_w / t_c, "met": t_w / t_c <= 0.15})
    emit({"part": "single", "target": "documents / (visible fraction * causal) <= 2.5",
          "visible_fraction": frac, "value": t_d / (frac * t_c), "met": t_d / (frac * t_c) <= 2.5})


def balance_part(args: argparse.Namespace, emit: Emit) -> None:
    """Causal documents under four layouts: compute time, tiles and visible pairs per rank."""
    c = get_comm()
    n, P, spec = args.n, c.size, _spec(args)
    seg = datagen.rows(spec, "segment_ids", 0, n)  # (1, n), the same on every rank
    layouts = {"balanced": balancing.balance(n, P, causal=True, segment_ids=seg, block_size=args.block),
               "balanced-pairs": balancing.balance(n, P, causal=True, segment_ids=seg),
               "contiguous": "contiguous", "zigzag": "zigzag"}
    for name, layout in layouts.items():
        q, k, v, ids = _rows(c, spec, layout, "q", "k", "v", "segment_ids")
        kw = dict(causal=True, segment_ids=ids, layout=layout, engine=NativeEngine.name, block_size=args.block)
        used: dict = {}
        attention(q, k, v, details=used, **kw)  # warm-up
        per_call, tiles = [], 0
        for _ in range(args.repeats):
            c.barrier()
            with KernelClock() as clock:
                attention(q, k, v, **kw)
            per_call.append(clock.seconds)
            tiles = clock.tiles
        every = c.allgather_obj((statistics.median(per_call), tiles))
        work = balancing.rank_work(layout, n, P, causal=True, segment_ids=seg)
        secs = [e[0] for e in every]
        emit({"part": "balance", "layout": name, "strategy": used["strategy"], "N": n, "P": P, "compute_s": secs,
              "spread": max(secs) / max(min(secs), 1e-12) - 1, "tiles": [e[1] for e in every],
              "visible_pairs": work.tolist(), "pairs_max_over_mean": float(work.max() / work.mean()),
              "ranges": None if isinstance(layout, str) else [len(r) for r in layout.ranges]})


def main(argv: list[str] | None = None) -> int:
    """``python -m mpiattn.bench.masks single|balance [options]``: print (and append) the records."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("part", choices=("single", "balance"))
    ap.add_argument("--n", type=int, default=32768, help="sequence length (default 32768)")
    ap.add_argument("--mean-doc", type=int, default=2048, help="mean document length (default 2048)")
    ap.add_argument("--window", type=int, nargs=2, default=(1024, 0), metavar=("LEFT", "RIGHT"))
    ap.add_argument("--block", type=int, default=DEFAULT_TILE,
                    help=f"exchanged block and tile rows (default {DEFAULT_TILE})")
    ap.add_argument("--repeats", type=int, default=3, help="timed calls per case (median; default 3)")
    ap.add_argument("--backward", action="store_true", help="single: time forward + backward")
    ap.add_argument("--json", default=None, help="append the records to this JSON-lines file")
    args = ap.parse_args(argv)
    c = get_comm()
    sink = open(args.json, "a") if args.json and c.rank == 0 else None

    def emit(record: dict) -> None:
        if c.rank != 0:
            return
        print(json.dumps(record), flush=True)
        if sink is not None:
            sink.write(json.dumps(record) + "\n")

    try:
        (single if args.part == "single" else balance_part)(args, emit)
    finally:
        if sink is not None:
            sink.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
