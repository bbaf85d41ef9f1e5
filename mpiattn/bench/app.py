"""Benchmark mpiattn beside plain GEMMs, a materialising reference and PyTorch.

``python -m mpiattn bench`` (no arguments) runs a quick sweep (about a
minute); ``--suite`` picks larger ones (``issue3``, ``targets``, ``scaling``,
``strategies``, ``products``, ``memory``, ``full``) and every option below
overrides the suite's choice.

How it runs
-----------
Started as one process (``python -m mpiattn bench``), it launches a fresh
``mpiexec -n P python -m mpiattn.bench --worker FILE`` job for every case, so
that each case's peak resident memory (``ru_maxrss``) is its own, and so
that one command can sweep ``P``. Started under ``mpiexec -n P`` (or with
``--in-process``) it runs every case in that job at its ``P`` instead (then
memory high-waters accumulate across cases: marked ``"fresh": false``).

Each case's records are JSON lines (``--json FILE`` appends them); the table
at the end adds the fractions of the GEMM ceilings, strong and weak scaling,
the memory-per-rank curve and the targets (see :mod:`mpiattn.bench_report`);
``--plot DIR`` draws PNGs (:mod:`mpiattn.bench_plot`, needs matplotlib).

Timing rules: one BLAS thread per rank (``--threads``, passed to the workers
as OPENBLAS/OMP/MKL_NUM_THREADS), never more ranks than usable cores for
timings (larger ``P`` only for the memory curve, with
``MPIR_CVAR_ENABLE_HEAVY_YIELD=1``), median of ``--repeat`` (>= 5) runs after
``--warmup`` full-size runs and one small warm-up problem.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

from . import bench_report
from .bench_workloads import estimate_bytes

__all__ = ["add_arguments", "run", "SUITES", "parse_size", "parse_count"]

K = 1024
MiB = 2**20

#: Presets: each suite is a list of plans; explicit command-line options override every plan.
SUITES: dict[str, list[dict]] = {
    "quick": [dict(name="quick", n=[4 * K, 8 * K], ranks=[1, 2], impl=["ring"],
                   peers=["gemm", "reference", "torch"], peers_n=[4 * K], products=["nt", "nn", "tn"],
                   product_n=[4 * K])],
    "issue3": [dict(name="issue3", n=[16 * K, 32 * K, 64 * K], ranks=[1, 2], impl=["ring"],
                    peers=["gemm", "reference"])],
    "targets": [dict(name="targets", n=[32 * K, 64 * K], ranks=[1, 2], impl=["ring"],
                     peers=["gemm", "reference", "torch"], peers_n=[32 * K])],
    "scaling": [dict(name="scaling", n=[8 * K, 16 * K, 32 * K], ranks=[1, 2], impl=["ring"], peers=["gemm"])],
    "strategies": [dict(name="strategies", n=[8 * K], ranks=[2], heads=2, kv_heads=2,
                        impl=["ring", "allgather", "ulysses", "materialized"], peers=["gemm"]),
                   dict(name="causal", n=[16 * K], ranks=[1, 2], impl=["ring"], causal="on",
                        layout="zigzag", peers=["gemm"])],
    "products": [dict(name="products", n=[], ranks=[1, 2], products=["nt", "nn", "tn"],
                      product_n=[8 * K, 16 * K], peers=["gemm"])],
    "memory": [dict(name="memory", n=[], ranks=[], peers=[], memory_curve=True)],
}
#: Everything the committed results need (issue 3's table, the targets, scaling, strategies,
#: products, the memory curve) in one command that fits a 2-core, 24 GiB machine.
SUITES["full"] = [
    dict(name="issue3+targets", n=[16 * K, 32 * K, 64 * K], ranks=[1, 2], impl=["ring"],
         peers=["gemm", "reference", "torch"], peers_n=[16 * K, 32 * K]),
    *SUITES["strategies"], *SUITES["products"], *SUITES["memory"],
]

_PLAN_DEFAULTS = dict(n=[4 * K], ranks=[1], impl=["ring"], peers=["gemm"], peers_n=None, passes=["fwd", "fwdbwd"],
                      batch=1, heads=1, kv_heads=None, head_dim=64, v_dim=None, dtype="float32", causal="off",
                      layout="contiguous", block=None, repeat=5, warmup=None, products=[], product_n=[],
                      product_dim=64, memory_curve=False, memory_cap=100 * MiB, memory_ranks=[1, 2, 4],
                      memory_pass="fwdbwd")
#: With ``warmup=None``: one full-size warm-up call up to this N, none above (a call then lasts
#: seconds, and the small warm-up problem has already run in the same process).
WARMUP_FULL_MAX_N = 16 * K


# ----------------------------------------------------------------- argument types
def parse_count(text: str) -> int:
    """``"4096"``, ``"4k"``, ``"64K"`` -> int (k = 1024)."""
    m = re.fullmatch(r"\s*(\d+)\s*([kKmM]?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a count: {text!r} (use e.g. 4096, 32k)")
    return int(m.group(1)) * {"": 1, "k": K, "m": K * K}[m.group(2).lower()]


def parse_size(text: str) -> int:
    """``"512M"``, ``"20G"``, ``"1.5GiB"``, ``"123456"`` (bytes) -> bytes."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([kKmMgGtT]?)(i?[bB])?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a memory size: {text!r} (use e.g. 512M, 20G)")
    value = float(m.group(1)) * 1024 ** "_kmgt".index((m.group(2) or "_").lower())
    if value <= 0:
        raise argparse.ArgumentTypeError(f"memory size must be positive: {text!r}")
    return int(value)


def _list_of(conv: Any) -> Any:
    def parse(text: str) -> list:
        items = [x for x in text.split(",") if x.strip()]
        if not items:
            raise argparse.ArgumentTypeError("empty list")
        return [conv(x.strip()) for x in items]
    return parse


def _positive(text: str) -> int:
    v = parse_count(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1: {text!r}")
    return v


def _choices(allowed: tuple[str, ...]) -> Any:
    def conv(x: str) -> str:
        if x not in allowed:
            raise argparse.ArgumentTypeError(f"{x!r} is not one of {', '.join(allowed)}")
        return x
    return conv


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the ``bench`` options on ``parser`` (a subcommand's parser)."""
    g = parser.add_argument_group("what to run")
    g.add_argument("--suite", default="quick", choices=sorted(SUITES),
                   help="preset (default quick, about a minute); the options below override it")
    g.add_argument("-n", "--seq", dest="n", type=_list_of(_positive), metavar="N[,N..]",
                   help="global sequence lengths N = M (4k = 4096)")
    g.add_argument("--ranks", type=_list_of(_positive), metavar="P[,P..]",
                   help="rank counts to launch (timings only up to the number of usable cores)")
    g.add_argument("--impl", type=_list_of(_choices(("ring", "allgather", "ulysses", "materialized", "auto"))),
                   metavar="S[,S..]", help="mpiattn strategies to time")
    g.add_argument("--peers", type=_list_of(_choices(("gemm", "reference", "torch", "none"))),
                   metavar="X[,X..]", help="side by side: gemm (ceilings), reference (materialising, 1 process), "
                                           "torch (scaled_dot_product_attention, 1 process), or none")
    g.add_argument("--passes", type=_list_of(_choices(("fwd", "fwdbwd"))), metavar="fwd,fwdbwd")
    g.add_argument("--products", type=_list_of(_choices(("nt", "nn", "tn", "none"))), metavar="nt,nn,tn",
                   help="also time the sequence-sharded products (or none)")
    g.add_argument("--product-n", type=_list_of(_positive), metavar="N[,N..]")
    g.add_argument("--product-dim", type=_positive, metavar="d")
    g.add_argument("--memory-curve", action="store_true", default=None,
                   help="find the largest N within --memory-cap per rank at each of --memory-ranks")
    g.add_argument("--memory-cap", type=parse_size, metavar="SIZE", help="per-rank cap of the curve (default 100M)")
    g.add_argument("--memory-ranks", type=_list_of(_positive), metavar="P[,P..]", help="default 1,2,4")
    s = parser.add_argument_group("problem")
    s.add_argument("--batch", type=_positive, metavar="B")
    s.add_argument("--heads", type=_positive, metavar="H")
    s.add_argument("--kv-heads", type=_positive, metavar="Hkv", help="default H")
    s.add_argument("--head-dim", type=_positive, metavar="E")
    s.add_argument("--v-dim", type=_positive, metavar="Ev", help="default E")
    s.add_argument("--dtype", choices=("float16", "float32", "float64"))
    s.add_argument("--causal", choices=("off", "on", "both"))
    s.add_argument("--layout", choices=("contiguous", "zigzag"))
    s.add_argument("--block-size", dest="block", type=_positive, metavar="T", help="default: the library's (512)")
    r = parser.add_argument_group("how")
    r.add_argument("--repeat", type=_positive, help="timed repeats (median; at least 5 for reported numbers)")
    r.add_argument("--warmup", type=int, help="untimed full-size calls before them (default 1 up to N = 16k, "
                                              "0 above; a small warm-up problem always runs first)")
    r.add_argument("--max-memory", type=parse_size, metavar="SIZE",
                   help="per-rank limit: cases whose estimate exceeds it are skipped "
                        "(default 90%% of available memory / ranks)")
    r.add_argument("--gemm-size", type=_positive, default=2048, metavar="S",
                   help="edge of the square GEMM ceiling (default 2048)")
    r.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    r.add_argument("--threads", type=_positive, default=1, help="BLAS (and torch) threads per rank (default 1)")
    r.add_argument("--check-finite", action="store_true", help="keep the NaN/Inf input check in timed calls")
    r.add_argument("--in-process", action="store_true", help="run in this MPI job instead of launching jobs")
    r.add_argument("--mpiexec", metavar="CMD", help="launcher (default: mpiexec beside python, else on PATH)")
    r.add_argument("--wait-idle", type=float, default=0.0, metavar="SECONDS",
                   help="before each case, wait up to this long for the machine to be idle (shared machines)")
    r.add_argument("--allow-oversubscribe", action="store_true",
                   help="time with more ranks than usable cores (numbers are then not meaningful)")
    o = parser.add_argument_group("output")
    o.add_argument("--json", metavar="FILE", help="append every record as a JSON line")
    o.add_argument("--plot", metavar="DIR", help="write PNG plots there (needs matplotlib)")
    o.add_argument("--quiet", "-q", action="store_true", help="print only the table")
    o.add_argument("--list", action="store_true", help="list the cases (with memory estimates) and exit")
    parser.add_argument("--worker", metavar="FILE", help=argparse.SUPPRESS)


# ----------------------------------------------------------------- plans -> tasks
def _plans(args: argparse.Namespace) -> list[dict]:
    plans = []
    explicit = {k: getattr(args, k) for k in _PLAN_DEFAULTS if getattr(args, k, None) is not None}
    for preset in SUITES[args.suite]:
        plan = dict(_PLAN_DEFAULTS, **preset)
        plan.update(explicit)
        if "n" in explicit:   # the user's sizes also apply where the suite had no attention runs
            plan["peers_n"] = None
        plans.append(plan)
    return plans


def _attention_base(plan: dict, N: int, causal: bool, device: str, check_finite: bool) -> dict:
    H = plan["heads"]
    E = plan["head_dim"]
    return dict(workload="attention", B=plan["batch"], H=H, Hkv=plan["kv_heads"] or H, N=N, M=N, E=E,
                Ev=plan["v_dim"] or E, dtype=plan["dtype"], causal=causal, layout=plan["layout"],
                block=plan["block"], passes=list(plan["passes"]), repeat=plan["repeat"],
                warmup=plan["warmup"] if plan["warmup"] is not None else int(N <= WARMUP_FULL_MAX_N),
                device=device, check_finite=check_finite, plan=plan["name"])


def build_tasks(args: argparse.Namespace) -> tuple[list[tuple[int, dict]], list[dict]]:
    """``[(P, task), ...]`` to run, and the memory-curve plans.

    With the ``gemm`` peer every attention task measures its GEMM ceilings
    itself, in the same process right after its timings, so that a change
    of load on the machine cannot skew the fractions.
    """
    tasks: list[tuple[int, dict]] = []
    curves = []
    for plan in _plans(args):
        peers = [p for p in plan["peers"] if p != "none"]
        causals = {"off": [False], "on": [True], "both": [False, True]}[plan["causal"]]
        for N in plan["n"]:
            for causal in causals:
                base = dict(_attention_base(plan, N, causal, args.device, args.check_finite),
                            ceilings="gemm" in peers, gemm_size=args.gemm_size)
                for P in plan["ranks"]:
                    for impl in plan["impl"]:
                        tasks.append((P, dict(base, impl=impl)))
                if plan["peers_n"] is None or N in plan["peers_n"]:
                    for peer in ("reference", "torch"):
                        if peer in peers:
                            tasks.append((1, dict(base, impl=peer)))
        ops = [o for o in plan["products"] if o != "none"]
        for N in plan["product_n"] if ops else []:
            for P in plan["ranks"]:
                for op in ops:
                    tasks.append((P, dict(workload="product", op=op, N=N, M=N, d=plan["product_dim"],
                                          dtype=plan["dtype"], layout=plan["layout"], block=plan["block"],
                                          repeat=plan["repeat"], warmup=1 if plan["warmup"] is None
                                          else plan["warmup"], device=args.device, plan=plan["name"])))
        if plan["memory_curve"]:
            curves.append(plan)
    return tasks, curves


# ----------------------------------------------------------------- launching
def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _available_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            info = dict(ln.split(":", 1) for ln in f)
        return int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return 8 * 2**30


def _launcher(args: argparse.Namespace) -> list[str]:
    if args.mpiexec:
        return shlex.split(args.mpiexec)
    local = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return [local if os.path.exists(local) else (shutil.which("mpiexec") or shutil.which("mpirun") or "mpiexec")]


_MPI_ENV = re.compile(r"^(PMI_|PMIX_|HYDRA_|MPI_LOCAL|OMPI_COMM_WORLD|OMPI_UNIVERSE|OMPI_MCA_ess|OMPI_MCA_pmix|"
                      r"OMPI_MCA_orte|OMPI_FILE_LOCATION|OMPI_APP_CTX|OMPI_FIRST_RANKS|PRTE_|I_MPI_HYDRA)")


def _worker_env(args: argparse.Namespace, P: int) -> dict:
    """The parent's environment without its own MPI job's variables, with the thread counts set."""
    env = {k: v for k, v in os.environ.items() if not _MPI_ENV.match(k)}
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env[var] = str(args.threads)
    if P * args.threads > _usable_cores():
        env["MPIR_CVAR_ENABLE_HEAVY_YIELD"] = "1"   # waiting MPICH ranks yield the core
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _spawn(args: argparse.Namespace, P: int, tasks: list[dict], cfg: dict, log: Any) -> list[dict]:
    """Run ``tasks`` in one fresh ``mpiexec -n P`` job; its records (or one error record per task)."""
    with tempfile.TemporaryDirectory(prefix="mpiattn-bench-") as tmp:
        cfg_path, out_path = os.path.join(tmp, "cfg.json"), os.path.join(tmp, "out.jsonl")
        with open(cfg_path, "w") as f:
            json.dump(dict(cfg, tasks=tasks, out=out_path), f)
        cmd = _launcher(args) + ["-n", str(P), sys.executable, "-m", "mpiattn.bench", "--worker", cfg_path]
        try:
            proc = subprocess.run(cmd, env=_worker_env(args, P), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, timeout=cfg.get("timeout", 4 * 3600))
            text, code = proc.stdout, proc.returncode
        except (OSError, subprocess.TimeoutExpired) as exc:
            text, code = str(exc), -1
        records = []
        if os.path.exists(out_path):
            with open(out_path) as f:
                records = [json.loads(ln) for ln in f if ln.strip()]
        if code != 0:
            tail = " | ".join(text.strip().splitlines()[-6:])
            log(f"    worker failed (exit {code}): {tail}")
            done = len([r for r in records if r.get("workload") != "env"])
            if done == 0:
                records += [dict(t, P=P, status="error", reason=f"worker exit {code}: {tail[-300:]}") for t in tasks]
        return records


def _cpu_ticks() -> tuple[int, int] | None:
    """(busy, total) jiffies of all CPUs from /proc/stat (None where unreadable)."""
    try:
        with open("/proc/stat") as f:
            vals = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
    total = sum(vals[:8])
    return total - idle, total


def _wait_idle(limit_s: float, cores: int, log: Any) -> tuple[float, float | None]:
    """Wait (at most ``limit_s``) until other processes use under 0.2 cores for 3 s in a row.

    Returns the seconds waited and the busy cores seen last (None without /proc/stat).
    """
    t0 = time.time()
    calm, busy = 0, None
    prev = _cpu_ticks()
    while prev is not None and time.time() - t0 < limit_s:
        time.sleep(1.0)
        now = _cpu_ticks()
        if now is None or now[1] == prev[1]:
            break
        busy = cores * (now[0] - prev[0]) / (now[1] - prev[1])
        prev = now
        calm = calm + 1 if busy < 0.2 else 0
        if calm >= 3:
            break
    waited = time.time() - t0
    if waited > 30:
        log(f"    waited {waited:.0f} s for an idle machine (busy cores last: {busy:.2f})")
    return waited, busy


# ----------------------------------------------------------------- the worker
def _device_module(c: Any, device: str) -> Any:
    """numpy, or cupy with one GPU bound to this rank (:func:`mpiattn.gpu.bind_device`)."""
    import numpy as np

    if device == "cpu":
        return np
    from . import gpu

    gpu.bind_device(c)
    import cupy

    return cupy


def run_in_job(c: Any, tasks: list[dict], cfg: dict, emit: Any) -> None:
    """Run ``tasks`` on every rank of ``c`` (the worker's loop); ``emit(records)`` is called on every rank."""
    from .bench_workloads import MemoryMeter, environment, run_task

    xp = _device_module(c, cfg.get("device", "cpu"))
    mem = MemoryMeter(xp)
    emit([dict(workload="env", P=c.size, **environment())])
    oversub = c.size * int(cfg.get("threads", 1)) > int(cfg.get("cores", _usable_cores()))
    for t in tasks:
        with c.abort_on_error():
            recs = run_task(c, xp, t, cfg, mem)
        for rec in recs:
            rec.setdefault("P", c.size)
            rec["fresh"] = bool(cfg.get("fresh", False))
            if oversub and rec.get("workload") != "env":
                rec["oversubscribed"] = True
        emit(recs)


def _worker_main(path: str) -> int:
    from mpi4py import MPI

    from .comm import get_comm

    with open(path) as f:
        cfg = json.load(f)
    c = get_comm(MPI.COMM_WORLD)
    out = open(cfg["out"], "a") if c.rank == 0 else None

    def emit(records: list[dict]) -> None:
        if out is not None:
            for r in records:
                out.write(json.dumps(r) + "\n")
            out.flush()

    try:
        run_in_job(c, cfg["tasks"], cfg, emit)
    finally:
        if out is not None:
            out.close()
    return 0


# ----------------------------------------------------------------- memory curve
def _largest_n(task: dict, P: int, budget: int, grain: int) -> int:
    """Largest multiple of ``grain`` whose estimate fits ``budget`` bytes per rank (0 if none)."""
    lo, hi = 0, grain
    while estimate_bytes(dict(task, N=hi, M=hi), P, task["passes"][0]) <= budget and hi < 2**31:
        lo, hi = hi, hi * 2
    while hi - lo > grain:
        mid = (lo + hi) // 2 // grain * grain
        if estimate_bytes(dict(task, N=mid, M=mid), P, task["passes"][0]) <= budget:
            lo = mid
        else:
            hi = mid
    return lo


def _memory_curve(args: argparse.Namespace, plan: dict, cfg: dict, log: Any) -> list[dict]:
    cap = plan["memory_cap"]
    out = []
    for P in plan["memory_ranks"]:
        probe = _spawn(args, P, [dict(workload="baseline", dtype=plan["dtype"], B=plan["batch"],
                                      H=plan["heads"], Hkv=plan["kv_heads"] or plan["heads"],
                                      E=plan["head_dim"], Ev=plan["v_dim"] or plan["head_dim"],
                                      causal=False, layout=plan["layout"], block=plan["block"])],
                       dict(cfg, fresh=True, max_memory=None), log)
        base = next((r["baseline_bytes"] for r in probe if r.get("workload") == "baseline" and r.get("status") == "ok"),
                    None)
        if base is None:
            out.append(dict(workload="memory_curve", P=P, cap_bytes=cap, status="baseline probe failed"))
            continue
        task = dict(_attention_base(plan, 0, False, args.device, False), impl="ring", passes=[plan["memory_pass"]],
                    repeat=1, warmup=0, plan="memory")
        grain = 256 * P
        N_est = N = _largest_n(task, P, cap - base, grain)
        rec = dict(workload="memory_curve", P=P, cap_bytes=cap, baseline_bytes=base, N_estimate=N_est,
                   pass_=plan["memory_pass"], status="no N fits the cap")
        for attempt in range(4):
            if N <= 0:
                break
            log(f"  memory curve P={P}: trying N={N} (estimate {(base + estimate_bytes(dict(task, N=N, M=N), P, task['passes'][0])) / MiB:.0f} MiB, cap {cap / MiB:.0f} MiB)")
            recs = _spawn(args, P, [dict(task, N=N, M=N)], dict(cfg, fresh=True, max_memory=None), log)
            run = next((r for r in recs if r.get("workload") == "attention" and r.get("status") == "ok"
                        and r.get("pass") == plan["memory_pass"]), None)
            if run is None:
                rec["status"] = "verifying run failed"
                break
            peak = run["peak_bytes"]
            rec.update(N_verified=N, peak_bytes=peak, run_baseline_bytes=run["baseline_bytes"],
                       attempts=attempt + 1)
            if peak <= cap:
                rec["status"] = "ok"
                break
            scale = (cap - run["baseline_bytes"]) / max(1, peak - run["baseline_bytes"])
            N = int(N * min(0.98, scale * 0.98)) // grain * grain
            rec["status"] = "over the cap"
        out.append(rec)
    return out


# ----------------------------------------------------------------- the command
def _describe(P: int, t: dict) -> str:
    if t["workload"] == "attention":
        return f"{t['impl']} N={t['N']} P={P}{' causal' if t['causal'] else ''}"
    if t["workload"] == "product":
        return f"matmul_{t['op']} N={t['N']} P={P}"
    return f"{t['workload']} P={P}"


def _summary(recs: list[dict]) -> str:
    parts = []
    for r in recs:
        if r.get("workload") == "env" or "measured_with" in r:
            continue
        if r.get("status") != "ok":
            parts.append(f"{r.get('pass', '')} {r.get('status')}: {r.get('reason', '')}")
        elif "time_s" in r:
            frac = f" ({r['gflops_per_rank'] / r['gemm_square_gflops_here']:.0%} of a GEMM right after)" \
                if r.get("gemm_square_gflops_here") else ""
            parts.append(f"{r.get('pass', '')} {r['time_s']:.3f} s{frac}".strip())
        elif "gflops_per_rank" in r:
            parts.append(f"{r.get('pass', '')} {r['gflops_per_rank']:.1f} GF/s/rank".strip())
    return "; ".join(parts)


def run(args: argparse.Namespace, comm: Any = None) -> int:
    """Run the benchmark described by ``args`` (from :func:`add_arguments`); returns an exit code.

    Parameters
    ----------
    args : argparse.Namespace
    comm : mpi4py.MPI.Intracomm, optional
        Run in this job (every rank). Default: launch jobs when this is a
        single process, run in ``MPI.COMM_WORLD`` when started under mpiexec
        with several ranks or with ``--in-process``.
    """
    if getattr(args, "worker", None):
        return _worker_main(args.worker)
    in_job = comm is not None or args.in_process or _launched_with_ranks()
    rank = 0
    c = None
    if in_job:
        from .comm import get_comm
        c = get_comm(comm)
        rank = c.rank
    t_start = time.time()

    def log(msg: str) -> None:
        if rank == 0 and not args.quiet:
            print(msg, file=sys.stderr, flush=True)

    tasks, curves = build_tasks(args)
    cores = _usable_cores()
    if args.list:
        if rank == 0:
            for P, t in tasks:
                est = ""
                if t["workload"] == "attention":
                    est = "  est. " + ", ".join(f"{p} {estimate_bytes(t, P, p) / MiB:.0f} MiB"
                                                for p in t["passes"]) + " per rank above the baseline"
                print(f"{_describe(P, t)} [{t.get('plan')}]{est}")
            for plan in curves:
                print(f"memory curve: P={plan['memory_ranks']} cap {plan['memory_cap'] / MiB:.0f} MiB per rank")
        return 0
    cfg = dict(seed=0, device=args.device, threads=args.threads, torch_threads=args.threads, cores=cores,
               max_memory=args.max_memory)
    records: list[dict] = []
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S")

    def save(recs: list[dict]) -> None:
        """Keep ``recs`` and append them to --json at once (a long run keeps what it measured)."""
        for r in recs:
            r.setdefault("run", stamp)
            r.setdefault("suite", args.suite)
        records.extend(recs)
        if args.json and rank == 0:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "a") as f:
                for r in recs:
                    f.write(json.dumps(r) + "\n")

    if in_job:
        P = c.size
        mine = [t for p, t in tasks if p == P or (t.get("impl") in ("reference", "torch") and P == 1)]
        if len(mine) < len(tasks):
            log(f"mpiattn bench: running the {len(mine)} of {len(tasks)} cases that use P={P} in this job")
        if cfg["max_memory"] is None:
            cfg["max_memory"] = int(0.9 * _available_memory() / _local_size(c))
        run_in_job(c, mine, dict(cfg, fresh=False), save)
        if curves:
            log("mpiattn bench: the memory curve needs fresh jobs; run without mpiexec / --in-process for it")
    else:
        tasks = [(P, t) for P, t in tasks if _allowed(args, P, t, cores, log)]
        for i, (P, t) in enumerate(tasks):
            limit = args.max_memory or int(0.9 * _available_memory() / P)
            waited, busy = _wait_idle(args.wait_idle, cores, log) if args.wait_idle > 0 else (0.0, None)
            recs = _spawn(args, P, [t], dict(cfg, fresh=True, max_memory=limit), log)
            for r in recs:
                r.update(idle_wait_s=round(waited, 1), busy_cores_before=busy)
            log(f"[{i + 1}/{len(tasks)}] {_describe(P, t)}: {_summary(recs)}")
            save(recs)
        for plan in curves:
            save(_memory_curve(args, plan, cfg, log))
    if rank != 0:
        return 0
    env = next((r for r in records if r.get("workload") == "env"), None)
    save(bench_report.derive(records))
    print(bench_report.format_table(records, env))
    print(f"\n(bench took {time.time() - t_start:.0f} s)")
    if args.plot:
        from . import bench_plot
        for path in bench_plot.plot_all(records, args.plot):
            log(f"wrote {path}")
    return 0 if not any(r.get("status") == "error" for r in records) else 1


def _launched_with_ranks() -> bool:
    """True when this process is one of several MPI ranks (without initialising MPI to find out)."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        return mpi.COMM_WORLD.Get_size() > 1
    for var in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS", "SLURM_STEP_NUM_TASKS"):
        v = os.environ.get(var)
        if v and v.isdigit() and int(v) > 1:
            return True
    return False


def _local_size(c: Any) -> int:
    from mpi4py import MPI

    local = c.mpi.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return local.Get_size()
    finally:
        local.Free()


def _allowed(args: argparse.Namespace, P: int, t: dict, cores: int, log: Any) -> bool:
    if P * args.threads <= cores or args.allow_oversubscribe:
        return True
    log(f"skipping {_describe(P, t)}: {P} ranks x {args.threads} thread(s) > {cores} usable cores "
        "(timings would be meaningless; --allow-oversubscribe to force)")
    return False


def _main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mpiattn.bench", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(_main())
