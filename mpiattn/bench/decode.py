"""The decode suite (issue 23): one decode step against a key/value cache sharded over P ranks.

Run it once per rank count and compare the step times::

    OMP_NUM_THREADS=1 python -m mpiattn.bench.decode                      # P = 1
    OMP_NUM_THREADS=1 mpiexec -n 2 python -m mpiattn.bench.decode         # P = 2
    python -m mpiattn.bench.decode --cache 8192 --repeats 3               # a smoke test, seconds

Defaults are the issue's target case: a cache of 256k tokens, ``H = Hkv = 8``,
``E = Ev = 128``, float32, one new token per step. The cache is adopted from
random shards (``mpiattn.KVCache.from_shards``, contiguous layout); each
step appends the new token's key and value (:meth:`~mpiattn.KVCache.append`)
and attends its query (:meth:`~mpiattn.KVCache.attend`). Printed (rank 0),
and written as JSON lines with ``--json``:

``step_ms``
    the median step (append + attend), between barriers
    (:class:`mpiattn.timing.Timer`);
``merge_ms``
    the median of the tree merge alone (:func:`mpiattn.inference.merge.tree_merge`
    on the step's partial, between barriers), and ``merge_share`` its
    fraction of the step (target at P = 2: at most 5 %);
``cache_mib_per_rank`` and ``bound_mib``
    the largest rank's key/value storage, and ``size / P + one page``.

The speed-up of P = 2 over P = 1 (target: at least 1.8x) is the ratio of
two runs' ``step_ms``; the environment (CPU, BLAS kernel and threads) is
printed with them (:func:`mpiattn.bench.environment.environment`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any

import numpy as np

from ..comm.core import get_comm
from ..inference import KVCache
from ..inference.decode import step_spec
from ..inference.local import partial_attention, step_attend
from ..inference.merge import tree_merge
from ..kernels import engines
from ..layouts import all_segments
from ..strategies.spec import Options
from ..timing import Timer
from .environment import environment

__all__ = ["main", "measure"]


def measure(c: Any, *, cache: int, heads: int, kv_heads: int, dim: int, dtype: str, tokens: int,
            repeats: int, page: int, seed: int = 1) -> dict:
    """One record: the decode step's times and memory at this communicator's size (collective)."""
    rng = np.random.default_rng(seed + c.rank)
    dt = np.dtype(dtype)
    (seg,) = all_segments(cache, c.size, "contiguous")[c.rank] or [(0, 0)]
    m = seg[1]
    k = rng.standard_normal((1, kv_heads, m, dim), dtype=np.float32).astype(dt, copy=False)
    v = rng.standard_normal((1, kv_heads, m, dim), dtype=np.float32).astype(dt, copy=False)
    kv = KVCache.from_shards(k, v, c, page=page)
    new = np.random.default_rng(seed + 1000)  # the same new tokens on every rank
    timer = Timer(c, np)
    steps, merges = [], []
    for i in range(repeats + 1):
        q = new.standard_normal((1, heads, tokens, dim), dtype=np.float32).astype(dt)
        kn = new.standard_normal((1, kv_heads, tokens, dim), dtype=np.float32).astype(dt)
        vn = new.standard_normal((1, kv_heads, tokens, dim), dtype=np.float32).astype(dt)
        with timer.phase("step"):
            kv.append(kn, vn)
            kv.attend(q)
        if i:  # the first step warms up
            steps.append(timer.times["step"])
        spec = step_spec(kv.shard, kv.length, q, Options(causal=True))
        attend = step_attend(engines.get("native"), spec, np.arange(kv.length - tokens, kv.length),
                             True)
        o, lse, _ = partial_attention(attend, q, kv.shard.views())
        with timer.phase("merge"):
            tree_merge(c, o, lse)
        if i:
            merges.append(timer.times["merge"])
        timer.times.clear()
    row = 2 * kv_heads * dim * dt.itemsize
    nbytes = max(c.allgather_obj(kv.nbytes))
    step, merge = statistics.median(steps), statistics.median(merges)
    return {"suite": "decode", "P": c.size, "cache": cache, "H": heads, "Hkv": kv_heads, "E": dim,
            "dtype": dtype, "tokens": tokens, "repeats": repeats, "page": page,
            "step_ms": step * 1e3, "step_ms_all": [s * 1e3 for s in steps],
            "merge_ms": merge * 1e3, "merge_share": merge / step if step else 0.0,
            "cache_mib_per_rank": nbytes / 2**20,
            "bound_mib": (-(-kv.length // c.size) + page) * row / 2**20}


def main(argv: list[str] | None = None) -> int:
    """``python -m mpiattn.bench.decode`` (see the module docstring)."""
    ap = argparse.ArgumentParser(prog="python -m mpiattn.bench.decode", description=__doc__.splitlines()[0])
    ap.add_argument("--cache", type=int, default=256 * 1024, help="cached tokens (default 262144)")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--dtype", choices=("float16", "float32", "float64"), default="float32")
    ap.add_argument("--tokens", type=int, default=1, help="new tokens per step (default 1)")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--page", type=int, default=4096)
    ap.add_argument("--json", default=None, help="append the record as a JSON line to this file")
    args = ap.parse_args(argv)
    c = get_comm()
    rec = measure(c, cache=args.cache, heads=args.heads, kv_heads=args.kv_heads, dim=args.dim,
                  dtype=args.dtype, tokens=args.tokens, repeats=args.repeats, page=args.page)
    env = environment()
    if c.rank == 0:
        rec["environment"] = env
        print(f"decode P={rec['P']} cache={rec['cache']} H={rec['H']} Hkv={rec['Hkv']} E={rec['E']} "
              f"{rec['dtype']} t={rec['tokens']}: step {rec['step_ms']:.2f} ms (median of "
              f"{rec['repeats']}), merge {rec['merge_ms']:.3f} ms ({100 * rec['merge_share']:.1f} % of "
              f"the step), cache {rec['cache_mib_per_rank']:.1f} MiB per rank (bound "
              f"{rec['bound_mib']:.1f} MiB = size/P + one page)")
        print("environment:", json.dumps({k: env.get(k) for k in ("cpu", "blas", "loadavg") if k in env}))
        if args.json:
            with open(args.json, "a", encoding="utf-8") as f:
                f.write(json.dumps(rec) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
