"""Steps shared by the commands: device choice, compute, write, check, report."""

from __future__ import annotations

import datetime
import importlib.util
import math
import os
import sys
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from .. import __version__
from .. import backend, gpu, io
from ..backend import to_host
from ..balancing import balance
from ..comm import errors
from ..comm.core import get_comm
from ..kernels import DEFAULT_TILE, engines
from ..kernels.reference import dense_attention, dense_nbytes
from ..layouts import Layout
from ..masks import MaskSpec, diagonal
from ..masks import stored
from ..masks.score import Score
from ..sharding import gather
from ..strategies import AttentionSpec, Options, attention, attention_backward, registry
from .check import check_errors
from ..timing import Timer
from .common import CHECK_TOL, Console, UsageError


# ----------------------------------------------------------------- shared steps
def world_comm() -> Any:
    return get_comm()


def host_names(c: Any) -> list[str]:
    from mpi4py import MPI

    return c.allgather_obj(MPI.Get_processor_name())


_NO_CUPY = "none (cupy not installed)"


def gpu_status() -> tuple[bool, str]:
    """(usable, description) of this rank's GPUs, never raising."""
    if "cupy" not in sys.modules and importlib.util.find_spec("cupy") is None:
        return False, _NO_CUPY
    count, why = gpu.probe()
    return (True, f"{count} visible") if count else (False, f"none ({why})")


def select_device(c: Any, device: str, transport: str | None) -> tuple[Any, str]:
    """(numpy or cupy, a note) for this run, agreed by every rank; binds one GPU per rank for cupy."""
    if device == "cpu":
        return np, ""
    status = c.allgather_obj(gpu_status())
    missing = [(r, why) for r, (ok, why) in enumerate(status) if not ok]
    if missing:
        where = f"rank {missing[0][0]}: {missing[0][1]}"
        if device == "auto":  # silent on CPU-only installs, a note where CuPy is there but unusable
            quiet = all(why == _NO_CUPY for _, why in missing)
            return np, "" if quiet else f" (--device auto: no usable GPU on {where})"
        with errors.alike():  # every rank knows (allgathered): all raise, no communication
            raise RuntimeError(f"--device gpu: no usable GPU on {where}")
    gpu.bind_device(c, transport=transport)  # one GPU per rank by node-local rank; chooses the transport
    import cupy
    return cupy, ""


@dataclass
class Settings:
    """The effective settings of one run (identical on every rank).

    Attributes
    ----------
    options : Options
        What the call is asked to do (from the command line and the input's attributes).
    xp : module
        numpy or cupy.
    device_note : str
    used : dict
        What :func:`mpiattn.attention` reports it used (``details``).
    score : Score
        The score modifiers the command line gives (``--softcap``, ``--mask-mod``: a named rule
        of :mod:`mpiattn.masks.mods`); the input's datasets join them (:meth:`score_of`).
    """

    options: Options
    xp: Any
    device_note: str = ""
    used: dict = field(default_factory=dict)
    score: Score = field(default_factory=Score)

    @property
    def layout_name(self) -> str:
        """The layout as named on the command line (an explicit Layout is "balanced")."""
        return self.options.layout if isinstance(self.options.layout, str) else "balanced"

    def spec(self, inp: Any) -> AttentionSpec:
        """The call on the input's global shapes (no arrays, no communication)."""
        B, H, _, E = inp.q.shape
        return AttentionSpec.from_shapes((B, H, inp.n, E), (B, inp.k.shape[1], inp.m, E),
                                         (B, inp.k.shape[1], inp.m, inp.v.shape[3]),
                                         inp.q.dtype, self.options, device=self.xp.__name__,
                                         padding=inp.key_padding_mask is not None,
                                         segments=inp.segment_ids is not None,
                                         kv_segments=inp.kv_segment_ids is not None,
                                         **self.score_of(inp).flags())

    def score_of(self, inp: Any) -> Score:
        """The call's score modifiers: the command line's and the input file's arrays."""
        return Score.of(self.score, **inp.score.keywords())


#: What a phase of the run's timer is doing, for the message when a signal ends the run.
_DOING = {"read": "while reading the input", "forward": "during the forward pass",
          "backward": "during the backward pass", "write": "while writing the output",
          "check": "during the float64 check", "generate": "while generating the data"}


def run_timer(c: Any, con: Console, xp: Any = np) -> Timer:
    """The run's :class:`mpiattn.timing.Timer`: each phase tells the console what the run does."""
    return Timer(c, xp, on_phase=lambda name: con.doing(_DOING.get(name, f"during {name}")))


def _compute(c: Any, con: Console, inp: Any, st: Settings, backward: bool,
             timer: Timer) -> dict[str, np.ndarray]:
    """Forward (and backward): this rank's results as NumPy arrays."""
    if st.xp is np:
        move = np.asarray
    else:
        move = lambda a: gpu.upload(a, c)  # noqa: E731 - host slab -> device, pinned
    q, k, v, dout, mask = (None if a is None else move(a)
                           for a in (inp.q, inp.k, inp.v, inp.dout, inp.key_padding_mask))
    kw = dict(key_padding_mask=mask, segment_ids=inp.segment_ids, kv_segment_ids=inp.kv_segment_ids,
              score=st.score_of(inp), options=st.options)
    with timer.phase("forward"):
        out, lse = attention(q, k, v, c, progress=con.progress("forward"), details=st.used, **kw)
    results = {"out": out, "lse": lse}
    if backward:
        with timer.phase("backward"):
            grads = attention_backward(dout, q, k, v, out, lse, c,
                                       progress=con.progress("backward"), **kw)
        results.update(zip(("dq", "dk", "dv", "dsinks"), grads))
    return {name: to_host(x) for name, x in results.items()}


#: Each output dataset keeps the number of dimensions of the input it derives from:
#: name -> (that input, dimensions fewer). ``dsinks`` (H,), float64, is written by rank 0.
_LIKE = {"out": ("q", 0), "lse": ("q", 1), "dq": ("q", 0), "dk": ("k", 0), "dv": ("v", 0)}


def rows_of_rank0(c: Any, x: np.ndarray) -> Any:
    """A small dataset ``x``, the same on every rank, as :class:`mpiattn.io.Rows` that rank 0
    writes whole (a layout giving it every row along axis 0)."""
    n = x.shape[0]
    everything = Layout([[(0, n)]] + [[] for _ in range(c.size - 1)])
    return io.Rows(x if c.rank == 0 else x[:0], n, 0, everything)


def output_datasets(inp: Any, backward: bool) -> dict[str, tuple[tuple[int, ...], str, int]]:
    """The output's datasets ``{name: (global shape, dtype, sequence axis)}`` for a run on ``inp``.

    The same description :func:`mpiattn.io.write_rows` derives from the
    results, so that the free space needed is known before computing
    (:func:`output_bytes`).
    """
    B, H, _, E = inp.q.shape
    Hkv, Ev = inp.k.shape[1], inp.v.shape[3]
    dt = np.dtype(inp.q.dtype)
    full = {"out": ((B, H, inp.n, Ev), dt), "lse": ((B, H, inp.n), backend.accum_dtype(dt))}
    if backward:
        full.update(dq=((B, H, inp.n, E), dt), dk=((B, Hkv, inp.m, E), dt),
                    dv=((B, Hkv, inp.m, Ev), dt))
    out = {}
    if backward and inp.score.sinks is not None:
        out["dsinks"] = ((H,), np.dtype(np.float64).str, 0)
    for name, (shape, dtype) in full.items():
        source, fewer = _LIKE[name]
        ndim = inp.stored_ndim[source] - fewer
        out[name] = (shape[len(shape) - ndim:], np.dtype(dtype).str,
                     ndim - (1 if name == "lse" else 2))
    return out


def output_bytes(inp: Any, backward: bool) -> int:
    """Bytes of data in the results of a run on ``inp`` (out, lse, with ``backward`` the gradients)."""
    return io.writing.data_bytes(output_datasets(inp, backward))


def _write_results(c: Any, con: Console, path: str, results: dict[str, np.ndarray], inp: Any,
                   layout: str, attrs: dict, force: bool) -> None:
    rows = {}
    for name, x in results.items():
        if name == "dsinks":  # the same on every rank: rank 0 writes it
            rows[name] = rows_of_rank0(c, x)
            continue
        ndim = inp.stored_ndim[_LIKE[name][0]] - _LIKE[name][1]
        y = x.reshape(x.shape[x.ndim - ndim:])  # drop the promoted leading axes of length 1
        length = inp.m if name in ("dk", "dv") else inp.n
        rows[name] = io.Rows(y, length, ndim - (1 if name == "lse" else 2),
                             inp.kv_layout if name in ("dk", "dv") else None)
    io.write_rows(path, rows, c, layout=layout, attrs=attrs, force=force, outputs=con.outputs)


def _check(c: Any, con: Console, results: dict[str, np.ndarray], inp: Any, st: Settings,
           limit_gib: float) -> str:
    """Gather everything to rank 0 and compare with :func:`mpiattn.kernels.reference.dense_attention`.

    Returns the verdict line; raises RuntimeError on every rank when an error
    exceeds the tolerance of the compute dtype (:data:`CHECK_TOL`). Rank 0 reports
    its progress per block of reference rows (``con.progress("check")``).
    """
    B, H, _, E = inp.q.shape
    Hkv, Ev = inp.k.shape[1], inp.v.shape[3]
    need = dense_nbytes((B, H, inp.n, E), (B, Hkv, inp.m, E), (B, Hkv, inp.m, Ev))
    if need > limit_gib * 2**30:
        return (f"skipped: the float64 check would need {need / 2**30:.1f} GiB on rank 0 "
                f"(limit {limit_gib:g} GiB, --check-limit-gib)")
    by_keys = ("k", "v", "key_padding_mask", "kv_segment_ids", "dk", "dv")
    o = st.options
    g = {name: gather(x, c, axis=-1 if x.ndim == 2 or name == "lse" else -2,
                      layout=o.kv_layout if name in by_keys and o.kv_layout is not None else o.layout)
         for name, x in [("q", inp.q), ("k", inp.k), ("v", inp.v), ("dout", inp.dout),
                         ("key_padding_mask", inp.key_padding_mask),
                         ("segment_ids", inp.segment_ids), ("kv_segment_ids", inp.kv_segment_ids),
                         *[(n, getattr(inp.score, n)) for n in stored.ROWS],
                         *[(n, x) for n, x in results.items() if n != "dsinks"]]
         if x is not None}
    if "dsinks" in results:
        g["dsinks"] = results["dsinks"]
    dtype = str(inp.q.dtype)
    tol = CHECK_TOL[dtype]
    found = None
    if c.rank == 0:
        ref = dense_attention(g["q"], g["k"], g["v"], g.get("dout") if "dq" in results else None,
                              mask=MaskSpec(bool(o.causal), o.window, diagonal=diagonal(
                                  o.causal, g["q"].shape[-2], g["k"].shape[-2])), scale=o.scale,
                              key_padding_mask=g.get("key_padding_mask"),
                              segment_ids=g.get("segment_ids"), kv_segment_ids=g.get("kv_segment_ids"),
                              progress=con.progress("check"),
                              **replace(st.score_of(inp), **{n: g.get(n) for n in stored.ROWS}).keywords())
        found = check_errors({name: g[name] for name in results}, ref, g["q"], g["k"], g["v"],
                             g.get("dout"), o.scale)
    found = c.bcast_obj(found if c.rank == 0 else None)
    text = ", ".join(f"{k} {e:.1e}" for k, e in found.items())
    with errors.alike():  # the errors were broadcast: every rank decides alike
        if any(not e <= tol for e in found.values()):
            raise RuntimeError(f"check failed: errors {text} exceed the {dtype} tolerance {tol:g} "
                               "(scaled errors, see mpiattn.cli.check.check_errors); no output "
                               "was written")
    return f"max error vs float64 (scaled by the operands): {text} (tolerance {tol:g}) OK"


def check_results(c: Any, results: dict[str, np.ndarray]) -> None:
    """Raise (every rank alike) when a result holds NaN or Inf (``lse`` may be ``-inf``: a row
    that sees no key): finite inputs whose scores overflowed (a huge ``--scale``), written
    nowhere."""
    with c.collective_errors():
        for name, x in results.items():
            bad = np.isnan(x) | (np.isposinf(x) if name == "lse" else np.isinf(x))
            if bad.any():
                raise ValueError(f"the result {name} holds NaN or Inf on this rank (from finite "
                                 f"inputs: the scores overflowed {backend.accum_dtype(x.dtype)}; "
                                 "is --scale too large?); nothing is written (pass "
                                 "--allow-nonfinite to write it anyway)")


def _causal_label(causal: Any) -> str:
    return "causal bottom-right" if causal == "bottom-right" else "causal" if causal else "non-causal"


def _header(con: Console, title: str, c: Any, hosts: list[str], path: str, inp: Any,
            st: Settings, backward: bool) -> None:
    """The report's first lines: what runs, on what, how."""
    shape = lambda x, n: (x.shape[0], x.shape[1], n, x.shape[3])  # noqa: E731 - global shape
    extras = [*(n for n in ("dout", "key_padding_mask", "segment_ids", "kv_segment_ids")
                if getattr(inp, n) is not None), *inp.score.given()]
    o = st.options
    scale = o.scale if o.scale is not None else f"1/sqrt({inp.q.shape[3]})"
    con.say(f"mpiattn {__version__} {title}: {'forward + backward' if backward else 'forward'}, "
            f"{_causal_label(o.causal)}, {c.size} rank(s) on {len(set(hosts))} host(s)")
    con.say(f"  input    {path}")
    con.say(f"  shapes   q {shape(inp.q, inp.n)}, k {shape(inp.k, inp.m)}, v {shape(inp.v, inp.m)}"
            + (f" + {', '.join(extras)}" if extras else ""))
    window = "" if o.window is None else f", window {_window_text(o.window)}"
    rule = "".join(f", {d}" for d in stored.described(st.score))
    con.say(f"  compute  {st.xp.__name__}, {inp.q.dtype}, layout {st.layout_name}, strategy "
            f"{o.strategy}, engine {o.engine}, scale {scale}{window}{rule}{st.device_note}")


def _window_text(window: tuple) -> str:
    return ",".join("none" if w is None else str(w) for w in window)


def prepare_output(c: Any, con: Console, output: str, force: bool, nbytes: int | None = None,
                   also: list | None = None) -> None:
    """Before any work: the output can be written (and fits), stale temporaries are gone.

    ``also``: other files (:class:`mpiattn.io.Target`) the run will publish
    together with ``output``, checked with it (one free-space check per
    file system). Removes the temporary files that dead writers left in
    their directories (never a live writer's) and says so.
    """
    first = io.Target(output, None, io.REPLACE if force else io.NEW, nbytes)
    io.check_targets(c, [first, *(also or [])])
    dirs = sorted({os.path.dirname(os.path.abspath(t.path)) for t in [first, *(also or [])]})
    stale = io.atomic.on_rank0(c, lambda: [r for d in dirs
                                           for r in io.remove_stale(d, con.outputs.active()).removed])
    for path, size in stale:
        con.say(f"removed {path} ({size / 2**20:.1f} MiB), left by an mpiattn writer that died")


def check_arguments(c: Any, inp: Any, st: Settings) -> None:
    """Argument errors that show only once the input is known: UsageError (exit 2) on every rank.

    Runs on metadata every rank has (global shapes, the rank count), so
    every rank raises alike without communicating: a ``--strategy`` that
    does not support the call (:mod:`mpiattn.strategies.registry`), an
    ``--engine`` whose declared capabilities do not cover it.
    """
    spec, o = st.spec(inp), st.options
    if o.strategy != "auto":
        why = registry.get(o.strategy).supports(spec, c.topology)
        if why is not None:
            raise UsageError(f"--strategy {o.strategy}: {why}")
    check_engine(o.engine, spec)


def check_engine(name: str, spec: AttentionSpec) -> None:
    """``--engine NAME`` whose declared capabilities do not cover the call ``spec`` (global
    shapes, the device): UsageError (exit 2) on every rank alike, as ``run``, ``prefill`` and
    ``decode`` refuse it."""
    if name != "auto":
        why = engines.get(name).supports(spec)
        if why is not None:
            raise UsageError(f"--engine {name}: {why}")


def _output_attrs(c: Any, inp: Any, st: Settings, hosts: list[str], timer: Timer,
                  threads: Any = None) -> dict:
    """Root attributes of the output file (see docs/file-format.md)."""
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return {"mpiattn_version": __version__, "ranks": c.size, "hosts": len(set(hosts)),
            "blas_threads": None if threads is None or threads.count is None else threads.count,
            "blas_threads_source": None if threads is None else threads.source,
            "strategy": st.options.strategy, "strategy_used": st.used.get("strategy", ""),
            "layout": st.layout_name, "dtype": str(inp.q.dtype), "device": st.xp.__name__,
            "window": None if st.options.window is None else [-1 if w is None else w
                                                              for w in st.options.window],
            "gpu_transport": None if st.xp is np else getattr(c, "transport", None),
            "causal": st.options.causal,
            "scale": st.options.scale if st.options.scale is not None else 1 / math.sqrt(inp.q.shape[3]),
            **stored.output_attributes(st.score),
            "block_size": st.options.block_size, "engine": st.options.engine,
            "engine_used": st.used.get("engine", ""), "engine_reason": st.used.get("engine_reason", ""),
            "block_size_used": st.used.get("block_size", 0),
            "input_path": inp.info["path"], "input_size": inp.info["size"],
            "input_mtime": inp.info["mtime"], "input_mtime_ns": inp.info["identity"][3],
            "input_device": inp.info["identity"][0], "input_inode": inp.info["identity"][1],
            "created": now,
            "command": " ".join(["mpiattn", *sys.argv[1:]]),
            **{f"time_{k}_s": v for k, v in timer.times.items()}}


def _layouts(c: Any, args: Any, path: str, causal: bool, window: tuple | None,
             meta: dict) -> tuple[Any, Any]:
    """The layouts of the query and the key rows: ``--layout``, ``auto`` resolved, ``balanced`` computed.

    ``balanced``: :func:`mpiattn.balance` of the file's queries from the
    causal flag, the window, ``segment_ids`` (read whole by rank 0 and
    broadcast, so every rank computes the same layout), ``--mask-mod`` and the tile rows
    (``--block-size``, else the library's default), counting visible
    tiles; the keys share it when ``M == N``, else they are contiguous.
    """
    if args.layout != "balanced":
        lay = args.layout if args.layout != "auto" else ("zigzag" if causal else "contiguous")
        return lay, lay
    shapes, ids = io.reading.read_whole(path, "segment_ids", c, meta)
    B, H, N = shapes["q"][:3]
    M = shapes["k"][2]
    with errors.alike():  # on data every rank holds
        lay = balance(N, c.size, causal=causal, window=window, segment_ids=ids,
                      block_size=args.block_size or DEFAULT_TILE,
                      m=M if causal == "bottom-right" else None,
                      mask_mod=getattr(args, "mask_mod", None), batch=B, heads=H)
    return lay, (lay if M == N else "contiguous")


def run_file(c: Any, con: Console, args: Any, path: str, output: str, force: bool,
              extra_attrs: dict, title: str) -> int:
    """The body shared by ``run`` and ``example``: read, compute, check, write, report.

    The check (``--check``) runs before the output is written: a failed
    check leaves no output under the requested name. The input's metadata
    is read once, and every later open must find the same file
    (:func:`mpiattn.io.read_input`).
    """
    timer = run_timer(c, con)
    with c.collective_errors():  # rank 0 decides
        if c.rank == 0 and os.path.exists(output) and os.path.exists(path) \
                and os.path.samefile(path, output):
            raise ValueError(f"the output {output} is the input file")
    prepare_output(c, con, output, force)  # before any computing
    meta = io.read_meta(path, c)
    causal = args.causal if getattr(args, "causal", None) is not None else (meta["causal"] or False)
    window = getattr(args, "window", None)
    window = meta["window"] if window is None else window
    layout, kv_layout = _layouts(c, args, path, causal, window, meta)
    allow_nonfinite = getattr(args, "allow_nonfinite", False)
    with timer.phase("read"):
        try:
            inp = io.read_input(path, c, layout=layout, dtype=getattr(args, "dtype", None),
                                check_finite=not allow_nonfinite, kv_layout=kv_layout, meta=meta)
        except io.NonFiniteError as exc:  # (raised alike on every rank)
            raise errors.mark(io.NonFiniteError(f"{exc}; pass --allow-nonfinite to compute "
                                                "anyway")) from None
    xp, note = select_device(c, args.device, args.gpu_transport)
    scale = inp.scale if getattr(args, "scale", None) is None else args.scale
    options = Options(causal=causal, scale=scale, window=window, layout=layout, kv_layout=kv_layout,
                      strategy=args.strategy, engine=getattr(args, "engine", "auto"),
                      machine=getattr(args, "machine", None),
                      block_size=args.block_size,
                      check_finite=False)  # read_input checked them (unless --allow-nonfinite)
    st = Settings(options, xp, note, score=stored.from_arguments(args))
    backward = inp.dout is not None and not getattr(args, "no_backward", False)
    check_arguments(c, inp, st)
    io.check_space(output, output_bytes(inp, backward), c)  # before computing
    hosts = host_names(c)
    _header(con, title, c, hosts, path, inp, st, backward)
    if getattr(args, "threads_info", None) is not None:
        con.say(f"  threads  BLAS {args.threads_info.describe()}")
    results = _compute(c, con, inp, st, backward, timer)
    if not allow_nonfinite:
        check_results(c, results)
    verdict = None
    if getattr(args, "check", True):
        with timer.phase("check"):
            verdict = _check(c, con, results, inp, st, getattr(args, "check_limit_gib", 4.0))
    with timer.phase("write"):
        threads = getattr(args, "threads_info", None)
        attrs_out = {**_output_attrs(c, inp, st, hosts, timer, threads), "check": verdict,
                     **extra_attrs}
        _write_results(c, con, output, results, inp, layout, attrs_out, force)
    u = st.used
    con.say(f"  plan     strategy {u.get('strategy', '?')} ({u.get('strategy_reason', '')}), "
            f"engine {u.get('engine', '?')} ({u.get('engine_reason', '')}), blocks of "
            f"{u.get('block_size', '?')} rows")
    con.say(f"  time     {timer.summary()}")
    if verdict:
        con.say(f"  check    {verdict}")
    con.say(f"  output   {os.path.abspath(output)}: {', '.join(results)}")
    return 0
