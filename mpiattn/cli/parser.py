"""The argument parser of ``python -m mpiattn`` (bounds checked before any work)."""

from __future__ import annotations

import argparse
import importlib
import importlib.util

from .. import __version__
from ..comm.watchdog import MIN_TIMEOUT_S
from ..kernels import engines
from ..masks import mods
from ..strategies import machines, registry
from . import calibrate, inference, plan
from .argtypes import (causal_alignment, finite_float, fraction, mask_mod, nonneg_int,
                       positive_float, positive_int, seed, strategy, watchdog_seconds, window)
from .common import EXAMPLE_OUTPUT, PLUGINS, Parser


# ----------------------------------------------------------------- the parser
def _add_compute_options(p: argparse.ArgumentParser) -> None:

    p.add_argument("--strategy", type=strategy, default="auto", metavar="NAME",
                   help="distributed algorithm: " + "; ".join(
                       f"{name}" + ("" if s.auto else " (never chosen by auto)")
                       for name, s in registry.STRATEGIES.items())
                   + "; hybrid:UxR fixes the two-level split (e.g. hybrid:2x2). Default auto: the "
                     "fastest the cost model predicts (see `mpiattn plan`)")
    p.add_argument("--machine", default=None, metavar="NAME|FILE",
                   help="what the cost model assumes when it chooses: a profile ("
                        + ", ".join(machines.PROFILES) + ") or a file written by `mpiattn calibrate` "
                        f"(default ${machines.MACHINE_VARIABLE}, else the device's profile)")
    p.add_argument("--layout", choices=("auto", "contiguous", "zigzag", "balanced"), default="auto",
                   help="rows per rank; auto = zigzag when causal (load balance), else contiguous; "
                        "balanced = an equal share of visible pairs per rank, from the causal flag, "
                        "window and segment_ids (mpiattn.balance)")
    p.add_argument("--engine", choices=engines.NAMES, default="auto",
                   help="local kernels: " + ", ".join(engines.ENGINES)
                   + f" (default auto: the one a calibrated --machine measured fastest, else "
                   f"{engines.AUTO[0]}, the reference)")
    p.add_argument("--block-size", type=positive_int, default=None, metavar="ROWS",
                   help="rows per exchanged key/value block and score tile (default 512)")
    p.add_argument("--device", choices=("cpu", "gpu", "auto"), default="auto",
                   help="where to compute: cpu (NumPy), gpu (CuPy, one GPU per rank), "
                        "auto (gpu when CuPy and a GPU are usable on every rank; the default)")
    p.add_argument("--gpu-transport", choices=("auto", "cuda-aware", "staged", "nccl"), default=None,
                   help="how device buffers cross ranks (sets MPIATTN_GPU_TRANSPORT)")
    _add_threads_option(p)
    _add_watchdog_option(p)
    p.add_argument("--quiet", "-q", action="store_true", help="print only errors")


def _add_watchdog_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--watchdog", type=watchdog_seconds, default=None, metavar="SECONDS",
                   help="end the job when a rank has heard nothing from another for this long "
                        f"(a lost host or a cut network; mpiattn.comm.watchdog; at least "
                        f"{MIN_TIMEOUT_S:g}). Default: off")


def _add_threads_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=positive_int, default=None, metavar="N",
                   help="BLAS threads per rank (default: OMP_NUM_THREADS, OPENBLAS_NUM_THREADS "
                        "or MKL_NUM_THREADS when set, else the node's cores / its ranks)")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``mpiattn`` argument parser (every rank builds the same one).

    Parameters
    ----------
    command : str, optional
        The command about to be parsed: a plugin's full options (and its
        import) are added only for its own command.
    """
    parser = Parser(prog="mpiattn", description="Exact attention over sequences sharded across "
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
    run.add_argument("input", help="HDF5 file with q, k, v [, dout, key_padding_mask, segment_ids, "
                                   "attn_mask, sinks, alibi_slopes]")
    run.add_argument("-o", "--output", required=True, help="HDF5 file to write")
    causal = run.add_mutually_exclusive_group()
    causal.add_argument("--causal", dest="causal", nargs="?", const=True, default=None,
                        type=causal_alignment, metavar="ALIGN",
                        help="causal attention, top-left (the default alignment: query i sees "
                             "keys j <= i) or bottom-right (j <= i + M - N); default: the "
                             "input's 'causal' attribute, else off")
    causal.add_argument("--no-causal", dest="causal", action="store_false")
    run.add_argument("--window", type=window, default=None, metavar="L,R",
                     help="sliding window: query i sees keys i-L..i+R (none = unbounded side; "
                          "default: the input's 'window' attribute, else no window)")
    run.add_argument("--scale", type=finite_float, default=None,
                     help="softmax scale (default: the input's 'scale' attribute, else 1/sqrt(E))")
    run.add_argument("--softcap", type=positive_float, default=None, metavar="C",
                     help="cap the scores: C tanh(scale q.k / C) (Gemma 2)")
    run.add_argument("--mask-mod", type=mask_mod, default=None, metavar="NAME:PARAMS",
                     help="a named mask rule, combined with the others by AND: "
                          f"{', '.join(mods.names())} (e.g. chunked:4096; see mpiattn.masks.mods)")
    run.add_argument("--dtype", choices=("float16", "float32", "float64"), default=None,
                     help="compute dtype (default: that of the stored q, k, v)")
    run.add_argument("--no-backward", action="store_true",
                     help="skip the gradients even when the input has dout")
    run.add_argument("--check", action="store_true",
                     help="compare with a float64 single-process reference on gathered data, "
                          "before writing: a failed check writes no output")
    run.add_argument("--check-limit-gib", type=positive_float, default=4.0, metavar="GIB",
                     help="skip --check when the reference would need more memory on rank 0 "
                          "(default 4)")
    run.add_argument("--force", "-f", action="store_true", help="overwrite an existing output")
    run.add_argument("--allow-nonfinite", action="store_true",
                     help="compute even if inputs hold NaN or Inf")
    _add_compute_options(run)

    mk = sub.add_parser("make-data", help="write a random input file, in parallel, deterministic "
                        "for a seed whatever the number of ranks")
    mk.add_argument("output", help="HDF5 file to write")
    mk.add_argument("--batch", type=positive_int, default=1, help="B (default 1)")
    mk.add_argument("--heads", type=positive_int, default=4, help="H query heads (default 4)")
    mk.add_argument("--kv-heads", type=positive_int, default=None, help="Hkv (default H)")
    mk.add_argument("--seq", type=positive_int, default=1024, help="N query rows (default 1024)")
    mk.add_argument("--kv-seq", type=positive_int, default=None, help="M key rows (default N)")
    mk.add_argument("--dim", type=positive_int, default=64, help="E (default 64)")
    mk.add_argument("--value-dim", type=positive_int, default=None, help="Ev (default E)")
    mk.add_argument("--dtype", choices=("float16", "float32", "float64"), default="float32")
    mk.add_argument("--with-dout", action="store_true", help="add dout (requests the backward)")
    mk.add_argument("--padding", type=fraction, default=0.0, metavar="FRAC",
                    help="add a key_padding_mask with this fraction of padding keys")
    mk.add_argument("--docs", type=nonneg_int, default=0, metavar="MEAN_LEN",
                    help="add segment_ids: packed documents of this mean length (needs --kv-seq = --seq)")
    mk.add_argument("--window", type=window, default=None, metavar="L,R",
                    help="set the file's window attribute")
    mk.add_argument("--causal", nargs="?", const=True, default=False, type=causal_alignment,
                    metavar="ALIGN", help="set the file's causal attribute (top-left or "
                                          "bottom-right; alone: top-left)")
    mk.add_argument("--scale", type=finite_float, default=None, help="set the file's scale attribute")
    mk.add_argument("--sinks", action="store_true", help="add sinks (H,): one per query head")
    mk.add_argument("--alibi", action="store_true",
                    help="add alibi_slopes (H,): the geometric slopes 2^(-8 h / H) of the ALiBi paper")
    mk.add_argument("--seed", type=seed, default=0)
    mk.add_argument("--force", "-f", action="store_true", help="overwrite an existing output")
    _add_watchdog_option(mk)
    mk.add_argument("--quiet", "-q", action="store_true")

    info = sub.add_parser("info", help="versions, ranks, hosts, threads, GPUs, CUDA-aware MPI, "
                          "parallel HDF5")
    _add_threads_option(info)

    clean = sub.add_parser("clean", help="remove the temporary files of dead mpiattn writers "
                           "in a directory (never those of live ones)")
    clean.add_argument("directory", nargs="?", default=".", help="directory (default: the current one)")
    clean.add_argument("--quiet", "-q", action="store_true", help="print only errors")

    inference.add_arguments(sub)

    pl = sub.add_parser("plan", help="predict every strategy's time, traffic and memory for a "
                        "problem on a machine, and show what auto picks (runs nothing)")
    plan.add_arguments(pl)

    cal = sub.add_parser("calibrate", help="measure this allocation's links and compute rates for "
                         "the cost model and write them as JSON")
    calibrate.add_arguments(cal)
    _add_threads_option(cal)

    for name, (module, text) in PLUGINS.items():
        if importlib.util.find_spec(module) is None:
            continue
        p = sub.add_parser(name, help=text)
        if command == name:
            importlib.import_module(module).add_arguments(p)
    return parser


