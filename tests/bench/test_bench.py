"""The workloads of ``mpiattn bench`` at tiny sizes, on every rank (never asserting timings).

What is checked against independent numbers: the bytes on the wire (read
from ``Comm.bytes_sent``, against the ring's cost formula and the registry's
cost model), the FLOP counts (against a brute-force count of visible pairs),
both single-process peers (against the tests' own float64 dense attention),
the ``--max-memory`` guard and the registry's refusal of a call, the
ceilings and the products.
"""

import argparse
import re

import numpy as np
import pytest

from helpers import dense_attention, visible_matrix
from mpiattn.bench import app, ceilings, memory, workloads
from mpiattn.bench.tasks import Settings, Task, attention_flops, tile_key, visible_pairs
from mpiattn.bench.worker import run_in_job
from mpiattn.layouts import local_length
from mpiattn.timing import Timer


def _task(P, **kw):
    base = dict(impl="ring", B=1, H=2, Hkv=1, N=96 * P, E=8, Ev=4, dtype="float32", block=32, repeat=1,
                warmup=0)
    base.update(kw)
    return Task(**base)


def _run(comm, xp, tasks, **kw):
    out = []
    settings = Settings(seed=0, device="cpu" if xp is np else "gpu", threads=1, cores=64).replace(**kw)
    run_in_job(comm, tasks, settings, out.extend)
    return [r for r in out if r["workload"] != "env"]


def _by_impl(recs):
    out = {}
    for r in recs:
        out.setdefault(r["workload"] if r["workload"] != "attention" else r["impl"], []).append(r)
    return out


def test_ring_records_and_bytes_on_the_wire(comm, xp):
    P = comm.size
    t = _task(P)
    recs = _run(comm, xp, [t])
    assert [r["pass"] for r in recs] == ["fwd", "fwdbwd"]
    assert all(r["status"] == "ok" and r["P"] == P and r["engine"] is None for r in recs)
    assert all(r["strategy_used"] == "ring" and r["engine_used"] == "native" and r["block_size_used"] == 32
               for r in recs)
    fwd, both = recs
    # every rank forwards all key/value rows except its successor's (k and v in float32);
    # the backward sends them again plus the dK, dV accumulators of the P-1 foreign blocks
    m = [local_length(t.M, r, P) for r in range(P)]
    kv_sent = max((t.M - m[(r + 1) % P]) * (t.E + t.Ev) * 4 for r in range(P)) if P > 1 else 0
    acc_sent = max((t.M - m[r]) * (t.E + t.Ev) * 4 for r in range(P)) if P > 1 else 0
    assert fwd["bytes_sent_per_rank"] == kv_sent
    assert both["bytes_sent_per_rank"] == 2 * kv_sent + acc_sent
    assert fwd["flops"] == 2 * t.N * t.M * t.H * (t.E + t.Ev)
    assert both["flops"] == fwd["flops"] + 2 * t.N * t.M * t.H * (3 * t.E + 2 * t.Ev)
    for r in recs:
        assert r["time_s"] > 0 and len(r["times_s"]) == 1
        assert r["peak_bytes"] >= r["baseline_bytes"] >= 0
        assert r["memory_kind"] == ("ru_maxrss" if xp is np else "cupy-pool-high-water")
        if xp is np:                      # a process holds memory; a CuPy pool may hold none between calls
            assert r["baseline_bytes"] > 0
        assert r["shard_bytes"] == 4 * (2 * -(-t.N // P) * (t.E + t.Ev) + -(-t.M // P) * (t.E + t.Ev))


@pytest.mark.parametrize("dtype, itemsize", [("float32", 4), ("float64", 8)])
def test_forward_bytes_are_the_ring_formula(comm, xp, dtype, itemsize):
    """Even shards: each rank sends (P-1) m Hkv (E+Ev) words per forward, m = M/P rows (B = 1)."""
    P = comm.size
    t = _task(P, H=4, Hkv=2, E=6, Ev=10, N=64 * P, dtype=dtype, passes=("fwd",), repeat=2, warmup=1)
    before = comm.bytes_sent
    (rec,) = _run(comm, xp, [t])
    m = t.M // P
    assert rec["bytes_sent_per_rank"] == (P - 1) * m * t.Hkv * (t.E + t.Ev) * itemsize
    assert rec["model_bytes_sent"] == rec["bytes_sent_per_rank"]      # the strategy's traffic formula, exact
    assert rec["model_bytes_between"] == rec["bytes_between_per_rank"] == 0   # one node
    assert rec["model_s"] > 0 and rec["model_machine"]
    calls = t.warmup + t.repeat + 1                       # and one small warm-up problem
    assert comm.bytes_sent - before >= calls * rec["bytes_sent_per_rank"]


def test_memory_guard_skips_without_running(comm, xp):
    recs = _run(comm, xp, [_task(comm.size)], max_memory=1)
    assert [r["status"] for r in recs] == ["skipped", "skipped"]
    assert all("--max-memory" in r["reason"] and "time_s" not in r for r in recs)


@pytest.mark.parametrize("kw", [dict(impl="auto", block=None), dict(impl="ring", block=None),
                                dict(impl="ulysses", H=12, Hkv=12)], ids=["auto", "ring", "ulysses"])
def test_the_estimate_prices_the_strategy_and_block_that_run(comm, xp, kw):
    """A record's ``est_bytes`` (and the ``--max-memory`` guard) price the strategy and block
    rows :func:`mpiattn.bench.memory.plan_call` predicts without running anything; the library's
    own choice when the task runs (auto's cost model, the engine's block) must be the same."""
    t = _task(comm.size, **kw)
    strategy, block = memory.plan_call(t, comm.size, comm.topology)
    recs = _run(comm, xp, [t])
    assert [r["status"] for r in recs] == ["ok", "ok"]
    assert {(r["strategy_used"], r["block_size_used"]) for r in recs} == {(strategy.label, block)}


def test_a_call_the_strategy_refuses_is_skipped(comm, xp):
    """ulysses splits heads: H = 1 on P >= 2 ranks is refused by the registry, before anything runs."""
    recs = _run(comm, xp, [_task(comm.size, impl="ulysses", H=1, Hkv=1)])
    if comm.size == 1:
        assert [r["status"] for r in recs] == ["ok", "ok"] and recs[0]["strategy_used"] == "ulysses"
    else:
        assert [r["status"] for r in recs] == ["skipped", "skipped"]
        assert all(r["reason"].startswith("strategy 'ulysses' needs at least one query head per rank: "
                                          "H = 1") for r in recs)


def test_ceilings_and_products_run(comm, xp):
    P = comm.size
    t = _task(P)
    tasks = [t.replace(workload="gemm_square", gemm_size=64),
             t.replace(workload="gemm_tile", tile_key=tile_key(t.to_dict(), P)),
             Task(workload="product", op="tn", N=40 * P, M=24 * P, d=4, layout="zigzag", repeat=1, warmup=0),
             Task(workload="overlap", N=64 * P, d=8, block=16, repeat=1)]
    by = _by_impl(_run(comm, xp, tasks))
    assert by["gemm_square"][0]["gflops_per_rank"] > 0
    assert [r["pass"] for r in by["gemm_tile"]] == ["fwd", "bwd", "fwdbwd"]
    assert all(r["gflops_per_rank"] > 0 for r in by["gemm_tile"])
    (prod,) = by["product"]
    assert prod["status"] == "ok" and prod["flops"] == 2 * 40 * P * 24 * P * 4
    assert prod["time_s"] > 0 and prod["local_gemm_time_s"] > 0
    (ov,) = by["overlap"]
    if P == 1:
        assert ov["status"] == "skipped" and ov["reason"] == "overlap needs >= 2 ranks"
    else:
        assert ov["status"] == "ok" and ov["piece_bytes"] == 16 * 8 * 4 and 0 <= ov["hidden"] <= 1


def test_ceilings_attached_to_attention(comm, xp):
    recs = _run(comm, xp, [_task(comm.size, ceilings=True, gemm_size=64)])
    timed = [r for r in recs if r["workload"] == "attention"]
    measured = [r for r in recs if r["workload"] in ("gemm_square", "gemm_tile")]
    assert all(r["gemm_square_gflops_here"] > 0 and r["gemm_tile_gflops_here"] > 0 for r in timed)
    assert {r["measured_with"] for r in measured} == {f"ring N={96 * comm.size}"}
    assert {r["tile_key"][-3:-1] == [32, 32] for r in measured if r["workload"] == "gemm_tile"} == {True}


def test_dense_peer_runs_at_one_rank(comm, xp):
    recs = _run(comm, xp, [_task(comm.size, impl="dense")])
    assert [r["pass"] for r in recs] == ["fwd", "fwdbwd"]
    if comm.size == 1:
        assert all(r["status"] == "ok" and r["time_s"] > 0 and r["P"] == 1 for r in recs)
    else:
        assert all(r["status"] == "skipped" and r["reason"] == "dense is single-process; run it at P=1"
                   for r in recs)


def test_torch_peer_runs_at_one_rank(comm, xp):
    pytest.importorskip("torch")
    recs = _run(comm, xp, [_task(comm.size, impl="torch")])
    assert [r["pass"] for r in recs] == ["fwd", "fwdbwd"]
    if comm.size > 1:
        assert all(r["status"] == "skipped" and "single-process" in r["reason"] for r in recs)
        return
    fwd, both = recs
    assert fwd["status"] == "ok" and both["status"] == "ok"
    assert fwd["time_s"] > 0 and both["time_s"] > 0 and len(both["times_s"]) == 1
    assert both["note"].startswith("fwd+bwd: one call") and "model_s" not in fwd


def _problem(seed=4):
    rng = np.random.default_rng(seed)
    shapes = ((1, 2, 24, 8), (1, 1, 20, 8), (1, 1, 20, 4), (1, 2, 24, 4))
    q, k, v, dout = (rng.standard_normal(s).astype(np.float32) for s in shapes)
    want = dense_attention(q, k, v, visible_matrix(1, 24, 20, causal=True)[:, None], dO=dout)
    return (q, k, v, dout), want


def test_torch_peer_is_attention(xp):
    torch = pytest.importorskip("torch")
    if xp is not np:
        pytest.skip("checked on NumPy inputs")
    (q, k, v, dout), (out, _, dq, dk, dv) = _problem()
    impl = workloads.torch_impl(Task(impl="torch", H=2, Hkv=1, N=24, M=20, E=8, Ev=4, causal=True))
    got = [impl.forward(q, k, v), *impl.both(dout, q, k, v)]
    for g, want in zip(got, (out, dq, dk, dv)):
        np.testing.assert_allclose(torch.as_tensor(g).numpy(), want, rtol=2e-4, atol=2e-5)


def test_dense_peer_is_attention_in_the_accumulation_dtype():
    """The dense peer is the library's reference, every row at once, in float32 for float16 inputs."""
    (q, k, v, dout), (out, lse, dq, dk, dv) = _problem(3)
    impl = workloads.implementation(None, Task(impl="dense", H=2, Hkv=1, N=24, M=20, E=8, Ev=4, causal=True,
                                               dtype="float16"))
    half = [x.astype(np.float16) for x in (q, k, v, dout)]
    fwd, both = impl.forward(*half[:3]), impl.forward_backward(half[3], *half[:3])
    assert fwd.out.dtype == np.float32 and fwd.dq is None and both.dq.dtype == np.float32
    for got, want in ((fwd.out, out), (fwd.lse, lse), (both.dq, dq), (both.dk, dk), (both.dv, dv)):
        np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)


def test_visible_pairs_and_sizes():
    for N, M in ((7, 7), (9, 4), (4, 9), (1, 5)):
        brute = int(np.sum(np.arange(M)[None, :] <= np.arange(N)[:, None]))
        assert visible_pairs(N, M, True) == brute
        assert visible_pairs(N, M, False) == N * M
    assert attention_flops(Task(N=8, M=8, E=4, Ev=2, causal=True), "fwd") == 2.0 * 36 * 6
    assert app.parse_count("32k") == 32768 and app.parse_count("5") == 5
    assert app.parse_size("1.5G") == 3 * 2**29 and app.parse_size("512MiB") == 2**29
    with pytest.raises(argparse.ArgumentTypeError, match=re.escape("not a memory size: 'lots' (use e.g. 512M, 20G)")):
        app.parse_size("lots")
    with pytest.raises(argparse.ArgumentTypeError, match=re.escape("not a count: '4q' (use e.g. 4096, 32k)")):
        app.parse_count("4q")
    with pytest.raises(argparse.ArgumentTypeError, match=re.escape("memory size must be positive: '0M'")):
        app.parse_size("0M")
    t = Task(N=4096)
    assert memory.estimate_bytes(t, 2, "fwd") < memory.estimate_bytes(t, 1, "fwd")
    assert memory.estimate_bytes(t, 1, "fwd") < memory.estimate_bytes(t, 1, "fwdbwd")
    assert memory.estimate_bytes(t.replace(impl="dense"), 1, "fwd") > 4096**2 * 4      # the score matrix


def test_ceiling_rate_batches_short_calls(comm):
    calls = []
    # min_time far above one call plus its barriers (about a millisecond on a loaded box)
    rate, times, rate_cpu = ceilings.gemm_rate(Timer(comm), lambda: calls.append(1), 1e6, repeat=3, min_time=0.5)
    assert len(times) == 3 and rate > 0 and rate_cpu > 0
    assert len(calls) > 2 + 3            # two single calls, then batches of several
