"""The ring pipeline: every rank's rows stream past every rank, block by block.

:func:`circulate` is the one communication pattern behind ring attention and
the ``nt``/``nn``/``tn`` products: rank ``r`` sees its own rows first, then
those of ``r-1``, ``r-2``, ..., each received piece forwarded to ``r+1`` as
soon as it arrives and the next receive posted before the current piece is
computed on (double buffering). Accumulators may travel with the pieces and
come home to their owner (how ``dK``, ``dV`` and the ``tn`` partial sums are
summed without any collective).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Sequence

from .. import backend
from ..layouts import all_segments
from .core import Comm, Request

__all__ = ["Piece", "Route", "row_pieces", "circulate"]


@dataclass
class Piece:
    """One block of rows travelling round the ring.

    Attributes
    ----------
    owner : int
        The rank whose shard these rows belong to.
    start, stop : int
        Global row range ``[start, stop)``.
    local : slice
        The same rows as positions in the owner's shard.
    data : tuple of arrays
        Read-only arrays, each ``(..., stop - start, ...)`` along axis -2.
    acc : tuple of arrays
        Accumulators for these rows; the consumer adds into them in place.
    """

    owner: int
    start: int
    stop: int
    local: slice
    data: tuple
    acc: tuple


def row_pieces(segs: Sequence[tuple[int, int]], block: int) -> list[tuple[int, int, int]]:
    """Split an owner's segments into pieces ``(global_start, local_start, rows)`` of <= block rows."""
    out, local = [], 0
    for g, ln in segs:
        for off in range(0, ln, block):
            rows = min(block, ln - off)
            out.append((g + off, local + off, rows))
        local += ln
    return out


@dataclass(frozen=True)
class Route:
    """The path of every block, as one rank sees it: at step ``t`` (0 .. P-1) it holds the
    block of ``owners[t]``, received from ``came_from[t]`` (``t >= 1``) and forwarded to
    ``goes_to[t]`` (``t <= P-2``); its own block's accumulators come home from ``home_from``.

    Every block visits every rank once, in P-1 moves.
    """

    owners: tuple
    came_from: tuple
    goes_to: tuple
    home_from: int

    @classmethod
    def ring(cls, P: int, r: int) -> "Route":
        """The ring ``r-1 -> r -> r+1``: rank ``r`` sees ``r, r-1, ..., r-P+1``."""
        return cls.two_level([list(range(P))], r)

    @classmethod
    def two_level(cls, nodes: Sequence[Sequence[int]], r: int) -> "Route":
        """A ring inside each node, and across the nodes between inner rounds (a double ring).

        ``nodes`` lists the ranks of each node, ``w`` of them on each. Rank ``(g, i)`` (node
        ``g``, local ``i``) holds at step ``t`` the block of ``(g - b, i - a)`` with ``b = t // w``
        and ``a = t - b``: ``w - 1`` moves to the next rank of the node, then one to the same
        local rank of the next node, so each rank sends between nodes ``len(nodes) - 1`` times.
        """
        w, R = len(nodes[0]), len(nodes)
        if any(len(nd) != w for nd in nodes):
            raise ValueError("a two-level route needs the same number of ranks on every node")
        g, i = next((gi, nd.index(r)) for gi, nd in enumerate(nodes) if r in nd)
        P = w * R

        def at(dg: int, di: int) -> int:
            return nodes[(g + dg) % R][(i + di) % w]

        def ab(t: int) -> tuple[int, int]:
            return t - t // w, t // w

        owners, came, goes = [], [], []
        for t in range(P):
            a, b = ab(t)
            owners.append(at(-b, -a))
            if t >= 1:
                a0, b0 = ab(t - 1)
                came.append(at(b0 - b, a0 - a))
            if t <= P - 2:
                a1, b1 = ab(t + 1)
                goes.append(at(b1 - b, a1 - a))
        a, b = ab(P - 1)
        return cls(tuple(owners), (None, *came), tuple(goes), at(b, a))


def circulate(c: Comm, data: Sequence[Any], n: int, layout: Any, block: int,
              acc_out: Sequence[Any] = (), route: Route | None = None) -> Iterator[Piece]:
    """Stream every rank's rows past this rank, block by block, in ring order.

    Rank ``r`` sees its own rows first, then those of ``r-1``, ``r-2``,
    ..., ``r-P+1``. Each piece received from ``r-1`` is forwarded to
    ``r+1`` as soon as it arrives, and the receive of the next piece is
    posted before the current one is handed to the caller (double
    buffering), so transfers overlap compute wherever the hardware lets
    them.

    Parameters
    ----------
    c : Comm
        The communicator.
    data : sequence of arrays, each (..., m_r, w_i)
        This rank's read-only rows (row axis -2), sent round the ring.
    n : int
        Global number of rows (``sum of m_r``), laid out by ``layout``.
    layout : str or Layout
        The layout of the rows.
    block : int
        Maximum rows per piece (bounds the memory of pieces in flight).
    acc_out : sequence of arrays, each (..., m_r, u_j)
        Accumulators for this rank's rows. For this rank's own pieces the
        caller receives views into ``acc_out``; for another rank's pieces
        it receives travelling buffers (zeros at their first stop) that
        follow the piece and, after the last rank, return to the owner,
        which adds them into ``acc_out`` before the generator finishes.

    Yields
    ------
    Piece
        The caller may read ``piece.data`` and add into ``piece.acc`` until
        it asks for the next piece.

    Notes
    -----
    Per rank: ``(P-1)`` pieces of every other rank are received, i.e.
    ``(n - m_r) * sum(w_i)`` words in, about the same out, plus
    ``(n - m_r) * sum(u_j)`` words for accumulators. Extra memory: about
    three pieces (``3 * block * (sum w_i + sum u_j)`` words per leading
    index) plus sends that have not completed yet.
    """
    P, r = c.size, c.rank
    if P > 1:
        c.point("circulate")
    route = Route.ring(P, r) if route is None else route
    segs = all_segments(n, P, layout)
    block = max(1, int(block))
    order: list[tuple[int, int, int, int, int]] = []  # (step, owner, gstart, lstart, rows)
    for t, o in enumerate(route.owners):
        order.extend((t, o, g, l, k) for g, l, k in row_pieces(segs[o], block))

    xp = backend.array_module(*data, *acc_out)
    lead_d = [(d.shape[:-2], d.shape[-1], d.dtype) for d in data]
    lead_a = [(a.shape[:-2], a.shape[-1], a.dtype) for a in acc_out]
    sends: list[Request] = []

    def post_recv(idx: int) -> tuple[list, list, list]:
        t, _, _, _, k = order[idx]
        src = route.came_from[t]
        bufs_d = [xp.empty(lead + (k, w), dtype=dt) for lead, w, dt in lead_d]
        reqs = [c.irecv(b, src, 10 + i) for i, b in enumerate(bufs_d)]
        bufs_a: list = []
        if acc_out:
            if t == 1:  # first stop of this piece: fresh accumulators
                bufs_a = [xp.zeros(lead + (k, u), dtype=dt) for lead, u, dt in lead_a]
            else:
                bufs_a = [xp.empty(lead + (k, u), dtype=dt) for lead, u, dt in lead_a]
                reqs += [c.irecv(b, src, 100 + j) for j, b in enumerate(bufs_a)]
        return bufs_d, bufs_a, reqs

    n_own = sum(1 for t, *_ in order if t == 0)
    pending = post_recv(n_own) if n_own < len(order) else None
    for idx, (t, o, g, l, k) in enumerate(order):
        if t == 0:
            bufs_d = [xp.ascontiguousarray(d[..., l:l + k, :]) for d in data]
            bufs_a = [a[..., l:l + k, :] for a in acc_out]
        else:
            bufs_d, bufs_a, reqs = pending  # type: ignore[misc]
            for q in reqs:
                q.wait()
            pending = post_recv(idx + 1) if idx + 1 < len(order) else None
        if t < P - 1:  # another rank still needs these rows
            sends += [c.isend(b, route.goes_to[t], 10 + i) for i, b in enumerate(bufs_d)]
        yield Piece(o, g, g + k, slice(l, l + k), tuple(bufs_d), tuple(bufs_a))
        if acc_out and t > 0:  # pass the accumulators on (or home)
            dest = route.goes_to[t] if t < P - 1 else o
            sends += [c.isend(b, dest, 100 + j) for j, b in enumerate(bufs_a)]
        sends = [s for s in sends if not s.req.Test()]

    if acc_out and P > 1:
        for g, l, k in row_pieces(segs[r], block):
            homes = [xp.empty(lead + (k, u), dtype=dt) for lead, u, dt in lead_a]
            reqs = [c.irecv(b, route.home_from, 100 + j) for j, b in enumerate(homes)]
            for j, q in enumerate(reqs):
                q.wait()
                acc_out[j][..., l:l + k, :] += homes[j]
    for s in sends:
        s.wait()
