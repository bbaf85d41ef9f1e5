"""The inference commands: ``prefill`` (a prompt's attention and its key/value cache) and ``decode``.

``mpiattn prefill INPUT -o CACHE.h5``
    Attention over the prompt of ``INPUT`` (``q``, ``k``, ``v`` of one
    length, causal; the input file's format of ``run``, with its score
    modifiers ``sinks``, ``alibi_slopes`` and ``--softcap``), then the
    prompt's keys and values as a cache (:class:`mpiattn.KVCache`):
    ``CACHE.h5`` holds ``k``, ``v`` (the cache), ``out`` and ``lse`` (the
    prompt's attention) and the cache's attributes, ``window`` and ``scale``
    among them (later decode steps use them unless told otherwise), and the
    modifiers used (``sinks``, ``alibi_slopes``, attribute ``softcap``).
``mpiattn decode CACHE.h5 --queries Q.h5 -o OUT.h5 [--append]``
    Loads the cache at this run's rank count, attends the new queries
    ``q (B, H, t, E)`` of ``Q.h5`` (bottom-right causal: they are the last
    ``t`` positions, so with ``--append`` the keys and values ``k``, ``v`` of
    ``Q.h5`` are appended first) and writes ``out``, ``lse`` to ``OUT.h5``.
    With ``--append`` the grown cache replaces ``CACHE.h5`` (its other
    datasets carried over, its permission bits kept), so a sequence of
    decode runs extends one cache; ``Q.h5`` then holds as many new keys and
    values as queries (the same new tokens).

Score modifiers: a cache is decoded with the ones it was made with
(:func:`_score`, the vocabulary of :mod:`mpiattn.masks.stored`): ``decode`` uses the cache's ``sinks``,
``alibi_slopes`` and ``softcap``; ``Q.h5`` and ``--softcap`` may repeat
them, and give them where the cache records none, but a value that differs
from the cache's is refused. An ``attn_mask`` belongs to the queries that
come with it: ``prefill`` reads the prompt's rows as slabs (like ``run``;
``(B or 1, H or 1, N, N)``) and does not keep it in the cache; ``decode``
reads ``Q.h5``'s whole, ``(B or 1, H or 1, t, L)`` over the cache's ``L``
absolute positions (the new tokens' included with ``--append``). A cache
file that holds one is refused (:data:`_NO_MASK`).

The guarantees of ``run`` hold: errors are decided on every rank alike
(exit 1), and every output path is checked before anything is computed
(with ``--append`` the cache's too: its directory, its free space, and that
it is writable). With ``--append``, ``OUT.h5`` and the grown cache are
published together, at one commit point: both or neither. A signal before
it leaves every file as it was; the cache is replaced only while it is
still the file this run read, so of two ``decode --append`` runs on one
cache at once the second gets one error and publishes nothing (instead of
losing the first one's token). Keys, values and queries holding NaN or Inf
are refused unless ``--allow-nonfinite``.
"""

from __future__ import annotations

import datetime
import os
import sys
from typing import Any, Callable

import numpy as np

from .. import __version__
from .. import backend, gpu, io
from ..comm import errors
from ..inference import PAGE_ROWS, KVCache
from ..inference.decode import step_spec
from ..io import kvstore
from ..io.schema import check_dtype, promoted_shape
from ..kernels import engines
from ..layouts import Layout, all_segments
from ..masks import stored
from ..masks.score import Score
from ..strategies import Options, attention
from . import argtypes
from .common import Console
from .steps import (Settings, check_engine, check_results, prepare_output, rows_of_rank0, run_timer,
                    select_device, world_comm)

__all__ = ["add_arguments", "cmd_prefill", "cmd_decode"]

#: Attributes of a cache file that :meth:`mpiattn.KVCache.save` writes itself.
_OWN = {"format", "format_version", "axes", "length", "page", "placement", "ranks", "rows_per_rank"}

#: Why a cache file holds no ``attn_mask``, and where one goes instead.
_NO_MASK = ("a mask belongs to the queries it comes with, not to a cache that grows: put the "
            "prompt's in prefill's input, a step's in decode's --queries file")


def add_arguments(sub: Any) -> None:
    """Add the ``prefill`` and ``decode`` sub-commands to the parser's ``sub``."""
    pre = sub.add_parser("prefill", help="attention over a prompt, kept as a key/value cache file")
    pre.add_argument("input", help="HDF5 file with the prompt's q, k, v (one length) [, sinks, "
                                   "alibi_slopes]")
    pre.add_argument("-o", "--output", required=True, help="the cache file to write (k, v, out, lse)")
    pre.add_argument("--window", type=argtypes.window, default=None, metavar="L,R",
                     help="sliding window (default: the input's 'window' attribute); kept in the cache")
    pre.add_argument("--scale", type=argtypes.finite_float, default=None,
                     help="softmax scale (default: the input's 'scale' attribute, else 1/sqrt(E)); "
                          "kept in the cache")
    pre.add_argument("--softcap", type=argtypes.positive_float, default=None, metavar="C",
                     help="cap the scores: C tanh(scale q.k / C) (Gemma 2); kept in the cache")
    pre.add_argument("--layout", choices=("contiguous", "zigzag"), default="contiguous",
                     help="rows per rank for the prompt (default contiguous)")
    pre.add_argument("--page", type=argtypes.page, default=PAGE_ROWS,
                     help=f"rows per page of later appends (default {PAGE_ROWS})")
    pre.add_argument("--dtype", choices=("float16", "float32", "float64"), default=None)
    _common(pre)

    dec = sub.add_parser("decode", help="new queries against a key/value cache file (and append them)")
    dec.add_argument("cache", help="a cache file written by prefill (or by decode --append)")
    dec.add_argument("--queries", required=True,
                     help="HDF5 file with q (B, H, t, E) [, k, v, sinks, alibi_slopes]")
    dec.add_argument("-o", "--output", required=True, help="HDF5 file to write (out, lse)")
    dec.add_argument("--append", action="store_true",
                     help="append the queries' k, v to the cache first, then replace the cache file")
    dec.add_argument("--window", type=argtypes.window, default=None, metavar="L,R",
                     help="sliding window (default: the cache's 'window' attribute)")
    dec.add_argument("--scale", type=argtypes.finite_float, default=None,
                     help="softmax scale (default: the cache's 'scale' attribute, else 1/sqrt(E))")
    dec.add_argument("--softcap", type=argtypes.positive_float, default=None, metavar="C",
                     help="cap the scores (default: the cache's 'softcap' attribute; a value "
                          "other than the cache's is refused)")
    _common(dec)


def _common(p: Any) -> None:
    p.add_argument("--engine", choices=engines.NAMES, default="auto", help="local kernels")
    p.add_argument("--device", choices=("cpu", "gpu", "auto"), default="cpu",
                   help="where to compute (default cpu)")
    p.add_argument("--gpu-transport", choices=("auto", "cuda-aware", "staged", "nccl"), default=None)
    p.add_argument("--threads", type=argtypes.positive_int, default=None, metavar="N",
                   help="BLAS threads per rank")
    p.add_argument("--force", "-f", action="store_true", help="overwrite an existing output")
    p.add_argument("--allow-nonfinite", action="store_true",
                   help="accept NaN or Inf in the inputs and the cache (they propagate)")
    p.add_argument("--quiet", "-q", action="store_true", help="print only errors")


def _mover(c: Any, xp: Any) -> Callable:
    return np.asarray if xp is np else (lambda a: gpu.upload(a, c))


def _stamp(timer: Any) -> dict:
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return {"created": now, "mpiattn_version": __version__,
            "command": " ".join(["mpiattn", *sys.argv[1:]]),
            **{f"time_{k}_s": v for k, v in timer.times.items()}}


def _not_same(c: Any, a: str, b: str, what: str) -> None:
    with c.collective_errors():
        if c.rank == 0 and os.path.exists(a) and os.path.exists(b) and os.path.samefile(a, b):
            raise ValueError(f"the output {b} is the {what}")


def cmd_prefill(args: Any, con: Console) -> int:
    """``mpiattn prefill INPUT -o CACHE.h5`` (module docstring)."""
    c = world_comm()
    timer = run_timer(c, con)
    _not_same(c, args.input, args.output, "input file")
    prepare_output(c, con, args.output, args.force)
    meta = io.read_meta(args.input, c)
    shapes = meta["shapes"]
    with errors.alike():  # the metadata is rank 0's, broadcast: every rank decides alike
        N, M = shapes["q"][2], shapes["k"][2]
        if N != M:
            raise ValueError(f"prefill needs a prompt: q and k of one length, got N = {N}, M = {M}")
        kept = [n for n in ("key_padding_mask", "segment_ids", "kv_segment_ids") if n in shapes]
        if kept:
            raise ValueError(f"prefill: a cache keeps no padding or document ids; {args.input} has "
                             f"{', '.join(kept)}")
    window = meta["window"] if args.window is None else args.window
    with timer.phase("read"):
        inp = io.read_input(args.input, c, layout=args.layout, dtype=args.dtype, meta=meta,
                            check_finite=not args.allow_nonfinite)
    xp, _ = select_device(c, args.device, args.gpu_transport)
    move = _mover(c, xp)
    q, k, v = move(inp.q), move(inp.k), move(inp.v)
    scale = inp.scale if args.scale is None else args.scale
    finite = not args.allow_nonfinite
    options = Options(causal=True, window=window, scale=scale, layout=args.layout,
                      engine=args.engine, check_finite=finite)
    st = Settings(options, xp, score=stored.from_arguments(args))
    check_engine(args.engine, st.spec(inp))  # as run: before any work
    kept, kept_attrs = stored.to_file(st.score_of(inp))  # what decode applies again
    used: dict = {}
    with timer.phase("forward"):
        out, lse = attention(q, k, v, c, options=options, details=used, score=st.score_of(inp),
                             progress=con.progress("forward"))
    if finite:
        check_results(c, {"out": backend.to_host(out), "lse": backend.to_host(lse)})
    cache = KVCache.from_shards(k, v, c, layout=args.layout, page=args.page, check_finite=finite)
    extra = {"out": io.Rows(backend.to_host(out), N, 2, args.layout),
             "lse": io.Rows(backend.to_host(lse), N, 2, args.layout),
             **{name: rows_of_rank0(c, x) for name, x in kept.items()}}  # decode's defaults
    attrs = {"causal": "bottom-right", "scale": scale, **kept_attrs,
             "input_path": os.path.abspath(args.input),
             "window": None if window is None else [-1 if w is None else w for w in window]}
    with timer.phase("write"):
        cache.save(args.output, force=args.force, extra=extra, outputs=con.outputs,
                   attrs={**attrs, **_stamp(timer), "engine": used.get("engine", "")})
    con.say(f"mpiattn {__version__} prefill: {N} tokens, B {inp.q.shape[0]}, H {inp.q.shape[1]}, "
            f"Hkv {inp.k.shape[1]}, E {inp.q.shape[3]}, {inp.q.dtype}, {c.size} rank(s), "
            f"strategy {used.get('strategy')}, engine {used.get('engine')}")
    con.say(f"  time     {timer.summary()}")
    con.say(f"  cache    {os.path.abspath(args.output)}: k, v ({cache.length} rows, pages of "
            f"{cache.page}), {', '.join(['out', 'lse', *kept])}")
    return 0


def _carried(c: Any, path: str, meta: dict) -> dict:
    """The cache file's other datasets (rows on axis 2 of 4-D, -1 of 3-D), this rank's share."""
    extra = {}
    for name, shape in meta["extra"].items():
        axis = 2 if len(shape) >= 3 else len(shape) - 1
        n = shape[axis]
        seg = all_segments(n, c.size, "contiguous")[c.rank]
        a, b = (seg[0][0], seg[0][0] + seg[0][1]) if seg else (0, 0)
        (x,) = kvstore.read_cache_rows(c, path, meta, a, b, names=(name,), axis=axis)
        extra[name] = io.Rows(x, n, axis, "contiguous")
    return extra


def cmd_decode(args: Any, con: Console) -> int:
    """``mpiattn decode CACHE.h5 --queries Q.h5 -o OUT.h5 [--append]`` (module docstring)."""
    c = world_comm()
    timer = run_timer(c, con)
    _not_same(c, args.cache, args.output, "cache file")
    _not_same(c, args.queries, args.output, "queries file")
    meta = kvstore.read_cache_meta(c, args.cache)
    grown = None
    if args.append:  # both files are published together: check both before any work
        grown = io.Target(args.cache, None, io.Rule.grows(meta["identity"]), _cache_bytes(meta))
    prepare_output(c, con, args.output, args.force, also=[grown] if grown else [])
    xp, _ = select_device(c, args.device, args.gpu_transport)
    finite = not args.allow_nonfinite
    with timer.phase("read"):
        cache = KVCache.load(args.cache, c, device=xp.__name__, check_finite=finite)
        with errors.alike():
            if tuple(cache.identity) != tuple(meta["identity"]):
                raise ValueError(f"the cache {args.cache} changed while it was being read; nothing "
                                 "was computed")
        new = kvstore.read_replicated(c, args.queries, ("q",),
                                      (*(("k", "v") if args.append else ()), *stored.ROWS), whole=True)
        given = {n: new.pop(n) for n in (*stored.WHOLE, *stored.ROWS) if n in new}
        with errors.alike():
            for name in stored.ROWS:  # as run and prefill read them: boolean or floating point
                if name in given:
                    try:
                        check_dtype(name, given[name].dtype)
                    except TypeError as exc:
                        raise TypeError(f"{args.queries}: {exc}") from None
            if args.append and not {"k", "v"} <= set(new):
                raise ValueError(f"--append needs the new tokens' k and v in {args.queries}")
            if args.append and not new["q"].shape[2:3] == new["k"].shape[2:3] == new["v"].shape[2:3]:
                raise ValueError(f"--append: {args.queries} holds {new['q'].shape[2]} queries but "
                                 f"{new['k'].shape[2]} new keys and {new['v'].shape[2]} new values; "
                                 "they must be the same new tokens (as many rows in q, k and v)")
        carried = _carried(c, args.cache, meta) if args.append else {}
    saved = meta["attrs"]
    window = meta["window"] if args.window is None else args.window
    scale = meta["scale"] if args.scale is None else args.scale
    move = _mover(c, xp)
    q = move(new["q"])
    for name in stored.ROWS:  # (t, L) or (H, t, L) stand for (1, 1, t, L), (1, H, t, L), as in run
        if name in given:  # (host: the modifiers' arrays live there)
            with errors.alike():  # (read whole: the same on every rank)
                given[name] = stored.as_read(name, given[name].reshape(
                    promoted_shape(name, given[name].shape)))
    score = _score(args, meta, stored.from_file(given), stored.from_arguments(args), new["q"].shape)
    if q.ndim == 4:  # (another shape is the library's to refuse, exit 1)
        length = cache.length + (q.shape[2] if args.append else 0)
        check_engine(args.engine, step_spec(cache.shard, length, q, Options(
            causal=True, window=window, scale=scale), **score.flags()))
    used: dict = {}
    with timer.phase("forward"):
        if args.append:
            cache.append(move(new["k"]), move(new["v"]), check_finite=finite)
        out, lse = cache.attend(q, window=window, scale=scale, score=score, engine=args.engine,
                                check_finite=finite, details=used)
    if finite:
        check_results(c, {"out": backend.to_host(out), "lse": backend.to_host(lse)})
    t = int(out.shape[2])
    mine = Layout([[(0, t)]] + [[] for _ in range(c.size - 1)])  # rank 0 writes the replicated result
    keep = slice(None) if c.rank == 0 else slice(0, 0)
    rows = {"out": io.Rows(backend.to_host(out)[:, :, keep], t, 2, mine),
            "lse": io.Rows(backend.to_host(lse)[:, :, keep], t, 2, mine)}
    with timer.phase("write"):
        attrs = {"cache_path": os.path.abspath(args.cache), "cache_length": cache.length,
                 "append": args.append, "engine": used.get("engine", ""),
                 **{n: getattr(score, n) for n in stored.ATTRIBUTES},
                 "score_modifiers": ",".join(n for n in score.given() if n not in stored.ATTRIBUTES)
                 or None, **_stamp(timer)}
        files = [io.rows_target(args.output, rows, c, attrs=attrs,
                                rule=io.REPLACE if args.force else io.NEW)]
        if grown is not None:  # one commit point for both files
            files.append(cache.target(args.cache, rule=grown.rule, extra=carried,
                                      attrs={k: v for k, v in saved.items() if k not in _OWN}))
        io.publish(c, files, outputs=con.outputs)
    named = stored.described(score)
    con.say(f"mpiattn {__version__} decode: {t} new token(s) against {cache.length} cached "
            f"({c.size} rank(s), engine {used.get('engine')}){'; appended' if args.append else ''}"
            f"{'; ' + ', '.join(named) if named else ''}")
    con.say(f"  time     {timer.summary()}")
    con.say(f"  output   {os.path.abspath(args.output)}: out, lse")
    if args.append:
        con.say(f"  cache    {os.path.abspath(args.cache)}: {cache.length} rows")
    return 0


def _score(args: Any, meta: dict, given: Score, flags: Score, q_shape: tuple) -> Score:
    """decode's score modifiers: the cache's (``meta["score"]``, what its prefill used), joined by
    those of the queries file (``given``) and the command line (``flags``): one that repeats the
    cache's is accepted, one that differs is refused (a cache is decoded with the modifiers it
    was made with; :func:`mpiattn.masks.stored.joined`); so are shapes that do not fit ``q``.
    Every rank decides alike: ``meta`` is rank 0's, and every rank read ``given`` from one file.
    """
    cache = f"the cache {args.cache}"
    with errors.alike():
        held = [n for n in stored.ROWS if n in meta["extra"]]
        if held:
            raise ValueError(f"{cache} holds {held[0]!r}, which a cache does not keep: {_NO_MASK}")
        kept = meta["score"]
        if len(q_shape) == 4:  # (another q KVCache.attend refuses)
            for where, held in ((cache, kept), (args.queries, given)):
                try:
                    stored.check_whole({n: np.shape(getattr(held, n)) for n in stored.WHOLE
                                        if getattr(held, n) is not None}, *q_shape[:2])
                except ValueError as exc:
                    raise ValueError(f"{where}: {exc}") from None
        score = stored.joined(kept, given, cache, args.queries)
        return stored.joined(score, flags, cache, "the command line")


def _cache_bytes(meta: dict) -> int:
    """Bytes of a cache file's arrays (its size once grown by a few rows)."""
    item = np.dtype(meta["dtype"]).itemsize
    return meta["B"] * meta["Hkv"] * (meta["M"] + 1) * (meta["E"] + meta["Ev"]) * item
