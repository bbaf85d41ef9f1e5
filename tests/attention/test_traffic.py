"""Bytes per link class: what every strategy sends, counted by the Comm, against its traffic formula.

Each strategy declares its traffic (:meth:`mpiattn.strategies.base.Strategy.traffic`:
the busiest rank's bytes inside its node and between nodes, per phase); the
cost model times it. Here the Comm's counters (``bytes_sent``,
``bytes_between``) after a forward and a backward must equal those formulas,
on one node and on the topologies of two nodes (given to the Comm with
:func:`mpiattn.comm.topology.override`; the counters follow it). Shapes
divide evenly, so every rank of a role sends alike.
"""

import numpy as np
import pytest

import mpiattn
from mpiattn.comm.topology import Topology, override
from mpiattn.strategies import AttentionSpec, Options, registry

TOPOLOGIES = ["one node", "2 nodes, blocks", "2 nodes, interleaved"]


def _topology(name, P):
    if name == "one node":
        return Topology.blocks(P, P)
    if P % 2:
        return None
    if name == "2 nodes, blocks":
        return Topology.blocks(P, P // 2)
    return Topology.parse(",".join(str(r % 2) for r in range(P)), P)


@pytest.fixture
def topology(comm, request):
    topo = _topology(request.param, comm.size)
    if topo is None:
        pytest.skip("two equal nodes need an even rank count")
    before = comm.topology
    override(comm, topo)
    yield topo
    override(comm, before)


def _counted(comm, fn):
    sent0, between0 = comm.bytes_sent, comm.bytes_between
    fn()
    got = np.array(comm.mpi.allgather((comm.bytes_sent - sent0, comm.bytes_between - between0)))
    return got[:, 0].max(), got[:, 1].max()


def _formula(strategy, spec, topo, block, backward):
    phases = strategy.traffic(spec, topo, block, backward)
    return sum(p.inside + p.between for p in phases), sum(p.between for p in phases)


@pytest.mark.parametrize("topology", TOPOLOGIES, indirect=True)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_every_strategy_sends_what_its_formula_says(comm, topology, causal, dtype):
    P = comm.size
    B, H, Hkv, N, E, block = 2, 4, 2, 16 * P, 8, 8
    rng = np.random.default_rng(0)
    Q, K, V, dO = (rng.standard_normal(s).astype(dtype) for s in
                   [(B, H, N, E), (B, Hkv, N, E), (B, Hkv, N, E), (B, H, N, E)])
    layout = "zigzag" if causal else "contiguous"
    checked = 0
    for name in registry.variants(P):
        options = Options(causal=causal, layout=layout, strategy=name, engine="native",
                          block_size=block)
        spec = AttentionSpec.from_shapes(Q.shape, K.shape, V.shape, dtype, options)
        s = registry.get(name)
        if s.supports(spec, topology) is not None:
            continue
        q, k, v, do = (mpiattn.shard(x, axis=2, layout=layout) for x in (Q, K, V, dO))
        res = {}

        def forward():
            res["out"], res["lse"] = mpiattn.attention(q, k, v, options=options)

        fwd = _counted(comm, forward)
        bwd = _counted(comm, lambda: mpiattn.attention_backward(do, q, k, v, res["out"], res["lse"],
                                                                options=options))
        for got, backward in ((fwd, False), (bwd, True)):
            want = _formula(s, spec, topology, block, backward)
            assert got == pytest.approx(want, rel=1e-12, abs=0), (
                f"{name} {'backward' if backward else 'forward'} on {topology.describe()}: counted "
                f"(sent, between) = {got}, formula {want}")
        checked += 1
    assert checked >= 3


def test_hybrid_halves_the_rings_bytes_between_nodes():
    """The issue's target, by the formulas the test above holds to the counters: causal, N = 32k,
    H = 8, 2 nodes x 2 ranks: hybrid:2x2 sends at most half of the flat ring's bytes between nodes."""
    topo = Topology.blocks(4, 2)
    spec = AttentionSpec.from_shapes((1, 8, 32768, 128), (1, 8, 32768, 128), (1, 8, 32768, 128),
                                     "float16",
                                     Options(causal=True, layout="zigzag"))
    between = {name: sum(_formula(registry.get(name), spec, topo, 512, bw)[1] for bw in (False, True))
               for name in ("ring", "hybrid:2x2")}
    assert 0 < between["hybrid:2x2"] <= between["ring"] / 2
