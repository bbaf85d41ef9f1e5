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
from typing import Any, Callable, Iterable, Sequence

from ..kernels import DEFAULT_TILE
from .derive import SHAPE_KEYS, derive, impl_label
from .tasks import DENSE, MiB

__all__ = ["load", "upgrade", "format_table", "main"]

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
#: A column: header, width, the value of a record (None: "-"), its format ("<": text, left-aligned).
Column = tuple[str, int, Callable[[dict], Any], str]


def _ok(r: dict) -> bool:
    return r.get("status") == "ok"


def _cell(r: dict, col: Column) -> str:
    _, width, value, spec = col
    x = value(r)
    if spec == "<":
        return str(x).ljust(width)
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-".rjust(width)
    return format(x, spec).rjust(width)


def _table(title: str, records: list[dict], columns: Sequence[Column], key: Callable[[dict], Any],
           head: int = 0) -> list[str]:
    """``title`` and the rows of ``records`` sorted by ``key``; a record not ok: its first ``head``
    columns, then its status and reason."""
    if not records:
        return []
    lines = ["", title, "  ".join(h.ljust(w) if s == "<" else h.rjust(w) for h, w, _, s in columns).rstrip(),
             "  ".join("-" * w for _, w, _, _ in columns).rstrip()]
    for r in sorted(records, key=key):
        if _ok(r) or not head:
            lines.append("  ".join(_cell(r, col) for col in columns).rstrip())
        else:
            lines.append("  ".join([_cell(r, col) for col in columns[:head]]
                                   + [f"{r.get('status')}: {r.get('reason', '')}"]))
    return lines


def _of(records: list[dict], *workloads: str) -> list[dict]:
    return [r for r in records if r.get("workload") in workloads]


def _mib(field: str) -> Callable[[dict], Any]:
    return lambda r: r[field] / MiB if r.get(field) else None


def _pct(field: str) -> Callable[[dict], Any]:
    return lambda r: 100 * r[field] if field in r else None


_ATTENTION: tuple[Column, ...] = (
    ("impl", 20, impl_label, "<"), ("pass", 6, lambda r: r.get("pass", ""), "<"), ("P", 2, lambda r: r["P"], "d"),
    ("N", 7, lambda r: r["N"], "d"), ("time s", 8, lambda r: r["time_s"], ".3f"),
    ("cpu s", 8, lambda r: r.get("time_cpu_s"), ".3f"), ("GF/s/rk", 8, lambda r: r["gflops_per_rank"], ".1f"),
    ("%sq", 5, _pct("frac_gemm_square"), ".0f"), ("%tile", 5, _pct("frac_gemm_tile"), ".0f"),
    ("%sq.c", 5, _pct("frac_gemm_square_cpu"), ".0f"), ("%idl", 5, _pct("frac_ideal"), ".0f"),
    ("MiB sent/rk", 11, lambda r: r.get("bytes_sent_per_rank", 0) / MiB, ".1f"),
    ("peak MiB/rk", 11, _mib("peak_bytes"), ".0f"), ("base", 5, _mib("baseline_bytes"), ".0f"),
    ("est", 6, lambda r: (r["baseline_bytes"] + r["est_bytes"]) / MiB if r.get("baseline_bytes")
     and r.get("est_bytes") else None, ".0f"),
    ("", 0, lambda r: "(oversubscribed)" if r.get("oversubscribed") else "", "<"))


def _attention_lines(records: list[dict]) -> list[str]:
    groups: dict[tuple, list[dict]] = {}
    for r in _of(records, "attention"):
        groups.setdefault(tuple(r.get(k) for k in SHAPE_KEYS), []).append(r)
    lines = []
    for key, rs in groups.items():
        s = dict(zip(SHAPE_KEYS, key))
        title = (f"attention  {s['dtype']}  B={s['B']} H={s['H']} Hkv={s['Hkv']} E={s['E']} Ev={s['Ev']}  "
                 f"{'causal' if s['causal'] else 'non-causal'}  {s['layout']}  block={s['block'] or DEFAULT_TILE}  "
                 f"{s['device'] or 'cpu'}")
        lines += _table(title, rs, _ATTENTION, lambda r: (r["N"], r["P"], r["impl"], str(r.get("engine")),
                                                          r.get("pass", "")), head=4)
    if lines:
        lines.append(
            "  impl: strategy or peer, /engine where one was passed, (what mpiattn chose); time: median wall-clock; "
            "cpu s: median CPU time of the process (max over ranks): well below the wall time means the machine "
            "was busy\n  %sq / %tile: GFLOP/s per rank over the best square / tile-shaped GEMM rate at the same P in "
            "this run; %sq.c: the same by CPU time\n  %idl: fraction of ideal T_best / (P T_P), T_best the fastest "
            "single-process time of the same problem in the same run (torch SDPA, dense, or any implementation at "
            "P = 1)\n  peak: max over ranks; base: the process before inputs; est: base + the library's memory model")
    return lines


def _gemm_lines(records: list[dict]) -> list[str]:
    groups: dict[tuple, list[float]] = {}
    for r in filter(_ok, _of(records, "gemm_square", "gemm_tile")):
        kind = "square" if r["workload"] == "gemm_square" else f"tile {r['pass']}"
        groups.setdefault((kind, r["P"], str(r.get("dtype", "")), r.get("shape", "")), []).append(
            r["gflops_per_rank"])
    rows = [dict(kind=k[0], P=k[1], dtype=k[2], shape=k[3], rates=sorted(v)) for k, v in groups.items()]
    return _table("GEMM ceilings (numpy/cupy matmul, every rank at once; GFLOP/s per rank; measured in each case's "
                  "own process after its timings: best [min, median] over the cases; %sq and %tile use the best)",
                  rows, [("ceiling", 12, lambda g: g["kind"], "<"), ("P", 2, lambda g: g["P"], "d"),
                         ("dtype", 8, lambda g: g["dtype"], ">"), ("best", 8, lambda g: g["rates"][-1], ".1f"),
                         ("[min, median]", 15, lambda g: f"[{g['rates'][0]:.1f}, "
                                                         f"{g['rates'][len(g['rates']) // 2]:.1f}]", ">"),
                         ("cases", 5, lambda g: len(g["rates"]), "d"), ("shapes", 8, lambda g: g["shape"], "<")],
                  lambda g: (g["kind"] != "square", g["kind"], g["P"], g["dtype"], g["shape"]))


def _product_lines(records: list[dict]) -> list[str]:
    return _table("products (A: rows sharded; local = plain matmul of the same per-rank shapes)",
                  _of(records, "product"),
                  [("product", 10, lambda r: f"matmul_{r['op']}", "<"), ("P", 2, lambda r: r["P"], "d"),
                   ("N=M", 7, lambda r: r["N"], "d"), ("d", 4, lambda r: r["d"], "d"),
                   ("time s", 8, lambda r: r["time_s"], ".4f"), ("GF/s/rk", 8, lambda r: r["gflops_per_rank"], ".1f"),
                   ("%local", 7, _pct("frac_local_gemm"), ".0f"),
                   ("MiB sent/rk", 11, lambda r: r["bytes_sent_per_rank"] / MiB, ".1f")],
                  lambda r: (r["op"], r["N"], r["P"]), head=3)


def _overlap_lines(records: list[dict]) -> list[str]:
    return _table("overlap: one matmul_nt ring step (median ms; hidden = share of the transfer hidden by the matmul)",
                  _of(records, "overlap"),
                  [("P", 2, lambda r: r["P"], "d"), ("N", 7, lambda r: r["N"], "d"),
                   ("a", 12, lambda r: f"{r['rows']} x {r['d']}", ">"),
                   ("piece", 12, lambda r: f"{r['block']} x {r['d']}", ">"),
                   ("transfer", 9, lambda r: 1e3 * r["transfer_s"], ".2f"),
                   ("matmul", 9, lambda r: 1e3 * r["matmul_s"], ".2f"), ("both", 9, lambda r: 1e3 * r["both_s"], ".2f"),
                   ("hidden", 6, lambda r: r["hidden"], ".2f"),
                   ("", 0, lambda r: "" if r.get("resolvable", True) else "(matmul noise > transfer: not resolvable)",
                    "<")],
                  lambda r: (r["N"], r["P"]), head=2)


def _scaling_lines(records: list[dict]) -> list[str]:
    return _table("scaling (strong: same N; weak: N proportional to P, efficiency = per-rank GFLOP/s vs 1 rank)",
                  _of(records, "scaling"),
                  [("kind", 6, lambda r: r["kind"], "<"), ("impl", 20, impl_label, "<"),
                   ("pass", 6, lambda r: r["pass"], "<"), ("N", 7, lambda r: r["N"], "d"),
                   ("P", 2, lambda r: r["P"], "d"), ("t1 s", 8, lambda r: r["time_1_s"], ".3f"),
                   ("tP s", 8, lambda r: r["time_P_s"], ".3f"), ("speedup", 7, lambda r: r.get("speedup"), ".2f"),
                   ("eff%", 5, _pct("efficiency"), ".0f"),
                   ("problem", 9, lambda r: f"H={r.get('H')} E={r.get('E')} {r.get('dtype')}"
                    + (f" causal {r.get('layout')}" if r.get("causal") else ""), "<")],
                  lambda r: (r["kind"], r["impl"], str(r.get("engine")), r["pass"], bool(r.get("causal")), r["N"],
                             r["P"]))


def _memory_lines(records: list[dict]) -> list[str]:
    return _table("memory per rank: largest N within a fixed per-rank cap (model estimate, verified by a run)",
                  _of(records, "memory_curve"),
                  [("P", 2, lambda r: r["P"], "d"), ("cap MiB", 7, _mib("cap_bytes"), ".0f"),
                   ("base", 5, lambda r: r.get("baseline_bytes", 0) / MiB, ".0f"),
                   ("N est", 8, lambda r: r.get("N_estimate"), ">"), ("N run", 8, lambda r: r.get("N_verified"), ">"),
                   ("peak MiB", 9, _mib("peak_bytes"), ".0f"), ("status", 8, lambda r: r.get("status", ""), "<")],
                  lambda r: r["P"])


def _target_lines(records: list[dict]) -> list[str]:
    def shown(field: str) -> Callable[[dict], str]:
        def show(r: dict) -> str:
            m, name = r.get(field), r["name"]
            if m is None:
                return "-"
            return f"{m:.0f} MiB" if "memory" in name else (f"{m:.0%}" if "fraction" in name else f"{m:.2f}")
        return show

    def met(field: str) -> Callable[[dict], str]:
        return lambda r: "" if r.get(field) is None else ("met" if r[field] else "MISSED")

    return _table("targets (reported, not asserted; 'cpu': the same measured by CPU time)", _of(records, "target"),
                  [("target", 56, lambda r: r["name"], "<"), ("goal", 44, lambda r: r["goal"], "<"),
                   ("measured", 9, shown("measured"), ">"), ("", 6, met("met"), "<"),
                   ("cpu", 7, shown("measured_cpu"), ">"), ("", 6, met("met_cpu"), "<"),
                   ("detail", 6, lambda r: r["detail"], "<")], lambda r: 0)


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
