"""The links of an allocation, each measured on its own: the network half of ``calibrate``.

Every figure is one link's, measured while nothing else moves and no other
rank takes a core:

* **inside** (two ranks of one node) and **between** (the first ranks of
  nodes 0 and 1): a ping-pong between that pair alone. Latency: half the
  best round trip of 8 bytes; bandwidth: ``nbytes`` over half the best round
  trip of ``nbytes``, less that latency.
* **node bandwidth**: every rank of node 0 sends ``nbytes`` at once to the
  rank of the same local index on node 1: the bytes per second a node sends
  to another with all its ranks sending, which share its link. It is its own
  figure (``Machine.node_bandwidth``; the cost model divides it among the
  ranks that send at once), never folded into ``between``.

Meanwhile every other rank waits in :func:`quiet_barrier`, which sleeps
between tests of an ``MPI_Ibarrier`` instead of spinning in MPI's progress
loop: with more ranks than cores a spinning waiter would take a core from
the pair being timed. The first transfer of each kind is not timed (it
sets up the connection).

Why not all-to-alls among the ranks of each node, as ``calibrate`` did: an
all-to-all of ``nbytes`` per destination measures the collective's
algorithm and every node's transfers at once, not a link. With pip's
MPICH 5.0.2 and ``MPIR_CVAR_ENABLE_HEAVY_YIELD=1`` (waiting ranks yield,
as CI sets with 4 ranks on 2 cores), ``MPI_Alltoallv`` of 16 MiB ran at
0.06 GB/s on a link whose ping-pong gives 4-11 GB/s (measured 2026-12-02 on
two hosts made by ``jobs/two_hosts.sh``; ``Comm.alltoallv_rows`` no longer
uses it), and the between figure was the pair's ping-pong halved by the
second pair crossing the same link at once.

* **overlap between nodes**: how much of a transfer from node 0's first rank
  to node 1's hides behind compute while every rank computes, as in a ring
  step (:func:`transfer_overlap`): the pair's time with both at once against
  the compute alone and the transfer alone.

What cannot be measured on an allocation is told (:data:`NOT_MEASURED`):
``inside`` when no two ranks share a node, ``between`` and the node
bandwidth on one node, the node bandwidth with one rank per node.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np

__all__ = ["quiet_barrier", "pingpong", "node_send", "link_of", "measure_links", "transfer_overlap",
           "NOT_MEASURED"]

#: Seconds a waiting rank sleeps between tests of the barrier.
POLL_S = 5e-4

#: Round trips of the small message per timed repeat (latency is noisy: many, the best kept).
SMALL_TRIPS = 20

#: A ping-pong goes on past its round trips until it has run this long (at most
#: :data:`MAX_TRIPS` round trips): a fast link's best of many is steadier than of a few (on two
#: hosts of a loaded 2-core machine, 5 calibrations: inside 5.1-7.0 GB/s at 1 s, 3.9-9.1 at 0.3 s).
MIN_PINGPONG_S = 1.0
MAX_TRIPS = 1000

#: Why a figure was not measured, by what the allocation lacks.
NOT_MEASURED = {
    "inside": "not measured (no two ranks of this allocation share a node)",
    "between": "not measured (this allocation has one node)",
    "node": "not measured (one rank per node: no ranks share a node's link)",
    "overlap_between": "not measured (this allocation has one node)",
}

#: Edge of the square float32 GEMM that is the unit of compute of :func:`transfer_overlap`.
UNIT = 256

_PING, _PONG, _BULK, _HIDDEN = 7, 8, 9, 10


def quiet_barrier(c: Any) -> None:
    """A barrier on ``c`` that sleeps while it waits (no core taken from ranks still working)."""
    req = c.mpi.Ibarrier()
    while not req.Test():
        time.sleep(POLL_S)


def pingpong(c: Any, xp: Any, a: int, b: int, nbytes: int, trips: int) -> float:
    """Half the best round trip of ``nbytes`` between ranks ``a`` and ``b`` (seconds), the same
    on every rank; the other ranks wait in :func:`quiet_barrier` (collective).

    At least ``trips`` round trips are timed, more until :data:`MIN_PINGPONG_S` have passed
    (at most :data:`MAX_TRIPS`); rank ``a`` decides when to stop and tells ``b`` in each ping.
    """
    best = math.inf
    if c.rank in (a, b):
        buf = xp.zeros(max(nbytes + 1, 2), dtype=np.uint8)  # the last byte: 1 = another trip follows
        flag = buf[-1:]
        peer = b if c.rank == a else a
        start, i, more = time.perf_counter(), 0, True
        while more:  # the first round trip sets up the connection: not kept
            t = time.perf_counter()
            if c.rank == a:
                more = i < trips or (t - start < MIN_PINGPONG_S and i < MAX_TRIPS)
                flag[0] = 1 if more else 0
                c.isend(buf, peer, _PING).wait()
                c.irecv(buf, peer, _PONG).wait()
            else:
                c.irecv(buf, peer, _PING).wait()
                more = bool(int(flag[0]))
                c.isend(buf, peer, _PONG).wait()
            if i:
                best = min(best, (time.perf_counter() - t) / 2)
            i += 1
    quiet_barrier(c)
    return float(c.bcast_obj(best, root=a))


def node_send(c: Any, xp: Any, senders: list[int], receivers: list[int], nbytes: int,
              repeat: int) -> float:
    """Seconds until every ``receivers[i]`` has ``nbytes`` that ``senders[i]`` sent, all at once
    (the best of ``repeat``; the same on every rank; the others wait quietly; collective)."""
    best = math.inf
    buf = xp.zeros(max(nbytes, 1), dtype=np.uint8) if c.rank in senders + receivers else None
    for i in range(repeat + 1):  # the first round sets up the connections: not kept
        quiet_barrier(c)
        t = time.perf_counter()
        if c.rank in senders:
            c.isend(buf, receivers[senders.index(c.rank)], _BULK).wait()
        elif c.rank in receivers:
            c.irecv(buf, senders[receivers.index(c.rank)], _BULK).wait()
        took = time.perf_counter() - t if c.rank in receivers else 0.0
        took = max(c.allgather_obj(took))
        if i:
            best = min(best, took)
    quiet_barrier(c)
    return float(best)


def link_of(small_s: float, large_s: float, nbytes: int) -> tuple[float, float]:
    """``(latency_s, bandwidth)`` from one-way times of 8 bytes and of ``nbytes``."""
    return small_s, nbytes / max(large_s - small_s, 1e-9)


def _pairs(topology: Any) -> tuple[tuple | None, tuple | None, tuple[list, list] | None]:
    """The inside pair, the between pair and the node-to-node senders and receivers (or None)."""
    nodes = topology.nodes
    inside = next(((n[0], n[1]) for n in nodes if len(n) > 1), None)
    if len(nodes) < 2:
        return inside, None, None
    between = (nodes[0][0], nodes[1][0])
    w = min(len(nodes[0]), len(nodes[1]))
    node = (list(nodes[0][:w]), list(nodes[1][:w])) if w > 1 else None
    return inside, between, node


def measure_links(c: Any, xp: Any, nbytes: int, repeat: int,
                  say: Any = lambda text: None) -> tuple[dict, float | None, dict]:
    """Measure this allocation's links (collective; the same results on every rank).

    Returns
    -------
    links : dict
        ``{"inside": (latency_s, bandwidth) or None, "between": ... or None}``.
    node_bandwidth : float or None
        Bytes per second node 0 sends to node 1 with all its ranks at once
        (None: not measurable here, see :data:`NOT_MEASURED`).
    sources : dict
        For ``"inside"``, ``"between"`` and ``"node"``: what was measured, or
        why not.
    """
    inside, between, node = _pairs(c.topology)
    links: dict = {}
    sources: dict = {}
    for cls, pair in (("inside", inside), ("between", between)):
        if pair is None:
            links[cls] = None
            sources[cls] = NOT_MEASURED[cls]
            continue
        say(f"  measuring the link {cls} a node: ranks {pair[0]} and {pair[1]} alone")
        small = pingpong(c, xp, *pair, 8, SMALL_TRIPS * repeat)
        large = pingpong(c, xp, *pair, nbytes, repeat)
        links[cls] = link_of(small, large, nbytes)
        sources[cls] = (f"measured: ping-pong between ranks {pair[0]} and {pair[1]} alone (the others "
                        f"idle), best of {SMALL_TRIPS * repeat} round trips of 8 B and {repeat} of "
                        f"{nbytes} B: latency {links[cls][0]:.4g} s, bandwidth {links[cls][1]:.4g} B/s")
    node_bw = None
    if node is None:
        sources["node"] = NOT_MEASURED["between" if between is None else "node"]
    else:
        senders, receivers = node
        say(f"  measuring node 0's link to node 1: ranks {senders} send to {receivers} at once")
        took = node_send(c, xp, senders, receivers, nbytes, repeat)
        latency = links["between"][0]
        node_bw = len(senders) * nbytes / max(took - latency, 1e-9)
        sources["node"] = (f"measured: ranks {senders} each sent {nbytes} B to {receivers} at once "
                           f"(the others idle), best of {repeat}: {took:.4g} s, {node_bw:.4g} B/s "
                           f"for the node ({node_bw / len(senders):.4g} B/s per rank)")
    return links, node_bw, sources


def _units(xp: Any, x: Any, count: int, req: Any = None) -> float:
    """Seconds of ``count`` GEMMs of ``x`` by itself, testing ``req`` (a transfer in flight)
    after each as a ring step tests its messages between tiles, then waiting for it."""
    t = time.perf_counter()
    for _ in range(count):
        x @ x
        if req is not None:
            getattr(req, "req", req).Test()  # a host request's MPI request, or a device one
    if xp is not np:
        xp.cuda.get_current_stream().synchronize()
    if req is not None:
        req.wait()
    return time.perf_counter() - t


def _slowest(c: Any, ranks: tuple, took: float) -> float:
    """The largest of ``took`` over ``ranks`` (collective)."""
    return float(max(t for r, t in enumerate(c.allgather_obj(took)) if r in ranks))


def transfer_overlap(c: Any, xp: Any, a: int, b: int, nbytes: int, bandwidth: float,
                     repeat: int) -> tuple[float, str]:
    """The fraction of a transfer of ``nbytes`` from rank ``a`` to rank ``b`` that hides behind
    compute while every rank computes (collective; the same on every rank), and how it was
    measured.

    Times, the best of ``repeat`` each, of the slower of ``a`` and ``b``: ``T_c``, every rank
    computing float32 GEMMs of :data:`UNIT` rows, as many as the transfer takes at
    ``bandwidth``; ``T_x``, the transfer alone (the other ranks waiting in
    :func:`quiet_barrier`); ``T_both``, every rank computing while ``a`` sends to ``b``, the
    pair testing the transfer after each GEMM. The overlap is
    ``(T_c + T_x - T_both) / min(T_c, T_x)``, clipped to [0, 1]: 1 when the shorter of the
    two hides entirely, 0 when they add up.
    """
    x = xp.ones((UNIT, UNIT), dtype=np.float32)
    pair = (a, b)
    buf = xp.zeros(max(nbytes, 1), dtype=np.uint8) if c.rank in pair else None

    def post() -> Any:
        if c.rank == a:
            return c.isend(buf, b, _HIDDEN)
        return c.irecv(buf, a, _HIDDEN) if c.rank == b else None

    def compute(count: int, with_transfer: bool = False) -> float:
        c.barrier()
        return _slowest(c, pair, _units(xp, x, count, post() if with_transfer else None))

    def transfer() -> float:
        quiet_barrier(c)
        t = time.perf_counter()
        req = post()
        if req is not None:
            req.wait()
        took = time.perf_counter() - t
        quiet_barrier(c)
        return _slowest(c, pair, took if c.rank in pair else 0.0)

    unit = min(compute(20) for _ in range(2)) / 20
    count = int(c.bcast_obj(max(1, min(100_000, math.ceil(nbytes / bandwidth / max(unit, 1e-9))))))
    transfer()  # the first transfer sets up the connection: not kept
    t_c = t_x = t_both = math.inf
    for _ in range(repeat):
        t_c = min(t_c, compute(count))
        t_x = min(t_x, transfer())
        t_both = min(t_both, compute(count, with_transfer=True))
    quiet_barrier(c)
    overlap = float(min(1.0, max(0.0, (t_c + t_x - t_both) / max(min(t_c, t_x), 1e-12))))
    return overlap, (f"measured: rank {a} sent {nbytes} B to rank {b} while every rank computed "
                     f"{count} float32 GEMMs of {UNIT} rows (the pair testing the transfer after "
                     f"each), best of {repeat}: compute alone {t_c:.4g} s, transfer alone "
                     f"{t_x:.4g} s, both {t_both:.4g} s: {overlap:.2f} of the shorter hidden")
