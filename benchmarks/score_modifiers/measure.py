"""What the score modifiers cost (issue 28's targets), as ratios measured in one run.

    python benchmarks/score_modifiers/measure.py cost          # one rank: softcap, sinks, ALiBi,
                                                               # score_mod (a softcap, a bias table),
                                                               # mpiattn.RelativeBias (the same table)
    mpiexec -n P python benchmarks/score_modifiers/measure.py skip   # block-diagonal mask_mod
    mpiexec -n P python benchmarks/score_modifiers/measure.py named  # a named rule vs its function

``cost``: N = 16384, H = 8, E = 64, float32, causal, the native engine: each modifier's
forward and forward + backward time over the plain call's. ``skip``: a block-diagonal
``mask_mod`` of 16 blocks against the full (unmasked) forward at the same shape. Prints one
JSON line per measurement (the best of ``--repeat`` runs). ``named``: causal attention with
Llama 4's chunks of N/8 rows, as the named rule ``chunked`` (its tile rule decides blocks and
tiles from their positions) and as a plain function of the same rule (evaluated tile by tile),
against plain causal attention, forward and forward + backward. Run it on an idle machine, with
one BLAS thread per rank.
"""

import argparse
import json
import time

import numpy as np

import mpiattn
from mpiattn.comm import get_comm


def best(fn, repeat):
    fn()  # warm: the first call pays for imports, plans and workspaces
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def cost(args):
    rng = np.random.default_rng(0)
    N, H, E = args.N, 8, 64
    q, k, v, do = (rng.standard_normal((1, H, N, E)).astype(np.float32) for _ in range(4))
    cap = np.float32(30.0)
    table = (0.1 * rng.standard_normal((H, 2 * N))).astype(np.float32)  # an (H, 2N) bias table
    flat = table.ravel()
    variants = {"plain": {}, "softcap": {"softcap": 30.0}, "sinks": {"sinks": rng.standard_normal(H)},
                "alibi": {"alibi_slopes": 2.0 ** -np.arange(1, H + 1)}}
    if hasattr(mpiattn, "ScoreMod"):  # (a release before score_mod: the others only)
        variants.update({
            "score_mod-softcap": {"score_mod": mpiattn.ScoreMod(
                lambda s, b, h, i, j: cap * np.tanh(s / cap),
                lambda s, b, h, i, j: 1 - np.tanh(s / cap) ** 2)},
            "score_mod-bias-table": {"score_mod": mpiattn.ScoreMod(
                lambda s, b, h, i, j: s + table[h, i - j + N],
                lambda s, b, h, i, j: np.ones_like(s))},
            # the same table read with np.take on its flat form: NumPy's gather by one index
            # array costs about half its 2-D fancy indexing (benchmarks/score_modifiers/README.md)
            "score_mod-bias-take": {"score_mod": mpiattn.ScoreMod(
                lambda s, b, h, i, j: s + np.take(flat, h * (2 * N) + (i - j + N)),
                lambda s, b, h, i, j: np.ones_like(s))}})
    if hasattr(mpiattn, "RelativeBias"):  # the same table and offset, added by Toeplitz views
        variants["score_mod-relative-bias"] = {"score_mod": mpiattn.RelativeBias(table, N)}
    if args.only:
        variants = {name: kw for name, kw in variants.items() if name == "plain" or name in args.only}
    base = {}
    for name, kw in variants.items():
        opts = dict(causal=True, engine="native", strategy="ring", check_finite=False, **kw)
        fwd = best(lambda: mpiattn.attention(q, k, v, **opts), args.repeat)
        out, lse = mpiattn.attention(q, k, v, **opts)
        both = fwd + best(lambda: mpiattn.attention_backward(do, q, k, v, out, lse, **opts), args.repeat)
        if name == "plain":
            base = {"forward": fwd, "forward+backward": both}
        print(json.dumps({"case": name, "N": N, "forward_s": round(fwd, 3),
                          "forward+backward_s": round(both, 3),
                          "forward_ratio": round(fwd / base["forward"], 3),
                          "forward+backward_ratio": round(both / base["forward+backward"], 3)}),
              flush=True)


def skip(args):
    c = get_comm()
    rng = np.random.default_rng(1)
    N, H, E, blocks = args.N, 8, 64, 16
    width = N // blocks
    Q, K, V = (rng.standard_normal((1, H, N, E)).astype(np.float32) for _ in range(3))
    q, k, v = (mpiattn.shard(x) for x in (Q, K, V))
    diag = lambda b, h, i, j: (i // width) == (j // width)  # noqa: E731
    opts = dict(engine="native", strategy="ring", check_finite=False)
    c.barrier()
    full = best(lambda: mpiattn.attention(q, k, v, **opts), args.repeat)
    c.barrier()
    masked = best(lambda: mpiattn.attention(q, k, v, mask_mod=diag, **opts), args.repeat)
    got = c.allgather_obj((full, masked))
    slow = (max(g[0] for g in got), max(g[1] for g in got))
    if c.rank == 0:
        print(json.dumps({"case": "block-diagonal mask_mod", "blocks": blocks, "N": N, "P": c.size,
                          "full_s": round(slow[0], 3), "masked_s": round(slow[1], 3),
                          "ratio": round(slow[1] / slow[0], 3)}), flush=True)


def named(args):
    from mpiattn.masks import mods

    c = get_comm()
    rng = np.random.default_rng(2)
    N, H, E = args.N, 8, 64
    Q, K, V, dO = (rng.standard_normal((1, H, N, E)).astype(np.float32) for _ in range(4))
    q, k, v, do = (mpiattn.shard(x) for x in (Q, K, V, dO))
    rule = mods.parse(f"chunked:{N // 8}")
    as_function = lambda b, h, i, j: rule(b, h, i, j)  # noqa: E731 - the same rule, unnamed
    opts = dict(causal=True, engine="native", strategy="ring", check_finite=False)
    times = {}
    for case, kw in (("causal", {}), ("named", {"mask_mod": rule}),
                     ("function", {"mask_mod": as_function})):
        c.barrier()
        fwd = best(lambda: mpiattn.attention(q, k, v, **opts, **kw), args.repeat)
        out, lse = mpiattn.attention(q, k, v, **opts, **kw)
        c.barrier()
        bwd = best(lambda: mpiattn.attention_backward(do, q, k, v, out, lse, **opts, **kw),
                   args.repeat)
        got = c.allgather_obj((fwd, fwd + bwd))
        times[case] = (max(g[0] for g in got), max(g[1] for g in got))
    if c.rank == 0:
        base = times["causal"]
        for case, (fwd, both) in times.items():
            print(json.dumps({"case": f"{case} (chunked:{N // 8})" if case != "causal" else case,
                              "N": N, "P": c.size, "forward_s": round(fwd, 3),
                              "forward+backward_s": round(both, 3),
                              "forward_ratio": round(fwd / base[0], 3),
                              "forward+backward_ratio": round(both / base[1], 3)}), flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=["cost", "skip", "named"])
    ap.add_argument("--N", type=int, default=16384)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--only", nargs="*", default=None, help="cost: these variants (and plain) only")
    a = ap.parse_args()
    {"cost": cost, "skip": skip, "named": named}[a.what](a)
