"""The cost model and ``auto`` checked by time on two real hosts (issue 30, item 4).

For each link rate it makes (or re-rates) the two-host cluster (``jobs/two_hosts.sh``, root),
calibrates it at 2 hosts x 2 ranks (``mpiattn calibrate`` through the cluster's ``mpiexec``),
then times every strategy and split, and ``auto``, with the benchmark launched on the cluster
(``mpiattn bench --mpiexec "jobs/two_hosts.sh mpiexec"``), which records beside each time the
cost model's prediction on that calibration (``$MPIATTN_MACHINE``) and the bytes sent between
nodes. Then it prints, from the records:

* every case: measured, predicted, the error ``(model - measured) / measured``;
* the median and largest absolute error, over all cases and per rate;
* per problem (rate, N, causal, pass): ``auto``'s plan and its time against the fastest
  measured plan (the target: within 1.15x);
* at each rate: where the model says ``hybrid`` or ``double-ring`` beats the flat ring, whether
  it did, and by how much against what the model said.

Full measurement (an idle machine; 38 minutes on a 2-core VM; root)::

    python benchmarks/two_hosts/measure.py --out benchmarks/two_hosts/results

A small run that only shows the script works (a few minutes)::

    python benchmarks/two_hosts/measure.py --out /tmp/two-hosts-small --rates 400mbit \\
        --seq 1024 --impl ring,hybrid:2x2,auto --repeat 1 --causal on --rows 256

``--summarize`` prints the tables again from the records in ``--out``. The cluster is removed
at the end unless ``--keep``. ``--remodel DIR`` (with ``--summarize``) prices every record again
with this checkout's cost model on ``DIR/machine-RATE.json`` (a newer calibration of the same
cluster) and lets ``auto`` choose again on it; the times are the records' own: ``auto``'s time
is then that of the plan it now picks, as measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from collections import defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
CLUSTER = os.path.join(ROOT, "jobs", "two_hosts.sh")
IMPLS = ("ring,double-ring,allgather,ulysses,hybrid:1x4,hybrid:2x2,hybrid:4x1,hybrid:2x2:ring-first,"
         "hybrid:1x4:ring-first,hybrid:4x1:ring-first,auto")
#: The fastest the veth pair reaches here is about 0.5-0.55 GB/s (TCP on a 2-core VM): 4gbit is it.
RATES = "400mbit,4gbit"


def _cluster(*args: str) -> None:
    subprocess.run(["bash", CLUSTER, *args], check=True)


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               MPIR_CVAR_ENABLE_HEAVY_YIELD="1",  # 4 ranks on 2 cores: waiting ranks yield the core
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    for var in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "MPIATTN_MACHINE"):
        env.pop(var, None)
    return env


def measure_rate(rate: str, args: argparse.Namespace) -> str:
    """Rate the link, calibrate, time; returns the records file."""
    _cluster("up", "--rate", rate)
    env = _env()
    cal = os.path.join(args.out, f"machine-{rate}.json")
    subprocess.run(["bash", CLUSTER, "mpiexec", "-per-host", "2", "-n", "4", sys.executable, "-m",
                    "mpiattn", "calibrate", "-o", cal, "--megabytes", "16", "--rows", str(args.rows),
                    "--heads", "4", "--dim", str(args.dim), "--name", f"two-hosts-{rate}"],
                   env=env, check=True)
    env["MPIATTN_MACHINE"] = os.path.abspath(cal)
    out = os.path.join(args.out, f"bench-{rate}.jsonl")
    if os.path.exists(out):
        os.unlink(out)
    subprocess.run([sys.executable, "-m", "mpiattn", "bench", "--ranks", "4", "--impl", args.impl,
                    "-n", args.seq, "--heads", str(args.heads), "--head-dim", str(args.dim),
                    "--dtype", "float32", "--causal", args.causal, "--passes", "fwd,fwdbwd",
                    "--repeat", str(args.repeat), "--warmup", "1", "--peers", "none",
                    "--allow-oversubscribe", "--mpiexec", f"bash {CLUSTER} mpiexec -per-host 2",
                    "--json", out, "--quiet"], env=env, check=True)
    return out


def read(out: str, rates: list[str]) -> list[dict]:
    """The timed records that carry the model's prediction, each with its rate."""
    rows = []
    for rate in rates:
        path = os.path.join(out, f"bench-{rate}.jsonl")
        if not os.path.exists(path):
            continue
        with open(path) as f:
            for line in f:
                r = json.loads(line)
                if r.get("status") == "ok" and "model_s" in r:
                    rows.append(dict(r, rate=rate, plan=r.get("strategy_used") or r["impl"]))
    return rows


def remodel(rows: list[dict], directory: str) -> list[dict]:
    """The records priced again with this checkout's model on ``directory``'s calibrations, and
    ``auto`` records re-planned (their time: the measured time of the plan now picked)."""
    import dataclasses

    from mpiattn.bench.memory import plan_call
    from mpiattn.bench.tasks import Task
    from mpiattn.comm.topology import Topology
    from mpiattn.strategies import machines, model

    topology = Topology.blocks(4, 2)
    names = {f.name for f in dataclasses.fields(Task)}
    measured = {(r["rate"], r["N"], r["causal"], r["pass"], r["plan"]): r["time_s"]
                for r in rows if r["impl"] != "auto"}
    out = []
    for r in rows:
        cal = os.path.abspath(os.path.join(directory, f"machine-{r['rate']}.json"))
        os.environ["MPIATTN_MACHINE"] = cal  # what plan_call's auto reads
        machine = machines.load(cal)
        t = Task.from_dict({k: v for k, v in r.items() if k in names})
        strategy, block = plan_call(t, 4, topology)
        pred = model.predict(strategy, t.spec(), topology, block, machine)
        new = dict(r, model_s=pred.forward_s if r["pass"] == "fwd" else pred.fwdbwd_s)
        if r["impl"] == "auto":
            new["plan"] = strategy.label
            new["time_s"] = measured.get((r["rate"], r["N"], r["causal"], r["pass"], strategy.label),
                                         r["time_s"])
        out.append(new)
    os.environ.pop("MPIATTN_MACHINE", None)
    return out


def _err(r: dict) -> float:
    return (r["model_s"] - r["time_s"]) / r["time_s"]


def summarize(rows: list[dict]) -> None:
    plans = [r for r in rows if r["impl"] != "auto"]
    print(f"{'rate':>8} {'plan':<22} {'N':>6} {'causal':>6} {'pass':>6} {'measured s':>10} {'model s':>9} "
          f"{'error':>7} {'MiB betw.':>9} {'model':>7}")
    for r in plans:
        print(f"{r['rate']:>8} {r['plan']:<22} {r['N']:>6} {str(r['causal']):>6} {r['pass']:>6} "
              f"{r['time_s']:>10.4f} {r['model_s']:>9.4f} {_err(r):>+7.1%} "
              f"{r['bytes_between_per_rank'] / 2**20:>9.2f} {r['model_bytes_between'] / 2**20:>7.2f}")
    if not plans:
        print("no records")
        return
    errs = [abs(_err(r)) for r in plans]
    worst = max(plans, key=lambda r: abs(_err(r)))
    print(f"\n{len(plans)} cases: median |error| {statistics.median(errs):.1%} (target <= 25 %), largest "
          f"{max(errs):.1%} ({worst['rate']} {worst['plan']} N={worst['N']} causal={worst['causal']} "
          f"{worst['pass']})")
    for rate in sorted({r["rate"] for r in plans}):
        e = [abs(_err(r)) for r in plans if r["rate"] == rate]
        print(f"  {rate}: {len(e)} cases, median |error| {statistics.median(e):.1%}, largest {max(e):.1%}")
    problems = defaultdict(list)
    for r in rows:
        problems[(r["rate"], r["N"], r["causal"], r["pass"])].append(r)
    print(f"\n{'rate':>8} {'N':>6} {'causal':>6} {'pass':>6} {'fastest measured':<22} {'s':>8} "
          f"{'auto picked':<22} {'s':>8} {'ratio':>6}")
    for key, rs in sorted(problems.items()):
        fixed = [r for r in rs if r["impl"] != "auto"]
        auto = next((r for r in rs if r["impl"] == "auto"), None)
        if not fixed or auto is None:
            continue
        best = min(fixed, key=lambda r: r["time_s"])
        same = next((r for r in fixed if r["plan"] == auto["plan"]), auto)  # its plan timed on its own
        ratio = min(auto["time_s"], same["time_s"]) / best["time_s"]
        print(f"{key[0]:>8} {key[1]:>6} {str(key[2]):>6} {key[3]:>6} {best['plan']:<22} {best['time_s']:>8.3f} "
              f"{auto['plan']:<22} {auto['time_s']:>8.3f} {ratio:>6.2f}" + ("" if ratio <= 1.15 else "  > 1.15"))
    print("\nwhere the model says a two-level plan beats the ring (model speedup -> measured):")
    for key, rs in sorted(problems.items()):
        ring = next((r for r in rs if r["plan"] == "ring" and r["impl"] != "auto"), None)
        if ring is None:
            continue
        for r in rs:
            if r["impl"] == "auto" or not (r["plan"].startswith("hybrid") or r["plan"] == "double-ring"):
                continue
            if r["plan"] == "hybrid:1x4" or r["model_s"] >= ring["model_s"]:
                continue
            print(f"  {key[0]:>8} N={key[1]} causal={key[2]} {key[3]}: {r['plan']} "
                  f"{ring['model_s'] / r['model_s']:.2f}x -> {ring['time_s'] / r['time_s']:.2f}x")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--rates", default=RATES, help=f"link rates, tc's syntax (default {RATES})")
    ap.add_argument("--seq", default="8192,16384")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--impl", default=IMPLS)
    ap.add_argument("--causal", default="both", choices=("on", "off", "both"))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--rows", type=int, default=2048, help="calibrate's attention-rate rows (default 2048)")
    ap.add_argument("--summarize", action="store_true", help="run nothing: the tables from --out")
    ap.add_argument("--keep", action="store_true", help="leave the cluster up at the end")
    ap.add_argument("--remodel", metavar="DIR", help="with --summarize: price the records again on "
                    "DIR/machine-RATE.json with this checkout's model (auto re-planned)")
    args = ap.parse_args()
    rates = args.rates.split(",")
    os.makedirs(args.out, exist_ok=True)
    if not args.summarize:
        try:
            for rate in rates:
                measure_rate(rate, args)
        finally:
            if not args.keep:
                _cluster("down")
    rows = read(args.out, rates)
    summarize(remodel(rows, args.remodel) if args.remodel else rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
