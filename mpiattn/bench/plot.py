"""PNG plots of ``mpiattn bench`` results (time, throughput, fraction of ideal, memory; against N and P).

Usage::

    python -m mpiattn.bench.plot RESULTS.jsonl [MORE.jsonl ...] OUTDIR

or ``python -m mpiattn bench ... --plot OUTDIR``. Needs matplotlib (the
``bench`` extra); it is imported here only, when a plot is drawn. When a file
holds several runs, the last record of each case wins. Engines are drawn
side by side: one line per ``impl/engine``, rank count and pass.
"""

from __future__ import annotations

import os
import sys
import types
from typing import Any

from .derive import SHAPE_KEYS, impl_label, timed
from .tasks import PEERS, MiB

__all__ = ["plot_all"]

_STYLE = types.MappingProxyType({"fwd": "-", "fwdbwd": "--"})


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _series(records: list[dict], key: Any) -> dict[tuple, list[dict]]:
    out: dict[tuple, list[dict]] = {}
    for r in records:
        out.setdefault(key(r), []).append(r)
    return {k: sorted(v, key=lambda r: r["N"]) for k, v in sorted(out.items(), key=lambda kv: str(kv[0]))}


def _label(impl: str, P: int, pass_: str) -> str:
    return f"{impl} P={P} {'fwd+bwd' if pass_ == 'fwdbwd' else 'fwd'}"


def _line_key(r: dict) -> tuple:
    return (impl_label(r), r["P"], r["pass"])


def _save(fig: Any, outdir: str, name: str) -> str:
    path = os.path.join(outdir, name)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def _title(r: dict) -> str:
    return (f"B={r['B']} H={r['H']} Hkv={r['Hkv']} E={r['E']} {r['dtype']} "
            f"{'causal' if r['causal'] else 'non-causal'}")


def _points(rs: list[dict], field: str, scale: float = 1.0) -> tuple[list[int], list[float]]:
    """(N, value) of the records that have ``field``."""
    have = [r for r in rs if r.get(field) is not None]
    return [r["N"] for r in have], [scale * r[field] for r in have]


def _plot_time_and_rate(plt: Any, recs: list[dict], outdir: str, tag: str) -> list[str]:
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.6))
    ax_t, ax_g, ax_i = axes
    panels = ((ax_t, "time_s", 1.0), (ax_g, "frac_gemm_square", 100.0), (ax_i, "frac_ideal", 100.0))
    for (impl, P, pass_), rs in _series(recs, _line_key).items():
        color = None
        for ax, field, scale in panels:
            Ns, ys = _points(rs, field, scale)
            if Ns:
                line, = ax.plot(Ns, ys, _STYLE.get(pass_, "-"), marker="o", color=color,
                                label=_label(impl, P, pass_))
                color = line.get_color()
    ax_t.set(ylabel="time (s, median)", title="time " + _title(recs[0]))
    ax_t.set_yscale("log")
    ax_g.axhline(60, color="gray", lw=0.8, ls=":")
    ax_g.axhline(50, color="gray", lw=0.8, ls=":")
    ax_g.set(ylabel="% of square-GEMM GFLOP/s per rank",
             title="throughput vs the GEMM ceiling (dotted: 60% / 50% targets)")
    ax_i.axhline(100, color="gray", lw=0.8, ls=":")
    ax_i.axhline(85, color="gray", lw=0.8, ls=":")
    ax_i.set(ylabel="% of ideal: T_best / (P T_P)",
             title="fraction of ideal (T_best: fastest 1-process kernel, same run)")
    for ax, field, _ in panels:
        ax.set_xlabel("sequence length N")
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.set_xscale("log", base=2)
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, f"no {field} in these records", ha="center", va="center",
                    transform=ax.transAxes, color="gray")
    ax_g.set_ylim(bottom=0)
    ax_i.set_ylim(bottom=0)
    return [_save(fig, outdir, f"time_vs_n{tag}.png")]


def _plot_memory(plt: Any, recs: list[dict], outdir: str, tag: str) -> list[str]:
    mem = [r for r in recs if r.get("peak_bytes") and r.get("fresh", True)]
    if not mem:
        return []
    fig, (ax_p, ax_a) = plt.subplots(1, 2, figsize=(12, 4.6))
    for (impl, P, pass_), rs in _series(mem, _line_key).items():
        Ns = [r["N"] for r in rs]
        line, = ax_p.plot(Ns, [r["peak_bytes"] / MiB for r in rs], _STYLE.get(pass_, "-"), marker="o",
                          label=_label(impl, P, pass_))
        ax_a.plot(Ns, [max(r["peak_bytes"] - r.get("baseline_bytes", 0), 1) / MiB for r in rs],
                  _STYLE.get(pass_, "-"), marker="o", color=line.get_color(), label=_label(impl, P, pass_))
    Ns = sorted({r["N"] for r in mem})
    Ps = sorted({r["P"] for r in mem if r["impl"] not in PEERS})
    words = (8 if mem[0]["dtype"] == "float64" else 4) * mem[0]["B"] * mem[0]["H"]
    for P in Ps:
        ax_a.plot(Ns, [words * N * N / P / MiB for N in Ns], ":", color="gray", lw=0.9)
        ax_a.annotate(f"N x N/P scores, P={P}", (Ns[-1], words * Ns[-1] ** 2 / P / MiB), fontsize=7,
                      color="gray", ha="right", va="bottom")
    ax_p.set(ylabel="peak resident memory per rank (MiB)", title="peak per rank (fresh process per case)")
    ax_a.set(ylabel="MiB above the process baseline", title="above the baseline; dotted: one score matrix")
    for ax in (ax_p, ax_a):
        ax.set(xlabel="sequence length N")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("memory " + _title(mem[0]), fontsize=10)
    return [_save(fig, outdir, f"memory_vs_n{tag}.png")]


def _plot_scaling(plt: Any, records: list[dict], outdir: str) -> list[str]:
    sc = [r for r in records if r.get("workload") == "scaling"]
    if not sc:
        return []
    fig, (ax_s, ax_w) = plt.subplots(1, 2, figsize=(11, 4.2))
    for kind, ax in (("strong", ax_s), ("weak", ax_w)):
        rs = [r for r in sc if r["kind"] == kind]
        for key, g in _series(rs, lambda r: (impl_label(r), r["pass"], r["N"] if kind == "strong" else r["N_1"],
                                             r["causal"])).items():
            g = sorted(g, key=lambda r: r["P"])
            Ps = [1] + [r["P"] for r in g]
            ys = [1.0] + [r["speedup"] if kind == "strong" else r["efficiency"] for r in g]
            ax.plot(Ps, ys, _STYLE.get(key[1], "-"), marker="o",
                    label=f"{key[0]} {'fwd+bwd' if key[1] == 'fwdbwd' else 'fwd'} "
                          f"{'N' if kind == 'strong' else 'N/P'}={key[2]}{' causal' if key[3] else ''}")
        Pmax = max([r["P"] for r in rs], default=2)
        if kind == "strong":
            ax.plot([1, Pmax], [1, Pmax], ":", color="gray", label="ideal")
            ax.set(ylabel="speedup over 1 rank", title="strong scaling (fixed N)")
        else:
            ax.axhline(1.0, ls=":", color="gray", label="ideal")
            ax.set(ylabel="per-rank GFLOP/s vs 1 rank", title="weak scaling (N proportional to P)")
            ax.set_ylim(0, 1.2)
        ax.set(xlabel="ranks P")
        ax.set_xticks(range(1, Pmax + 1))
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    return [_save(fig, outdir, "scaling.png")]


def _plot_memory_curve(plt: Any, records: list[dict], outdir: str) -> list[str]:
    mc = sorted([r for r in records if r.get("workload") == "memory_curve" and r.get("N_verified")],
                key=lambda r: r["P"])
    if not mc:
        return []
    fig, ax = plt.subplots(figsize=(6, 4.2))
    Ps = [r["P"] for r in mc]
    ax.plot(Ps, [r["N_verified"] for r in mc], marker="o", label="largest N run within the cap (verified)")
    ax.plot(Ps, [r["N_estimate"] for r in mc], ls="--", marker="x", label="largest N by the memory model")
    ax.plot(Ps, [mc[0]["N_verified"] * P / Ps[0] for P in Ps], ":", color="gray", label="linear in P")
    ax.set(xlabel="ranks P", ylabel="sequence length N",
           title=f"largest N within {mc[0]['cap_bytes'] / MiB:.0f} MiB per rank ({mc[0].get('impl', 'mpiattn')}, "
                 f"{'fwd+bwd' if mc[0].get('pass_') == 'fwdbwd' else 'fwd'})")
    ax.set_xticks(Ps)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    return [_save(fig, outdir, "memory_curve.png")]


def plot_all(records: list[dict], outdir: str) -> list[str]:
    """Draw every plot the records allow into ``outdir``; returns the files written.

    Files: ``time_vs_n*.png`` (time and fraction of the GEMM ceiling against
    N, one per problem shape), ``memory_vs_n*.png`` (peak memory per rank
    against N, with the ``N²/P`` score matrix for scale), ``scaling.png``
    (strong and weak), ``memory_curve.png`` (largest N within a per-rank cap
    against P).
    """
    plt = _pyplot()
    os.makedirs(outdir, exist_ok=True)
    written = []
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        if timed(r) and not r.get("oversubscribed"):
            groups.setdefault(tuple(r.get(k) for k in SHAPE_KEYS), []).append(r)
    for i, recs in enumerate(sorted(groups.values(), key=lambda g: -len(g))):
        tag = "" if i == 0 else f"_{recs[0]['dtype']}_H{recs[0]['H']}{'_causal' if recs[0]['causal'] else ''}"
        if len({r["N"] for r in recs}) < 2 and i > 0:
            continue
        written += _plot_time_and_rate(plt, recs, outdir, tag)
        written += _plot_memory(plt, recs, outdir, tag)
    written += _plot_scaling(plt, records, outdir)
    written += _plot_memory_curve(plt, records, outdir)
    plt.close("all")
    return written


def main(argv: list[str] | None = None) -> int:
    """``python -m mpiattn.bench.plot RESULTS.jsonl [...] OUTDIR``: draw the plots of saved results."""
    from .report import load

    argv = sys.argv[1:] if argv is None else list(argv)
    if len(argv) < 2:
        print("usage: python -m mpiattn.bench.plot RESULTS.jsonl [MORE.jsonl ...] OUTDIR", file=sys.stderr)
        return 2
    for path in plot_all(load(argv[:-1]), argv[-1]):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
