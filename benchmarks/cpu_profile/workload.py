"""One rank's attention call for a CPU profile (issue 40): ``python workload.py DTYPE WHAT ENGINE``.

``DTYPE``: float32, bfloat16 or float16; ``WHAT``: ``fwd`` or ``fwdbwd``; ``ENGINE``: native,
torch (mpiattn's torch engine) or sdpa (torch's own ``scaled_dot_product_attention``, the
yardstick). P = 1, B = 1, H = 1, E = 64, causal, N from ``MPIATTN_PROFILE_N`` (default 8192).
Prints the median seconds of ``MPIATTN_PROFILE_REPEAT`` calls (default 1) after one warm-up as
JSON; ``perf record`` around it, its start delayed past the imports and the warm-up, gives where
the calls' time goes (``profile.sh``).
"""

import json
import os
import sys
import time

import numpy as np


def main() -> None:
    dtype, what, engine = sys.argv[1:4]
    N = int(os.environ.get("MPIATTN_PROFILE_N", 8192))
    B, H, E = 1, 1, 64
    rng = np.random.default_rng(0)
    x = [rng.standard_normal((B, H, N, E)).astype(np.float32) for _ in range(4)]
    import torch

    torch.set_num_threads(1)
    tdt = getattr(torch, dtype)
    if engine == "sdpa":
        q, k, v, do = (torch.from_numpy(a).to(tdt).requires_grad_(what == "fwdbwd") for a in x)

        def call():
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            if what == "fwdbwd":
                out.backward(do.detach())
    else:
        import mpiattn
        from mpi4py import MPI

        if dtype == "bfloat16":
            import ml_dtypes
            arrays = [a.astype(ml_dtypes.bfloat16) for a in x]
        else:
            arrays = [a.astype(dtype) for a in x]
        q, k, v, do = arrays
        comm = MPI.COMM_WORLD

        def call():
            out, lse = mpiattn.attention(q, k, v, comm, causal=True, engine=engine)
            if what == "fwdbwd":
                mpiattn.attention_backward(do, q, k, v, out, lse, comm, causal=True, engine=engine)
    call()  # warm-up
    repeat = int(os.environ.get("MPIATTN_PROFILE_REPEAT", 1))
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    print(json.dumps({"dtype": dtype, "what": what, "engine": engine, "N": N,
                      "seconds": float(np.median(times)), "repeat": repeat}))


if __name__ == "__main__":
    main()
