"""The benchmark application end to end: CLI, worker jobs, report, plots, GPU suite (tiny sizes).

Each test here launches processes itself, so it runs in the single-process
session only (``serial_only``).
"""

import ast
import glob
import json
import os
import sys

import pytest

from mpiattn.kernels import engines
from mpiattn.strategies import registry

from helpers import mpiexec, run_group

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _env(**extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MPIR_CVAR_ENABLE_HEAVY_YIELD="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, extra.pop("PYTHONPATH", ""), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def _py(*args, timeout=120, **env):
    return run_group([sys.executable, *args], timeout, env=_env(**env), cwd=REPO)


def test_cli_launches_workers_and_saved_results_report_and_plot(serial_only, tmp_path):
    out = tmp_path / "r.jsonl"
    rc, stdout, stderr = _py("-m", "mpiattn", "bench", "-n", "256", "--ranks", "1", "--peers", "gemm,dense",
                             "--products", "nn", "--product-n", "128", "--repeat", "1", "--warmup", "0",
                             "--gemm-size", "64", "--json", str(out), "--quiet")
    assert rc == 0, stdout + stderr
    recs = [json.loads(ln) for ln in out.read_text().splitlines()]
    assert any(r["workload"] == "env" and "blas" in r for r in recs)
    auto = [r for r in recs if r["workload"] == "attention" and r["impl"] == "auto"]
    assert {r["pass"] for r in auto} == {"fwd", "fwdbwd"} and all(r["fresh"] and r["status"] == "ok" for r in auto)
    assert {r["strategy_used"] for r in auto} == {"ring"}
    assert {r["impl"] for r in recs if r["workload"] == "attention"} == {"auto", "dense"}
    assert not any("frac_ideal" in r for r in recs)               # saved as measured, derived on loading
    from mpiattn.bench import report
    loaded = [r for r in report.load([str(out)]) if r["workload"] == "attention"]
    assert len(loaded) == 4 and all(r["frac_ideal"] > 0 and "frac_gemm_square" in r for r in loaded)
    assert any(r["workload"] == "product" and r["status"] == "ok" for r in recs)
    assert "GEMM ceilings" in stdout and "dense" in stdout

    rc, table, err = _py("-m", "mpiattn.bench.report", str(out))
    assert rc == 0, err
    assert "attention  float32" in table and "%idl" in table and "products" in table
    pytest.importorskip("matplotlib", reason="the plots need the bench extra (matplotlib)")
    rc, text, err = _py("-m", "mpiattn.bench.plot", str(out), str(tmp_path / "plots"))
    assert rc == 0, err
    assert "time_vs_n.png" in text and os.path.getsize(tmp_path / "plots" / "time_vs_n.png") > 10000


def test_help_and_listing(serial_only):
    rc, text, err = _py("-m", "mpiattn", "bench", "--help")
    assert rc == 0, err
    words = " ".join(text.split())                                   # help lines wrap with the terminal
    assert "--engines" in words and "dense (materialising, 1 process)" in words
    assert ", ".join(registry.NAMES) + ", hybrid:UxR splits" in words  # the registry's names
    rc, text, err = _py("-m", "mpiattn.bench", "--suite", "engines", "--list")
    assert rc == 0, err
    lines = text.splitlines()
    assert "auto/native N=16384 P=1 [engines]" in lines[0] and "auto/torch N=16384 P=1 [engines]" in lines[1]
    rc, text, err = _py("-m", "mpiattn", "bench", "--impl", "ulysses", "--ranks", "2", "--list")
    assert rc == 0 and "ulysses N=4096 P=2 [quick]  skipped: strategy 'ulysses' needs at least one query head per rank" in text, err
    rc, text, err = _py("-m", "mpiattn", "bench", "--engines", "fast", "--list")
    assert rc == 2 and f"'fast' is not one of {', '.join(engines.NAMES)}" in err


def test_importing_the_bench_loads_no_optional_library(serial_only):
    code = ("import sys; before = set(sys.modules); import mpiattn.bench, mpiattn.bench.app, mpiattn.bench.report; "
            "print(sorted(m for m in ('matplotlib', 'psutil', 'torch', 'cupy') if m in set(sys.modules) - before))")
    rc, text, err = _py("-c", code)
    assert rc == 0, err
    assert text.strip() == "[]"


def test_in_job_mode_under_mpiexec(serial_only):
    rc, text, err = run_group([mpiexec(), "-n", "2", sys.executable, "-m", "mpiattn", "bench", "-n", "256",
                               "--ranks", "2", "--peers", "none", "--products", "none", "--repeat", "1",
                               "--warmup", "0", "--passes", "fwd", "--quiet"], 180, env=_env(), cwd=REPO)
    assert rc == 0, text + err
    rows = [ln.split() for ln in text.splitlines() if ln.startswith("auto(ring, native)")]
    assert len(rows) == 1 and rows[0][2:5] == ["fwd", "2", "256"]


def test_gpu_suite_on_the_fake_cupy(serial_only, tmp_path):
    """The GPU suite's code paths on ``tests/fake_cupy.py`` (what ``jobs/gpu_check.sh --dry-run`` runs)."""
    rc, text, err = _py("-m", "mpiattn.bench.gpu", "--out", str(tmp_path), "--sizes", "256,512", "--dims", "16",
                        "--dtypes", "float32", "--block", "64", "--budget-s", "120", "--engines", "default,native",
                        "--gemm-size", "128", PYTHONPATH=os.path.join(REPO, "tests", "fake_site"), timeout=300)
    assert rc == 0, text + err
    recs = [json.loads(ln) for ln in (tmp_path / "gpu_bench.jsonl").read_text().splitlines()]
    env = [r for r in recs if r["workload"] == "env"]
    assert len(env) == 1 and env[0]["gpu"].startswith("fake GPU") and env[0]["transport"] == "staged"
    assert [r["workload"] for r in recs].count("fused") == 1      # (its fused kernels need a real GPU)
    timed = [r for r in recs if r["workload"] == "attention"]
    assert [(r["impl"], r["N"], r["engine"], r["pass"]) for r in timed] == [
        (impl, N, engine, p) for N in (256, 512) for impl, engine in (("auto", None), ("auto", "native"),
                                                                       ("torch", None)) for p in ("fwd", "fwdbwd")]
    for r in timed:
        if r["impl"] == "torch":          # torch on the fake GPU's (host) arrays, where it is installed
            assert r["status"] == "ok" or "torch not importable" in r["reason"], r
            continue
        assert r["status"] == "ok" and r["device"] == "gpu" and r["time_s"] > 0, r
        assert r["strategy_used"] == "ring" and r["gemm_square_gflops_here"] > 0 and r["repeat"] == (
            3 if r["N"] == 256 else 1)
        assert r["gemm_size"] == 128  # (--gemm-size: the ceiling's edge)
    assert "done in" in text
    rc, table, err = _py("-m", "mpiattn.bench.report", str(tmp_path / "gpu_bench.jsonl"))
    assert rc == 0 and "attention  float32  B=1 H=8 Hkv=8 E=16 Ev=16" in table and "gpu" in table, err


def test_gpu_suite_keeps_to_its_budget(serial_only, tmp_path):
    rc, text, err = _py("-m", "mpiattn.bench.gpu", "--out", str(tmp_path), "--sizes", "256", "--dims", "16",
                        "--dtypes", "float32", "--block", "64", "--no-torch", "--budget-s", "1",
                        PYTHONPATH=os.path.join(REPO, "tests", "fake_site"))
    assert rc == 0, text + err
    recs = [json.loads(ln) for ln in (tmp_path / "gpu_bench.jsonl").read_text().splitlines()]
    (case,) = [r for r in recs if r.get("impl") == "auto"]
    assert case["status"] == "skipped" and case["reason"].startswith("budget: ")


def test_only_the_entry_points_print():
    """The application prints; workloads, harness, launcher and report hand back records and text."""
    printing = set()
    for path in glob.glob(os.path.join(REPO, "mpiattn", "bench", "*.py")):
        tree = ast.parse(open(path).read())
        for fn in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.Module))]:
            body = fn.body if isinstance(fn, ast.FunctionDef) else [n for n in fn.body if not isinstance(
                n, (ast.FunctionDef, ast.ClassDef))]
            calls = [c for stmt in body for c in ast.walk(stmt) if isinstance(c, ast.Call)
                     and getattr(c.func, "id", None) == "print"]
            if calls:
                printing.add(f"{os.path.basename(path)}:{getattr(fn, 'name', '<module>')}")
    assert printing == {"app.py:run", "app.py:_print_list", "app.py:log", "report.py:main", "plot.py:main",
                        "gpu.py:main", "masks.py:main", "masks.py:emit",  # emit: nested in masks.main
                        "decode.py:main"}


def test_masks_suite_smoke(serial_only):
    """The masks suite runs end to end at a tiny size and reports its two targets."""
    import json
    import subprocess
    import sys
    p = subprocess.run([sys.executable, "-m", "mpiattn.bench.masks", "single", "--n", "1024", "--repeats", "1"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    records = [json.loads(line) for line in p.stdout.splitlines()]
    cases = [r["case"] for r in records if "case" in r]
    assert cases == ["causal", "window 1024,0", "documents mean 2048"]
    assert all(r["time_s"] > 0 for r in records if "case" in r)
    assert [r["target"] for r in records if "target" in r] == [
        "window / causal <= 0.15", "documents / (visible fraction * causal) <= 2.5"]
