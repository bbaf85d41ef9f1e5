"""``python -m mpiattn calibrate``: measure this allocation for the cost model, write it as JSON.

Run it with the ranks, nodes and devices of the jobs to plan (collective)::

    mpiexec -n 8 python -m mpiattn calibrate -o machine.json

It measures, with every rank placed as the job places them
(:class:`~mpiattn.comm.topology.Topology`):

* each link class (inside a node, between nodes): a ping-pong of one small
  message (latency: half the round trip) and of ``--megabytes`` (bandwidth),
  then an all-to-all of that size per destination among all the ranks of a
  node at once (inside) or among one rank of every node at once, on every
  node together (between). The bandwidth kept is the all-to-all's, where it
  is lower (links shared by concurrent transfers, as a ring's and an
  all-to-all's are);
* the attention rate of one rank per dtype, forward and backward, with every
  rank computing at once (so that a shared node's contention is in the
  number), on ``--rows`` query and key rows of ``--heads`` heads of ``--dim``;
* the memory per rank (the device's, else the node's divided by its ranks),
  and the bandwidth at which a rank reads it while every rank does (what
  bounds a decode step).

A link class the allocation lacks (``between`` on one node) and the
overlap of transfers with compute come from the device's profile
(:data:`mpiattn.strategies.machines.PROFILES`), as the file's ``sources``
say. The file is what ``machine=``, ``--machine`` and ``$MPIATTN_MACHINE``
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

__all__ = ["add_arguments", "cmd_calibrate"]

DTYPES = ("float64", "float32", "float16")


def add_arguments(p: argparse.ArgumentParser, positive_int: Any) -> None:
    """The options of ``calibrate``."""
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
    p.add_argument("--device", choices=("cpu", "gpu"), default="cpu",
                   help="measure NumPy ranks (cpu) or CuPy ranks, one GPU each (gpu)")
    p.add_argument("--quiet", "-q", action="store_true", help="print only errors")


# ----------------------------------------------------------------- links
def _pingpong(c: Any, xp: Any, a: int, b: int, nbytes: int, repeat: int) -> float:
    """Seconds of one message of ``nbytes`` from ``a`` to ``b`` (half the best round trip);
    every rank calls, only ``a`` and ``b`` send."""
    buf = xp.zeros(max(nbytes, 1), dtype=np.uint8)
    best = math.inf
    for _ in range(repeat + 1):  # the first round trip sets up the connection: not kept
        c.barrier()
        t = time.perf_counter()
        if c.rank == a:
            c.isend(buf, b, 7).wait()
            c.irecv(buf, b, 8).wait()
        elif c.rank == b:
            c.irecv(buf, a, 7).wait()
            c.isend(buf, a, 8).wait()
        best = min(best, (time.perf_counter() - t) / 2)
    return float(c.bcast_obj(best, root=a))


def _alltoall(c: Any, g: Any, xp: Any, nbytes: int, repeat: int) -> float:
    """Seconds of an all-to-all of ``nbytes`` per destination inside sub-communicator ``g``
    (every group at once; the slowest group's best)."""
    send = xp.zeros((g.size, max(nbytes, 1)), dtype=np.uint8)
    best = math.inf
    for _ in range(repeat + 1):
        c.barrier()
        t = time.perf_counter()
        g.alltoallv_rows(send, [1] * g.size, [1] * g.size)
        c.barrier()
        best = min(best, time.perf_counter() - t)
    return float(max(c.allgather_obj(best)))


def _link(c: Any, xp: Any, pair: tuple[int, int], group: Any, nbytes: int, repeat: int) -> tuple[Link, dict]:
    """A link class measured between ``pair`` and inside the sub-communicators ``group``."""
    small = _pingpong(c, xp, *pair, 8, 10 * repeat)
    large = _pingpong(c, xp, *pair, nbytes, repeat)
    bw_pp = nbytes / max(large - small, 1e-9)
    a2a = _alltoall(c, group, xp, nbytes, repeat)
    peers = c.bcast_obj(group.size - 1 if c.rank == pair[0] else None, root=pair[0])
    bw_a2a = peers * nbytes / max(a2a - peers * small, 1e-9) if peers else math.inf
    detail = {"latency_s": small, "pingpong_bandwidth": bw_pp, "alltoall_bandwidth": bw_a2a,
              "alltoall_peers": peers, "message_bytes": nbytes}
    return Link(small, min(bw_pp, bw_a2a)), detail


def _groups(c: Any) -> tuple[Any, Any, tuple | None, tuple | None]:
    """This rank's node group and cross-node group, and the inside and between ping-pong pairs."""
    topo = c.topology
    me = topo.node_of(c.rank)
    local = topo.local_rank(c.rank)
    node_group = c.split(topo.nodes[me])
    cross_group = c.split([n[local] for n in topo.nodes if local < len(n)])
    inside = next(((n[0], n[1]) for n in topo.nodes if len(n) > 1), None)
    between = (topo.nodes[0][0], topo.nodes[1][0]) if topo.n_nodes > 1 else None
    return node_group, cross_group, inside, between


# ----------------------------------------------------------------- compute
def _rates(c: Any, xp: Any, args: Any) -> tuple[dict, float, dict]:
    """Forward FLOP/s of one rank per dtype (every rank at once), the backward's ratio, details."""
    from mpi4py import MPI

    from ..strategies.api import attention, attention_backward

    B, H, N, E = 1, args.heads, args.rows, args.dim
    flops = 2.0 * B * H * N * N * (E + E)
    rates, ratios, detail = {}, [], {}
    rng = np.random.default_rng(c.rank)
    for name in DTYPES:
        q, k, v, do = (xp.asarray(rng.standard_normal((B, H, N, E)).astype(name)) for _ in range(4))
        fwd = bwd = math.inf
        for _ in range(args.repeat + 1):
            c.barrier()
            t = time.perf_counter()
            out, lse = attention(q, k, v, MPI.COMM_SELF, check_finite=False)
            _sync(xp)
            t1 = time.perf_counter()
            attention_backward(do, q, k, v, out, lse, MPI.COMM_SELF, check_finite=False)
            _sync(xp)
            fwd, bwd = min(fwd, t1 - t), min(bwd, time.perf_counter() - t1)
        fwd, bwd = max(c.allgather_obj(fwd)), max(c.allgather_obj(bwd))  # the slowest rank
        rates[name] = flops / fwd
        ratios.append(2.5 * flops / bwd / rates[name])
        detail[name] = {"forward_s": fwd, "backward_s": bwd}
    return rates, float(np.median(ratios)), detail


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
    node_group, cross_group, inside_pair, between_pair = _groups(c)
    sources = {"topology": f"{c.topology.describe()}: {c.topology.nodes}",
               "measured": time.strftime("%Y-%m-%dT%H:%M:%S") + f" by mpiattn calibrate on {c.size} rank(s)"}
    links = {}
    for cls, pair, group in (("inside", inside_pair, node_group), ("between", between_pair, cross_group)):
        if pair is None:
            links[cls] = getattr(profile, cls)
            sources[cls] = f"not measured (this allocation has no such pair of ranks): profile {profile.name}'s"
            continue
        say(f"  measuring the link {cls} a node: ranks {pair[0]} and {pair[1]}, then all-to-alls")
        links[cls], detail = _link(c, xp, pair, group, nbytes, args.repeat)
        sources[cls] = "measured: " + ", ".join(f"{k} {v:.4g}" for k, v in detail.items())
    say(f"  measuring the attention rate per dtype ({args.rows} rows, {args.heads} heads of {args.dim})")
    rates, ratio, detail = _rates(c, xp, args)
    rates.setdefault("bfloat16", rates["float16"])
    sources["rates"] = ("measured, every rank at once, the slowest rank's best of "
                        f"{args.repeat}: " + "; ".join(f"{k} {v['forward_s']:.4g} s forward, "
                                                       f"{v['backward_s']:.4g} s backward"
                                                       for k, v in detail.items())
                        + "; bfloat16: not measured, as float16")
    sources["backward_ratio"] = "measured: the median over dtypes of backward FLOP/s / forward FLOP/s"
    sources["overlap"] = f"not measured: profile {profile.name}'s ({profile.sources.get('overlap', '')})"
    sources["memory"] = "measured: the device's memory" if xp is not np else \
        "measured: the node's physical memory divided by its ranks"
    say("  measuring the memory bandwidth (every rank reads at once)")
    bandwidth = _bandwidth(c, xp, 16 * nbytes, args.repeat)
    sources["memory_bandwidth"] = (f"measured: a sum over {16 * args.megabytes} MiB on every rank at "
                                   "once, the slowest rank's best")
    name = args.name or c.bcast_obj(socket.gethostname())
    return Machine(name, links["inside"], links["between"], rates, ratio, profile.overlap,
                   _memory(c, xp) if c.rank == 0 else 0.0, bandwidth, sources)


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
            f"{machine.between.bandwidth / 1e9:.2f} GB/s; float32 {machine.rates['float32'] / 1e9:.1f} "
            "GFLOP/s per rank")
    return 0
