#!/usr/bin/env python
"""Train mpiattn.MultiheadAttention on associative recall over one long sharded sequence.

Every step draws a fresh sequence of ``N`` tokens (the same on every rank;
each rank keeps its rows of the contiguous layout):

* the first quarter holds ``K`` *memory* tokens, each repeated ``copies``
  times at random positions; memory token ``k`` carries key ``k`` and a value
  ``v_k`` drawn anew for every sequence;
* the last quarter holds ``NQ`` *query* tokens at random positions, each
  asking for one key;
* all other positions are noise tokens (64 kinds).

A token's embedding is the sum of fixed random vectors: memory
``key_k + value_v + memory_flag``, query ``query_key_k + query_flag``.

The model is one self-attention layer plus a linear readout that predicts
``v_k`` at each query position (cross-entropy). A query sits more than
``N/2`` positions after its memory token, so with ``P`` ranks (``P >= 2``)
the answer always lies on another rank's shard: the task can only be
solved through the distributed attention. The token embeddings are fixed
random vectors; the layer and the readout are trained with Adam (written
out below). Gradients are identical on every rank, so every rank takes the
same steps and the loss curve does not depend on ``P`` (up to rounding).

Run (prints the loss; rank 0 writes the per-step history)::

    mpirun -n 4 python examples/train_retrieval.py --history loss_P4.txt
    python examples/train_retrieval.py --history loss_P1.txt
    python examples/plot_loss.py loss_P1.txt loss_P4.txt -o examples/retrieval_loss.png
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI

import mpiattn


def make_task(args: argparse.Namespace) -> dict[str, np.ndarray]:
    """Fixed random embeddings of the token kinds (the same on every rank)."""
    rng = np.random.default_rng(args.seed + 1)
    E = args.embed_dim
    emb = lambda rows: rng.standard_normal((rows, E)) / np.sqrt(E)
    return {"key_mem": emb(args.keys), "key_query": emb(args.keys), "value": emb(args.values),
            "noise": args.noise_scale * emb(args.noise_tokens), "memory_flag": emb(1)[0],
            "query_flag": emb(1)[0]}


def make_sequence(task: dict, args: argparse.Namespace, step: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One global sequence: x (N, E), query positions (NQ,), target values (NQ,)."""
    rng = np.random.default_rng([args.seed, step])
    N, K, quarter = args.seq_len, args.keys, args.seq_len // 4
    x = task["noise"][rng.integers(args.noise_tokens, size=N)]
    mem_pos = rng.choice(quarter, size=(args.copies, K), replace=False)
    values = rng.integers(args.values, size=K)
    x[mem_pos] = task["key_mem"] + task["value"][values] + task["memory_flag"]
    q_pos = N - quarter + rng.choice(quarter, size=args.queries, replace=False)
    q_key = rng.integers(K, size=args.queries)
    x[q_pos] = task["key_query"][q_key] + task["query_flag"]
    return x, q_pos, values[q_key]


class Adam:
    """Adam (Kingma & Ba 2015) on a dict of arrays, updated in place."""

    def __init__(self, params: dict, lr: float, betas=(0.9, 0.999), eps: float = 1e-8):
        self.params, self.lr, self.betas, self.eps, self.t = params, lr, betas, eps, 0
        self.m = {k: np.zeros(v.shape, dtype=np.float64) for k, v in params.items()}
        self.v = {k: np.zeros(v.shape, dtype=np.float64) for k, v in params.items()}

    def step(self, grads: dict) -> None:
        b1, b2 = self.betas
        self.t += 1
        for k, g in grads.items():
            self.m[k] = b1 * self.m[k] + (1 - b1) * g
            self.v[k] = b2 * self.v[k] + (1 - b2) * g * g
            m_hat = self.m[k] / (1 - b1 ** self.t)
            v_hat = self.v[k] / (1 - b2 ** self.t)
            p = self.params[k]
            p -= (self.lr * m_hat / (np.sqrt(v_hat) + self.eps)).astype(p.dtype)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=2048, help="global sequence length N")
    ap.add_argument("--embed-dim", type=int, default=32)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--keys", type=int, default=8, help="distinct keys (memory tokens) per sequence")
    ap.add_argument("--values", type=int, default=8, help="value classes")
    ap.add_argument("--copies", type=int, default=16, help="copies of each memory token")
    ap.add_argument("--queries", type=int, default=256, help="query tokens per sequence")
    ap.add_argument("--noise-tokens", type=int, default=64)
    ap.add_argument("--noise-scale", type=float, default=1.0, help="norm of the noise embeddings")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--print-every", type=int, default=10)
    ap.add_argument("--history", help="rank 0 writes 'step loss accuracy' lines here")
    ap.add_argument("--save", help="save the trained layer here (HDF5)")
    ap.add_argument("--threads", type=int, default=1,
                    help="BLAS threads per rank (default 1: P ranks use P cores)")
    args = ap.parse_args()
    from threadpoolctl import threadpool_limits
    threadpool_limits(args.threads)  # (NumPy's BLAS would start one thread per core in each rank)

    comm = MPI.COMM_WORLD
    c = mpiattn.get_comm(comm)
    dtype = np.dtype(args.dtype)
    E, NV = args.embed_dim, args.values
    layer = mpiattn.MultiheadAttention(E, args.heads, dtype=dtype, seed=args.seed)
    rng = np.random.default_rng(args.seed + 2)
    readout = {"w": (rng.standard_normal((E, NV)) / np.sqrt(E)).astype(dtype),
               "b": np.zeros(NV, dtype=dtype)}
    params = {**{f"attn.{k}": v for k, v in layer.params.items()},
              **{f"readout.{k}": v for k, v in readout.items()}}
    opt = Adam(params, args.lr)
    task = make_task(args)
    owned = mpiattn.partition(args.seq_len, comm)  # global positions of this rank's rows
    local_row = np.full(args.seq_len, -1)
    local_row[owned] = np.arange(owned.size)
    if c.rank == 0:
        print(f"associative recall: N={args.seq_len} over P={c.size} ranks (N/P={args.seq_len // c.size}), "
              f"E={E}, heads={args.heads}, {args.keys} keys, {NV} values, {args.queries} queries/seq, "
              f"{dtype.name}; chance loss ln({NV})={np.log(NV):.3f}", flush=True)

    history = []
    t0 = time.perf_counter()
    for step in range(args.steps):
        x, q_pos, target = make_sequence(task, args, step)
        mine = local_row[q_pos] >= 0  # queries on this rank
        rows, tgt = local_row[q_pos[mine]], target[mine]
        # forward: attention layer on this rank's rows, readout at its query rows
        y = layer.forward(x[owned][None].astype(dtype), comm=comm)
        h = y[0, rows].astype(np.float64)
        logits = h @ readout["w"] + readout["b"]
        logits -= logits.max(axis=1, keepdims=True)
        prob = np.exp(logits)
        prob /= prob.sum(axis=1, keepdims=True)
        # backward of the mean cross-entropy over all queries of all ranks
        d_logits = prob.copy()
        d_logits[np.arange(tgt.size), tgt] -= 1.0
        d_logits /= args.queries
        red = np.concatenate([(h.T @ d_logits).ravel(), d_logits.sum(axis=0),
                              [-np.log(prob[np.arange(tgt.size), tgt]).sum(),
                               float((prob.argmax(axis=1) == tgt).sum())]])
        c.allreduce_(red)  # readout gradients, loss and hits summed over ranks
        g_w, g_b = red[:E * NV].reshape(E, NV), red[E * NV:E * NV + NV]
        loss, acc = red[-2] / args.queries, red[-1] / args.queries
        dy = np.zeros(y.shape, dtype=np.float64)
        dy[0, rows] = d_logits @ readout["w"].T
        layer.backward(dy.astype(dtype))
        grads = {**{f"attn.{k}": g for k, g in layer.grads.items()}, "readout.w": g_w, "readout.b": g_b}
        opt.step(grads)
        history.append((step, loss, acc))
        if c.rank == 0 and (step % args.print_every == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {loss:.6f}  accuracy {acc:.3f}  "
                  f"({time.perf_counter() - t0:.1f} s)", flush=True)

    if c.rank == 0:
        print(f"done: loss {history[0][1]:.6f} -> {history[-1][1]:.6f} in {args.steps} steps, "
              f"{time.perf_counter() - t0:.1f} s", flush=True)
        if args.history:
            with open(args.history, "w") as fh:
                fh.write(f"# P={c.size} N={args.seq_len} dtype={dtype.name} seed={args.seed}\n")
                fh.writelines(f"{s} {float(loss)!r} {float(acc)!r}\n" for s, loss, acc in history)
    if args.save:
        layer.save(args.save, comm)


if __name__ == "__main__":
    main()
