#!/usr/bin/env python
"""The thesis' experiment: a character-level Transformer LM on one long context split over ranks.

A small pre-norm Transformer (byte embedding, sinusoidal positions of the
*global* row index, ``--layers`` blocks of causal self-attention and a GELU
feed-forward, a final norm and a linear readout) is trained with Adam on one
context of ``--context`` characters per step, taken at a random offset of the
corpus: the Python standard library's own ``.py`` files (the top level of
``sysconfig.get_paths()["stdlib"]``, sorted by name), which every Python
installation carries, so nothing is downloaded.

``--attention mpiattn`` (the default) shards the context over the ranks of
``mpiexec`` in the zigzag layout (which balances causal attention): every
rank embeds, normalises and projects only its rows, and
:func:`mpiattn.torch.attention` computes the exact causal attention over the
whole context. The loss of a step is the mean over all ``--context``
characters (each rank adds its rows' cross-entropy divided by the global
count), and :func:`mpiattn.torch.reduce_gradients` sums the parameters'
partial gradients before every Adam step, so every rank takes the same step.

``--attention sdpa`` is the same model, the same initial weights (built after
``torch.manual_seed(--seed)``) and the same data on one process, its attention
``torch.nn.functional.scaled_dot_product_attention(..., is_causal=True)``:
the reference the distributed runs must follow, up to float32 rounding.

Run (rank 0 writes the JSON history: per-step loss in nats, bits per
character, seconds per step)::

    python examples/char_lm.py --attention sdpa --history examples/lm/sdpa.json
    python examples/char_lm.py --history examples/lm/P1.json
    mpiexec -n 2 python examples/char_lm.py --history examples/lm/P2.json
    mpiexec -n 4 python examples/char_lm.py --history examples/lm/P4.json
    python examples/plot_lm.py examples/lm/sdpa.json examples/lm/P*.json -o examples/lm/curves.png
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import math
import os
import platform
import sysconfig
import time

import numpy as np
import torch
from mpi4py import MPI
from torch import nn
from torch.nn import functional as F

import mpiattn
import mpiattn.torch as mt


# ------------------------------------------------------------------ the corpus
def corpus() -> tuple[np.ndarray, dict]:
    """The bytes of the standard library's top-level ``.py`` files, sorted by name, and what they are."""
    root = sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(os.path.join(root, "*.py")))
    data = b"".join(open(f, "rb").read() for f in files)
    info = {"root": root, "files": len(files), "bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest()[:16], "python": platform.python_version()}
    return np.frombuffer(data, dtype=np.uint8), info


def write_history(path: str | None, summary: dict) -> None:
    """Write a run's JSON history to ``path`` (its folder made), if given."""
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as fh:
            json.dump(summary, fh, indent=1)


# ------------------------------------------------------------------ the model
def positions(pos: torch.Tensor, d: int) -> torch.Tensor:
    """Sinusoidal embeddings ``(n, d)`` of global positions ``pos`` (so every shard agrees)."""
    i = torch.arange(d // 2, dtype=torch.float64)
    angle = pos.to(torch.float64)[:, None] / (10000.0 ** (2 * i / d))[None]
    return torch.cat([angle.sin(), angle.cos()], dim=1).to(torch.float32)


class SelfAttention(nn.Module):
    """Causal self-attention; the attention itself is ``attend(q, k, v)`` (mpiattn or SDPA)."""

    def __init__(self, d: int, heads: int, attend):
        super().__init__()
        self.heads, self.attend = heads, attend
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, n, d = x.shape
        qkv = self.qkv(x).reshape(B, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = (t.contiguous() for t in qkv)          # (B, H, n, D) each
        o = self.attend(q, k, v)
        return self.out(o.transpose(1, 2).reshape(B, n, d))


class Block(nn.Module):
    def __init__(self, d: int, heads: int, attend):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = SelfAttention(d, heads, attend)
        self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.ff(self.ln2(x))


class CharLM(nn.Module):
    def __init__(self, d: int, heads: int, layers: int, attend, vocab: int = 256):
        super().__init__()
        self.d = d
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, heads, attend) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Logits ``(1, n, vocab)`` of this rank's rows (``tokens``, global ``pos``: ``(n,)``)."""
        x = (self.embed(tokens) + positions(pos, self.d))[None]
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))


# ------------------------------------------------------------------ training
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--attention", choices=("mpiattn", "sdpa"), default="mpiattn")
    ap.add_argument("--context", type=int, default=8192, help="characters per step (default 8192)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch and BLAS threads per rank (default 1: P ranks use P cores)")
    ap.add_argument("--history", help="JSON file for the per-step history (rank 0 writes it)")
    args = ap.parse_args()

    comm = MPI.COMM_WORLD
    P, rank = comm.Get_size(), comm.Get_rank()
    if args.attention == "sdpa" and P != 1:
        raise SystemExit("--attention sdpa is the single-process reference: run it without mpiexec")
    threads = args.threads
    torch.set_num_threads(threads)
    from threadpoolctl import threadpool_limits
    threadpool_limits(threads)

    data, info = corpus()
    N = args.context
    rows = mpiattn.partition(N, comm, layout="zigzag")       # this rank's global positions
    if args.attention == "mpiattn":
        def attend(q, k, v):
            return mt.attention(q, k, v, comm=comm, causal=True, layout="zigzag")
    else:
        def attend(q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.manual_seed(args.seed)
    model = CharLM(args.d_model, args.heads, args.layers, attend)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    pos = torch.from_numpy(rows)
    history = []
    for step in range(args.steps):
        offset = int(np.random.default_rng([args.seed, step]).integers(0, data.size - N - 1))
        x = torch.from_numpy(data[offset + rows].astype(np.int64))
        y = torch.from_numpy(data[offset + rows + 1].astype(np.int64))
        comm.Barrier()
        t0 = time.perf_counter()
        logits = model(x, pos)[0]
        loss = F.cross_entropy(logits, y, reduction="sum") / N   # this rank's part of the mean
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if args.attention == "mpiattn":
            mt.reduce_gradients(model, comm)
        opt.step()
        comm.Barrier()
        seconds = time.perf_counter() - t0
        total = comm.allreduce(loss.item())                      # the whole context's mean
        history.append({"step": step, "loss": total, "bpc": total / math.log(2), "seconds": seconds})
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss {total:.6f}  bpc {total / math.log(2):.4f}  {seconds:.2f} s",
                  flush=True)
    if rank == 0:
        times = [h["seconds"] for h in history[1:]] or [history[0]["seconds"]]
        summary = {"attention": args.attention, "ranks": P, "context": N, "steps": args.steps,
                   "d_model": args.d_model, "heads": args.heads, "layers": args.layers, "lr": args.lr,
                   "seed": args.seed, "threads_per_rank": threads, "torch": torch.__version__,
                   "corpus": info, "median_seconds_per_step": float(np.median(times)),
                   "loadavg_1min_at_end": os.getloadavg()[0], "history": history}
        print(f"done: {args.attention} P={P}: loss {history[0]['loss']:.4f} -> {history[-1]['loss']:.4f}"
              f" ({history[-1]['bpc']:.3f} bpc), median {summary['median_seconds_per_step']:.2f} s/step")
        write_history(args.history, summary)


if __name__ == "__main__":
    main()
