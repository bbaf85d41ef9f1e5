"""The benchmark application: options, presets, launching, and everything ``python -m mpiattn bench`` prints.

No arguments: a quick sweep (about a minute); ``--suite`` picks another preset
(:data:`mpiattn.bench.presets.SUITES`) and every option overrides it; ``--list``
shows the cases with their memory estimates. Started as one process it
launches a fresh ``mpiexec -n P`` job per case (:mod:`.launcher`), so each
case's peak memory is its own; under ``mpiexec`` (or ``--in-process``) it
runs the cases of that ``P`` in its own job (``"fresh": false``). Records are
JSON lines (``--json FILE``); the table (:mod:`.report`) and the plots
(``--plot DIR``, :mod:`.plot`) follow. How it measures: ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from typing import Any

from ..kernels import engines
from ..strategies import registry
from . import report
from ..comm.node import usable_cores
from .environment import available_memory, wait_idle
from .memory import estimate_bytes
from .presets import K, SUITES, build_tasks, plans_for
from .tasks import PASSES, PEERS, MiB, Settings, Task, is_configured

__all__ = ["add_arguments", "run", "main", "parse_count", "parse_size", "list_of", "positive", "choices",
           "engine_name"]


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
    try:
        value = float(m.group(1)) * 1024 ** "_kmgt".index((m.group(2) or "_").lower())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a memory size: {text!r} (use e.g. 512M, 20G)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"memory size must be positive: {text!r}")
    return int(value)


def list_of(conv: Any) -> Any:
    """An argparse type: a comma-separated list, each item converted by ``conv``."""
    def parse(text: str) -> list:
        items = [x.strip() for x in text.split(",") if x.strip()]
        if not items:
            raise argparse.ArgumentTypeError("empty list")
        return [conv(x) for x in items]
    return parse


def positive(text: str) -> int:
    """An argparse type: a count >= 1 (``4k`` = 4096)."""
    v = parse_count(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1: {text!r}")
    return v


def choices(allowed: tuple[str, ...]) -> Any:
    """A converter accepting one of ``allowed``."""
    def conv(x: str) -> str:
        if x not in allowed:
            raise argparse.ArgumentTypeError(f"{x!r} is not one of {', '.join(allowed)}")
        return x
    return conv


def strategy_name(x: str) -> str:
    """A strategy of the registry, ``auto``, or one with its configuration (``hybrid:2x2``)."""
    return x if is_configured(x) else choices(registry.NAMES)(x)


def engine_name(x: str) -> str | None:
    """An engine name of the registry; ``default`` = do not pass ``engine=`` (the library's default)."""
    return None if x == "default" else choices(engines.NAMES)(x)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the ``bench`` options on ``parser`` (a subcommand's parser)."""
    g = parser.add_argument_group("what to run")
    g.add_argument("--suite", default="quick", choices=sorted(SUITES),
                   help="preset (default quick, about a minute); the options below override it")
    g.add_argument("-n", "--seq", dest="n", type=list_of(positive), metavar="N[,N..]",
                   help="global sequence lengths N = M (4k = 4096)")
    g.add_argument("--ranks", type=list_of(positive), metavar="P[,P..]",
                   help="rank counts to launch (timings only up to the number of usable cores)")
    g.add_argument("--impl", type=list_of(strategy_name), metavar="S[,S..]",
                   help=f"mpiattn strategies to time: {', '.join(registry.NAMES)}, hybrid:UxR splits "
                        "(e.g. hybrid:1x4,hybrid:2x2,hybrid:4x1) (default auto)")
    g.add_argument("--engines", type=list_of(engine_name), metavar="E[,E..]",
                   help=f"engines, side by side: {', '.join(engines.NAMES)}, or default (engine= not passed)")
    g.add_argument("--peers", type=list_of(choices(("gemm", *PEERS, "none"))),
                   metavar="X[,X..]", help="side by side: gemm (ceilings), dense (materialising, 1 process), "
                                           "torch (scaled_dot_product_attention, 1 process), or none")
    g.add_argument("--passes", type=list_of(choices(PASSES)), metavar="fwd,fwdbwd")
    g.add_argument("--products", type=list_of(choices(("nt", "nn", "tn", "none"))), metavar="nt,nn,tn",
                   help="also time the sequence-sharded products (or none); nt at P >= 2 adds the ring-step "
                        "overlap")
    g.add_argument("--product-n", type=list_of(positive), metavar="N[,N..]")
    g.add_argument("--product-dim", type=positive, metavar="d")
    g.add_argument("--memory-curve", action="store_true", default=None,
                   help="find the largest N within --memory-cap per rank at each of --memory-ranks")
    g.add_argument("--memory-cap", type=parse_size, metavar="SIZE", help="per-rank cap of the curve (default 100M)")
    g.add_argument("--memory-ranks", type=list_of(positive), metavar="P[,P..]", help="default 1,2,4")
    s = parser.add_argument_group("problem")
    s.add_argument("--batch", type=positive, metavar="B")
    s.add_argument("--heads", type=positive, metavar="H")
    s.add_argument("--kv-heads", type=positive, metavar="Hkv", help="default H")
    s.add_argument("--head-dim", type=positive, metavar="E")
    s.add_argument("--v-dim", type=positive, metavar="Ev", help="default E")
    s.add_argument("--dtype", choices=("float16", "float32", "float64"))
    s.add_argument("--causal", choices=("off", "on", "both"))
    s.add_argument("--layout", choices=("contiguous", "zigzag"))
    s.add_argument("--block-size", dest="block", type=positive, metavar="T", help="default: the engine's preference")
    r = parser.add_argument_group("how")
    r.add_argument("--repeat", type=positive, help="timed repeats (median; at least 5 for reported numbers)")
    r.add_argument("--warmup", type=int, help="untimed full-size calls before them (default 1 up to N = 16k, "
                                              "0 above; a small warm-up problem always runs first)")
    r.add_argument("--max-memory", type=parse_size, metavar="SIZE",
                   help="per-rank limit: cases whose estimate exceeds it are skipped "
                        "(default 90%% of available memory / ranks)")
    r.add_argument("--gemm-size", type=positive, default=2048, metavar="S",
                   help="edge of the square GEMM ceiling (default 2048)")
    r.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    r.add_argument("--threads", type=positive, default=1, help="BLAS (and torch) threads per rank (default 1)")
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


# ----------------------------------------------------------------- printing
def describe(P: int, t: Task) -> str:
    """One line naming a case."""
    if t.workload == "attention":
        engine = f"/{t.engine}" if t.engine else ""
        return f"{t.impl}{engine} N={t.N} P={P}{' causal' if t.causal else ''}"
    if t.workload == "product":
        return f"matmul_{t.op} N={t.N} P={P}"
    if t.workload == "overlap":
        return f"overlap matmul_nt ring step N={t.N} P={P}"
    return f"{t.workload} P={P}"


def summary(recs: list[dict]) -> str:
    """What a case measured, in one line."""
    parts = []
    for r in recs:
        if r.get("workload") == "env" or "measured_with" in r:
            continue
        if r.get("status") != "ok":
            parts.append(f"{r.get('pass', '')} {r.get('status')}: {r.get('reason', '')}".strip())
        elif "time_s" in r:
            frac = f" ({r['gflops_per_rank'] / r['gemm_square_gflops_here']:.0%} of a GEMM right after)" \
                if r.get("gemm_square_gflops_here") else ""
            parts.append(f"{r.get('pass', '')} {r['time_s']:.3f} s{frac}".strip())
        elif "hidden" in r:
            parts.append(f"hidden fraction {r['hidden']:.2f}")
        elif "gflops_per_rank" in r:
            parts.append(f"{r.get('pass', '')} {r['gflops_per_rank']:.1f} GF/s/rank".strip())
    return "; ".join(parts)


def _print_list(tasks: list[tuple[int, Task]], curves: list) -> None:
    for P, t in tasks:
        est = ""
        if t.workload == "attention":
            try:
                est = "  est. " + ", ".join(f"{p} {estimate_bytes(t, P, p) / MiB:.0f} MiB" for p in t.passes) \
                    + " per rank above the baseline"
            except ValueError as exc:  # the strategy does not support the call
                est = f"  skipped: {exc}"
        print(f"{describe(P, t)} [{t.plan}]{est}")
    for plan in curves:
        print(f"memory curve: P={list(plan.memory_ranks)} cap {plan.memory_cap / MiB:.0f} MiB per rank")


# ----------------------------------------------------------------- the command
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


def run(args: argparse.Namespace, comm: Any = None) -> int:
    """Run the benchmark described by ``args`` (from :func:`add_arguments`); returns an exit code.

    Parameters
    ----------
    args : argparse.Namespace
    comm : mpi4py.MPI.Intracomm, optional
        Run in this job (every rank). Default: launch jobs when this is a
        single process, run in ``MPI.COMM_WORLD`` when started under mpiexec
        with several ranks or with ``--in-process``.

    Returns
    -------
    int
        0, or 1 when a case failed with an error.
    """
    if getattr(args, "worker", None):
        from . import worker
        return worker.main(args.worker)
    in_job = comm is not None or args.in_process or _launched_with_ranks()
    c = None
    if in_job:
        from ..comm import get_comm
        c = get_comm(comm)
    rank = c.rank if c is not None else 0
    t_start = time.time()

    def log(msg: str) -> None:
        if rank == 0 and not args.quiet:
            print(msg, file=sys.stderr, flush=True)

    plans = plans_for(args.suite, vars(args))
    tasks, curves = build_tasks(plans, args.device, args.check_finite, args.gemm_size)
    if args.list:
        if rank == 0:
            _print_list(tasks, curves)
        return 0
    cores = usable_cores()
    settings = Settings(seed=0, device=args.device, threads=args.threads, cores=cores, max_memory=args.max_memory)
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
        from .worker import run_in_job
        P = c.size
        mine = [t for p, t in tasks if p == P or (t.single_process and P == 1)]
        if len(mine) < len(tasks):
            log(f"mpiattn bench: running the {len(mine)} of {len(tasks)} cases that use P={P} in this job")
        if settings.max_memory is None:
            settings = settings.replace(max_memory=int(0.9 * available_memory() / c.node.local_size))
        run_in_job(c, mine, settings, save)
        if curves:
            log("mpiattn bench: the memory curve needs fresh jobs; run without mpiexec / --in-process for it")
    else:
        from .launcher import memory_curve, spawn
        allowed = []
        for P, t in tasks:
            if P * args.threads <= cores or args.allow_oversubscribe:
                allowed.append((P, t))
            else:
                log(f"skipping {describe(P, t)}: {P} ranks x {args.threads} thread(s) > {cores} usable cores "
                    "(timings would be meaningless; --allow-oversubscribe to force)")
        for i, (P, t) in enumerate(allowed):
            limit = args.max_memory or int(0.9 * available_memory() / P)
            waited, busy = wait_idle(args.wait_idle, cores) if args.wait_idle > 0 else (0.0, None)
            if waited > 30:
                log(f"    waited {waited:.0f} s for an idle machine (busy cores last: {busy:.2f})")
            recs = spawn(P, [t], settings.replace(fresh=True, max_memory=limit), log, args.mpiexec)
            for r in recs:
                r.update(idle_wait_s=round(waited, 1), busy_cores_before=busy)
            log(f"[{i + 1}/{len(allowed)}] {describe(P, t)}: {summary(recs)}")
            save(recs)
        for plan in curves:
            save(memory_curve(plan, settings, log, args.mpiexec))
    if rank != 0:
        return 0
    env = next((r for r in records if r.get("workload") == "env"), None)
    save(report.derive(records))
    print(report.format_table(records, env))
    print(f"\n(bench took {time.time() - t_start:.0f} s)")
    if args.plot:
        from . import plot
        for path in plot.plot_all(records, args.plot):
            log(f"wrote {path}")
    return 0 if not any(r.get("status") == "error" for r in records) else 1


def main(argv: list[str] | None = None) -> int:
    """``python -m mpiattn.bench [options]`` (the same options as ``python -m mpiattn bench``)."""
    parser = argparse.ArgumentParser(prog="python -m mpiattn.bench", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))
