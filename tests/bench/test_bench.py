"""Smoke tests of ``mpiattn bench`` at tiny sizes (never asserting timings).

What is checked against independent numbers: the counted bytes on the wire
(against the ring's cost formula), the FLOP counts (against a brute-force
count of visible pairs), the materialising reference (against
:func:`mpiattn.reference.reference` in float64), the derived ceiling
fractions, scaling and targets (against hand-computed values), and the
``--max-memory`` guard.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from mpiattn import bench, bench_report, bench_workloads
from mpiattn.layouts import local_length


def _task(P, **kw):
    t = dict(workload="attention", impl="ring", B=1, H=2, Hkv=1, N=96 * P, M=96 * P, E=8, Ev=4,
             dtype="float32", causal=False, layout="contiguous", block=32, passes=["fwd", "fwdbwd"],
             repeat=1, warmup=0, device="cpu", check_finite=False)
    t.update(kw)
    return t


def _run(comm, xp, tasks, **cfg):
    out = []
    settings = dict(seed=0, device="cpu" if xp is np else "gpu", threads=1, cores=64, max_memory=None)
    settings.update(cfg)
    bench.run_in_job(comm, tasks, settings, out.extend)
    return [r for r in out if r["workload"] != "env"]


def test_ring_records_and_bytes_on_the_wire(comm, xp):
    P = comm.size
    t = _task(P)
    recs = _run(comm, xp, [t])
    assert [r["pass"] for r in recs] == ["fwd", "fwdbwd"]
    assert all(r["status"] == "ok" and r["P"] == P for r in recs)
    fwd, both = recs
    # cost formula: every rank forwards all key/value rows except those of its successor
    # (k and v in float32); backward adds the dK, dV accumulators of the P-1 foreign blocks.
    m = [local_length(t["M"], r, P) for r in range(P)]
    kv_sent = max((t["M"] - m[(r + 1) % P]) * (t["E"] + t["Ev"]) * 4 for r in range(P)) if P > 1 else 0
    acc_sent = max((t["M"] - m[r]) * (t["E"] + t["Ev"]) * 4 for r in range(P)) if P > 1 else 0
    assert fwd["bytes_sent_per_rank"] == kv_sent
    assert both["bytes_sent_per_rank"] == 2 * kv_sent + acc_sent
    assert fwd["flops"] == 2 * t["N"] * t["M"] * t["H"] * (t["E"] + t["Ev"])
    assert both["flops"] == fwd["flops"] + 2 * t["N"] * t["M"] * t["H"] * (3 * t["E"] + 2 * t["Ev"])
    for r in recs:
        assert r["time_s"] > 0 and len(r["times_s"]) == 1
        assert r["peak_bytes"] >= r["baseline_bytes"] > 0
        assert r["shard_bytes"] == 4 * (2 * -(-t["N"] // P) * (t["E"] + t["Ev"]) + -(-t["M"] // P) * (t["E"] + t["Ev"]))


def test_memory_guard_skips_without_running(comm, xp):
    recs = _run(comm, xp, [_task(comm.size)], max_memory=1)
    assert [r["status"] for r in recs] == ["skipped", "skipped"]
    assert all("--max-memory" in r["reason"] for r in recs)


def test_ceilings_products_and_peers_run(comm, xp):
    P = comm.size
    t = _task(P)
    tasks = [dict(t, workload="gemm_square", size=64, repeat=1),
             dict(t, workload="gemm_tile", repeat=1, tile_key=list(bench_report.tile_key(t, P))),
             dict(workload="product", op="tn", N=40 * P, M=24 * P, d=4, dtype="float32", layout="zigzag",
                  block=None, repeat=1, warmup=0, device="cpu"),
             dict(t, impl="reference"), dict(t, impl="torch", passes=["fwd"])]
    recs = _run(comm, xp, tasks)
    by = {}
    for r in recs:
        by.setdefault(r["workload"] if r["workload"] != "attention" else r["impl"], []).append(r)
    assert by["gemm_square"][0]["gflops_per_rank"] > 0
    assert [r["pass"] for r in by["gemm_tile"]] == ["fwd", "bwd", "fwdbwd"]
    prod = by["product"][0]
    assert prod["status"] == "ok" and prod["flops"] == 2 * 40 * P * 24 * P * 4
    single = "ok" if P == 1 else "skipped"
    assert {r["status"] for r in by["reference"]} == {single}
    assert {r["status"] for r in by["torch"]} <= {"ok", "skipped"}


def test_reference_implementation_is_attention():
    rng = np.random.default_rng(3)
    t = _task(1, N=24, M=20, causal=True)
    q = rng.standard_normal((1, 2, 24, 8)).astype(np.float32)
    k = rng.standard_normal((1, 1, 20, 8)).astype(np.float32)
    v = rng.standard_normal((1, 1, 20, 4)).astype(np.float32)
    dout = rng.standard_normal((1, 2, 24, 4)).astype(np.float32)
    fwd, bwd = bench_workloads._reference_impl(None, t)
    res = fwd(q, k, v)
    dq, dk, dv = bwd(dout, q, k, v, res)
    from mpiattn.reference import reference
    ref = reference(q, k, v, dout, causal=True)
    for got, want in ((res[0], ref.out), (res[1], ref.lse), (dq, ref.dq), (dk, ref.dk), (dv, ref.dv)):
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5)


def test_visible_pairs_and_sizes():
    for N, M in ((7, 7), (9, 4), (4, 9), (1, 5)):
        brute = int(np.sum(np.arange(M)[None, :] <= np.arange(N)[:, None]))
        assert bench_workloads.visible_pairs(N, M, True) == brute
        assert bench_workloads.visible_pairs(N, M, False) == N * M
    assert bench.parse_count("32k") == 32768 and bench.parse_count("5") == 5
    assert bench.parse_size("1.5G") == 3 * 2**29 and bench.parse_size("512MiB") == 2**29
    with pytest.raises(Exception):
        bench.parse_size("lots")
    t = _task(1, N=4096, M=4096)
    assert bench_workloads.estimate_bytes(t, 2, "fwd") < bench_workloads.estimate_bytes(t, 1, "fwd")
    assert bench_workloads.estimate_bytes(t, 1, "fwd") < bench_workloads.estimate_bytes(t, 1, "fwdbwd")


def test_derived_fractions_scaling_and_targets():
    base = dict(workload="attention", impl="ring", B=1, H=1, Hkv=1, E=64, Ev=64, dtype="float32", causal=False,
                layout="contiguous", block=None, device="cpu", status="ok", N=32768, M=32768)
    flops = 4.0 * 32768**2 * 64
    recs = [dict(base, P=1, **{"pass": "fwd"}, time_s=flops / 60e9, gflops_per_rank=60.0),
            dict(base, P=2, **{"pass": "fwd"}, time_s=flops / 100e9, gflops_per_rank=50.0),
            dict(base, impl="torch", P=1, **{"pass": "fwd"}, time_s=flops / 50e9, gflops_per_rank=50.0),
            dict(workload="gemm_square", P=1, dtype="float32", device="cpu", status="ok", gflops_per_rank=100.0),
            dict(workload="gemm_square", P=1, dtype="float32", device="cpu", status="ok", gflops_per_rank=70.0),
            dict(workload="gemm_tile", P=1, status="ok", **{"pass": "fwd"}, gflops_per_rank=80.0,
                 tile_key=list(bench_report.tile_key(base, 1)))]
    extra = bench_report.derive(recs)
    assert recs[0]["frac_gemm_square"] == pytest.approx(0.6)   # of the best ceiling seen
    assert recs[0]["frac_gemm_tile"] == pytest.approx(0.75)
    strong = [r for r in extra if r["workload"] == "scaling" and r["kind"] == "strong"]
    assert len(strong) == 1 and strong[0]["speedup"] == pytest.approx(100 / 60)
    targets = {r["name"]: r for r in extra if r["workload"] == "target"}
    frac = targets["ring fwd N=32k, 1 rank: fraction of GEMM ceiling"]
    assert frac["met"] and frac["measured"] == pytest.approx(0.6)
    torch = targets["ring fwd N=32k vs torch SDPA, 1 process"]
    assert torch["met"] and torch["measured"] == pytest.approx(60 / 50)
    two = targets["ring fwd N=32k: 2 ranks vs 1"]
    assert not two["met"] and two["measured"] == pytest.approx(100 / 60)
    assert "targets" in bench_report.format_table(recs + extra)


def test_cli_launches_workers(serial_only, tmp_path):
    out = tmp_path / "r.jsonl"
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "mpiattn", "bench", "-n", "256", "--ranks", "1", "--peers", "gemm",
           "--products", "nn", "--product-n", "128", "--repeat", "1", "--warmup", "0", "--gemm-size", "64",
           "--json", str(out), "--quiet"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    recs = [json.loads(ln) for ln in out.read_text().splitlines()]
    assert any(r["workload"] == "env" and "blas" in r for r in recs)
    recs = bench_report.load([str(out)])       # re-derives the fractions from the saved ceilings
    ring = [r for r in recs if r["workload"] == "attention" and r.get("impl") == "ring"]
    assert {r["pass"] for r in ring} == {"fwd", "fwdbwd"} and all(r["fresh"] for r in ring)
    assert all("frac_gemm_square" in r and "frac_gemm_tile" in r for r in ring)
    assert any(r["workload"] == "product" and r["status"] == "ok" for r in recs)
    assert "GEMM ceilings" in proc.stdout
