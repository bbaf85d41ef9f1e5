"""Per-call cost of a tiny attention call: ``auto``, a fixed ring, and a plan (issue 27, item 5).

Run under ``mpiexec -n P`` (P = 1, 2) with ``OMP_NUM_THREADS=1``; prints one JSON line on rank 0:
the median over ``--repeat`` rounds of the mean seconds per call of ``--calls`` calls each, for
``mpiattn.attention(strategy="auto")``, ``mpiattn.attention(strategy="ring")`` and, where this
mpiattn has it, ``plan.forward`` of a plan made once (``strategy="auto"``). ``--old`` skips the
plan (for a checkout without ``plan_attention``).
"""

import argparse
import json
import statistics
import time

import numpy as np
from mpi4py import MPI

import mpiattn

ap = argparse.ArgumentParser()
ap.add_argument("--n", type=int, default=256)
ap.add_argument("--calls", type=int, default=200)
ap.add_argument("--repeat", type=int, default=7)
args = ap.parse_args()
comm = MPI.COMM_WORLD
x = mpiattn.shard(np.random.default_rng(0).standard_normal((1, 4, args.n, 32)).astype(np.float32))
kinds = {"auto": lambda: mpiattn.attention(x, x, x, strategy="auto"),
         "ring": lambda: mpiattn.attention(x, x, x, strategy="ring")}
if hasattr(mpiattn, "plan_attention"):
    plan = mpiattn.plan_attention(x, x, x)
    kinds["planned"] = lambda: plan.forward(x, x, x)
for fn in kinds.values():  # warm: the communicator's duplicate, imports
    fn()
out = {}
for name, fn in kinds.items():
    rounds = []
    for _ in range(args.repeat):
        comm.Barrier()
        t = time.perf_counter()
        for _ in range(args.calls):
            fn()
        rounds.append((time.perf_counter() - t) / args.calls)
    out[name] = statistics.median(comm.allreduce(r, op=MPI.MAX) for r in rounds)
if comm.rank == 0:
    print(json.dumps({"P": comm.size, "N": args.n, "seconds_per_call": out}))
