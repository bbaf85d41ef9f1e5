"""The products suite: the sequence-sharded ``A·Bᵀ``, ``A·B``, ``Aᵀ·B`` beside a local matmul.

``product`` tasks time :func:`mpiattn.matmul_nt` / ``nn`` / ``tn`` (global
sizes ``N`` rows of the sharded operand, ``M`` rows of the other, width
``d``) and, on the same ranks in the same run, a plain local ``matmul`` of
the same per-rank shapes with no communication (for ``tn`` the transposed
view ``x.T @ y``, NumPy's own spelling of ``Aᵀ·B``). ``frac_local_gemm`` is
the local time over the distributed one.

``overlap`` tasks measure how much of one ring step of ``matmul_nt`` the
transfer hides: the transfer of one piece to the next rank alone, the
piece's matmul alone, and both together (``Isend``/``Irecv`` posted, matmul,
wait); ``hidden = (t_transfer + t_matmul - t_both) / t_transfer`` (1: fully
hidden, 0: not at all). Both use the bench's one harness,
:class:`~mpiattn.timing.Timer`.
"""

from __future__ import annotations

import types
from typing import Any

import numpy as np

from .. import backend
from ..layouts import local_length
from .memory import MemoryMeter
from .tasks import Settings, Task
from ..timing import Timer

__all__ = ["SHAPES", "product_task", "overlap_task"]

#: op -> (shape of a, of b, of x, of y) for the distributed call (a, b) and the local one (x, y).
SHAPES = types.MappingProxyType({
    "nt": lambda n, m, N, M, d: ((n, d), (m, d), (n, d), (d, M)),
    "nn": lambda n, m, N, M, d: ((n, M), (m, d), (n, M), (M, d)),
    "tn": lambda n, m, N, M, d: ((m, N), (m, d), (m, N), (m, d)),
})
_TAG = 77


def draw(xp: Any, rng: np.random.Generator, shape: tuple, dtype: str) -> Any:
    """Standard normal numbers of ``shape`` in ``dtype``, drawn on the host, in namespace ``xp``."""
    return backend.to_device(rng.standard_normal(shape, dtype=np.float32).astype(dtype), xp)


def product_task(c: Any, xp: Any, t: Task, settings: Settings, mem: MemoryMeter) -> list[dict]:
    """A distributed product beside a plain local matmul of the same per-rank shapes."""
    from .. import products

    timer = Timer(c, xp)
    N, M, d = t.N, t.M, t.d
    n = local_length(N, c.rank, c.size, t.layout)
    m = local_length(M, c.rank, c.size, t.layout)
    rng = np.random.default_rng([settings.seed, c.size, c.rank, 3])
    sa, sb, sx, sy = SHAPES[t.op](n, m, N, M, d)
    a, b = draw(xp, rng, sa, t.dtype), draw(xp, rng, sb, t.dtype)
    fn = {"nt": products.matmul_nt, "nn": products.matmul_nn, "tn": products.matmul_tn}[t.op]
    sent0 = c.bytes_sent
    dist = timer.measure(lambda: fn(a, b, c, layout=t.layout, block_size=t.block), t.warmup, t.repeat)
    sent = (c.bytes_sent - sent0) / (t.warmup + t.repeat)
    a = b = None                    # freed before the local operands are drawn
    x, y = draw(xp, rng, sx, t.dtype), draw(xp, rng, sy, t.dtype)
    if t.op == "tn":
        x = x.T
    local = timer.measure(lambda: xp.matmul(x, y), t.warmup, t.repeat)
    flops = 2.0 * N * M * d
    return [dict(t.to_dict(), P=c.size, status="ok", times_s=dist.times, time_s=dist.median, flops=flops,
                 gflops=flops / dist.median / 1e9, gflops_per_rank=flops / dist.median / 1e9 / c.size,
                 local_gemm_times_s=local.times, local_gemm_time_s=local.median,
                 frac_local_gemm=local.median / dist.median,
                 bytes_sent_per_rank=max(c.allgather_obj(sent)), peak_bytes=max(c.allgather_obj(mem.peak())))]


def overlap_task(c: Any, xp: Any, t: Task, settings: Settings, mem: MemoryMeter) -> list[dict]:
    """One ``matmul_nt`` ring step: a ``(rows, d)`` ``a`` times a ``(block, d)`` piece in flight."""
    from ..products import default_block_size

    base = dict(t.to_dict(), P=c.size)
    if c.size < 2:
        return [dict(base, status="skipped", reason="overlap needs >= 2 ranks")]
    timer = Timer(c, xp)
    dt = np.dtype(t.dtype)
    n_r = -(-t.N // c.size)
    rows = int(t.rows or n_r)
    block = min(n_r, int(t.block or default_block_size(n_r, t.d * dt.itemsize)))
    rng = np.random.default_rng([settings.seed, 7, c.rank])
    a = draw(xp, rng, (rows, t.d), t.dtype)
    mine, other = draw(xp, rng, (block, t.d), t.dtype), draw(xp, rng, (block, t.d), t.dtype)
    incoming = xp.empty_like(mine)
    out = xp.empty((rows, block), dtype=dt)
    nxt, prv = (c.rank + 1) % c.size, (c.rank - 1) % c.size

    def post() -> tuple[Any, Any]:
        return c.irecv(incoming, prv, _TAG), c.isend(mine, nxt, _TAG)

    def transfer() -> None:
        for r in post():
            r.wait()

    def compute() -> None:
        xp.matmul(a, other.T, out=out)

    def both() -> None:
        reqs = post()
        compute()
        for r in reqs:
            r.wait()

    samples: dict[str, list[float]] = {"transfer": [], "matmul": [], "both": []}
    for _ in range(int(t.repeat)):           # interleaved, so the three see the same machine state
        for name, fn in (("transfer", transfer), ("matmul", compute), ("both", both)):
            samples[name] += timer.measure(fn, 0, 1).times
    med = {k: float(np.median(v)) for k, v in samples.items()}
    hidden = (med["transfer"] + med["matmul"] - med["both"]) / med["transfer"]
    spread = max(samples["matmul"]) - min(samples["matmul"])
    return [dict(base, status="ok", rows=rows, block=block, piece_bytes=int(mine.nbytes),
                 transfer_s=med["transfer"], matmul_s=med["matmul"], both_s=med["both"],
                 hidden=max(0.0, min(1.0, hidden)), hidden_raw=hidden, matmul_spread_s=spread,
                 resolvable=spread <= med["transfer"])]
