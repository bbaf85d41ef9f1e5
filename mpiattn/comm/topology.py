"""Which ranks of a communicator share a node: the machine's shape, as one object.

:class:`Topology` lists, for each node, the ranks of a communicator on it.
It comes from ``MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)`` (:meth:`Topology.of`,
collective: every rank learns every rank's node, so every rank holds the same
object), handles nodes with unequal rank counts and ranks interleaved across
nodes, and can be made by hand for experiments and planning
(:meth:`Topology.blocks`, :meth:`Topology.parse`) and given to a communicator
(:func:`override`). Two-level strategies place their groups by it, and a
:class:`~mpiattn.comm.core.Comm` counts the bytes it sends inside a node and
between nodes by it.

On one machine, MPICH's ``MPIR_CVAR_NUM_CLIQUES=2`` (or
``MPIR_CVAR_ODD_EVEN_CLIQUES=1``) makes ``Split_type`` see two nodes; with
pip's MPICH 5.0.2 at ``mpiexec -n 4`` both give nodes ``{0, 2}`` and
``{1, 3}``. Only the topology changes: messages between these "nodes" still
go through shared memory (ping-pong latency and bandwidth measured the same
inside and between them), so they emulate the shape of a cluster, not its
slower links.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from . import errors

__all__ = ["Topology", "override"]


@dataclass(frozen=True)
class Topology:
    """The nodes of a communicator and the ranks on each.

    Attributes
    ----------
    nodes : tuple of tuple of int
        For each node, its ranks in increasing order; the nodes ordered by
        their lowest rank. Every rank appears exactly once.
    """

    nodes: tuple

    def __post_init__(self) -> None:
        nodes = tuple(tuple(int(r) for r in sorted(n)) for n in self.nodes if len(n))
        nodes = tuple(sorted(nodes, key=lambda n: n[0]))
        ranks = sorted(r for n in nodes for r in n)
        if ranks != list(range(len(ranks))):
            raise ValueError(f"a topology must place each rank 0..P-1 on exactly one node, got {self.nodes}")
        object.__setattr__(self, "nodes", nodes)
        where = [0] * len(ranks)
        for i, n in enumerate(nodes):
            for r in n:
                where[r] = i
        object.__setattr__(self, "_where", tuple(where))
        index = np.asarray(where, dtype=np.int64)
        major = np.argsort(index, kind="stable")  # node by node, each node's ranks increasing
        for a in (index, major):
            a.flags.writeable = False
        object.__setattr__(self, "_index", index)
        object.__setattr__(self, "_major", major)

    # ------------------------------------------------------------- construction
    @classmethod
    def of(cls, mpi_comm: Any) -> "Topology":
        """The nodes of ``mpi_comm`` as MPI sees them (collective on ``mpi_comm``)."""
        P = mpi_comm.Get_size()
        if P == 1:
            return cls(((0,),))
        from mpi4py import MPI

        node = mpi_comm.Split_type(MPI.COMM_TYPE_SHARED)
        try:
            low = np.array([mpi_comm.Get_rank()], dtype=np.int64)  # (a buffer Allreduce: see
            node.Allreduce(MPI.IN_PLACE, [low, MPI.INT64_T], op=MPI.MIN)  # errors.agree)
            leader = int(low[0])
        finally:
            node.Free()
        leaders = mpi_comm.allgather(leader)
        return cls(tuple(tuple(r for r in range(P) if leaders[r] == l) for l in sorted(set(leaders))))

    @classmethod
    def blocks(cls, P: int, per_node: int | Sequence[int]) -> "Topology":
        """``P`` ranks on nodes of ``per_node`` consecutive ranks (an int, or one count per node)."""
        sizes = [int(per_node)] * -(-P // int(per_node)) if isinstance(per_node, int) else list(per_node)
        if any(s < 1 for s in sizes):
            raise ValueError(f"ranks per node must be >= 1, got {per_node}")
        out, start = [], 0
        for s in sizes:
            if start >= P:
                break
            out.append(tuple(range(start, min(P, start + s))))
            start += s
        if start < P:
            raise ValueError(f"{list(sizes)} ranks per node hold fewer than P = {P} ranks")
        return cls(tuple(out))

    @classmethod
    def parse(cls, text: str, P: int | None = None) -> "Topology":
        """``"2x4"`` (2 nodes of 4 consecutive ranks), ``"4,4,2"`` (ranks per node) or
        ``"0,1,0,1"`` with ``P`` given (each rank's node)."""
        text = text.strip().lower()
        try:
            if "x" in text:
                nodes, per = (int(t) for t in text.split("x"))
                return cls.blocks(nodes * per, per)
            values = [int(t) for t in text.split(",")]
        except ValueError:
            raise ValueError(f"topology {text!r}: expected NODESxRANKS, counts per node "
                             "('4,4,2'), or each rank's node ('0,1,0,1')") from None
        if P is not None and len(values) == P:
            return cls(tuple(tuple(r for r in range(P) if values[r] == v) for v in sorted(set(values))))
        return cls.blocks(sum(values), values)

    # ------------------------------------------------------------- questions
    @property
    def P(self) -> int:
        """Ranks in the communicator."""
        return len(self._where)

    @property
    def n_nodes(self) -> int:
        return len(self.nodes)

    @property
    def sizes(self) -> tuple[int, ...]:
        """Ranks per node."""
        return tuple(len(n) for n in self.nodes)

    @property
    def uniform(self) -> bool:
        """Every node has the same number of ranks."""
        return len(set(self.sizes)) == 1

    def node_of(self, rank: int) -> int:
        """The index of ``rank``'s node."""
        if not 0 <= rank < len(self._where):
            raise ValueError(f"rank {rank} is not in this topology of {self.P} ranks")
        return self._where[rank]

    def local_rank(self, rank: int) -> int:
        """``rank``'s index among the ranks of its node."""
        return self.nodes[self.node_of(rank)].index(rank)

    def same_node(self, a: int, b: int) -> bool:
        return self._where[a] == self._where[b]

    def nodes_of(self, ranks: Any) -> np.ndarray:
        """:meth:`node_of` of every rank in ``ranks`` (an int array of any shape), at once:
        what the cost model counts its groups by (:mod:`mpiattn.strategies.base`)."""
        return self._index[np.asarray(ranks, dtype=np.int64)]

    def node_counts(self, ranks: Any) -> np.ndarray:
        """How many of the distinct ``ranks`` (an int array) each node holds, ``(n_nodes,)``."""
        chosen = np.zeros(len(self._index), dtype=bool)
        chosen[np.asarray(ranks, dtype=np.int64)] = True
        return np.bincount(self._index[chosen], minlength=self.n_nodes)

    def node_major(self) -> tuple[int, ...]:
        """The ranks ordered node by node (each node's ranks in increasing order)."""
        return tuple(self._major.tolist())

    def node_major_array(self) -> np.ndarray:
        """:meth:`node_major` as a read-only int64 array (the cost model's, without a loop)."""
        return self._major

    def restricted(self, ranks: Sequence[int]) -> "Topology":
        """The topology of a sub-communicator whose rank ``i`` is ``ranks[i]`` here."""
        index = {r: i for i, r in enumerate(ranks)}
        return Topology(tuple(tuple(index[r] for r in n if r in index) for n in self.nodes))

    def describe(self) -> str:
        """``"2 nodes x 2 ranks"`` or ``"3 nodes (4, 4, 2 ranks)"``."""
        if self.uniform:
            return f"{self.n_nodes} node(s) x {self.sizes[0]} rank(s)"
        return f"{self.n_nodes} nodes ({', '.join(map(str, self.sizes))} ranks)"


def override(comm: Any, topology: Topology) -> None:
    """Give a :class:`~mpiattn.comm.core.Comm` another topology, for experiments (collective).

    Every rank must pass the same topology, of the communicator's size
    (checked; the same error everywhere).
    """
    got = comm.allgather_checked(lambda: _check_size(topology, comm.size))
    errors.same_everywhere(got, "the topology", lambda t: t.describe() + f" {t.nodes}")
    comm.topology = topology


def _check_size(topology: Topology, P: int) -> Topology:
    if not isinstance(topology, Topology):
        raise TypeError(f"topology must be a mpiattn.comm.topology.Topology, got {type(topology).__name__}")
    if topology.P != P:
        raise ValueError(f"a topology of {topology.P} ranks for a communicator of {P}")
    return topology
