"""The Python sections of ``jobs/gpu_check.sh``: each prints one JSON object (its last line).

    python jobs/gpu_check.py preflight          versions; torch's op schemas
    python jobs/gpu_check.py grid [--small]     float16/32/64 x masks x engines, fwd+bwd vs float64
    python jobs/gpu_check.py stream [--small]   the documented stream pattern, 20 times
    python jobs/gpu_check.py kernels            a small driver of the fused kernels (for compute-sanitizer)
    python jobs/gpu_check.py hostdev [--small]  host time vs device time of a forward call
    python jobs/gpu_check.py pools              CuPy's and torch's pools around a torch-engine call

Runs on the GPU machine, or on the fake CuPy (``PYTHONPATH=tests/fake_site``) for
``--dry-run``; numbers from the fake mean nothing.
"""

import json
import math
import os
import sys
import time

import numpy as np


def _cupy():
    import cupy

    from mpiattn import gpu

    gpu.bind_device()
    return cupy


def preflight(small):
    import cupy

    out = {"python": sys.version.split()[0], "numpy": np.__version__, "cupy": cupy.__version__}
    try:
        out["cuda_runtime"] = int(cupy.cuda.runtime.runtimeGetVersion())
        props = cupy.cuda.runtime.getDeviceProperties(0)
        out["gpu"] = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    except Exception as exc:  # noqa: BLE001
        out["gpu_error"] = f"{type(exc).__name__}: {exc}"
    try:
        import torch

        from mpiattn.kernels import torch_ops

        out["torch"] = torch.__version__
        out["torch_cuda"] = bool(torch.cuda.is_available())
        bad = {}
        for name in torch_ops._SCHEMAS:
            try:
                torch_ops._op(name)
            except Exception as exc:  # noqa: BLE001
                bad[name] = str(exc).splitlines()[0]
        out["torch_schemas"] = "all match" if not bad else bad
    except ImportError as exc:
        out["torch"] = f"not importable: {exc}"
    out["CUDA_MODULE_LOADING"] = os.environ.get("CUDA_MODULE_LOADING")
    out["CUPY_CACHE_DIR"] = os.environ.get("CUPY_CACHE_DIR")
    return out


def _dense(q, k, v, vis, scale):
    """float64 attention and its gradients for dout = 1 (numpy), vis (B, N, M) bool."""
    B, H, N, E = q.shape
    G = H // k.shape[1]
    k, v = np.repeat(k, G, 1), np.repeat(v, G, 1)
    s = scale * q @ k.swapaxes(-1, -2)
    s = np.where(vis[:, None], s, -np.inf)
    m = s.max(-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0)
    p = np.exp(s - m)
    lsum = p.sum(-1, keepdims=True)
    p = p / np.where(lsum > 0, lsum, 1)
    out = p @ v
    do = np.ones_like(out)
    dv = p.swapaxes(-1, -2) @ do
    dp = do @ v.swapaxes(-1, -2)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True))
    dq = scale * ds @ k
    dk = scale * ds.swapaxes(-1, -2) @ q
    red = lambda x: x.reshape(B, -1, G, *x.shape[2:]).sum(2)  # noqa: E731
    return out, dq, red(dk), red(dv)


def grid(small):
    import mpiattn

    cp = _cupy()
    B, H, Hkv, N, E = (1, 4, 2, 96, 16) if small else (2, 8, 2, 1000, 64)
    rng = np.random.default_rng(0)
    rows = []
    masks = ["none", "causal", "padding", "window", "documents"]
    for dtype in ("float16", "float32", "float64"):
        q = rng.standard_normal((B, H, N, E))
        k, v = (rng.standard_normal((B, Hkv, N, E)) for _ in range(2))
        q, k, v = (x.astype(dtype).astype(np.float64) for x in (q, k, v))
        for mask in masks:
            kw, vis = {}, np.ones((B, N, N), bool)
            i, j = np.arange(N)[:, None], np.arange(N)[None, :]
            if mask == "causal":
                kw["causal"], vis = True, np.broadcast_to(j <= i, (B, N, N))
            elif mask == "padding":
                pad = rng.random((B, N)) < 0.2
                kw["key_padding_mask"], vis = cp.asarray(pad), np.broadcast_to(~pad[:, None, :], (B, N, N))
            elif mask == "window":
                kw["window"], vis = (N // 8, 3), np.broadcast_to((i - N // 8 <= j) & (j <= i + 3), (B, N, N))
            elif mask == "documents":
                seg = np.repeat(np.arange(4), -(-N // 4))[:N][None].repeat(B, 0)
                kw["segment_ids"], vis = seg, seg[:, :, None] == seg[:, None, :]
            ref = _dense(q, k, v, np.ascontiguousarray(vis), 1 / math.sqrt(E))
            for engine in ("native", "fused", "torch"):
                rec = {"dtype": dtype, "mask": mask, "engine": engine}
                try:
                    d = [cp.asarray(x.astype(dtype)) for x in (q, k, v)]
                    out, lse = mpiattn.attention(*d, engine=engine, **kw)
                    grads = mpiattn.attention_backward(cp.ones_like(out), *d, out, lse, engine=engine, **kw)
                    for nm, got, want in zip(("out", "dq", "dk", "dv"), (out, *grads), ref):
                        err = np.abs(cp.asnumpy(got).astype(np.float64) - want).max()
                        rec[nm] = float(err / max(np.abs(want).max(), 1e-30))
                    tol = {"float16": 2e-2, "float32": 1e-4, "float64": 1e-10}[dtype]
                    rec["ok"] = all(rec[nm] <= tol for nm in ("out", "dq", "dk", "dv"))
                except Exception as exc:  # noqa: BLE001 - the engine may not take this case
                    rec["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                    rec["ok"] = "cannot" in rec["error"] or "NotImplemented" in rec["error"]
                rows.append(rec)
    return {"cases": len(rows), "failed": [r for r in rows if not r["ok"]], "rows": rows}


def stream(small):
    import mpiattn
    from mpiattn import gpu

    cp = _cupy()
    N, E = (64, 16) if small else (4096, 64)
    rng = np.random.default_rng(1)
    host = [rng.standard_normal((1, 4, N, E)).astype(np.float32) for _ in range(3)]
    want = mpiattn.attention(*host, causal=True)[0]
    worst = 0.0
    for _ in range(3 if small else 20):
        d = [cp.asarray(x) for x in host]          # copies on the legacy stream
        big = cp.ones((2048, 2048), np.float32)
        for _ in range(3 if small else 50):        # a long kernel queue on the legacy stream
            big = big @ big * np.float32(1e-3)
        with gpu.compute_stream():
            out, _ = mpiattn.attention(*d, causal=True)
        worst = max(worst, float(np.abs(out.get() - want).max()))  # .get() outside the block
    return {"max_abs_diff": worst, "ok": worst < 1e-3}


def kernels(small):
    from mpiattn.kernels import fused

    cp = _cupy()
    rng = np.random.default_rng(2)
    res = {}
    for acc, op in (("float32", "float16"), ("float32", "float32"), ("float64", "float64")):
        S = cp.asarray(rng.standard_normal((4, 37, 136)).astype(acc))[..., :130]
        P = cp.zeros((4, 37, 136), op)[..., :130]
        m, l = cp.full((4, 37), -np.inf, acc), cp.zeros((4, 37), acc)
        O = cp.zeros((4, 37, 24), acc)
        bias = cp.asarray(np.where(rng.random((2, 130)) < 0.2, -np.inf, 0).astype(acc))
        fused.softmax_fwd_(S, P, m, l, O, bias, (10, 0, -40, 0, 2), 2)
        dP = cp.asarray(rng.standard_normal((4, 37, 136)).astype(acc))[..., :130]
        dS = cp.zeros((4, 37, 136), op)[..., :130]
        fused.softmax_bwd_(S, dP, P, dS, m, l, bias, (10, 0, -40, 0, 2), 2)
        cp.cuda.Device().synchronize()
        res[f"{acc}/{op}"] = bool(np.isfinite(cp.asnumpy(l)).all())
    return {"ran": res, "ok": all(res.values())}


def hostdev(small):
    import mpiattn

    cp = _cupy()
    N, E = (256, 16) if small else (16384, 128)
    rng = np.random.default_rng(3)
    d = [cp.asarray(rng.standard_normal((1, 8, N, E)).astype(np.float16)) for _ in range(3)]
    out = {}
    for engine in ("native", "fused"):
        mpiattn.attention(*d, causal=True, engine=engine)  # warm: compiles, allocates
        cp.cuda.Device().synchronize()
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        t0 = time.perf_counter()
        mpiattn.attention(*d, causal=True, check_finite=False, engine=engine)
        host_s = time.perf_counter() - t0
        end.record()
        end.synchronize()
        dev_s = cp.cuda.get_elapsed_time(start, end) / 1e3 if hasattr(cp.cuda, "get_elapsed_time") else None
        out["fused" if engine == "fused" else "generic"] = {"host_s": host_s, "device_s": dev_s}
    return out


def pools(small):
    import mpiattn

    cp = _cupy()
    try:
        import torch
    except ImportError:
        return {"skipped": "no torch"}
    if not torch.cuda.is_available():
        return {"skipped": "torch has no CUDA"}
    N = 256 if small else 8192
    d = [cp.asarray(np.random.default_rng(4).standard_normal((1, 8, N, 128)).astype(np.float16))
         for _ in range(3)]
    pool = cp.get_default_memory_pool()
    before = {"cupy_total": pool.total_bytes(), "torch_reserved": torch.cuda.memory_reserved()}
    out, lse = mpiattn.attention(*d, engine="torch", causal=True)
    mpiattn.attention_backward(cp.ones_like(out), *d, out, lse, engine="torch", causal=True)
    cp.cuda.Device().synchronize()
    after = {"cupy_total": pool.total_bytes(), "torch_reserved": torch.cuda.memory_reserved()}
    return {"before": before, "after": after}


if __name__ == "__main__":
    what, small = sys.argv[1], "--small" in sys.argv
    result = {"section": what, **globals()[what](small)}
    print(json.dumps(result, default=str))
