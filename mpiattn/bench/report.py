"""Turn ``mpiattn bench`` records into derived numbers and a readable table.

Input: the JSON-ready records of :mod:`mpiattn.bench_workloads` (one dict per
measurement). :func:`derive` adds, without running anything:

* ``frac_gemm_square`` and ``frac_gemm_tile`` on every timed attention record:
  its GFLOP/s per rank over the GEMM ceilings measured in the same run at the
  same ``P`` (every rank multiplying at once): a large square GEMM (the
  machine's ceiling) and GEMMs of attention's own tile shapes;
* ``scaling`` records: strong scaling (same ``N``, ``P`` ranks vs one: speedup
  and efficiency) and weak scaling (``N`` proportional to ``P``: per-rank
  GFLOP/s relative to one rank);
* ``target`` records: the goals of the benchmark issue, measured vs wanted
  (reported, never asserted).

:func:`format_table` renders everything for a terminal.
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any, Iterable

__all__ = ["tile_key", "derive", "format_table", "load", "TARGET_N", "MEMORY_N"]

MiB = 2**20
#: Problem of the speed targets: N = 32k, B = H = 1, E = Ev = 64, float32, not causal.
TARGET_N = 32768
#: Sequence length of the memory target.
MEMORY_N = 65536
_SHAPE_KEYS = ("B", "H", "Hkv", "E", "Ev", "dtype", "causal", "layout", "block", "device")
_CASE = ("workload", "impl", "pass", "op", "N", "P", "measured_with") + _SHAPE_KEYS


def load(paths: Iterable[str]) -> list[dict]:
    """Measured records of JSON-lines files, the last of each case kept, derived records made anew.

    Later runs replace earlier ones case by case; ``scaling`` and ``target``
    records in the files are dropped and recomputed by :func:`derive` (so
    results of several runs combine).
    """
    latest: dict[tuple, dict] = {}
    for path in paths:
        with open(path) as f:
            for line in f:
                if line.strip():
                    r = json.loads(line)
                    if r.get("workload") in ("scaling", "target"):
                        continue
                    latest[tuple(str(r.get(k)) for k in _CASE)] = r
    records = list(latest.values())
    return records + derive(records)


def tile_key(t: dict, P: int) -> tuple:
    """Key of the tile-GEMM ceiling that applies to attention task ``t`` at ``P`` ranks."""
    T = int(t.get("block") or 512)
    single = t.get("impl") in ("reference", "torch")
    n = t["N"] if single else -(-t["N"] // P)
    m = t["M"] if single else -(-t["M"] // P)
    return (P, t["dtype"], t["B"], t["Hkv"], t["H"] // t["Hkv"], t["E"], t["Ev"], min(T, n), min(T, m),
            t.get("device", "cpu"))


def _ok(r: dict) -> bool:
    return r.get("status") == "ok"


def _timed(r: dict) -> bool:
    return _ok(r) and r.get("workload") == "attention" and "time_s" in r


def derive(records: list[dict]) -> list[dict]:
    """Add ceiling fractions to attention records; return scaling and target records.

    The ceilings are the best GFLOP/s per rank measured anywhere in the
    records for the same ``P`` (and tile shape): load from other work on the
    machine only ever lowers a GEMM's rate, so the best one is the closest
    to the machine's, and a fraction of it never flatters attention.

    Parameters
    ----------
    records : list of dict
        All records of a run (modified in place: ``frac_gemm_square``,
        ``frac_gemm_tile``, ``gemm_square_gflops``, ``gemm_tile_gflops``).

    Returns
    -------
    list of dict
        New ``scaling`` and ``target`` records.
    """
    best: dict[tuple, float] = {}
    for r in records:
        if not _ok(r) or r.get("workload") not in ("gemm_square", "gemm_tile"):
            continue
        if r["workload"] == "gemm_square":
            key: tuple = ("square", r["P"], r["dtype"], r.get("device", "cpu"))
        else:
            key = ("tile", tuple(r["tile_key"]), r["pass"])
        for clock, field in (("wall", "gflops_per_rank"), ("cpu", "gflops_per_rank_cpu")):
            if r.get(field):
                best[key + (clock,)] = max(best.get(key + (clock,), 0.0), r[field])
    for r in records:
        if not _timed(r):
            continue
        keys = {"square": ("square", r["P"], r["dtype"], r.get("device", "cpu")),
                "tile": ("tile", tuple(tile_key(r, r["P"])), r["pass"])}
        for kind, key in keys.items():
            for clock, field, suffix in (("wall", "gflops_per_rank", ""), ("cpu", "gflops_per_rank_cpu", "_cpu")):
                ceiling = best.get(key + (clock,))
                if ceiling and r.get(field):
                    r[f"gemm_{kind}_gflops{suffix}"] = ceiling
                    r[f"frac_gemm_{kind}{suffix}"] = r[field] / ceiling
    return _scaling(records) + _targets(records)


def _group_key(r: dict) -> tuple:
    return (r["impl"], r["pass"]) + tuple(r.get(k) for k in _SHAPE_KEYS)


def _scaling(records: list[dict]) -> list[dict]:
    out = []
    by_group: dict[tuple, dict[tuple[int, int], dict]] = {}
    for r in records:
        if _timed(r) and not r.get("oversubscribed") and r["impl"] not in ("reference", "torch"):
            by_group.setdefault(_group_key(r), {})[(r["N"], r["P"])] = r
    for key, runs in by_group.items():
        impl, pass_ = key[0], key[1]
        for (N, P), r in sorted(runs.items()):
            one = runs.get((N, 1))
            if P > 1 and one:
                s = one["time_s"] / r["time_s"]
                out.append(dict(workload="scaling", kind="strong", impl=impl, **{"pass": pass_}, N=N, P=P,
                                time_1_s=one["time_s"], time_P_s=r["time_s"], speedup=s, efficiency=s / P,
                                **{k: r.get(k) for k in _SHAPE_KEYS}))
            if P > 1 and N % P == 0 and (N // P, 1) in runs:
                base = runs[(N // P, 1)]
                eff = r["gflops_per_rank"] / base["gflops_per_rank"]
                out.append(dict(workload="scaling", kind="weak", impl=impl, **{"pass": pass_}, N=N, P=P,
                                N_1=N // P, time_1_s=base["time_s"], time_P_s=r["time_s"], efficiency=eff,
                                **{k: r.get(k) for k in _SHAPE_KEYS}))
    return out


def _is_target_shape(r: dict, N: int) -> bool:
    return (r["N"] == N and r["M"] == N and r["B"] == 1 and r["H"] == 1 and r["Hkv"] == 1
            and r["E"] == 64 and r["Ev"] == 64 and r["dtype"] == "float32" and not r["causal"])


def _target(name: str, goal: str, measured: float | None, met: bool | None, detail: str,
            measured_cpu: float | None = None, met_cpu: bool | None = None) -> dict:
    return dict(workload="target", name=name, goal=goal, measured=measured, met=met, detail=detail,
                measured_cpu=measured_cpu, met_cpu=met_cpu)


def _cpu_ratio(a: dict, b: dict, field: str = "time_cpu_s") -> float | None:
    return a[field] / b[field] if a.get(field) and b.get(field) else None


def _targets(records: list[dict]) -> list[dict]:
    def find(impl: str, pass_: str, P: int, N: int = TARGET_N) -> dict | None:
        hits = [r for r in records if _timed(r) and r["impl"] == impl and r["pass"] == pass_
                and r["P"] == P and _is_target_shape(r, N) and not r.get("oversubscribed")]
        return hits[-1] if hits else None

    out = []
    for pass_, goal in (("fwd", 0.60), ("fwdbwd", 0.50)):
        r = find("ring", pass_, 1)
        if r and "frac_gemm_square" in r:
            tile = r.get("frac_gemm_tile")
            fc = r.get("frac_gemm_square_cpu")
            out.append(_target(f"ring {pass_} N=32k, 1 rank: fraction of GEMM ceiling", f">= {goal:.0%}",
                               r["frac_gemm_square"], r["frac_gemm_square"] >= goal,
                               f"{r['gflops_per_rank']:.1f} GFLOP/s vs square GEMM "
                               f"{r['gemm_square_gflops']:.1f}"
                               + (f"; {tile:.0%} of the tile-shaped GEMMs ({r['gemm_tile_gflops']:.1f})"
                                  if tile else ""), fc, None if fc is None else fc >= goal))
    for pass_ in ("fwd", "fwdbwd"):
        r, t = find("ring", pass_, 1), find("torch", pass_, 1)
        if r and t:
            ratio = t["time_s"] / r["time_s"]
            rc = _cpu_ratio(t, r)
            out.append(_target(f"ring {pass_} N=32k vs torch SDPA, 1 process", "torch time / ring time >= 1",
                               ratio, ratio >= 1.0, f"ring {r['time_s']:.2f} s, torch {t['time_s']:.2f} s",
                               rc, None if rc is None else rc >= 1.0))
    for pass_ in ("fwd", "fwdbwd"):
        one, two = find("ring", pass_, 1), find("ring", pass_, 2)
        if one and two:
            s = one["time_s"] / two["time_s"]
            sc = _cpu_ratio(one, two)
            sq1, sq2 = one.get("gemm_square_gflops"), two.get("gemm_square_gflops")
            out.append(_target(f"ring {pass_} N=32k: 2 ranks vs 1", "speedup >= 1.8", s, s >= 1.8,
                               f"{one['time_s']:.2f} s -> {two['time_s']:.2f} s"
                               + (f"; square GEMM per rank {sq1:.0f} GF/s alone, {sq2:.0f} with 2 ranks busy "
                                  f"(bound on the speedup: {2 * sq2 / sq1:.2f})" if sq1 and sq2 else ""),
                               sc, None if sc is None else sc >= 1.8))
    for r in records:
        if not (_timed(r) and r["impl"] == "ring" and _is_target_shape(r, MEMORY_N) and "peak_bytes" in r):
            continue
        if r["pass"] == "fwd":
            shard, what = r["shard_bytes"], "q, k, v, out"
        else:
            shard, what = r["shard_bytes_grads"], "q, k, v, out, dout, dq, dk, dv"
        limit = 2 * shard + 64 * MiB
        peak = r["peak_bytes"]
        out.append(_target(f"ring {r['pass']} N=64k, P={r['P']}: peak memory per rank",
                           f"<= 2 x ({what}) + 64 MiB = {limit / MiB:.0f} MiB", peak / MiB, peak <= limit,
                           f"peak {peak / MiB:.0f} MiB (process baseline {r['baseline_bytes'] / MiB:.0f} MiB, "
                           f"above it {(peak - r['baseline_bytes']) / MiB:.0f} MiB); shards "
                           f"{shard / MiB:.0f} MiB"))
    return out


# ----------------------------------------------------------------- table
def _fmt(x: Any, spec: str, width: int) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-".rjust(width)
    return format(x, spec).rjust(width)


def _rows(header: list[tuple[str, int]], rows: Iterable[list[str]]) -> list[str]:
    lines = ["  ".join(h.rjust(w) if i else h.ljust(w) for i, (h, w) in enumerate(header))]
    lines.append("  ".join("-" * w for _, w in header))
    lines += ["  ".join(c for c in row) for row in rows]
    return lines


def _attention_lines(records: list[dict]) -> list[str]:
    rec = [r for r in records if r.get("workload") == "attention"]
    if not rec:
        return []
    groups: dict[tuple, list[dict]] = {}
    for r in rec:
        groups.setdefault(tuple(r.get(k) for k in _SHAPE_KEYS), []).append(r)
    lines = []
    header = [("impl", 12), ("pass", 6), ("P", 2), ("N", 7), ("time s", 8), ("cpu s", 8), ("GF/s/rk", 8),
              ("%sq", 5), ("%tile", 5), ("%sq.c", 5), ("MiB sent/rk", 11), ("peak MiB/rk", 11), ("base", 5),
              ("est", 6)]
    for key, rs in groups.items():
        s = dict(zip(_SHAPE_KEYS, key))
        lines.append("")
        lines.append(f"attention  {s['dtype']}  B={s['B']} H={s['H']} Hkv={s['Hkv']} E={s['E']} Ev={s['Ev']}  "
                     f"{'causal' if s['causal'] else 'non-causal'}  {s['layout']}  block={s['block'] or 512}  "
                     f"{s['device'] or 'cpu'}")
        rows = []
        for r in sorted(rs, key=lambda r: (r["N"], r["P"], r["impl"], r.get("pass", ""))):
            if not _ok(r):
                rows.append([r["impl"].ljust(12), str(r.get("pass", "")).ljust(6), str(r["P"]).rjust(2),
                             str(r["N"]).rjust(7), f"{r.get('status')}: {r.get('reason', '')}"])
                continue
            base = r.get("baseline_bytes")
            rows.append([r["impl"].ljust(12), r["pass"].ljust(6), str(r["P"]).rjust(2), str(r["N"]).rjust(7),
                         _fmt(r["time_s"], ".3f", 8), _fmt(r.get("time_cpu_s"), ".3f", 8),
                         _fmt(r["gflops_per_rank"], ".1f", 8),
                         _fmt(100 * r["frac_gemm_square"] if "frac_gemm_square" in r else None, ".0f", 5),
                         _fmt(100 * r["frac_gemm_tile"] if "frac_gemm_tile" in r else None, ".0f", 5),
                         _fmt(100 * r["frac_gemm_square_cpu"] if "frac_gemm_square_cpu" in r else None, ".0f", 5),
                         _fmt(r.get("bytes_sent_per_rank", 0) / MiB, ".1f", 11),
                         _fmt(r["peak_bytes"] / MiB if r.get("peak_bytes") else None, ".0f", 11),
                         _fmt(base / MiB if base else None, ".0f", 5),
                         _fmt((base + r["est_bytes"]) / MiB if base and r.get("est_bytes") else None, ".0f", 6)
                         + (" (oversubscribed)" if r.get("oversubscribed") else "")])
        lines += _rows(header, rows)
    lines.append("  time: median wall-clock; cpu s: median CPU time of the process (max over ranks): well below "
                 "the wall time means the machine was busy with other work\n"
                 "  %sq / %tile: GFLOP/s per rank over the best square / tile-shaped GEMM rate at the same P in "
                 "this run; %sq.c: the same by CPU time\n"
                 "  peak: max over ranks; base: the process before inputs; est: base + the memory model")
    return lines


def _gemm_lines(records: list[dict]) -> list[str]:
    rec = [r for r in records if _ok(r) and r.get("workload") in ("gemm_square", "gemm_tile")]
    if not rec:
        return []
    lines = ["", "GEMM ceilings (numpy/cupy matmul, every rank at once; GFLOP/s per rank; measured in each "
                 "case's own process after its timings: best [min, median] over the cases; %sq and %tile "
                 "use the best)"]
    groups: dict[tuple, list[float]] = {}
    for r in rec:
        kind = "square" if r["workload"] == "gemm_square" else f"tile {r['pass']}"
        groups.setdefault((kind, r["P"], str(r.get("dtype", "")), r.get("shape", "")), []).append(
            r["gflops_per_rank"])
    rows = []
    for (kind, P, dtype, shape), rates in sorted(groups.items(), key=lambda kv: (kv[0][0] != "square", kv[0])):
        rates.sort()
        med = rates[len(rates) // 2]
        rows.append([kind.ljust(12), str(P).rjust(2), dtype.rjust(8), _fmt(rates[-1], ".1f", 8),
                     f"[{rates[0]:.1f}, {med:.1f}]".rjust(15), str(len(rates)).rjust(5), "  " + shape])
    return lines + _rows([("ceiling", 12), ("P", 2), ("dtype", 8), ("best", 8), ("[min, median]", 15),
                          ("cases", 5), ("  shapes", 8)], rows)


def _product_lines(records: list[dict]) -> list[str]:
    rec = [r for r in records if r.get("workload") == "product"]
    if not rec:
        return []
    lines = ["", "products (A: rows sharded; local = plain matmul of the same per-rank shapes)"]
    rows = []
    for r in sorted(rec, key=lambda r: (r["op"], r["N"], r["P"])):
        if not _ok(r):
            rows.append([f"matmul_{r['op']}".ljust(10), str(r["P"]).rjust(2), str(r["N"]).rjust(7),
                         f"{r.get('status')}: {r.get('reason', '')}"])
            continue
        rows.append([f"matmul_{r['op']}".ljust(10), str(r["P"]).rjust(2), str(r["N"]).rjust(7),
                     str(r["d"]).rjust(4), _fmt(r["time_s"], ".4f", 8), _fmt(r["gflops_per_rank"], ".1f", 8),
                     _fmt(100 * r["frac_local_gemm"], ".0f", 7), _fmt(r["bytes_sent_per_rank"] / MiB, ".1f", 11)])
    return lines + _rows([("product", 10), ("P", 2), ("N=M", 7), ("d", 4), ("time s", 8), ("GF/s/rk", 8),
                          ("%local", 7), ("MiB sent/rk", 11)], rows)


def _scaling_lines(records: list[dict]) -> list[str]:
    rec = [r for r in records if r.get("workload") == "scaling"]
    if not rec:
        return []
    lines = ["", "scaling (strong: same N; weak: N proportional to P, efficiency = per-rank GFLOP/s vs 1 rank)"]
    rows = []
    for r in sorted(rec, key=lambda r: (r["kind"], r["impl"], r["pass"], bool(r.get("causal")), r["N"], r["P"])):
        shape = f"H={r.get('H')} E={r.get('E')} {r.get('dtype')}{' causal ' + str(r.get('layout')) if r.get('causal') else ''}"
        rows.append([r["kind"].ljust(6), r["impl"].ljust(10), r["pass"].ljust(6), str(r["N"]).rjust(7),
                     str(r["P"]).rjust(2), _fmt(r["time_1_s"], ".3f", 8), _fmt(r["time_P_s"], ".3f", 8),
                     _fmt(r.get("speedup"), ".2f", 7), _fmt(100 * r["efficiency"], ".0f", 5), "  " + shape])
    return lines + _rows([("kind", 6), ("impl", 10), ("pass", 6), ("N", 7), ("P", 2), ("t1 s", 8), ("tP s", 8),
                          ("speedup", 7), ("eff%", 5), ("  problem", 9)], rows)


def _memory_lines(records: list[dict]) -> list[str]:
    rec = [r for r in records if r.get("workload") == "memory_curve"]
    if not rec:
        return []
    lines = ["", "memory per rank: largest N within a fixed per-rank cap (model estimate, verified by a run)"]
    rows = []
    for r in sorted(rec, key=lambda r: r["P"]):
        rows.append([str(r["P"]).rjust(2), _fmt(r["cap_bytes"] / MiB, ".0f", 7),
                     _fmt(r.get("baseline_bytes", 0) / MiB, ".0f", 5), str(r.get("N_estimate")).rjust(8),
                     str(r.get("N_verified")).rjust(8),
                     _fmt(r["peak_bytes"] / MiB if r.get("peak_bytes") else None, ".0f", 9),
                     "  " + r.get("status", "")])
    return lines + _rows([("P", 2), ("cap MiB", 7), ("base", 5), ("N est", 8), ("N run", 8), ("peak MiB", 9),
                          ("  status", 8)], rows)


def _target_lines(records: list[dict]) -> list[str]:
    rec = [r for r in records if r.get("workload") == "target"]
    if not rec:
        return []
    lines = ["", "targets (reported, not asserted; 'cpu': the same measured by CPU time)"]
    rows = []

    def shown(name: str, m: float | None) -> str:
        if m is None:
            return "-"
        return f"{m:.0f} MiB" if "memory" in name else (f"{m:.0%}" if "fraction" in name else f"{m:.2f}")

    for r in rec:
        cpu = "" if r.get("met_cpu") is None else ("met" if r["met_cpu"] else "MISSED")
        rows.append([r["name"].ljust(52), r["goal"].ljust(44), shown(r["name"], r["measured"]).rjust(9),
                     ("met" if r["met"] else "MISSED").ljust(6), shown(r["name"], r.get("measured_cpu")).rjust(7),
                     cpu.ljust(6), r["detail"]])
    return lines + _rows([("target", 52), ("goal", 44), ("measured", 9), ("", 6), ("cpu", 7), ("", 6),
                          ("detail", 6)], rows)


def format_table(records: list[dict], env: dict | None = None) -> str:
    """The readable report of a run (attention, ceilings, products, scaling, memory, targets)."""
    lines = []
    if env:
        blas = env.get("blas")
        if isinstance(blas, list) and blas:
            b = blas[0]
            blas = f"{b.get('internal_api')} {b.get('version')} kernel={b.get('architecture')} " \
                   f"threads={b.get('num_threads')}"
        lines.append(f"mpiattn {env.get('mpiattn')}  numpy {env.get('numpy')}  {env.get('cpu', '')}  "
                     f"cores={env.get('cores_usable')}  BLAS: {blas}")
        if env.get("vars", {}).get("OPENBLAS_CORETYPE"):
            lines.append(f"  note: OPENBLAS_CORETYPE={env['vars']['OPENBLAS_CORETYPE']} is set: it may slow "
                         "the BLAS; unset it (and OPENBLAS_L2_SIZE) for benchmarks where safe")
    for part in (_attention_lines, _gemm_lines, _product_lines, _scaling_lines, _memory_lines, _target_lines):
        lines += part(records)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m mpiattn.bench_report RESULTS.jsonl [...]``: print the table of saved results."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print("usage: python -m mpiattn.bench_report RESULTS.jsonl [MORE.jsonl ...]", file=sys.stderr)
        return 2
    records = load(argv)
    env = next((r for r in reversed(records) if r.get("workload") == "env"), None)
    print(format_table(records, env))
    return 0


if __name__ == "__main__":
    sys.exit(main())
