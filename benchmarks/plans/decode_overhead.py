"""Per-step cost of a decode step against a small cache: one-shot ``KVCache.attend`` and a step of
a plan made once (``KVCache.plan_attend``) (issue 27, item 5).

Run under ``mpiexec -n P`` (P = 1, 2) with ``OMP_NUM_THREADS=1``; prints one JSON line on rank 0:
the median over ``--repeat`` rounds of the mean seconds per step of ``--calls`` steps each (one
new query, ``B = 1``, ``H = 4``, ``Hkv = 2``, ``E = 32``, float32, a cache of ``--n`` rows, no
append between steps: the per-step overhead, not the cache's growth). The two kinds alternate
round by round.
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
rng = np.random.default_rng(0)
k, v = (mpiattn.shard(rng.standard_normal((1, 2, args.n, 32)).astype(np.float32)) for _ in range(2))
q = rng.standard_normal((1, 4, 1, 32)).astype(np.float32)
cache = mpiattn.KVCache.from_shards(k, v)
plan = cache.plan_attend(q)
kinds = {"attend": lambda: cache.attend(q), "planned": lambda: plan(q)}
for fn in kinds.values():  # warm
    fn()
rounds = {name: [] for name in kinds}
for _ in range(args.repeat):
    for name, fn in kinds.items():
        comm.Barrier()
        t = time.perf_counter()
        for _ in range(args.calls):
            fn()
        rounds[name].append(comm.allreduce((time.perf_counter() - t) / args.calls, op=MPI.MAX))
out = {name: statistics.median(r) for name, r in rounds.items()}
if comm.rank == 0:
    print(json.dumps({"P": comm.size, "M": args.n, "seconds_per_step": out,
                      "planned/attend": out["planned"] / out["attend"]}))
