"""Command line: ``python -m mpiattn [example | run | make-data | info] ...``.

Every rank parses the same ``argv`` and runs the same sequence of collective
steps; only rank 0 prints (the progress bar only when stdout is a terminal).

Exit codes: 0 success, 2 usage error (bad arguments), 1 runtime error (bad
input file, unwritable output, failed check, ...). Each error is printed
once. Errors of the collective steps are raised identically on every rank,
so every rank returns the same code; an unexpected error on one rank only
(a bug) is printed by that rank, which then aborts the job so nothing hangs.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import math
import os
import sys
import time
import traceback
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np

from . import __version__

__all__ = ["main", "build_parser", "EXAMPLE_OUTPUT", "EXAMPLE_ATTR", "UsageError"]

#: Output of ``python -m mpiattn`` with no arguments (in the current directory).
EXAMPLE_OUTPUT = "mpiattn-example-out.h5"
#: Root attribute marking a file written by the example (the only kind it overwrites).
EXAMPLE_ATTR = "mpiattn_example"
#: make-data arguments of the bundled example (``mpiattn/data/example.h5``).
EXAMPLE_SPEC = dict(batch=1, heads=4, kv_heads=2, seq=1024, kv_seq=1024, dim=16, value_dim=16,
                    dtype="float32", with_dout=True, padding=0.1, seed=2024)
#: Relative tolerance of ``--check`` per compute dtype (max error / max |reference|).
CHECK_TOL = {"float16": 3e-2, "float32": 1e-4, "float64": 1e-10}
#: Optional subcommands of other modules: name -> (module with add_arguments(parser) and
#: run(args) -> exit code, one-line help). The module is imported only when its command runs.
PLUGINS = {"bench": ("mpiattn.bench", "benchmarks: mpiattn against GEMM and peers (see bench --help)")}


class UsageError(Exception):
    """Bad command-line arguments (exit code 2)."""

    def __init__(self, message: str, usage: str = ""):
        super().__init__(message)
        self.usage = usage


def _world_rank() -> int:
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_rank()


class _Parser(argparse.ArgumentParser):
    """argparse that raises :class:`UsageError` and prints help on rank 0 only."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{self.prog}: error: {message}", self.format_usage())

    def _print_message(self, message: str, file: Any = None) -> None:
        if _world_rank() == 0:
            super()._print_message(message, file)


class Console:
    """Rank 0's output: messages (unless quiet), errors, a progress bar on terminals."""

    def __init__(self, rank: int, quiet: bool = False):
        self.rank, self.quiet = rank, quiet
        self.tty = rank == 0 and not quiet and sys.stdout.isatty()

    def say(self, msg: str = "") -> None:
        if self.rank == 0 and not self.quiet:
            print(msg, flush=True)

    def error(self, msg: str) -> None:
        if self.rank == 0:
            print(f"mpiattn: error: {msg}", file=sys.stderr, flush=True)

    def progress(self, label: str) -> Callable[[int, int], None]:
        """A ``progress(done, total)`` callback drawing a bar (a no-op off terminals)."""
        last = [0.0]

        def update(done: int, total: int) -> None:
            if not self.tty:
                return
            now = time.monotonic()
            if done < total and now - last[0] < 0.1:
                return
            last[0] = now
            width = 30
            fill = width * done // max(total, 1)
            sys.stdout.write(f"\r  {label:9s}[{'#' * fill}{'.' * (width - fill)}] {done}/{total}")
            if done >= total:
                sys.stdout.write("\n")
            sys.stdout.flush()

        return update


# ----------------------------------------------------------------- argument types
def _int_at_least(low: int):
    """An argparse type: an integer >= ``low``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value
    return parse


_positive_int = _int_at_least(1)
_nonneg_int = _int_at_least(0)


def _finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be finite, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = _finite_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def _fraction(text: str) -> float:
    value = _finite_float(text)
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {value}")
    return value


# ----------------------------------------------------------------- the parser
def _add_compute_options(p: argparse.ArgumentParser) -> None:
    from .strategies import STRATEGIES

    p.add_argument("--strategy", choices=STRATEGIES, default="auto",
                   help="distributed algorithm (default auto: chosen by a cost model)")
    p.add_argument("--layout", choices=("auto", "contiguous", "zigzag"), default="auto",
                   help="rows per rank; auto = zigzag when causal (load balance), else contiguous")
    p.add_argument("--block-size", type=_positive_int, default=None, metavar="ROWS",
                   help="rows per exchanged key/value block and score tile (default 512)")
    p.add_argument("--device", choices=("cpu", "gpu", "auto"), default="auto",
                   help="where to compute: cpu (NumPy), gpu (CuPy, one GPU per rank), "
                        "auto (gpu when CuPy and a GPU are usable on every rank; the default)")
    p.add_argument("--gpu-transport", choices=("auto", "cuda-aware", "staged", "nccl"), default=None,
                   help="how device buffers cross ranks (sets MPIATTN_GPU_TRANSPORT)")
    p.add_argument("--quiet", "-q", action="store_true", help="print only errors")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``mpiattn`` argument parser (every rank builds the same one).

    Parameters
    ----------
    command : str, optional
        The command about to be parsed: a plugin's full options (and its
        import) are added only for its own command.
    """
    parser = _Parser(prog="mpiattn", description="Exact attention over sequences sharded across "
                     "MPI ranks. Without a command: run the bundled example (forward + backward, "
                     "causal) and check it against a float64 reference.")
    parser.add_argument("--version", action="version", version=f"mpiattn {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    ex = sub.add_parser("example", help="run the bundled example (the default command)")
    ex.add_argument("-o", "--output", default=EXAMPLE_OUTPUT,
                    help=f"output file (default ./{EXAMPLE_OUTPUT}; only an earlier example "
                         "output is overwritten)")
    _add_compute_options(ex)

    run = sub.add_parser("run", help="compute attention (and gradients) for an HDF5 input")
    run.add_argument("input", help="HDF5 file with q, k, v [, dout, key_padding_mask]")
    run.add_argument("-o", "--output", required=True, help="HDF5 file to write")
    causal = run.add_mutually_exclusive_group()
    causal.add_argument("--causal", dest="causal", action="store_true", default=None,
                        help="causal attention (default: the input's 'causal' attribute, else off)")
    causal.add_argument("--no-causal", dest="causal", action="store_false")
    run.add_argument("--scale", type=_finite_float, default=None,
                     help="softmax scale (default: the input's 'scale' attribute, else 1/sqrt(E))")
    run.add_argument("--dtype", choices=("float16", "float32", "float64"), default=None,
                     help="compute dtype (default: that of the stored q, k, v)")
    run.add_argument("--no-backward", action="store_true",
                     help="skip the gradients even when the input has dout")
    run.add_argument("--check", action="store_true",
                     help="compare with a float64 single-process reference on gathered data")
    run.add_argument("--check-limit-gib", type=_positive_float, default=4.0, metavar="GIB",
                     help="skip --check when the reference would need more memory on rank 0 "
                          "(default 4)")
    run.add_argument("--force", "-f", action="store_true", help="overwrite an existing output")
    run.add_argument("--allow-nonfinite", action="store_true",
                     help="compute even if inputs hold NaN or Inf")
    _add_compute_options(run)

    mk = sub.add_parser("make-data", help="write a random input file, in parallel, deterministic "
                        "for a seed whatever the number of ranks")
    mk.add_argument("output", help="HDF5 file to write")
    mk.add_argument("--batch", type=_positive_int, default=1, help="B (default 1)")
    mk.add_argument("--heads", type=_positive_int, default=4, help="H query heads (default 4)")
    mk.add_argument("--kv-heads", type=_positive_int, default=None, help="Hkv (default H)")
    mk.add_argument("--seq", type=_positive_int, default=1024, help="N query rows (default 1024)")
    mk.add_argument("--kv-seq", type=_positive_int, default=None, help="M key rows (default N)")
    mk.add_argument("--dim", type=_positive_int, default=64, help="E (default 64)")
    mk.add_argument("--value-dim", type=_positive_int, default=None, help="Ev (default E)")
    mk.add_argument("--dtype", choices=("float16", "float32", "float64"), default="float32")
    mk.add_argument("--with-dout", action="store_true", help="add dout (requests the backward)")
    mk.add_argument("--padding", type=_fraction, default=0.0, metavar="FRAC",
                    help="add a key_padding_mask with this fraction of padding keys")
    mk.add_argument("--causal", action="store_true", help="set the file's causal attribute")
    mk.add_argument("--scale", type=_finite_float, default=None, help="set the file's scale attribute")
    mk.add_argument("--seed", type=_nonneg_int, default=0)
    mk.add_argument("--force", "-f", action="store_true", help="overwrite an existing output")
    mk.add_argument("--quiet", "-q", action="store_true")

    sub.add_parser("info", help="versions, ranks, hosts, GPUs, CUDA-aware MPI, parallel HDF5")

    for name, (module, text) in PLUGINS.items():
        if importlib.util.find_spec(module) is None:
            continue
        p = sub.add_parser(name, help=text)
        if command == name:
            importlib.import_module(module).add_arguments(p)
    return parser


# ----------------------------------------------------------------- error agreement
@contextlib.contextmanager
def _agreed() -> Iterator[None]:
    """Mark errors of the block as raised identically on every rank (a collective mpiattn call)."""
    try:
        yield
    except Exception as exc:
        exc.mpiattn_agreed = True  # type: ignore[attr-defined]
        raise


@contextlib.contextmanager
def _local(c: Any) -> Iterator[None]:
    """A purely local block whose error is agreed on by all ranks."""
    with _agreed(), c.collective_errors():
        yield


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit code (0, 1 or 2) on every rank."""
    argv = sys.argv[1:] if argv is None else list(argv)
    rank = _world_rank()
    con = Console(rank)
    try:
        if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help", "--version")):
            argv = ["example", *argv]  # options without a command belong to the example
        args = build_parser(argv[0]).parse_args(argv)
        con.quiet = bool(getattr(args, "quiet", False))
        con.tty = con.tty and not con.quiet
    except UsageError as exc:
        if rank == 0:
            sys.stderr.write(exc.usage + str(exc) + "\n")
            sys.stderr.flush()
        return 2
    except SystemExit as exc:  # --help / --version
        return exc.code if isinstance(exc.code, int) else 0
    try:
        if args.command in PLUGINS:
            return int(importlib.import_module(PLUGINS[args.command][0]).run(args) or 0)
        return {"example": cmd_example, "run": cmd_run, "make-data": cmd_make_data,
                "info": cmd_info}[args.command](args, con)
    except UsageError as exc:
        con.error(str(exc))
        return 2
    except Exception as exc:  # noqa: BLE001 - turned into an exit code
        if getattr(exc, "mpiattn_agreed", False):
            con.error(str(exc) or type(exc).__name__)
            return 1
        return _unexpected(exc)


def _unexpected(exc: BaseException) -> int:
    """A failure on this rank alone: report it here and end the whole job."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    sys.stderr.write(f"mpiattn: error on rank {world.Get_rank()}: {type(exc).__name__}: {exc}\n"
                     f"{traceback.format_exc()}")
    sys.stderr.flush()
    if world.Get_size() > 1:
        sys.stderr.write("mpiattn: aborting the job so no rank waits forever\n")
        sys.stderr.flush()
        world.Abort(1)
    return 1


# ----------------------------------------------------------------- shared steps
def _comm() -> Any:
    from .comm import get_comm

    with _agreed():
        return get_comm()


def _hosts(c: Any) -> list[str]:
    from mpi4py import MPI

    return c.allgather_obj(MPI.Get_processor_name())


_NO_CUPY = "none (cupy not installed)"


def _gpu_status() -> tuple[bool, str]:
    """(usable, description) of this rank's GPUs, never raising."""
    if "cupy" not in sys.modules and importlib.util.find_spec("cupy") is None:
        return False, _NO_CUPY
    if importlib.util.find_spec("mpiattn.gpu") is None:
        return False, "none (this mpiattn has no GPU path)"
    from . import gpu

    count, why = gpu.probe()
    return (True, f"{count} visible") if count else (False, f"none ({why})")


def _select_device(c: Any, device: str, transport: str | None) -> tuple[Any, str]:
    """(numpy or cupy, a note) for this run, agreed by every rank; binds one GPU per rank for cupy."""
    if device == "cpu":
        return np, ""
    if transport is not None:
        os.environ["MPIATTN_GPU_TRANSPORT"] = transport
    status = c.allgather_obj(_gpu_status())
    missing = [(r, why) for r, (ok, why) in enumerate(status) if not ok]
    if missing:
        where = f"rank {missing[0][0]}: {missing[0][1]}"
        if device == "auto":  # silent on CPU-only installs, a note where CuPy is there but unusable
            quiet = all(why == _NO_CUPY for _, why in missing)
            return np, "" if quiet else f" (--device auto: no usable GPU on {where})"
        with _agreed():  # every rank knows (allgathered): all raise, no communication
            raise RuntimeError(f"--device gpu: no usable GPU on {where}")
    with _agreed():
        from . import gpu

        gpu.bind_device(c)  # one GPU per rank by node-local rank; chooses the transport
        import cupy
    return cupy, ""


@dataclass
class _Settings:
    """The effective settings of one run (identical on every rank)."""

    causal: bool
    scale: float | None
    layout: str
    strategy: str
    block_size: int | None
    xp: Any
    device_note: str = ""

    def strategy_used(self, inp: Any, P: int) -> str:
        """What ``auto`` resolves to (the attention module's cost model), else the strategy."""
        if self.strategy != "auto":
            return self.strategy
        from .strategies import DEFAULT_BLOCK, choose_strategy

        _, H, _, E = inp.q.shape
        Hkv, Ev = inp.k.shape[1], inp.v.shape[3]
        return choose_strategy(inp.n, inp.m, H, Hkv, E, Ev, P, self.block_size or DEFAULT_BLOCK)


class _Timer:
    """Wall-clock phases delimited by barriers (so they cover the slowest rank)."""

    def __init__(self, c: Any):
        self.c, self.times = c, {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.c.barrier()
        t0 = time.perf_counter()
        yield  # on an error (raised alike on every rank) the closing barrier is skipped everywhere
        self.c.barrier()
        self.times[name] = time.perf_counter() - t0

    def summary(self) -> str:
        return ", ".join(f"{k} {v:.3g} s" for k, v in self.times.items())


def _compute(c: Any, con: Console, inp: Any, st: _Settings, backward: bool,
             timer: _Timer) -> dict[str, np.ndarray]:
    """Forward (and backward): this rank's results as NumPy arrays."""
    from . import attention, attention_backward
    from .backend import to_host

    if st.xp is np:
        move = np.asarray
    else:
        from .gpu import upload as move  # host slab -> device through a pinned buffer
    q, k, v, dout, mask = (None if a is None else move(a)
                           for a in (inp.q, inp.k, inp.v, inp.dout, inp.key_padding_mask))
    kw = dict(causal=st.causal, scale=st.scale, key_padding_mask=mask, layout=st.layout,
              strategy=st.strategy, block_size=st.block_size,
              check_finite=False)  # read_input checked them (unless --allow-nonfinite)
    with _agreed():
        with timer.phase("forward"):
            out, lse = attention(q, k, v, c, progress=con.progress("forward"), **kw)
        results = {"out": out, "lse": lse}
        if backward:
            with timer.phase("backward"):
                dq, dk, dv = attention_backward(dout, q, k, v, out, lse, c,
                                                progress=con.progress("backward"), **kw)
            results.update(dq=dq, dk=dk, dv=dv)
    return {name: to_host(x) for name, x in results.items()}


def _write_results(c: Any, path: str, results: dict[str, np.ndarray], inp: Any, layout: str,
                   attrs: dict, force: bool) -> None:
    from . import io

    # each output keeps the number of dimensions of the input it derives from
    like = {"out": ("q", 0), "lse": ("q", 1), "dq": ("q", 0), "dk": ("k", 0), "dv": ("v", 0)}
    rows = {}
    for name, x in results.items():
        source, fewer = like[name]
        ndim = inp.stored_ndim[source] - fewer
        y = x.reshape(x.shape[x.ndim - ndim:])  # drop the promoted leading axes of length 1
        length = inp.m if name in ("dk", "dv") else inp.n
        rows[name] = io.Rows(y, length, ndim - (1 if name == "lse" else 2))
    with _agreed():
        io.write_rows(path, rows, c, layout=layout, attrs=attrs, force=force)


def _check(c: Any, results: dict[str, np.ndarray], inp: Any, st: _Settings,
           limit_gib: float) -> str:
    """Gather everything to rank 0 and compare with :func:`mpiattn.reference.reference`.

    Returns the verdict line; raises RuntimeError on every rank when an error
    exceeds the tolerance of the compute dtype (:data:`CHECK_TOL`).
    """
    from .layouts import gather
    from .reference import reference, reference_nbytes

    B, H, _, E = inp.q.shape
    Hkv, Ev = inp.k.shape[1], inp.v.shape[3]
    need = reference_nbytes((B, H, inp.n, E), (B, Hkv, inp.m, E), (B, Hkv, inp.m, Ev))
    if need > limit_gib * 2**30:
        return (f"skipped: the reference would need {need / 2**30:.1f} GiB on rank 0 "
                f"(limit {limit_gib:g} GiB, --check-limit-gib)")
    with _agreed():
        g = {name: gather(x, c, axis=-1 if name in ("lse", "key_padding_mask") else -2,
                          layout=st.layout)
             for name, x in [("q", inp.q), ("k", inp.k), ("v", inp.v), ("dout", inp.dout),
                             ("key_padding_mask", inp.key_padding_mask), *results.items()]
             if x is not None}
    dtype = str(inp.q.dtype)
    tol = CHECK_TOL[dtype]
    errors = None
    if c.rank == 0:
        ref = reference(g["q"], g["k"], g["v"], g.get("dout") if "dq" in results else None,
                        causal=st.causal, scale=st.scale, key_padding_mask=g.get("key_padding_mask"))
        errors = {name: _rel_error(g[name], getattr(ref, name)) for name in results}
    errors = c.bcast_obj(errors)
    text = ", ".join(f"{k} {e:.1e}" for k, e in errors.items())
    with _agreed():  # the errors were broadcast: every rank decides alike
        if any(not e <= tol for e in errors.values()):
            raise RuntimeError(f"check failed: relative errors {text} exceed the {dtype} "
                               f"tolerance {tol:g}")
    return f"max relative error vs float64 reference: {text} (tolerance {tol:g}) OK"


def _rel_error(x: np.ndarray, ref: np.ndarray) -> float:
    """max |x - ref| / max |ref| over finite entries; inf when the infinities differ."""
    x = np.asarray(x, dtype=np.float64)
    fin = np.isfinite(ref)
    if not np.array_equal(fin, np.isfinite(x)) or not np.array_equal(x[~fin], ref[~fin]):
        return math.inf
    if not fin.any():
        return 0.0
    return float(np.abs(x[fin] - ref[fin]).max() / max(np.abs(ref[fin]).max(), 1e-30))


def _header(con: Console, title: str, c: Any, hosts: list[str], path: str, inp: Any,
            st: _Settings, backward: bool) -> None:
    """The report's first lines: what runs, on what, how."""
    shape = lambda x, n: (x.shape[0], x.shape[1], n, x.shape[3])  # noqa: E731 - global shape
    extras = [n for n in ("dout", "key_padding_mask") if getattr(inp, n) is not None]
    scale = st.scale if st.scale is not None else f"1/sqrt({inp.q.shape[3]})"
    strategy = st.strategy if st.strategy != "auto" else f"auto -> {st.strategy_used(inp, c.size)}"
    con.say(f"mpiattn {__version__} {title}: {'forward + backward' if backward else 'forward'}, "
            f"{'causal' if st.causal else 'non-causal'}, {c.size} rank(s) on {len(set(hosts))} host(s)")
    con.say(f"  input    {path}")
    con.say(f"  shapes   q {shape(inp.q, inp.n)}, k {shape(inp.k, inp.m)}, v {shape(inp.v, inp.m)}"
            + (f" + {', '.join(extras)}" if extras else ""))
    con.say(f"  compute  {st.xp.__name__}, {inp.q.dtype}, layout {st.layout}, strategy {strategy}, "
            f"scale {scale}{st.device_note}")


def _output_attrs(c: Any, inp: Any, st: _Settings, hosts: list[str], timer: _Timer) -> dict:
    """Root attributes of the output file (see docs/file-format.md)."""
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return {"mpiattn_version": __version__, "ranks": c.size, "hosts": len(set(hosts)),
            "strategy": st.strategy, "strategy_used": st.strategy_used(inp, c.size),
            "layout": st.layout, "dtype": str(inp.q.dtype), "device": st.xp.__name__,
            "gpu_transport": None if st.xp is np else getattr(c, "transport", None),
            "causal": st.causal,
            "scale": st.scale if st.scale is not None else 1 / math.sqrt(inp.q.shape[3]),
            "block_size": st.block_size, "input_path": inp.info["path"],
            "input_size": inp.info["size"], "input_mtime": inp.info["mtime"], "created": now,
            "command": " ".join(["mpiattn", *sys.argv[1:]]),
            **{f"time_{k}_s": v for k, v in timer.times.items()}}


def _run_file(c: Any, con: Console, args: Any, path: str, output: str, force: bool,
              extra_attrs: dict, title: str) -> int:
    """The body shared by ``run`` and ``example``: read, compute, write, check, report."""
    from . import io

    timer = _Timer(c)
    with _local(c):  # rank 0 decides
        if c.rank == 0 and os.path.exists(output) and os.path.exists(path) \
                and os.path.samefile(path, output):
            raise ValueError(f"the output {output} is the input file")
    with _agreed():
        io.check_output(output, c, force=force)  # before any computing
        attrs = io.read_attributes(path, c) or {}
    causal = args.causal if getattr(args, "causal", None) is not None else bool(attrs.get("causal"))
    layout = args.layout if args.layout != "auto" else ("zigzag" if causal else "contiguous")
    allow_nonfinite = getattr(args, "allow_nonfinite", False)
    with _agreed(), timer.phase("read"):
        try:
            inp = io.read_input(path, c, layout=layout, dtype=getattr(args, "dtype", None),
                                check_finite=not allow_nonfinite)
        except io.NonFiniteError as exc:
            raise io.NonFiniteError(f"{exc}; pass --allow-nonfinite to compute anyway") from None
    xp, note = _select_device(c, args.device, args.gpu_transport)
    scale = inp.scale if getattr(args, "scale", None) is None else args.scale
    st = _Settings(causal, scale, layout, args.strategy, args.block_size, xp, note)
    backward = inp.dout is not None and not getattr(args, "no_backward", False)
    hosts = _hosts(c)
    _header(con, title, c, hosts, path, inp, st, backward)
    results = _compute(c, con, inp, st, backward, timer)
    with timer.phase("write"):
        attrs_out = {**_output_attrs(c, inp, st, hosts, timer), **extra_attrs}
        _write_results(c, output, results, inp, layout, attrs_out, force)
    verdict = None
    if getattr(args, "check", True):
        with timer.phase("check"):
            verdict = _check(c, results, inp, st, getattr(args, "check_limit_gib", 4.0))
    con.say(f"  time     {timer.summary()}")
    if verdict:
        con.say(f"  check    {verdict}")
    con.say(f"  output   {os.path.abspath(output)}: {', '.join(results)}")
    return 0


# ----------------------------------------------------------------- commands
def cmd_run(args: Any, con: Console) -> int:
    """``mpiattn run INPUT -o OUTPUT``."""
    c = _comm()
    return _run_file(c, con, args, args.input, args.output, args.force, {}, "run")


def _example_input() -> Any:
    """Context manager giving the path of the bundled example input (None when missing)."""
    from importlib import resources

    ref = resources.files("mpiattn").joinpath("data", "example.h5")
    if not ref.is_file():
        return contextlib.nullcontext(None)
    return resources.as_file(ref)


def cmd_example(args: Any, con: Console) -> int:
    """The default command: the bundled example, forward + backward, causal, checked."""
    from . import io

    c = _comm()
    output = args.output
    with _agreed():
        exists = c.bcast_obj(os.path.lexists(output))  # rank 0 decides for everybody
        attrs = io.read_attributes(output, c) if exists else {}
    with _agreed():  # exists and attrs come from rank 0: every rank decides alike
        if attrs is None or (exists and not attrs.get(EXAMPLE_ATTR)):
            raise FileExistsError(f"{os.path.abspath(output)} exists and is not an output of the "
                                  "mpiattn example; refusing to overwrite it (move it away or run "
                                  "in another directory)")
    args.check, args.causal = True, None
    with _example_input() as path:
        with _agreed():
            missing = c.bcast_obj(path is None or not os.path.isfile(path))
        if missing:
            return _example_regenerated(c, con, args, output)
        return _run_file(c, con, args, str(path), output, True, {EXAMPLE_ATTR: 1}, "example")


def _example_regenerated(c: Any, con: Console, args: Any, output: str) -> int:
    """Bundled file missing (an unusual install): regenerate it (make-data), run, delete it."""
    directory = os.path.dirname(os.path.abspath(output))
    regen = c.bcast_obj(os.path.join(directory, f".mpiattn-example-in-{uuid.uuid4().hex[:8]}.h5"))
    con.say("bundled example input missing: regenerating it with make-data (seed "
            f"{EXAMPLE_SPEC['seed']})")
    try:
        _make_data(c, regen, dict(EXAMPLE_SPEC), causal=True, scale=None, force=False)
        return _run_file(c, con, args, regen, output, True, {EXAMPLE_ATTR: 1}, "example")
    finally:  # every rank has finished reading it once _run_file returns or raises alike
        if c.rank == 0 and os.path.exists(regen):
            os.remove(regen)


def _make_data(c: Any, output: str, spec_kw: dict, causal: bool, scale: float | None,
               force: bool) -> tuple[Any, dict]:
    from . import datagen, io
    from .layouts import all_segments

    spec = datagen.Spec(**spec_kw)
    timer = _Timer(c)
    with _agreed():
        io.check_output(output, c, force=force)
    with timer.phase("generate"), _local(c):
        rows = {}
        for name, (shape, axis) in spec.datasets().items():
            segs = all_segments(shape[axis], c.size, "contiguous")[c.rank]
            rows[name] = io.Rows(datagen.local_rows(spec, name, segs), shape[axis], axis)
    attrs = {"causal": bool(causal), "scale": scale, "generator": "mpiattn make-data",
             "mpiattn_version": __version__, "seed": spec.seed, "padding": spec.padding,
             "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    with _agreed(), timer.phase("write"):
        io.write_rows(output, rows, c, attrs=attrs, force=force)
    return spec, timer.times


def cmd_make_data(args: Any, con: Console) -> int:
    """``mpiattn make-data OUTPUT ...``."""
    kv_heads = args.kv_heads or args.heads
    if args.heads % kv_heads:
        raise UsageError(f"--heads {args.heads} must be a multiple of --kv-heads {kv_heads}")
    spec_kw = dict(batch=args.batch, heads=args.heads, kv_heads=kv_heads, seq=args.seq,
                   kv_seq=args.kv_seq or args.seq, dim=args.dim, value_dim=args.value_dim or args.dim,
                   dtype=args.dtype, with_dout=args.with_dout, padding=args.padding, seed=args.seed)
    c = _comm()
    spec, times = _make_data(c, args.output, spec_kw, args.causal, args.scale, args.force)
    names = ", ".join(f"{n} {s}" for n, (s, _) in spec.datasets().items())
    con.say(f"wrote {os.path.abspath(args.output)} on {c.size} rank(s): {names} ({spec.dtype}, "
            f"seed {spec.seed}); " + ", ".join(f"{k} {v:.3g} s" for k, v in times.items()))
    return 0


def _transport_line(c: Any, any_gpu: bool) -> str:
    """The CUDA-aware decision of :func:`mpiattn.gpu.describe_transport` (collective)."""
    if importlib.util.find_spec("mpiattn.gpu") is None:
        return "n/a (no GPU path)"
    from . import gpu

    describe = getattr(gpu, "describe_transport", None)
    if describe is None:
        return "n/a (mpiattn.gpu has no describe_transport)"
    import logging

    log = logging.getLogger("mpiattn.gpu")
    level = log.level
    log.setLevel(logging.ERROR)  # its "staged" notice would repeat what info prints anyway
    try:
        d = describe(c)  # collective; raises alike on every rank
        summary = d.get("summary", str(d)) if isinstance(d, dict) else str(d)
    except Exception as exc:  # noqa: BLE001 - info must not crash
        return f"unknown ({type(exc).__name__}: {exc})"
    finally:
        log.setLevel(level)
    return summary if any_gpu else f"{summary} [unused here: no usable GPU]"


def cmd_info(args: Any, con: Console) -> int:
    """``mpiattn info``: what this installation and this job see."""
    import h5py
    import mpi4py
    from mpi4py import MPI

    from . import io

    c = _comm()
    hosts = _hosts(c)
    status = c.allgather_obj(_gpu_status())
    gpus = [why for _, why in status]
    transport = _transport_line(c, any(ok for ok, _ in status))
    con.say(f"mpiattn    {__version__} (python {sys.version.split()[0]}, numpy {np.__version__})")
    con.say(f"mpi4py     {mpi4py.__version__}; MPI {'.'.join(map(str, MPI.Get_version()))}: "
            f"{' '.join(MPI.Get_library_version().splitlines()[0].split())}")
    con.say(f"h5py       {h5py.__version__}, HDF5 {h5py.version.hdf5_version}, parallel HDF5: "
            f"{'yes (mpio driver, collective writes)' if io.parallel_hdf5() else 'no (serial writes in turn)'}")
    by_host: dict[str, list[int]] = {}
    for r, h in enumerate(hosts):
        by_host.setdefault(h, []).append(r)
    con.say(f"ranks      {c.size} on {len(by_host)} host(s): "
            + "; ".join(f"{h} ({_ranges(rs)})" for h, rs in by_host.items()))
    if len(set(gpus)) == 1:
        con.say(f"GPUs       every rank: {gpus[0]}")
    else:
        con.say("GPUs       " + "; ".join(f"rank {r}: {g}" for r, g in enumerate(gpus)))
    con.say(f"CUDA-aware {transport}")
    return 0


def _ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> 'ranks 0-2, 5'."""
    parts, start = [], ranks[0]
    for a, b in zip(ranks, ranks[1:] + [None]):
        if b != a + 1:
            parts.append(f"{start}-{a}" if a > start else f"{a}")
            start = b
    return ("ranks " if len(ranks) > 1 else "rank ") + ", ".join(parts)
