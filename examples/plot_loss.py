#!/usr/bin/env python
"""Plot loss histories written by train_retrieval.py (``--history``) into one PNG.

Usage::

    python examples/plot_loss.py loss_P1.txt loss_P4.txt -o examples/retrieval_loss.png

The first file is the baseline: a second panel shows ``|loss - baseline|`` of
the others, step by step (the curves agree up to rounding).
"""

from __future__ import annotations

import argparse

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def read_history(path: str) -> tuple[str, np.ndarray]:
    """(label from the header line, array of rows (step, loss, accuracy))."""
    with open(path) as fh:
        header = fh.readline().lstrip("# ").strip()
    return header, np.loadtxt(path, comments="#", ndmin=2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("histories", nargs="+")
    ap.add_argument("-o", "--output", default="retrieval_loss.png")
    args = ap.parse_args()
    runs = [read_history(p) for p in args.histories]
    fig, axes = plt.subplots(1, 2 if len(runs) > 1 else 1, figsize=(11 if len(runs) > 1 else 6, 4),
                             squeeze=False)
    ax = axes[0, 0]
    for (label, h), style in zip(runs, ["-", "--", ":", "-."] * 4):
        ax.plot(h[:, 0], h[:, 1], style, lw=1.5, label=label.split(" N=")[0])
    ax.axhline(np.log(8), color="grey", lw=0.8, ls=":", label="chance, ln 8")
    ax.set_yscale("log")
    ax.set_xlabel("Adam step")
    ax.set_ylabel("cross-entropy loss")
    ax.set_title(f"associative recall, {runs[0][0].split(' ', 1)[1]}", fontsize=10)
    ax.legend()
    if len(runs) > 1:
        base = runs[0][1]
        ax2 = axes[0, 1]
        for (label, h), style in zip(runs[1:], ["--", ":", "-."] * 4):
            n = min(len(h), len(base))
            diff = np.abs(h[:n, 1] - base[:n, 1])
            shown = diff > 0  # equal values have no place on a log axis
            ax2.semilogy(h[:n, 0][shown], diff[shown], style, lw=1,
                         label=f"{label.split(' N=')[0]}: max {diff.max():.2g}")
            print(f"{args.histories[0]} vs {label}: max |loss difference| {diff.max():.3g}")
        ax2.set_xlabel("Adam step")
        ax2.set_ylabel(f"|loss - loss({runs[0][0].split(' N=')[0]})|")
        ax2.set_title("difference between rank counts (rounding)", fontsize=10)
        ax2.legend()
    fig.tight_layout()
    fig.savefig(args.output, dpi=110)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
