"""Calibration that measures what it claims, and the model's shared links between nodes.

``calibrate`` times each link on its own (``mpiattn.cli.links``): while one pair of ranks
ping-pongs, no other rank moves a byte; a figure it cannot measure on the allocation says so.
The cost model divides a node's measured bandwidth among the ranks of the node that send
between nodes at once (``Phase.sharing``, ``Machine.node_bandwidth``); checked here by hand on
2 nodes x 2 ranks for every strategy and split.
"""

import json

import numpy as np
import pytest

from mpiattn import cli
from mpiattn.cli import links
from mpiattn.comm.topology import Topology
from mpiattn.strategies import AttentionSpec, Options, machines, model, registry
from mpiattn.strategies.base import Phase


# ------------------------------------------------------------------ measuring
def _sent(comm, fn):
    """Bytes each rank handed to MPI for others while ``fn()`` ran (gathered on every rank)."""
    before = comm.bytes_sent
    result = fn()
    return result, comm.allgather_obj(comm.bytes_sent - before)


@pytest.mark.mpi(min_size=2)
def test_a_pingpong_moves_bytes_between_its_pair_only(comm):
    a, b = 0, comm.size - 1
    took, sent = _sent(comm, lambda: links.pingpong(comm, np, a, b, 4096, 3))
    assert took > 0 and comm.allgather_obj(took) == [took] * comm.size
    for r, nbytes in enumerate(sent):
        if r in (a, b):  # at least the 3 timed round trips and the untimed first one
            assert nbytes >= 4 * 4097 and nbytes % 4097 == 0, (r, nbytes)
        else:
            assert nbytes == 0, f"rank {r} sent {nbytes} B while ranks {a} and {b} were timed"


@pytest.mark.mpi(min_size=3)
def test_a_nodes_link_is_timed_with_its_senders_only(comm):
    senders, receivers = [0], [comm.size - 1]
    took, sent = _sent(comm, lambda: links.node_send(comm, np, senders, receivers, 8192, 2))
    assert took > 0
    assert sent == [3 * 8192] + [0] * (comm.size - 1)


def test_a_link_from_its_one_way_times():
    assert links.link_of(2e-6, 2e-6 + 1e-3, 10**6) == pytest.approx((2e-6, 1e9))


def test_calibrate_keeps_each_links_own_figure(comm, capsys, shared_dir):
    path = f"{shared_dir}/machine.json"
    assert cli.main(["calibrate", "-o", path, "--megabytes", "1", "--rows", "64", "--heads", "1",
                     "--dim", "8", "--repeat", "1", "-q"]) == 0
    with open(path) as f:
        d = json.load(f)
    topo = comm.topology
    for cls in ("inside", "between"):
        text = d["sources"][cls]
        if text.startswith("measured"):  # the figure kept is the pair's own ping-pong, as written
            said = float(text.rsplit("bandwidth ", 1)[1].split()[0])
            assert d[cls]["bandwidth"] == pytest.approx(said, rel=1e-3)
            assert "alone" in text
    has_pair = any(len(n) > 1 for n in topo.nodes)
    assert d["sources"]["inside"].startswith("measured") == has_pair
    if not has_pair:
        assert d["sources"]["inside"].startswith(links.NOT_MEASURED["inside"])
    if topo.n_nodes == 1:
        assert d["sources"]["between"].startswith(links.NOT_MEASURED["between"])
        assert d["node_bandwidth"] == 0 and d["sources"]["node_bandwidth"].startswith("not measured")
    assert d["sources"]["overlap"].startswith("not measured")
    if topo.n_nodes == 1:
        assert d["overlap_between"] is None
        assert d["sources"]["overlap_between"].startswith(links.NOT_MEASURED["overlap_between"])
    else:
        assert 0.0 <= d["overlap_between"] <= 1.0
        assert d["sources"]["overlap_between"].startswith("measured")


# ------------------------------------------------------------------ the model
def _spec(strategy):
    return AttentionSpec.from_shapes((1, 4, 4096, 16), (1, 4, 4096, 16), (1, 4, 4096, 16), "float32",
                                     Options(strategy=strategy), device="numpy")


LINK = machines.Link(0.0, 1e9)
SLOW = machines.Link(0.0, 1e8)


def _machine(node_bandwidth):
    return machines.Machine("m", LINK, SLOW, {"float32": 1e12}, backward_ratio=1.0, overlap=0.0,
                            node_bandwidth=node_bandwidth)


@pytest.mark.parametrize("strategy,sharing", [("ring", 1), ("hybrid:1x4", 1), ("double-ring", 2),
                                              ("hybrid:2x2", 2), ("hybrid:2x2:ring-first", 2),
                                              ("ulysses", 2), ("allgather", 2), ("hybrid:4x1", 2)])
def test_ranks_crossing_at_once_share_their_nodes_link(strategy, sharing):
    """2 nodes x 2 ranks: how many of a node's ranks send between nodes in each phase that
    crosses, and the time of the between bytes when the node's link carries 1e8 B/s in all."""
    topo = Topology.blocks(4, 2)
    s = registry.get(strategy)
    spec = _spec(strategy)
    phases = [p for bwd in (False, True) for p in s.traffic(spec, topo, 512, bwd)]
    crossing = [p for p in phases if p.between > 0]
    assert crossing and {p.sharing for p in crossing} == {sharing}
    alone = model.predict(s, spec, topo, 512, _machine(0.0))
    shared = model.predict(s, spec, topo, 512, _machine(1e8))
    between_s = sum(p.between for p in crossing) / 1e8
    inside_max = sum(max(p.inside / 1e9 - p.between / 1e8, 0.0) for p in crossing)
    extra = (sharing - 1) * between_s  # the same bytes at 1/sharing of the rate
    assert shared.fwdbwd_s - alone.fwdbwd_s == pytest.approx(extra, rel=1e-9, abs=1e-12 + inside_max)
    wide = model.predict(s, spec, topo, 512, _machine(1e8 * sharing))  # room for every sender
    assert wide.fwdbwd_s == pytest.approx(alone.fwdbwd_s)


def test_one_node_shares_nothing():
    topo = Topology.blocks(4, 4)
    for strategy in ("ring", "double-ring", "hybrid:2x2", "ulysses", "allgather"):
        s = registry.get(strategy)
        spec = _spec(strategy)
        assert all(p.between == 0 for bwd in (False, True) for p in s.traffic(spec, topo, 512, bwd))
        assert model.predict(s, spec, topo, 512, _machine(1e6)).fwdbwd_s == pytest.approx(
            model.predict(s, spec, topo, 512, _machine(0.0)).fwdbwd_s)


def test_machine_files_keep_the_nodes_bandwidth(tmp_path):
    m = _machine(3e8)
    m.save(str(tmp_path / "m.json"))
    assert machines.load(str(tmp_path / "m.json")).node_bandwidth == 3e8
    d = m.to_dict()
    del d["node_bandwidth"]  # a file written before it existed: no sharing
    assert machines.Machine.from_dict(d).node_bandwidth == 0.0


# ------------------------------------------------ what hides behind compute, per link class
def _overlaps(overlap, between):
    return machines.Machine("m", LINK, SLOW, {"float32": 1e12}, overlap=overlap,
                            overlap_between=between)


@pytest.mark.parametrize("overlap,between", [(0.0, None), (0.0, 1.0), (1.0, 0.0), (0.5, 0.25)])
def test_a_ring_step_hides_each_link_class_up_to_its_own_overlap(overlap, between):
    """A ring of 3 steps, 0.4 s of compute (0.1 s per block): each step moves 1e7 B inside
    (0.01 s at 1e9 B/s) and 2e7 B between nodes (0.2 s at 1e8 B/s); the step waits for the
    class that leaves more exposed."""
    ring = Phase(inside=3e7, between=6e7, overlap=True, steps=3)
    m = _overlaps(overlap, between)
    ob = overlap if between is None else between
    exposed_in = max(0.01 - overlap * 0.1, (1 - overlap) * 0.01)
    exposed_bw = max(0.2 - ob * 0.1, (1 - ob) * 0.2)
    assert model.pass_time(0.4, [ring], m) == pytest.approx(0.4 + 3 * max(exposed_in, exposed_bw))
    assert m.between_overlap == ob


def test_without_overlap_between_a_ring_step_is_priced_as_before():
    """``overlap_between`` unset: one overlap for the step's slower link, as the model always
    did: ``steps x max(tau - overlap x per_step, (1 - overlap) x tau)``, tau the slower class."""
    ring = Phase(inside=3e7, between=6e7, messages=6, overlap=True, steps=3)
    m = machines.Machine("m", machines.Link(1e-3, 1e9), machines.Link(2e-3, 1e8),
                         {"float32": 1e12}, overlap=0.3)
    tau = (6 * 2e-3 + 6e7 / 1e8) / 3
    assert model.pass_time(0.4, [ring], m) == pytest.approx(
        0.4 + 3 * max(tau - 0.3 * 0.1, 0.7 * tau))


def test_overlap_between_is_range_checked_and_kept_in_machine_files(tmp_path):
    with pytest.raises(ValueError, match="overlap_between must be >= 0 and <= 1"):
        _overlaps(0.0, 1.5)
    m = _overlaps(0.0, 0.75)
    m.save(str(tmp_path / "m.json"))
    assert machines.load(str(tmp_path / "m.json")).overlap_between == 0.75
    d = m.to_dict()
    del d["overlap_between"]  # a file written before it existed: as overlap
    assert machines.Machine.from_dict(d).between_overlap == 0.0


@pytest.mark.mpi(min_size=2)
def test_the_overlap_between_two_ranks_is_measured_with_their_transfer_only(comm):
    a, b = 0, comm.size - 1
    (overlap, text), sent = _sent(comm, lambda: links.transfer_overlap(comm, np, a, b, 1 << 16,
                                                                       1e9, 2))
    assert 0.0 <= overlap <= 1.0 and comm.allgather_obj(overlap) == [overlap] * comm.size
    assert text.startswith("measured") and f"{overlap:.2f} of the shorter hidden" in text
    # rank a: the untimed first transfer, then one alone and one beside the compute per repeat
    assert sent == [5 * (1 << 16) if r == a else 0 for r in range(comm.size)]
