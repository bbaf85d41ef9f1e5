"""Derived numbers, the table, saved results of earlier releases and the plots (no MPI traffic)."""

import json
import os

import pytest

from mpiattn.bench import derive, report
from mpiattn.bench.tasks import tile_key

_BASE = dict(workload="attention", impl="ring", B=1, H=1, Hkv=1, E=64, Ev=64, dtype="float32", causal=False,
             layout="contiguous", block=None, device="cpu", status="ok", N=32768, M=32768, run="r1")
_FLOPS = 4.0 * 32768**2 * 64


def _att(**kw):
    r = dict(_BASE, **{"pass": "fwd"}, P=1)
    r.update(kw)
    r.setdefault("gflops_per_rank", _FLOPS / r["time_s"] / 1e9 / r["P"])
    return r


def test_derived_fractions_scaling_and_targets():
    recs = [_att(time_s=_FLOPS / 60e9), _att(P=2, time_s=_FLOPS / 100e9), _att(impl="torch", time_s=_FLOPS / 50e9),
            dict(workload="gemm_square", P=1, dtype="float32", device="cpu", status="ok", gflops_per_rank=100.0),
            dict(workload="gemm_square", P=1, dtype="float32", device="cpu", status="ok", gflops_per_rank=70.0),
            dict(workload="gemm_tile", P=1, status="ok", **{"pass": "fwd"}, gflops_per_rank=80.0,
                 tile_key=list(tile_key(_BASE, 1)))]
    extra = derive.derive(recs)
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
    assert not any(name.startswith("torch") for name in targets)          # peers get no targets
    assert "targets" in report.format_table(recs + extra)


def test_fraction_of_ideal_uses_the_fastest_single_process_time_of_the_same_run():
    recs = [_att(time_s=2.0), _att(P=2, time_s=1.25), _att(impl="torch", time_s=1.5),
            _att(impl="dense", time_s=4.0),
            _att(impl="torch", time_s=0.1, run="r0"),                 # another run: not compared
            _att(P=2, time_s=1.0, causal=True, layout="zigzag")]        # another problem: no T_best
    derive.derive(recs)
    ring1, ring2, torch, dense, other, causal = recs
    assert ring2["frac_ideal"] == pytest.approx(1.5 / (2 * 1.25)) and ring2["ideal_impl"] == "torch"
    assert ring1["frac_ideal"] == pytest.approx(0.75) and ring2["ideal_time_s"] == 1.5
    assert torch["frac_ideal"] == pytest.approx(1.0) and dense["frac_ideal"] == pytest.approx(0.375)
    assert other["frac_ideal"] == pytest.approx(1.0) and "frac_ideal" not in causal


def test_engines_side_by_side_and_their_targets():
    """Every implementation (strategy, engine) gets the targets; labels say what mpiattn chose."""
    recs = [_att(N=16384, M=16384, impl="torch", time_s=1.0),
            _att(N=16384, M=16384, impl="auto", engine="torch", strategy_used="ring", engine_used="torch",
                 time_s=1.02),
            _att(N=16384, M=16384, impl="auto", strategy_used="ring", engine_used="native", time_s=1.5),
            _att(N=16384, M=16384, impl="auto", engine="torch", strategy_used="ring", engine_used="torch", P=2,
                 time_s=0.55),
            _att(N=16384, M=16384, impl="auto", strategy_used="ring", engine_used="native", P=2, time_s=0.7,
                 causal=True),
            _att(N=16384, M=16384, impl="torch", time_s=1.2, causal=True)]
    extra = derive.derive(recs)
    assert recs[3]["frac_ideal"] == pytest.approx(1.0 / 1.1)
    targets = {r["name"]: r for r in extra if r["workload"] == "target"}
    assert set(targets) == {"auto/torch(ring) fwd N=16k, 2 ranks: fraction of ideal",
                            "auto(ring, native) fwd N=16k causal, 2 ranks: fraction of ideal"}
    ideal = targets["auto/torch(ring) fwd N=16k, 2 ranks: fraction of ideal"]
    assert ideal["met"] and ideal["measured"] == pytest.approx(1.0 / 1.1) and ideal["goal"] == ">= 85%"
    causal = targets["auto(ring, native) fwd N=16k causal, 2 ranks: fraction of ideal"]
    assert causal["met"] and causal["goal"] == ">= 80%" and causal["measured"] == pytest.approx(1.2 / 1.4)
    strong = {r["engine"]: r for r in extra if r["workload"] == "scaling"}
    assert set(strong) == {"torch"} and strong["torch"]["speedup"] == pytest.approx(1.02 / 0.55)
    table = report.format_table(recs + extra)
    rows = [ln.split() for ln in table.splitlines()]
    labels = {(r[0], r[2]) for r in rows if len(r) > 3 and r[1] == "fwd"}
    assert {("auto/torch(ring)", "1"), ("auto/torch(ring)", "2"), ("torch", "1")} <= labels
    assert ("auto(ring,", "native)") in {(r[0], r[1]) for r in rows if len(r) > 3}
    assert "%idl" in table and " 91 " in table                       # auto/torch at P=2: 91 % of ideal


def test_old_records_load_with_todays_names(tmp_path):
    old = [dict(_att(impl="reference", time_s=4.0), suite="full"),
           dict(_att(time_s=2.0)),
           dict(workload="gemm_square", P=1, dtype="float32", device="cpu", status="ok", gflops_per_rank=100.0,
                measured_with="reference N=32768"),
           dict(workload="target", name="stale", goal="", measured=0, met=False, detail="")]
    for r in old:
        r.pop("engine", None)
    path = tmp_path / "old.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in old))
    recs = report.load([str(path)])
    dense = [r for r in recs if r.get("impl") == "dense"]
    assert len(dense) == 1 and not any(r.get("impl") == "reference" for r in recs)
    assert dense[0]["frac_ideal"] == pytest.approx(0.5)
    assert any(r.get("measured_with") == "dense N=32768" for r in recs)
    assert not any(r.get("name") == "stale" for r in recs)          # derived records are made anew
    assert "dense" in report.format_table(recs) and "reference" not in report.format_table(recs)


def test_committed_results_still_load():
    path = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "results.jsonl")
    if not os.path.exists(path):
        pytest.skip("no committed results in this checkout")
    recs = report.load([path])
    impls = {r.get("impl") for r in recs if r.get("workload") == "attention"}
    assert "dense" in impls and "reference" not in impls
    assert any("frac_ideal" in r for r in recs)
    assert "GEMM ceilings" in report.format_table(recs)


def test_plots_show_engines(tmp_path):
    pytest.importorskip("matplotlib")
    from mpiattn.bench import plot

    recs = []
    for N in (8192, 16384):
        scale = (N / 8192) ** 2
        recs += [_att(N=N, M=N, impl="torch", time_s=scale, peak_bytes=2**27, baseline_bytes=2**26),
                 _att(N=N, M=N, engine="torch", time_s=1.1 * scale, peak_bytes=2**27, baseline_bytes=2**26),
                 _att(N=N, M=N, engine="native", time_s=1.5 * scale, peak_bytes=2**27, baseline_bytes=2**26),
                 _att(N=N, M=N, engine="torch", P=2, time_s=0.6 * scale, peak_bytes=2**26, baseline_bytes=2**25)]
    recs += derive.derive(recs)
    written = plot.plot_all(recs, str(tmp_path))
    assert {os.path.basename(p) for p in written} == {"time_vs_n.png", "memory_vs_n.png", "scaling.png"}
    assert all(os.path.getsize(p) > 10000 for p in written)
