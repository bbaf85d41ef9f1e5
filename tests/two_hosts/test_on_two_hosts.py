"""Inside the two-host cluster (jobs/two_hosts.sh): real nodes, TCP between them, a limited link.

Runs under ``jobs/two_hosts.sh mpiexec -n 4`` (2 ranks per host) with ``MPIATTN_TWO_HOSTS=1``
(the two_hosts lane); skipped everywhere else. It checks what one machine with emulated nodes
cannot: that MPI sees two nodes because the ranks are on two hosts, that the bytes mpiattn
counts between nodes are the bytes the link carried (each host's end of the veth pair, read
from ``/sys/class/net/net0/statistics``, which inside a host's namespace shows that host's
devices), that decode over a cache spread over both hosts is exact, that ``run`` writes one
HDF5 file from both hosts, and that ``calibrate`` finds the limited link.
"""

import os

import numpy as np
import pytest

import mpiattn
from mpiattn.strategies import AttentionSpec, Options, machines, registry

from helpers import host, reference, run_cli

DEV = "net0"
#: TCP/IP and MPI headers, acknowledgements, and the test's own small collectives: what the link
#: may carry beyond the payload mpiattn counts (measured: 0.2-1.3 % on 32 MiB transfers).
OVERHEAD = 0.05
SLACK = 256 * 1024


@pytest.fixture(scope="module")
def hosts(comm):
    if os.environ.get("MPIATTN_TWO_HOSTS") != "1":
        pytest.skip("runs on the two-host cluster (jobs/two_hosts.sh; the two_hosts lane)")
    from mpi4py import MPI

    names = comm.allgather_obj(MPI.Get_processor_name())
    if comm.topology.n_nodes != 2 or len(set(names)) != 2:
        pytest.skip(f"needs 2 hosts, has {comm.topology.describe()} on {sorted(set(names))}")
    return names


def _link():
    """This host's (tx_bytes, rx_bytes) on the link."""
    base = f"/sys/class/net/{DEV}/statistics"
    with open(f"{base}/tx_bytes") as tx, open(f"{base}/rx_bytes") as rx:
        return int(tx.read()), int(rx.read())


def test_two_hosts_are_two_nodes(comm, hosts):
    t = comm.topology
    assert t.nodes == ((0, 1), (2, 3)), t.nodes
    for node in t.nodes:  # the ranks of a node share a host, and no host holds two nodes
        assert len({hosts[r] for r in node}) == 1
    assert hosts[0] != hosts[2]
    assert os.path.isdir(f"/sys/class/net/{DEV}")


STRATEGIES = ["ring", "double-ring", "allgather", "ulysses", "hybrid:1x4", "hybrid:2x2",
              "hybrid:4x1", "hybrid:2x2:ring-first"]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_link_carries_the_bytes_counted_between_hosts(comm, hosts, strategy):
    """Forward and backward: the busiest rank's bytes between nodes equal the formula, and the
    bytes each host's ranks sent to the other host are what its end of the link sent (within
    protocol overhead), and what the other end received."""
    P, B, H, N, E = comm.size, 1, 4, 4096, 32
    rng = np.random.default_rng(1)
    Q, K, V, dO = (rng.standard_normal((B, H, N, E)).astype(np.float32) for _ in range(4))
    options = Options(strategy=strategy, engine="native", block_size=512)
    spec = AttentionSpec.from_shapes(Q.shape, K.shape, V.shape, "float32", options)
    s = registry.get(strategy)
    assert s.supports(spec, comm.topology) is None
    q, k, v, do = (mpiattn.shard(x, axis=2) for x in (Q, K, V, dO))
    leader = comm.topology.local_rank(comm.rank) == 0
    comm.barrier()
    before, counted0 = (_link() if leader else None), comm.bytes_between
    out, lse = mpiattn.attention(q, k, v, options=options)
    mpiattn.attention_backward(do, q, k, v, out, lse, options=options)
    comm.barrier()
    after = _link() if leader else None
    counted = comm.allgather_obj(comm.bytes_between - counted0)
    links = comm.allgather_obj(None if before is None else (after[0] - before[0], after[1] - before[1]))
    formula = sum(p.between for bwd in (False, True) for p in s.traffic(spec, comm.topology, 512, bwd))
    assert max(counted) == pytest.approx(formula, rel=1e-12), (counted, formula)
    # allgather goes through MPI_Allgatherv and MPI_Reduce_scatter, whose algorithms route the
    # blocks (MPICH's ring: a block crosses once, not once per rank of the other host); the Comm
    # counts them as sent to every rank. What crosses lies between the blocks the other host
    # lacks (half the count at 2 x 2) and the count.
    low = 0.5 if strategy == "allgather" else 1.0
    for node, other in ((0, 1), (1, 0)):
        mine = comm.topology.nodes[node]
        payload = sum(counted[r] for r in mine)
        tx = links[mine[0]][0]
        rx_other = links[comm.topology.nodes[other][0]][1]
        assert low * payload <= tx <= payload * (1 + OVERHEAD) + SLACK, (strategy, node, payload, tx)
        assert low * payload <= rx_other <= payload * (1 + OVERHEAD) + SLACK, (strategy, node, payload,
                                                                                rx_other)


def test_decode_over_a_cache_spread_over_both_hosts(comm, hosts):
    rng = np.random.default_rng(7)
    B, H, Hkv, L, E = 2, 4, 2, 3000, 16
    Q = rng.standard_normal((B, H, L, E))
    K = rng.standard_normal((B, Hkv, L, E))
    V = rng.standard_normal((B, Hkv, L, E))
    n0 = 2990
    cache = mpiattn.KVCache.from_shards(mpiattn.shard(K[:, :, :n0]), mpiattn.shard(V[:, :, :n0]), page=4)
    cache.append(K[:, :, n0:], V[:, :, n0:])
    rows = comm.allgather_obj(cache.rows)
    assert all(rows[r] > 0 for r in range(comm.size)) and sum(rows) == L  # on both hosts
    between0 = comm.bytes_between
    out, lse = cache.attend(Q[:, :, L - 3:])
    crossed = comm.allgather_obj(comm.bytes_between - between0)
    same = comm.allgather_obj(host(out).tobytes())
    ref = reference(Q[:, :, L - 3:], K, V, causal="bottom-right")  # the last 3 rows of causal attention
    np.testing.assert_allclose(host(out), ref.out, atol=1e-12)
    np.testing.assert_allclose(host(lse), ref.lse, atol=1e-11)
    assert sum(crossed) > 0  # the partial results crossed the link
    assert same == [same[0]] * comm.size


def test_a_run_writes_one_hdf5_file_from_both_hosts(comm, capsys, shared_dir, hosts):
    import h5py

    src, dst = f"{shared_dir}/in.h5", f"{shared_dir}/out.h5"
    code, _, _ = run_cli(comm, capsys, "make-data", src, "--seq", "2048", "--heads", "4", "--kv-heads",
                         "2", "--dim", "16", "--with-dout", "--causal", "-q")
    assert code == 0
    code, out, err = run_cli(comm, capsys, "run", src, "-o", dst, "--check", "--watchdog", "60",
                             "--strategy", "double-ring")
    assert code == 0, out + err
    if comm.rank:
        return
    assert any(ln.split()[:1] == ["check"] and ln.rstrip().endswith("OK") for ln in out.splitlines()), out
    with h5py.File(src, "r") as f:
        ref = reference(f["q"][...], f["k"][...], f["v"][...], f["dout"][...], causal=True)
    with h5py.File(dst, "r") as f:  # every row, the rows of host 2's ranks included
        np.testing.assert_allclose(f["out"][...], ref.out, atol=2e-5)
        np.testing.assert_allclose(f["dq"][...], ref.dq, atol=2e-4)
        np.testing.assert_allclose(f["dk"][...], ref.dk, atol=2e-4)


def test_calibrate_finds_the_limited_link(comm, capsys, shared_dir, hosts):
    """The between figures are the shaped link's: never above its rate (a figure above it would
    be measuring something else); inside is shared memory, far above it. Reported, not timed."""
    rate = float(os.environ.get("MPIATTN_TWO_HOSTS_RATE_BPS", "0")) / 8
    path = f"{shared_dir}/machine.json"
    code, _, err = run_cli(comm, capsys, "calibrate", "-o", path, "--megabytes", "8", "--rows", "256",
                           "--heads", "2", "--repeat", "2", "-q")
    assert code == 0, err
    m = machines.load(path)
    if comm.rank == 0:  # (no collective below)
        print(f"\ncalibrate on two hosts: inside {m.inside.latency_s * 1e6:.1f} us "
              f"{m.inside.bandwidth / 1e9:.3g} GB/s; between {m.between.latency_s * 1e6:.1f} us "
              f"{m.between.bandwidth / 1e9:.3g} GB/s; node {m.node_bandwidth / 1e9:.3g} GB/s; "
              f"overlap between {m.overlap_between:.2f}"
              + (f"; the link is shaped to {rate / 1e9:.3g} GB/s" if rate else ""), flush=True)
    assert m.sources["between"].startswith("measured") and m.sources["node_bandwidth"].startswith("measured")
    assert m.inside.bandwidth > m.between.bandwidth
    assert m.sources["overlap_between"].startswith("measured") and 0 <= m.overlap_between <= 1
    if rate:
        assert m.between.bandwidth <= 1.1 * rate and m.node_bandwidth <= 1.1 * rate
