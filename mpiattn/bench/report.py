"""``mpiattn bench`` records as a readable table; saved results loaded back.

``python -m mpiattn.bench.report RESULTS.jsonl [MORE.jsonl ...]`` prints the
table of saved results (the last record of each case wins, derived numbers
made anew by :func:`mpiattn.bench.derive.derive`). Records of earlier
releases load too: the dense peer's old name ``reference`` reads as
``dense``, a record without ``engine`` as one that passed none.

Sections of :func:`format_table`: attention (one table per problem shape,
engines side by side as ``impl/engine`` rows, with the fractions of the
GEMM ceilings and of ideal), GEMM ceilings, products, ring-step overlap,
scaling, the memory curve and the targets.
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any, Callable, Iterable

from ..kernels import DEFAULT_TILE
from .derive import SHAPE_KEYS, derive, impl_label
from .tasks import DENSE

__all__ = ["load", "upgrade", "format_table", "main"]

MiB = 2**20
#: The dense peer's name in earlier releases.
_OLD_DENSE = "reference"
_CASE = ("workload", "impl", "engine", "pass", "op", "N", "P", "measured_with") + SHAPE_KEYS


def upgrade(r: dict) -> dict:
    """A saved record in today's names (``impl`` ``reference`` -> ``dense``), in place."""
    if r.get("impl") == _OLD_DENSE:
        r["impl"] = DENSE
    if isinstance(r.get("measured_with"), str) and r["measured_with"].startswith(_OLD_DENSE + " "):
        r["measured_with"] = DENSE + r["measured_with"][len(_OLD_DENSE):]
    return r


def load(paths: Iterable[str]) -> list[dict]:
    """Measured records of JSON-lines files, the last of each case kept, derived records made anew.

    Later runs replace earlier ones case by case; ``scaling`` and ``target``
    records in the files are dropped and recomputed (so results of several
    runs combine).
    """
    latest: dict[tuple, dict] = {}
    for path in paths:
        with open(path) as f:
            for line in f:
                if line.strip():
                    r = upgrade(json.loads(line))
                    if r.get("workload") in ("scaling", "target"):
                        continue
                    latest[tuple(str(r.get(k)) for k in _CASE)] = r
    records = list(latest.values())
    return records + derive(records)


# ----------------------------------------------------------------- table
def _ok(r: dict) -> bool:
    return r.get("status") == "ok"


def _fmt(x: Any, spec: str, width: int) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-".rjust(width)
    return format(x, spec).rjust(width)


def _pct(r: dict, key: str) -> str:
    return _fmt(100 * r[key] if key in r else None, ".0f", 5)


def _rows(header: list[tuple[str, int]], rows: Iterable[list[str]]) -> list[str]:
    lines = ["  ".join(h.rjust(w) if i else h.ljust(w) for i, (h, w) in enumerate(header))]
    lines.append("  ".join("-" * w for _, w in header))
    lines += ["  ".join(c for c in row) for row in rows]
    return lines


def _failed(r: dict, *cols: str) -> list[str]:
    return [*cols, f"{r.get('status')}: {r.get('reason', '')}"]


def _attention_lines(records: list[dict]) -> list[str]:
    rec = [r for r in records if r.get("workload") == "attention"]
    if not rec:
        return []
    groups: dict[tuple, list[dict]] = {}
    for r in rec:
        groups.setdefault(tuple(r.get(k) for k in SHAPE_KEYS), []).append(r)
    header = [("impl", 18), ("pass", 6), ("P", 2), ("N", 7), ("time s", 8), ("cpu s", 8), ("GF/s/rk", 8),
              ("%sq", 5), ("%tile", 5), ("%sq.c", 5), ("%idl", 5), ("MiB sent/rk", 11), ("peak MiB/rk", 11),
              ("base", 5), ("est", 6)]
    lines = []
    for key, rs in groups.items():
        s = dict(zip(SHAPE_KEYS, key))
        lines += ["", f"attention  {s['dtype']}  B={s['B']} H={s['H']} Hkv={s['Hkv']} E={s['E']} Ev={s['Ev']}  "
                      f"{'causal' if s['causal'] else 'non-causal'}  {s['layout']}  block={s['block'] or DEFAULT_TILE}  "
                      f"{s['device'] or 'cpu'}"]
        rows = []
        for r in sorted(rs, key=lambda r: (r["N"], r["P"], r["impl"], str(r.get("engine")), r.get("pass", ""))):
            head = [impl_label(r).ljust(18), str(r.get("pass", "")).ljust(6), str(r["P"]).rjust(2),
                    str(r["N"]).rjust(7)]
            if not _ok(r):
                rows.append(_failed(r, *head))
                continue
            base = r.get("baseline_bytes")
            rows.append(head + [_fmt(r["time_s"], ".3f", 8), _fmt(r.get("time_cpu_s"), ".3f", 8),
                                _fmt(r["gflops_per_rank"], ".1f", 8), _pct(r, "frac_gemm_square"),
                                _pct(r, "frac_gemm_tile"), _pct(r, "frac_gemm_square_cpu"), _pct(r, "frac_ideal"),
                                _fmt(r.get("bytes_sent_per_rank", 0) / MiB, ".1f", 11),
                                _fmt(r["peak_bytes"] / MiB if r.get("peak_bytes") else None, ".0f", 11),
                                _fmt(base / MiB if base else None, ".0f", 5),
                                _fmt((base + r["est_bytes"]) / MiB if base and r.get("est_bytes") else None, ".0f", 6)
                                + (" (oversubscribed)" if r.get("oversubscribed") else "")])
        lines += _rows(header, rows)
    lines.append("  impl: strategy or peer, /engine where one was passed; time: median wall-clock; cpu s: median "
                 "CPU time of the process (max over ranks): well below the wall time means the machine was busy\n"
                 "  %sq / %tile: GFLOP/s per rank over the best square / tile-shaped GEMM rate at the same P in "
                 "this run; %sq.c: the same by CPU time\n"
                 "  %idl: fraction of ideal T_best / (P T_P), T_best the fastest single-process time of the same "
                 "problem in the same run (torch SDPA, dense, or any implementation at P = 1)\n"
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
        rows.append([kind.ljust(12), str(P).rjust(2), dtype.rjust(8), _fmt(rates[-1], ".1f", 8),
                     f"[{rates[0]:.1f}, {rates[len(rates) // 2]:.1f}]".rjust(15), str(len(rates)).rjust(5),
                     "  " + shape])
    return lines + _rows([("ceiling", 12), ("P", 2), ("dtype", 8), ("best", 8), ("[min, median]", 15),
                          ("cases", 5), ("  shapes", 8)], rows)


def _product_lines(records: list[dict]) -> list[str]:
    rec = [r for r in records if r.get("workload") == "product"]
    if not rec:
        return []
    rows = []
    for r in sorted(rec, key=lambda r: (r["op"], r["N"], r["P"])):
        head = [f"matmul_{r['op']}".ljust(10), str(r["P"]).rjust(2), str(r["N"]).rjust(7)]
        if not _ok(r):
            rows.append(_failed(r, *head))
            continue
        rows.append(head + [str(r["d"]).rjust(4), _fmt(r["time_s"], ".4f", 8),
                            _fmt(r["gflops_per_rank"], ".1f", 8), _fmt(100 * r["frac_local_gemm"], ".0f", 7),
                            _fmt(r["bytes_sent_per_rank"] / MiB, ".1f", 11)])
    return ["", "products (A: rows sharded; local = plain matmul of the same per-rank shapes)"] + _rows(
        [("product", 10), ("P", 2), ("N=M", 7), ("d", 4), ("time s", 8), ("GF/s/rk", 8), ("%local", 7),
         ("MiB sent/rk", 11)], rows)


def _overlap_lines(records: list[dict]) -> list[str]:
    rec = [r for r in records if r.get("workload") == "overlap"]
    if not rec:
        return []
    rows = []
    for r in sorted(rec, key=lambda r: (r["N"], r["P"])):
        head = [str(r["P"]).rjust(2), str(r["N"]).rjust(7)]
        if not _ok(r):
            rows.append(_failed(r, *head))
            continue
        rows.append(head + [f"{r['rows']} x {r['d']}".rjust(12), f"{r['block']} x {r['d']}".rjust(12),
                            _fmt(1e3 * r["transfer_s"], ".2f", 9), _fmt(1e3 * r["matmul_s"], ".2f", 9),
                            _fmt(1e3 * r["both_s"], ".2f", 9), _fmt(r["hidden"], ".2f", 6)
                            + ("" if r.get("resolvable", True) else "  (matmul noise > transfer: not resolvable)")])
    return ["", "overlap: one matmul_nt ring step (median ms; hidden = share of the transfer hidden by the matmul)"] \
        + _rows([("P", 2), ("N", 7), ("a", 12), ("piece", 12), ("transfer", 9), ("matmul", 9), ("both", 9),
                 ("hidden", 6)], rows)


def _scaling_lines(records: list[dict]) -> list[str]:
    rec = [r for r in records if r.get("workload") == "scaling"]
    if not rec:
        return []
    rows = []
    for r in sorted(rec, key=lambda r: (r["kind"], r["impl"], str(r.get("engine")), r["pass"], bool(r.get("causal")),
                                        r["N"], r["P"])):
        shape = f"H={r.get('H')} E={r.get('E')} {r.get('dtype')}" + (
            f" causal {r.get('layout')}" if r.get("causal") else "")
        rows.append([r["kind"].ljust(6), impl_label(r).ljust(18), r["pass"].ljust(6), str(r["N"]).rjust(7),
                     str(r["P"]).rjust(2), _fmt(r["time_1_s"], ".3f", 8), _fmt(r["time_P_s"], ".3f", 8),
                     _fmt(r.get("speedup"), ".2f", 7), _fmt(100 * r["efficiency"], ".0f", 5), "  " + shape])
    return ["", "scaling (strong: same N; weak: N proportional to P, efficiency = per-rank GFLOP/s vs 1 rank)"] + _rows(
        [("kind", 6), ("impl", 18), ("pass", 6), ("N", 7), ("P", 2), ("t1 s", 8), ("tP s", 8), ("speedup", 7),
         ("eff%", 5), ("  problem", 9)], rows)


def _memory_lines(records: list[dict]) -> list[str]:
    rec = [r for r in records if r.get("workload") == "memory_curve"]
    if not rec:
        return []
    rows = [[str(r["P"]).rjust(2), _fmt(r["cap_bytes"] / MiB, ".0f", 7),
             _fmt(r.get("baseline_bytes", 0) / MiB, ".0f", 5), str(r.get("N_estimate")).rjust(8),
             str(r.get("N_verified")).rjust(8),
             _fmt(r["peak_bytes"] / MiB if r.get("peak_bytes") else None, ".0f", 9), "  " + r.get("status", "")]
            for r in sorted(rec, key=lambda r: r["P"])]
    return ["", "memory per rank: largest N within a fixed per-rank cap (model estimate, verified by a run)"] + _rows(
        [("P", 2), ("cap MiB", 7), ("base", 5), ("N est", 8), ("N run", 8), ("peak MiB", 9), ("  status", 8)], rows)


def _target_lines(records: list[dict]) -> list[str]:
    rec = [r for r in records if r.get("workload") == "target"]
    if not rec:
        return []

    def shown(name: str, m: float | None) -> str:
        if m is None:
            return "-"
        return f"{m:.0f} MiB" if "memory" in name else (f"{m:.0%}" if "fraction" in name else f"{m:.2f}")

    rows = []
    for r in rec:
        cpu = "" if r.get("met_cpu") is None else ("met" if r["met_cpu"] else "MISSED")
        rows.append([r["name"].ljust(56), r["goal"].ljust(44), shown(r["name"], r["measured"]).rjust(9),
                     ("met" if r["met"] else "MISSED").ljust(6), shown(r["name"], r.get("measured_cpu")).rjust(7),
                     cpu.ljust(6), r["detail"]])
    return ["", "targets (reported, not asserted; 'cpu': the same measured by CPU time)"] + _rows(
        [("target", 56), ("goal", 44), ("measured", 9), ("", 6), ("cpu", 7), ("", 6), ("detail", 6)], rows)


_SECTIONS: tuple[Callable[[list[dict]], list[str]], ...] = (
    _attention_lines, _gemm_lines, _product_lines, _overlap_lines, _scaling_lines, _memory_lines, _target_lines)


def format_table(records: list[dict], env: dict | None = None) -> str:
    """The readable report of a run (attention, ceilings, products, overlap, scaling, memory, targets)."""
    lines = []
    if env:
        blas = env.get("blas")
        if isinstance(blas, list) and blas:
            b = blas[0]
            blas = f"{b.get('internal_api')} {b.get('version')} kernel={b.get('architecture')} " \
                   f"threads={b.get('num_threads')}"
        lines.append(f"mpiattn {env.get('mpiattn')}  numpy {env.get('numpy')}  {env.get('cpu', '')}  "
                     f"cores={env.get('cores_usable')}  BLAS: {blas}"
                     + (f"  GPU: {env['gpu']}" if env.get("gpu") else ""))
        if env.get("vars", {}).get("OPENBLAS_CORETYPE"):
            lines.append(f"  note: OPENBLAS_CORETYPE={env['vars']['OPENBLAS_CORETYPE']} is set: it may slow "
                         "the BLAS; unset it (and OPENBLAS_L2_SIZE) for benchmarks where safe")
    for part in _SECTIONS:
        lines += part(records)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m mpiattn.bench.report RESULTS.jsonl [...]``: print the table of saved results."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m mpiattn.bench.report RESULTS.jsonl [MORE.jsonl ...]", file=sys.stderr)
        return 0 if argv else 2
    records = load(argv)
    env = next((r for r in reversed(records) if r.get("workload") == "env"), None)
    print(format_table(records, env))
    return 0


if __name__ == "__main__":
    sys.exit(main())
