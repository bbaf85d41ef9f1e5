"""``python -m mpiattn calibrate``: measure this allocation for the cost model, write it as JSON.

Run it with the ranks, nodes and devices of the jobs to plan (collective)::

    mpiexec -n 8 python -m mpiattn calibrate -o machine.json

It measures, with every rank placed as the job places them
(:class:`~mpiattn.comm.topology.Topology`):

* each link class (inside a node, between nodes), each on its own: a
  ping-pong of 8 bytes (latency: half the best round trip) and of
  ``--megabytes`` (bandwidth) between one pair of ranks while every other
  rank waits without taking a core; then the bytes per second node 0 sends
  to node 1 with all its ranks at once, which the cost model shares among
  the ranks that send between nodes together (:mod:`mpiattn.cli.links`);
* the attention rate of one rank per dtype, forward and backward, with every
  rank computing at once (so that a shared node's contention is in the
  number), on ``--rows`` query and key rows of ``--heads`` heads of ``--dim``,
  by each engine that can run it on every rank (``--engines``; bfloat16 too
  where ``ml_dtypes`` is installed): the machine's ``engines``, from which
  ``engine="auto"`` picks the fastest (:func:`mpiattn.kernels.engines.local_choice`);
* the memory per rank (the device's, else the node's divided by its ranks),
  and the bandwidth at which a rank reads it while every rank does (what
  bounds a decode step);
* on two nodes or more, how much of a transfer between nodes hides behind
  compute while every rank computes (``overlap_between``).

A link class the allocation lacks (``between`` on one node, ``inside``
with one rank per node) and the overlap of transfers inside a node with
compute come from the device's profile (:data:`mpiattn.strategies.machines.PROFILES`); the
node's bandwidth, where it cannot be measured, is left unknown (0); the
file's ``sources`` say which figure is measured and which is not. The file is what ``machine=``, ``--machine`` and ``$MPIATTN_MACHINE``
take, and ``plan --calibration``.
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import time
from dataclasses import replace
from typing import Any

import numpy as np

from ..strategies import machines
from ..strategies.machines import Link, Machine
from . import argtypes
from .links import NOT_MEASURED, measure_links, transfer_overlap

__all__ = ["add_arguments", "cmd_calibrate"]

DTYPES = ("float64", "float32", "float16")

#: Engines measured only when ``--engines`` names them (never run on a GPU yet: ``auto`` does not
#: pick them unless asked to measure them).
UNASKED = ("fused",)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``calibrate``."""
    positive_int = argtypes.positive_int
    p.add_argument("-o", "--output", default="mpiattn-machine.json",
                   help="JSON file to write (default ./mpiattn-machine.json)")
    p.add_argument("--force", "-f", action="store_true", help="overwrite an existing output")
    p.add_argument("--name", default=None, help="the machine's name (default: the first host's)")
    p.add_argument("--megabytes", type=positive_int, default=16,
                   help="message size of the bandwidth measurements, MiB (default 16)")
    p.add_argument("--rows", type=positive_int, default=2048,
                   help="query and key rows of the attention-rate measurement (default 2048)")
    p.add_argument("--heads", type=positive_int, default=4, help="heads of it (default 4)")
    p.add_argument("--dim", type=positive_int, default=64, help="head dimension of it (default 64)")
    p.add_argument("--repeat", type=positive_int, default=3, help="timed repeats, the best kept (default 3)")
    p.add_argument("--engines", type=argtypes.engine_list, default=None, metavar="NAMES",
                   help="engines whose speeds are measured, comma-separated (default: every "
                        "engine every rank can run but fused; the native engine always)")
    p.add_argument("--device", choices=("cpu", "gpu"), default="cpu",
                   help="measure NumPy ranks (cpu) or CuPy ranks, one GPU each (gpu)")
    p.add_argument("--quiet", "-q", action="store_true", help="print only errors")


# ----------------------------------------------------------------- compute
def _times(c: Any, xp: Any, args: Any, dtype: Any, engine: str) -> tuple[float, float]:
    """Seconds of one rank's forward and backward in ``dtype`` with ``engine`` (every rank at once;
    the slowest rank's best of ``--repeat``)."""
    from mpi4py import MPI

    from ..strategies.api import attention, attention_backward

    B, H, N, E = 1, args.heads, args.rows, args.dim
    rng = np.random.default_rng(c.rank)
    q, k, v, do = (xp.asarray(rng.standard_normal((B, H, N, E)).astype(dtype)) for _ in range(4))
    fwd = bwd = math.inf
    for _ in range(args.repeat + 1):
        c.barrier()
        t = time.perf_counter()
        out, lse = attention(q, k, v, MPI.COMM_SELF, check_finite=False, engine=engine)
        _sync(xp)
        t1 = time.perf_counter()
        attention_backward(do, q, k, v, out, lse, MPI.COMM_SELF, check_finite=False, engine=engine)
        _sync(xp)
        fwd, bwd = min(fwd, t1 - t), min(bwd, time.perf_counter() - t1)
    return max(c.allgather_obj(fwd)), max(c.allgather_obj(bwd))


def _rates(c: Any, xp: Any, args: Any) -> tuple[dict, float, dict]:
    """Forward FLOP/s of one rank per dtype (every rank at once, the native engine), the
    backward's ratio, details."""
    flops = 2.0 * args.heads * args.rows * args.rows * (2 * args.dim)
    rates, ratios, detail = {}, [], {}
    for name in DTYPES:
        fwd, bwd = _times(c, xp, args, name, "native")
        rates[name] = flops / fwd
        ratios.append(2.5 * flops / bwd / rates[name])
        detail[name] = {"forward_s": fwd, "backward_s": bwd}
    return rates, float(np.median(ratios)), detail


def _engine_speeds(c: Any, xp: Any, args: Any, native: dict, say: Any) -> tuple[dict, str]:
    """The machine's ``engines``: ``[forward, backward]`` FLOP/s per engine and dtype (the native
    engine's from ``native``, :func:`_rates`' details), each engine measured in each dtype where
    every rank can run it; and the words for ``sources``."""
    from ..kernels import engines
    from ..strategies.spec import AttentionSpec

    flops = 2.0 * args.heads * args.rows * args.rows * (2 * args.dim)
    dtypes = list(DTYPES)
    try:
        import ml_dtypes  # noqa: F401 - bfloat16 NumPy arrays
        if xp is np:
            dtypes.append(ml_dtypes.bfloat16)
    except ImportError:
        pass
    speeds = {"native": {n: [flops / t["forward_s"], 2.5 * flops / t["backward_s"]]
                         for n, t in native.items()}}
    words = []
    asked = ["native", *(n for n in (args.engines or [e for e in engines.ENGINES if e not in UNASKED])
                         if n != "native")]
    for dtype in dtypes:
        name = np.dtype(dtype).name
        shape = (1, args.heads, args.rows, args.dim)
        spec = AttentionSpec.from_shapes(shape, shape, shape, dtype, device=xp.__name__)
        for engine in asked:
            if engine == "native" and name in speeds["native"]:
                continue
            e = engines.get(engine)
            here = (e.supports(spec) or e.usable(spec.device)) is None
            if not all(c.allgather_obj(here)):  # measured where every rank can run it
                continue
            say(f"  measuring the {engine} engine in {name}")
            fwd, bwd = _times(c, xp, args, dtype, engine)
            speeds.setdefault(engine, {})[name] = [flops / fwd, 2.5 * flops / bwd]
            words.append(f"{engine} {name} {fwd:.4g} s forward, {bwd:.4g} s backward")
    return speeds, ("measured like rates (the native engine's are rates'): " + "; ".join(words)
                    if words else "measured: the native engine only (no other engine runs here)")


def _bandwidth(c: Any, xp: Any, nbytes: int, repeat: int) -> float:
    """Bytes per second one rank reads from memory while every rank does (a sum over ``nbytes``)."""
    x = xp.ones(nbytes // 8, dtype=np.float64)
    best = math.inf
    for _ in range(repeat + 1):
        c.barrier()
        t = time.perf_counter()
        float(x.sum())
        best = min(best, time.perf_counter() - t)
    return nbytes / max(c.allgather_obj(best))


def _sync(xp: Any) -> None:
    if xp is not np:
        xp.cuda.get_current_stream().synchronize()


def _memory(c: Any, xp: Any) -> float:
    if xp is not np:
        return float(xp.cuda.Device().mem_info[1])
    pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    return float(pages * size / len(c.topology.nodes[c.topology.node_of(c.rank)]))


# ----------------------------------------------------------------- the command
def measure(c: Any, xp: Any, args: Any, say: Any = lambda text: None) -> Machine:
    """The machine of this allocation (collective on ``c``; the same on every rank)."""
    profile = machines.PROFILES[machines.DEFAULT_FOR_DEVICE["numpy" if xp is np else "cupy"]]
    nbytes = args.megabytes * 2**20
    sources = {"topology": f"{c.topology.describe()}: {c.topology.nodes}",
               "measured": time.strftime("%Y-%m-%dT%H:%M:%S") + f" by mpiattn calibrate on {c.size} rank(s)"}
    measured, node_bandwidth, link_sources = measure_links(c, xp, nbytes, args.repeat, say)
    links = {}
    for cls in ("inside", "between"):
        if measured[cls] is None:
            links[cls] = getattr(profile, cls)
            sources[cls] = f"{link_sources[cls]}: profile {profile.name}'s"
        else:
            links[cls] = Link(*measured[cls])
            sources[cls] = link_sources[cls]
    sources["node_bandwidth"] = link_sources["node"] + ("" if node_bandwidth else ": unknown (0)")
    say(f"  measuring the attention rate per dtype ({args.rows} rows, {args.heads} heads of {args.dim})")
    rates, ratio, detail = _rates(c, xp, args)
    rates.setdefault("bfloat16", rates["float16"])
    sources["rates"] = ("measured, every rank at once, the slowest rank's best of "
                        f"{args.repeat}: " + "; ".join(f"{k} {v['forward_s']:.4g} s forward, "
                                                       f"{v['backward_s']:.4g} s backward"
                                                       for k, v in detail.items())
                        + "; bfloat16: not measured, as float16")
    sources["backward_ratio"] = "measured: the median over dtypes of backward FLOP/s / forward FLOP/s"
    speeds, sources["engines"] = _engine_speeds(c, xp, args, detail, say)
    sources["overlap"] = f"not measured: profile {profile.name}'s ({profile.sources.get('overlap', '')})"
    overlap_between = None
    if measured["between"] is None:
        sources["overlap_between"] = NOT_MEASURED["overlap_between"] + ": as overlap"
    else:
        a, b = c.topology.nodes[0][0], c.topology.nodes[1][0]
        say(f"  measuring how much of a transfer between nodes hides behind compute: rank {a} "
            f"to {b} while every rank computes")
        overlap_between, sources["overlap_between"] = transfer_overlap(
            c, xp, a, b, nbytes, links["between"].bandwidth, args.repeat)
    sources["memory"] = "measured: the device's memory" if xp is not np else \
        "measured: the node's physical memory divided by its ranks"
    say("  measuring the memory bandwidth (every rank reads at once)")
    bandwidth = _bandwidth(c, xp, 16 * nbytes, args.repeat)
    sources["memory_bandwidth"] = (f"measured: a sum over {16 * args.megabytes} MiB on every rank at "
                                   "once, the slowest rank's best")
    name = args.name or c.bcast_obj(socket.gethostname())
    return Machine(name, links["inside"], links["between"], rates, ratio, profile.overlap,
                   _memory(c, xp) if c.rank == 0 else 0.0, bandwidth, sources,
                   node_bandwidth=node_bandwidth or 0.0, overlap_between=overlap_between,
                   engines=speeds)


def _needs(c: Any, xp: Any, args: Any) -> None:
    """UsageError (every rank alike) when the measurements would not fit in a rank's memory."""
    from .common import UsageError

    rates = 5 * args.heads * args.rows * args.dim * 8 + 2 * args.heads * args.rows * 4 * 512
    links = max(c.size, 2) * args.megabytes * 2**20 + 16 * args.megabytes * 2**20
    have = c.bcast_obj(_memory(c, xp) if c.rank == 0 else None)
    for what, need in (("--rows/--heads/--dim", rates), ("--megabytes", links)):
        if need > have / 2:
            raise UsageError(f"calibrate {what}: the measurement needs about {need / 2**30:.1f} GiB "
                             f"per rank, and a rank has {have / 2**30:.1f} GiB (half of it may be "
                             "used): choose smaller sizes")


def cmd_calibrate(args: Any, con: Any) -> int:
    """``mpiattn calibrate``: measure (every rank), rank 0 writes the JSON file, atomically.

    The output is checked before anything is measured (``--force`` to
    replace an existing file), written as any output is (a temporary that
    ``clean`` knows, published at a commit point, stopped by a signal).
    """
    from .. import io
    from ..io.jsonfile import dump_json
    from .steps import prepare_output, select_device, world_comm

    c = world_comm()
    prepare_output(c, con, args.output, args.force)
    xp, _ = select_device(c, args.device, None)
    _needs(c, xp, args)
    con.say(f"mpiattn calibrate: {c.size} rank(s), {c.topology.describe()}, "
            f"{'CuPy' if xp is not np else 'NumPy'}")
    machine = measure(c, xp, args, con.say)
    machine = replace(machine, memory=c.bcast_obj(machine.memory))

    def write(tmp: str) -> None:
        with c.collective_errors():
            if c.rank == 0:
                dump_json(tmp, machine.to_dict())
    con.doing("while writing the output")
    io.write_atomically(c, args.output, write, force=args.force, outputs=con.outputs)
    con.say(f"  wrote {args.output}: inside {machine.inside.latency_s * 1e6:.1f} us, "
            f"{machine.inside.bandwidth / 1e9:.2f} GB/s; between {machine.between.latency_s * 1e6:.1f} us, "
            f"{machine.between.bandwidth / 1e9:.2f} GB/s"
            + (f" (a node: {machine.node_bandwidth / 1e9:.2f} GB/s)" if machine.node_bandwidth else "")
            + f"; float32 {machine.rates['float32'] / 1e9:.1f} "
            "GFLOP/s per rank")
    return 0
