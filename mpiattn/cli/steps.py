"""Steps shared by the commands: device choice, compute, write, check, report."""

from __future__ import annotations

import contextlib
import datetime
import importlib
import importlib.util
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np

from .. import __version__
from .. import backend, gpu, io
from ..strategies import DEFAULT_BLOCK, attention, attention_backward, choose_strategy
from ..backend import to_host
from ..balancing import balance
from ..comm.core import get_comm
from ..sharding import gather
from .check import check_errors, exact_attention, exact_nbytes
from .common import CHECK_TOL, Console, UsageError, agreed, local_errors



# ----------------------------------------------------------------- shared steps
def world_comm() -> Any:
    with agreed():
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
        with agreed():  # every rank knows (allgathered): all raise, no communication
            raise RuntimeError(f"--device gpu: no usable GPU on {where}")
    with agreed():
        gpu.bind_device(c, transport=transport)  # one GPU per rank by node-local rank; chooses the transport
        import cupy
    return cupy, ""


@dataclass
class Settings:
    """The effective settings of one run (identical on every rank)."""

    causal: bool
    scale: float | None
    layout: str
    strategy: str
    block_size: int | None
    xp: Any
    device_note: str = ""
    engine: str = "auto"
    used: dict = field(default_factory=dict)  # what attention() reports it used
    window: tuple | None = None
    kv_layout: Any = None  # the keys' layout (default: layout)

    @property
    def layout_name(self) -> str:
        """The layout as named on the command line (an explicit Layout is "balanced")."""
        return self.layout if isinstance(self.layout, str) else "balanced"

    def strategy_used(self, inp: Any, P: int) -> str:
        """What ``auto`` resolves to (the attention module's cost model), else the strategy."""
        if self.strategy != "auto":
            return self.strategy
        _, H, _, E = inp.q.shape
        Hkv, Ev = inp.k.shape[1], inp.v.shape[3]
        return choose_strategy(inp.n, inp.m, H, Hkv, E, Ev, P, self.block_size or DEFAULT_BLOCK)


#: What a phase of :class:`Timer` is doing, for the message when a signal ends the run.
_DOING = {"read": "while reading the input", "forward": "during the forward pass",
          "backward": "during the backward pass", "write": "while writing the output",
          "check": "during the float64 check", "generate": "while generating the data"}


class Timer:
    """Wall-clock phases delimited by barriers (so they cover the slowest rank).

    Each phase also tells the console what the run is doing (for the
    message of a signal that ends it).
    """

    def __init__(self, c: Any, con: Console):
        self.c, self.con, self.times = c, con, {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.con.doing(_DOING.get(name, f"during {name}"))
        self.c.barrier()
        t0 = time.perf_counter()
        yield  # on an error (raised alike on every rank) the closing barrier is skipped everywhere
        self.c.barrier()
        self.times[name] = time.perf_counter() - t0

    def summary(self) -> str:
        return ", ".join(f"{k} {v:.3g} s" for k, v in self.times.items())


def _compute(c: Any, con: Console, inp: Any, st: Settings, backward: bool,
             timer: Timer) -> dict[str, np.ndarray]:
    """Forward (and backward): this rank's results as NumPy arrays."""
    if st.xp is np:
        move = np.asarray
    else:
        move = gpu.upload  # host slab -> device through a pinned buffer
    q, k, v, dout, mask = (None if a is None else move(a)
                           for a in (inp.q, inp.k, inp.v, inp.dout, inp.key_padding_mask))
    if st.engine == "auto" and "torch" not in sys.modules and importlib.util.find_spec("torch"):
        import torch  # noqa: F401 - the command line lets auto use torch's kernels when installed
    kw = dict(causal=st.causal, scale=st.scale, key_padding_mask=mask, layout=st.layout,
              strategy=st.strategy, block_size=st.block_size, engine=st.engine, window=st.window,
              segment_ids=inp.segment_ids, kv_segment_ids=inp.kv_segment_ids, kv_layout=st.kv_layout,
              check_finite=False)  # read_input checked them (unless --allow-nonfinite)
    with agreed():
        with timer.phase("forward"):
            out, lse = attention(q, k, v, c, progress=con.progress("forward"), details=st.used, **kw)
        results = {"out": out, "lse": lse}
        if backward:
            with timer.phase("backward"):
                dq, dk, dv = attention_backward(dout, q, k, v, out, lse, c,
                                                progress=con.progress("backward"), **kw)
            results.update(dq=dq, dk=dk, dv=dv)
    return {name: to_host(x) for name, x in results.items()}


#: Each output dataset keeps the number of dimensions of the input it derives from:
#: name -> (that input, dimensions fewer).
_LIKE = {"out": ("q", 0), "lse": ("q", 1), "dq": ("q", 0), "dk": ("k", 0), "dv": ("v", 0)}


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
        ndim = inp.stored_ndim[_LIKE[name][0]] - _LIKE[name][1]
        y = x.reshape(x.shape[x.ndim - ndim:])  # drop the promoted leading axes of length 1
        length = inp.m if name in ("dk", "dv") else inp.n
        rows[name] = io.Rows(y, length, ndim - (1 if name == "lse" else 2),
                             inp.kv_layout if name in ("dk", "dv") else None)
    with agreed():
        io.write_rows(path, rows, c, layout=layout, attrs=attrs, force=force, outputs=con.outputs)


def _check(c: Any, results: dict[str, np.ndarray], inp: Any, st: Settings,
           limit_gib: float) -> str:
    """Gather everything to rank 0 and compare with :func:`mpiattn.cli.check.exact_attention`.

    Returns the verdict line; raises RuntimeError on every rank when an error
    exceeds the tolerance of the compute dtype (:data:`CHECK_TOL`).
    """
    B, H, _, E = inp.q.shape
    Hkv, Ev = inp.k.shape[1], inp.v.shape[3]
    need = exact_nbytes((B, H, inp.n, E), (B, Hkv, inp.m, E), (B, Hkv, inp.m, Ev))
    if need > limit_gib * 2**30:
        return (f"skipped: the float64 check would need {need / 2**30:.1f} GiB on rank 0 "
                f"(limit {limit_gib:g} GiB, --check-limit-gib)")
    by_keys = ("k", "v", "key_padding_mask", "kv_segment_ids", "dk", "dv")
    with agreed():
        g = {name: gather(x, c, axis=-1 if x.ndim == 2 or name == "lse" else -2,
                          layout=st.kv_layout if name in by_keys and st.kv_layout is not None else st.layout)
             for name, x in [("q", inp.q), ("k", inp.k), ("v", inp.v), ("dout", inp.dout),
                             ("key_padding_mask", inp.key_padding_mask),
                             ("segment_ids", inp.segment_ids), ("kv_segment_ids", inp.kv_segment_ids),
                             *results.items()]
             if x is not None}
    dtype = str(inp.q.dtype)
    tol = CHECK_TOL[dtype]
    errors = None
    if c.rank == 0:
        ref = exact_attention(g["q"], g["k"], g["v"], g.get("dout") if "dq" in results else None,
                        causal=st.causal, scale=st.scale, key_padding_mask=g.get("key_padding_mask"),
                        window=st.window, segment_ids=g.get("segment_ids"),
                        kv_segment_ids=g.get("kv_segment_ids"))
        errors = check_errors({name: g[name] for name in results}, ref, g["q"], g["k"], g["v"],
                              g.get("dout"), st.scale)
    errors = c.bcast_obj(errors)
    text = ", ".join(f"{k} {e:.1e}" for k, e in errors.items())
    with agreed():  # the errors were broadcast: every rank decides alike
        if any(not e <= tol for e in errors.values()):
            raise RuntimeError(f"check failed: errors {text} exceed the {dtype} tolerance {tol:g} "
                               "(scaled errors, see mpiattn.cli.check.check_errors); no output "
                               "was written")
    return f"max error vs float64 (scaled by the operands): {text} (tolerance {tol:g}) OK"


def _header(con: Console, title: str, c: Any, hosts: list[str], path: str, inp: Any,
            st: Settings, backward: bool) -> None:
    """The report's first lines: what runs, on what, how."""
    shape = lambda x, n: (x.shape[0], x.shape[1], n, x.shape[3])  # noqa: E731 - global shape
    extras = [n for n in ("dout", "key_padding_mask", "segment_ids", "kv_segment_ids")
              if getattr(inp, n) is not None]
    scale = st.scale if st.scale is not None else f"1/sqrt({inp.q.shape[3]})"
    strategy = st.strategy if st.strategy != "auto" else f"auto -> {st.strategy_used(inp, c.size)}"
    con.say(f"mpiattn {__version__} {title}: {'forward + backward' if backward else 'forward'}, "
            f"{'causal' if st.causal else 'non-causal'}, {c.size} rank(s) on {len(set(hosts))} host(s)")
    con.say(f"  input    {path}")
    con.say(f"  shapes   q {shape(inp.q, inp.n)}, k {shape(inp.k, inp.m)}, v {shape(inp.v, inp.m)}"
            + (f" + {', '.join(extras)}" if extras else ""))
    window = "" if st.window is None else f", window {_window_text(st.window)}"
    con.say(f"  compute  {st.xp.__name__}, {inp.q.dtype}, layout {st.layout_name}, strategy {strategy}, "
            f"scale {scale}{window}{st.device_note}")


def _window_text(window: tuple) -> str:
    return ",".join("none" if w is None else str(w) for w in window)


def prepare_output(c: Any, con: Console, output: str, force: bool, nbytes: int | None = None) -> None:
    """Before any work: the output can be written (and fits), stale temporaries are gone.

    Removes the temporary files that dead writers left in the output's
    directory (never a live writer's) and says so.
    """
    with agreed():
        io.check_output(output, c, force=force, nbytes=nbytes)
        directory = os.path.dirname(os.path.abspath(output))
        stale = io.atomic.on_rank0(c, lambda: io.remove_stale(directory, con.outputs.active()))
    for path, size in stale.removed:
        con.say(f"removed {path} ({size / 2**20:.1f} MiB), left by an mpiattn writer that died")


def check_arguments(c: Any, inp: Any, st: Settings) -> None:
    """Argument errors that show only once the input is known: UsageError (exit 2) on every rank.

    Runs on metadata every rank has (global shapes, the rank count), so
    every rank raises alike without communicating.
    """
    H, Hkv = inp.q.shape[1], inp.k.shape[1]
    if st.strategy == "ulysses" and (H % c.size or Hkv % c.size):
        raise UsageError(f"--strategy ulysses needs the query heads H = {H} and key/value heads "
                         f"Hkv = {Hkv} to be divisible by the number of ranks ({c.size}); use "
                         "--strategy ring or allgather, or another rank count")


def _output_attrs(c: Any, inp: Any, st: Settings, hosts: list[str], timer: Timer,
                  threads: Any = None) -> dict:
    """Root attributes of the output file (see docs/file-format.md)."""
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return {"mpiattn_version": __version__, "ranks": c.size, "hosts": len(set(hosts)),
            "blas_threads": None if threads is None or threads.count is None else threads.count,
            "blas_threads_source": None if threads is None else threads.source,
            "strategy": st.strategy, "strategy_used": st.strategy_used(inp, c.size),
            "layout": st.layout_name, "dtype": str(inp.q.dtype), "device": st.xp.__name__,
            "window": None if st.window is None else [-1 if w is None else w for w in st.window],
            "gpu_transport": None if st.xp is np else getattr(c, "transport", None),
            "causal": st.causal,
            "scale": st.scale if st.scale is not None else 1 / math.sqrt(inp.q.shape[3]),
            "block_size": st.block_size, "engine": st.engine,
            "engine_used": st.used.get("engine", ""), "block_size_used": st.used.get("block_size", 0),
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
    broadcast, so every rank computes the same layout) and the tile rows
    (``--block-size``, else the library's default), counting visible
    tiles; the keys share it when ``M == N``, else they are contiguous.
    """
    if args.layout != "balanced":
        lay = args.layout if args.layout != "auto" else ("zigzag" if causal else "contiguous")
        return lay, lay
    with agreed():
        shapes, ids = io.reading.read_whole(path, "segment_ids", c, meta)
        N, M = shapes["q"][2], shapes["k"][2]
        lay = balance(N, c.size, causal=causal, window=window, segment_ids=ids,
                      block_size=args.block_size or DEFAULT_BLOCK)
    return lay, (lay if M == N else "contiguous")


def run_file(c: Any, con: Console, args: Any, path: str, output: str, force: bool,
              extra_attrs: dict, title: str) -> int:
    """The body shared by ``run`` and ``example``: read, compute, check, write, report.

    The check (``--check``) runs before the output is written: a failed
    check leaves no output under the requested name. The input's metadata
    is read once, and every later open must find the same file
    (:func:`mpiattn.io.read_input`).
    """
    timer = Timer(c, con)
    with local_errors(c):  # rank 0 decides
        if c.rank == 0 and os.path.exists(output) and os.path.exists(path) \
                and os.path.samefile(path, output):
            raise ValueError(f"the output {output} is the input file")
    prepare_output(c, con, output, force)  # before any computing
    with agreed():
        meta = io.read_meta(path, c)
    causal = args.causal if getattr(args, "causal", None) is not None else bool(meta["causal"])
    window = getattr(args, "window", None)
    window = meta["window"] if window is None else window
    layout, kv_layout = _layouts(c, args, path, causal, window, meta)
    allow_nonfinite = getattr(args, "allow_nonfinite", False)
    with agreed(), timer.phase("read"):
        try:
            inp = io.read_input(path, c, layout=layout, dtype=getattr(args, "dtype", None),
                                check_finite=not allow_nonfinite, kv_layout=kv_layout, meta=meta)
        except io.NonFiniteError as exc:
            raise io.NonFiniteError(f"{exc}; pass --allow-nonfinite to compute anyway") from None
    xp, note = select_device(c, args.device, args.gpu_transport)
    scale = inp.scale if getattr(args, "scale", None) is None else args.scale
    st = Settings(causal, scale, layout, args.strategy, args.block_size, xp, note,
                  getattr(args, "engine", "auto"), window=window, kv_layout=kv_layout)
    backward = inp.dout is not None and not getattr(args, "no_backward", False)
    with agreed():
        check_arguments(c, inp, st)
        io.check_space(output, output_bytes(inp, backward), c)  # before computing
    hosts = host_names(c)
    _header(con, title, c, hosts, path, inp, st, backward)
    if getattr(args, "threads_info", None) is not None:
        con.say(f"  threads  BLAS {args.threads_info.describe()}")
    results = _compute(c, con, inp, st, backward, timer)
    verdict = None
    if getattr(args, "check", True):
        with timer.phase("check"):
            verdict = _check(c, results, inp, st, getattr(args, "check_limit_gib", 4.0))
    with timer.phase("write"):
        threads = getattr(args, "threads_info", None)
        attrs_out = {**_output_attrs(c, inp, st, hosts, timer, threads), "check": verdict,
                     **extra_attrs}
        _write_results(c, con, output, results, inp, layout, attrs_out, force)
    con.say(f"  engine   {st.used.get('engine', '?')} ({st.used.get('engine_reason', '')}), "
            f"blocks of {st.used.get('block_size', '?')} rows")
    con.say(f"  time     {timer.summary()}")
    if verdict:
        con.say(f"  check    {verdict}")
    con.say(f"  output   {os.path.abspath(output)}: {', '.join(results)}")
    return 0
