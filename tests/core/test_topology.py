"""The topology of a communicator, and the two-level route of blocks over it."""

import os

import pytest

from mpiattn.comm.ring import Route
from mpiattn.comm.topology import Topology, override


def test_made_by_hand():
    t = Topology.blocks(8, 4)
    assert t.nodes == ((0, 1, 2, 3), (4, 5, 6, 7)) and t.P == 8 and t.n_nodes == 2 and t.uniform
    assert [t.node_of(r) for r in range(8)] == [0] * 4 + [1] * 4
    assert t.local_rank(5) == 1 and t.same_node(4, 7) and not t.same_node(3, 4)
    assert Topology.parse("2x4") == t and Topology.parse("4,4") == t
    uneven = Topology.parse("4,4,2")
    assert uneven.sizes == (4, 4, 2) and not uneven.uniform and uneven.describe() == "3 nodes (4, 4, 2 ranks)"
    inter = Topology.parse("0,1,0,1", 4)  # MPICH's cliques: ranks interleaved over two nodes
    assert inter.nodes == ((0, 2), (1, 3)) and inter.node_major() == (0, 2, 1, 3)
    assert inter.restricted([2, 3]).nodes == ((0,), (1,))
    assert inter.restricted([1, 3]).nodes == ((0, 1),)
    assert Topology.blocks(5, [2, 3]).nodes == ((0, 1), (2, 3, 4))


@pytest.mark.parametrize("bad", ["2x", "a,b", "x3"])
def test_bad_text(bad):
    with pytest.raises(ValueError, match="topology"):
        Topology.parse(bad)


def test_every_rank_on_one_node():
    with pytest.raises(ValueError, match="exactly one node"):
        Topology(((0, 1), (1, 2)))
    with pytest.raises(ValueError, match="exactly one node"):
        Topology(((0, 2),))
    with pytest.raises(ValueError, match="not in this topology"):
        Topology.blocks(4, 2).node_of(4)


@pytest.mark.parametrize("nodes", [[[0]], [[0, 1, 2]], [[0, 2, 4], [1, 3, 5]], [[0], [1], [2]],
                                   [[0, 1], [2, 3], [4, 5], [6, 7]]])
def test_two_level_route_visits_every_rank_once(nodes):
    P = sum(len(n) for n in nodes)
    routes = [Route.two_level(nodes, r) for r in range(P)]
    w = len(nodes[0])
    node = {r: g for g, n in enumerate(nodes) for r in n}
    for r, route in enumerate(routes):
        assert sorted(route.owners) == list(range(P)) and route.owners[0] == r
        between = 0
        for t in range(1, P):
            src = route.came_from[t]
            assert routes[src].owners[t - 1] == route.owners[t] and routes[src].goes_to[t - 1] == r
            between += node[src] != node[r]
        assert between == len(nodes) - 1 if w > 1 else between == P - 1
        assert routes[route.home_from].owners[P - 1] == r
    for t in range(P):  # at every step every block is in exactly one place
        assert sorted(rt.owners[t] for rt in routes) == list(range(P))


def test_the_flat_ring_is_one_node():
    for P in (1, 2, 5):
        for r in range(P):
            route = Route.ring(P, r)
            assert route.owners == tuple((r - t) % P for t in range(P))
            assert set(route.came_from[1:]) <= {(r - 1) % P} and set(route.goes_to) <= {(r + 1) % P}


def test_a_route_needs_equal_nodes():
    with pytest.raises(ValueError, match="same number of ranks"):
        Route.two_level([[0, 1], [2]], 0)


def test_the_communicator_knows_its_nodes(comm):
    from mpi4py import MPI

    t = comm.topology
    assert t.P == comm.size and comm.mpi.allgather(t) == [t] * comm.size
    shared = comm.mpi.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        mine = sorted(shared.allgather(comm.rank))
    finally:
        shared.Free()
    assert tuple(mine) == t.nodes[t.node_of(comm.rank)]
    if os.environ.get("MPIR_CVAR_NUM_CLIQUES") == "2" and comm.size == 4 and "MPICH" in MPI.Get_library_version():
        assert t.nodes == ((0, 2), (1, 3))  # pip's MPICH 5.0.2 (measured: see comm/topology.py)


def test_override_is_checked_alike(comm):
    before = comm.topology
    with pytest.raises(ValueError, match=f"a topology of {comm.size + 1} ranks for a communicator of {comm.size}"):
        override(comm, Topology.blocks(comm.size + 1, 1))
    assert comm.topology == before
    if comm.size > 1:
        mine = Topology.blocks(comm.size, 1 if comm.rank == 0 else comm.size)
        with pytest.raises(ValueError, match="ranks disagree on the topology"):
            override(comm, mine)
    override(comm, Topology.blocks(comm.size, 1))
    assert comm.topology.n_nodes == comm.size
    override(comm, before)
