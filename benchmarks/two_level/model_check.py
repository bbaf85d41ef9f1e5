"""The cost model against measured times on this machine: P = 2, 3, 4, flat and as 2 emulated nodes.

For each configuration it calibrates the allocation (``python -m mpiattn
calibrate``, every rank at once, so a shared machine's contention is in the
rates), then times the strategies and splits with the benchmark, which
records beside each time the model's prediction on that calibration
(``model_s``, ``$MPIATTN_MACHINE`` pointing at the file) and the bytes
sent between nodes, measured and predicted. Prints one line per case and
the median absolute relative error ``|model - measured| / measured``.

    python benchmarks/two_level/model_check.py --out benchmarks/two_level/results

Run it on an idle machine: it launches ``mpiexec`` jobs of up to 4 ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CONFIGS = [  # (P, emulated nodes, strategies)
    (2, 1, "ring,allgather,ulysses,double-ring,hybrid:1x2,hybrid:2x1"),
    (3, 1, "ring,allgather,double-ring,hybrid:1x3"),
    (4, 1, "ring,allgather,ulysses,double-ring,hybrid:1x4,hybrid:2x2,hybrid:4x1"),
    (4, 2, "ring,allgather,ulysses,double-ring,hybrid:1x4,hybrid:2x2,hybrid:4x1,hybrid:2x2:ring-first"),
]


def _read(path: str, nodes: int) -> list[dict]:
    """The timed records of one configuration that carry the model's prediction."""
    rows = []
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                r = json.loads(line)
                if r.get("status") == "ok" and "model_s" in r:
                    r["nodes"] = nodes
                    rows.append(r)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/two_level/results")
    ap.add_argument("--seq", default="8192,16384")
    ap.add_argument("--repeat", default="3")
    ap.add_argument("--only", default=None, help="run only configurations P:nodes, e.g. 4:2")
    ap.add_argument("--summarize", action="store_true",
                    help="run nothing: summarise the bench-P*-nodes*.jsonl files already in --out")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    rows = []
    for P, nodes, impls in CONFIGS:
        if args.only and f"{P}:{nodes}" not in args.only.split(","):
            continue
        out = os.path.join(args.out, f"bench-P{P}-nodes{nodes}.jsonl")
        if args.summarize:
            rows += _read(out, nodes)
            continue
        env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
        env.pop("MPIR_CVAR_ENABLE_HEAVY_YIELD", None)
        if P > (os.cpu_count() or 1):  # as the benchmark's launcher does: waiting ranks yield the core
            env["MPIR_CVAR_ENABLE_HEAVY_YIELD"] = "1"  # (it also slows MPICH's Alltoallv many times)
        env.pop("OPENBLAS_CORETYPE", None)
        env.pop("OPENBLAS_L2_SIZE", None)
        if nodes == 2:
            env["MPIR_CVAR_NUM_CLIQUES"] = "2"
        cal = os.path.join(args.out, f"machine-P{P}-nodes{nodes}.json")
        subprocess.run([mpiexec, "-n", str(P), sys.executable, "-m", "mpiattn", "calibrate", "-o", cal,
                        "--megabytes", "8", "--rows", "2048", "--heads", "4", "--dim", "64", "--name",
                        f"here-P{P}-nodes{nodes}"], env=env, check=True)
        env["MPIATTN_MACHINE"] = os.path.abspath(cal)
        if os.path.exists(out):
            os.unlink(out)
        subprocess.run([sys.executable, "-m", "mpiattn", "bench", "--ranks", str(P), "--impl", impls,
                        "-n", args.seq, "--heads", "8", "--head-dim", "64", "--dtype", "float32",
                        "--causal", "both", "--passes", "fwd,fwdbwd", "--repeat", args.repeat,
                        "--warmup", "1", "--peers", "none", "--allow-oversubscribe", "--json", out,
                        "--quiet"], env=env, check=True)
        rows += _read(out, nodes)
    errs = []
    print(f"{'P':>2} {'nodes':>5} {'strategy':<22} {'N':>6} {'causal':>6} {'pass':>6} {'measured s':>10} "
          f"{'model s':>9} {'error':>7} {'MiB betw.':>9} {'model':>7}")
    for r in rows:
        err = (r["model_s"] - r["time_s"]) / r["time_s"]
        errs.append(abs(err))
        print(f"{r['P']:>2} {r['nodes']:>5} {r.get('strategy_used') or r['impl']:<22} {r['N']:>6} "
              f"{str(r['causal']):>6} {r['pass']:>6} {r['time_s']:>10.4f} {r['model_s']:>9.4f} {err:>+7.1%} "
              f"{r['bytes_between_per_rank'] / 2**20:>9.2f} {r['model_bytes_between'] / 2**20:>7.2f}")
    if errs:
        print(f"{len(errs)} cases: median |error| {statistics.median(errs):.1%}, mean {statistics.mean(errs):.1%}, "
              f"max {max(errs):.1%}")
        for cfg in sorted({(r['P'], r['nodes']) for r in rows}):
            e = [abs((r["model_s"] - r["time_s"]) / r["time_s"]) for r in rows if (r["P"], r["nodes"]) == cfg]
            print(f"  P={cfg[0]} nodes={cfg[1]}: {len(e)} cases, median |error| {statistics.median(e):.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
