#!/usr/bin/env python
"""Plot the character-LM histories of char_lm.py, compare them with the reference, write a table.

Usage::

    python examples/plot_lm.py examples/lm/sdpa.json examples/lm/P1.json examples/lm/P2.json \\
        examples/lm/P4.json -o examples/lm/curves.png --csv examples/lm/curves.csv

The first file is the reference (the single-process SDPA model). The plot shows
bits per character against the step for every run and, beside it,
``|loss - reference loss|`` step by step; the CSV holds every run's loss (nats)
and bits per character per step and its seconds per step; the table printed
last gives each run's largest difference from the reference and its median time
per step.
"""

from __future__ import annotations

import argparse
import csv
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def label(run: dict) -> str:
    return "SDPA, 1 process" if run["attention"] == "sdpa" else f"mpiattn, P = {run['ranks']}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("histories", nargs="+", help="JSON files of char_lm.py; the first is the reference")
    ap.add_argument("-o", "--output", default="curves.png")
    ap.add_argument("--csv", help="also write the curves as CSV")
    args = ap.parse_args()
    runs = [json.load(open(p)) for p in args.histories]
    ref = runs[0]
    steps = np.array([h["step"] for h in ref["history"]])
    loss = {label(r): np.array([h["loss"] for h in r["history"]]) for r in runs}

    fig, (ax, dx) = plt.subplots(1, 2, figsize=(11, 4))
    for (name, lo), style in zip(loss.items(), ["-", "--", ":", "-."] * 3):
        ax.plot(steps[:lo.size], lo / np.log(2), style, lw=1.6, label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("bits per character (training context)")
    ax.set_title(f"char LM, {ref['context']} characters per step")
    ax.legend()
    ax.grid(alpha=0.3)
    rows = []
    for r in runs[1:]:
        name = label(r)
        n = min(loss[name].size, loss[label(ref)].size)
        diff = np.abs(loss[name][:n] - loss[label(ref)][:n])
        dx.semilogy(steps[:n], np.maximum(diff, 1e-9), ".-", ms=3, label=name)
        rows.append((name, float(diff.max()), r["median_seconds_per_step"], r["loadavg_1min_at_end"]))
    dx.axhline(np.finfo(np.float32).eps * float(np.max(loss[label(ref)])), color="gray", lw=0.8,
               ls="--", label="float32 eps x loss")
    dx.set_xlabel("step")
    dx.set_ylabel("|loss - SDPA loss| (nats; 0 drawn at 1e-9)")
    dx.set_title("difference from the single-process SDPA model")
    dx.legend(fontsize=8)
    dx.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.output, dpi=110)

    if args.csv:
        with open(args.csv, "w", newline="") as fh:
            w = csv.writer(fh)
            names = list(loss)
            w.writerow(["step"] + [f"{n} {what}" for n in names for what in ("loss", "bpc", "seconds")])
            for i, s in enumerate(steps):
                row = [int(s)]
                for r in runs:
                    h = r["history"][i] if i < len(r["history"]) else None
                    row += ["", "", ""] if h is None else [f"{h['loss']:.7f}", f"{h['bpc']:.7f}",
                                                         f"{h['seconds']:.3f}"]
                w.writerow(row)
    print(f"reference: {label(ref)}: median {ref['median_seconds_per_step']:.2f} s/step")
    print("| run | max abs loss difference | median s/step | 1-min load at end |")
    print("| --- | --- | --- | --- |")
    for name, d, s, load in rows:
        print(f"| {name} | {d:.2e} | {s:.2f} | {load:.1f} |")


if __name__ == "__main__":
    main()
