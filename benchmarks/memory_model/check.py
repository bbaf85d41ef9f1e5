"""The memory model against measured peaks (issue 27, item 4): resident-set growth per rank.

For every strategy at three sizes, forward and forward+backward, the benchmark
(``python -m mpiattn bench``, one fresh ``mpiexec`` job per case) measures the peak resident set
of each rank during the calls and records the library's prediction beside it
(:meth:`mpiattn.strategies.base.Strategy.memory` plus the inputs, ``est_bytes``); this script runs
it and prints, per case, the growth above the process's baseline (``peak_bytes - baseline_bytes``,
the busiest rank), the prediction and their ratio, then the worst ratio.

    python benchmarks/memory_model/check.py --out benchmarks/memory_model/results.jsonl

``--summarize FILE`` prints the table again from a results file.
"""

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
STRATEGIES = "ring,allgather,ulysses,double-ring,materialized,hybrid:1x2,hybrid:2x1"


def run(out: str, sizes: str, ranks: int) -> None:
    cmd = [sys.executable, "-m", "mpiattn", "bench", "--impl", STRATEGIES, "-n", sizes, "--ranks",
           str(ranks), "--passes", "fwd,fwdbwd", "--peers", "none", "--products", "none",
           "--repeat", "1", "--warmup", "0", "--heads", "4", "--head-dim", "64", "--json", out]
    subprocess.run(cmd, check=True)


def summarize(path: str) -> None:
    rows = [json.loads(line) for line in open(path) if line.strip()]
    rows = [r for r in rows if r.get("workload") == "attention" and r.get("status") == "ok"]
    print(f"{'strategy':<16} {'N':>6} {'pass':<7} {'growth MiB':>10} {'model MiB':>10} {'ratio':>6}")
    worst = []
    for r in rows:
        growth = (r["peak_bytes"] - r["baseline_bytes"]) / 2**20
        est = r["est_bytes"] / 2**20
        ratio = growth / est if est else float("nan")
        worst.append(abs(ratio - 1))
        print(f"{r.get('strategy_used', r['impl']):<16} {r['N']:>6} {r['pass']:<7} {growth:>10.1f} "
              f"{est:>10.1f} {ratio:>6.2f}")
    if worst:
        print(f"cases {len(worst)}; within 25 %: {sum(w <= 0.25 for w in worst)}; largest "
              f"deviation {max(worst):.0%}")


ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--out", default=os.path.join(HERE, "results.jsonl"))
ap.add_argument("--sizes", default="4k,8k,16k")
ap.add_argument("--ranks", type=int, default=2)
ap.add_argument("--summarize", metavar="FILE")
args = ap.parse_args()
if args.summarize:
    summarize(args.summarize)
else:
    if os.path.exists(args.out):
        os.remove(args.out)
    run(args.out, args.sizes, args.ranks)
    summarize(args.out)
