"""``python -m mpiattn plan``: what every strategy would cost on a machine, and what ``auto`` picks.

With ``--cache M`` it also predicts inference over a KV cache of ``M`` rows
sharded over the ranks: a decode step of ``--new-tokens`` queries
(:func:`mpiattn.inference.decode.predict_step`) and a chunked prefill of
``--chunk`` rows (:func:`mpiattn.inference.prefill.choose`: pass-KV or pass-Q).

Nothing runs and nothing is sent: the problem (``--seq``, ``--heads``, ...)
and the machine (``--nodes`` x ``--ranks-per-node`` ranks, ``--hardware``
profile or ``--calibration`` file) go through the cost model
(:mod:`mpiattn.strategies.model`) for every strategy of the registry and
every split of the two-level ones. A table (or ``--json``) gives, per
configured strategy: the predicted forward and forward+backward seconds,
the bytes the busiest rank sends inside its node and between nodes, its
memory, the parallel efficiency, and ``auto``'s choice.

bfloat16 is sized as float16 (two bytes, float32 accumulators, as the
engines compute it) and timed at the machine's bfloat16 rate.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


from ..comm.topology import Topology
from ..inference import prefill
from ..inference.decode import predict_step
from ..inference.pricing import PassQ, chunk_spec
from ..kernels import engines
from ..strategies import AttentionSpec, Options, machines, model, registry
from . import argtypes
from .common import UsageError

__all__ = ["add_arguments", "cmd_plan", "build"]

DTYPES = ("bfloat16", "float16", "float32", "float64")
MiB, GiB = 2.0**20, 2.0**30
#: The most ranks (``--nodes`` x ``--ranks-per-node``) a plan models: far more than one
#: attention's communicator spans today, and few enough that the plan takes a fraction of a
#: second (the model's work per rank is vectorised; the layouts' rows are listed per rank).
MAX_RANKS = 2**16
#: The argparse type of ``--nodes`` and ``--ranks-per-node``.
_ranks = argtypes.int_in(1, MAX_RANKS)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``plan``."""
    positive_int, window = argtypes.positive_int, argtypes.window
    g = p.add_argument_group("the problem")
    g.add_argument("--seq", type=positive_int, required=True, help="N, query rows")
    g.add_argument("--kv-seq", type=positive_int, default=None, help="M, key rows (default N)")
    g.add_argument("--batch", type=positive_int, default=1, help="B (default 1)")
    g.add_argument("--heads", type=positive_int, required=True, help="H, query heads")
    g.add_argument("--kv-heads", type=positive_int, default=None, help="Hkv (default H)")
    g.add_argument("--dim", type=positive_int, required=True, help="E, the head dimension")
    g.add_argument("--value-dim", type=positive_int, default=None, help="Ev (default E)")
    g.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="default bfloat16")
    g.add_argument("--causal", action="store_true")
    g.add_argument("--window", type=window, default=None, metavar="L,R", help="sliding window")
    g.add_argument("--block-size", type=positive_int, default=None, metavar="ROWS",
                   help="rows per exchanged block (default: the engine's preference)")
    m = p.add_argument_group("the machine")
    m.add_argument("--nodes", type=_ranks, default=1,
                   help=f"nodes (default 1; nodes x ranks per node at most {MAX_RANKS})")
    m.add_argument("--ranks-per-node", type=_ranks, default=8,
                   help="ranks (GPUs) per node (default 8)")
    hw = m.add_mutually_exclusive_group()
    hw.add_argument("--hardware", choices=tuple(machines.PROFILES), default=None,
                    help="a documented machine profile (default: $MPIATTN_MACHINE, else "
                         f"{machines.DEFAULT_FOR_DEVICE['cupy']})")
    hw.add_argument("--calibration", default=None, metavar="FILE",
                    help="a machine measured by `python -m mpiattn calibrate`")
    i = p.add_argument_group("inference (with --cache: a decode step and a chunked prefill)")
    i.add_argument("--cache", type=positive_int, default=None, metavar="M",
                   help="rows in a KV cache sharded over the ranks: also predict decode and prefill")
    i.add_argument("--new-tokens", type=positive_int, default=None, metavar="T",
                   help="queries per decode step (default 1; needs --cache)")
    i.add_argument("--chunk", type=positive_int, default=None, metavar="C",
                   help="rows of a prefill chunk against the cache (default --seq; needs --cache)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")


def build(args: Any) -> dict:
    """The plan of parsed ``args`` as a JSON-ready dict (raises UsageError for a bad machine)."""
    if args.cache is None and (args.new_tokens is not None or args.chunk is not None):
        given = [f for f, v in (("--new-tokens", args.new_tokens), ("--chunk", args.chunk))
                 if v is not None]
        raise UsageError(f"{' and '.join(given)} describe{'s' if len(given) == 1 else ''} inference "
                         "against a cache: give --cache M too")
    if args.nodes * args.ranks_per_node > MAX_RANKS:
        raise UsageError(f"--nodes {args.nodes} x --ranks-per-node {args.ranks_per_node} = "
                         f"{args.nodes * args.ranks_per_node} ranks; plan models at most {MAX_RANKS}")
    try:
        machine = machines.load(machines.resolve_name(args.hardware or args.calibration, "cupy"))
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.dtype not in machine.rates:
        raise UsageError(f"machine {machine.name!r} has no compute rate for {args.dtype}")
    topo = Topology.blocks(args.nodes * args.ranks_per_node, args.ranks_per_node)
    P = topo.P
    Hkv = args.kv_heads or args.heads
    if args.heads % Hkv:
        raise UsageError(f"--heads {args.heads} must be a multiple of --kv-heads {Hkv}")
    M, Ev = args.kv_seq or args.seq, args.value_dim or args.dim
    options = Options(causal=args.causal, window=args.window, block_size=args.block_size,
                      layout="zigzag" if args.causal else "contiguous")
    size_dtype = "float16" if args.dtype == "bfloat16" else args.dtype
    spec = AttentionSpec.from_shapes((args.batch, args.heads, args.seq, args.dim),
                                     (args.batch, Hkv, M, args.dim), (args.batch, Hkv, M, Ev),
                                     size_dtype, options, device="cupy")
    block = args.block_size or engines.get(engines.AUTO[0]).block_rows(spec, -(-M // P))
    rows = registry.table(spec, topo, block, machine, rate_dtype=args.dtype)
    return {
        "inference": None if args.cache is None else _inference(args, Hkv, Ev, topo, machine),
        "problem": {"B": args.batch, "H": args.heads, "Hkv": Hkv, "N": args.seq, "M": M, "E": args.dim,
                    "Ev": Ev, "dtype": args.dtype, "causal": args.causal,
                    "window": None if args.window is None else list(args.window), "block": block},
        "machine": {"name": machine.name, "nodes": args.nodes, "ranks_per_node": args.ranks_per_node},
        "auto": next((r.label for r in rows if r.auto), None),
        "rows": [_row(r) for r in rows],
    }


def _inference(args: Any, Hkv: int, Ev: int, topo: Topology, machine: Any) -> dict:
    """Decode step and chunked prefill against a cache of ``--cache`` rows, on P ranks and on one
    (the new rows' calls priced by the model's one entry point, :mod:`mpiattn.inference.pricing`)."""
    M, t, C = args.cache, args.new_tokens or 1, args.chunk or args.seq
    size_dtype = "float16" if args.dtype == "bfloat16" else args.dtype
    one = Topology.blocks(1, 1)

    def call(n: int) -> Any:
        return chunk_spec(args.batch, args.heads, Hkv, n, M, args.dim, Ev, size_dtype, args.window)

    step = predict_step(call(t), topo, machine, rate_dtype=args.dtype)
    alone = predict_step(call(t), one, machine, rate_dtype=args.dtype)
    chunk = call(C)
    pre = prefill.choose(chunk, topo, machine, rate_dtype=args.dtype)
    pre_one_s = model.predict(PassQ(), chunk, one, chunk.M, machine, rate_dtype=args.dtype).forward_s
    return {"cache": M, "new_tokens": t, "chunk": C,
            "decode": {**step, "one_rank_s": alone["step_s"], "speedup": alone["step_s"] / step["step_s"]},
            "prefill": {"variant": pre.variant, "pass_kv_s": pre.pass_kv_s, "pass_q_s": pre.pass_q_s,
                        "pass_kv_bytes": pre.pass_kv_bytes, "pass_q_bytes": pre.pass_q_bytes,
                        "one_rank_s": pre_one_s}}


def _row(r: registry.Row) -> dict:
    if r.prediction is None:
        return {"strategy": r.label, "supported": False, "why": r.why}
    p = r.prediction
    return {"strategy": r.label, "supported": True, "auto": r.auto, "pickable": r.pickable,
            "forward_s": p.forward_s, "fwdbwd_s": p.fwdbwd_s, "inside_bytes": p.inside,
            "between_bytes": p.between, "memory_bytes": p.memory, "fits": r.fits,
            "efficiency": p.efficiency}


def render(plan: dict) -> str:
    """The plan as a table, one line per configured strategy."""
    pr, mc = plan["problem"], plan["machine"]
    mask = "causal" if pr["causal"] else "full"
    if pr["window"] is not None:
        mask += f", window {pr['window']}"
    lines = [f"plan: B={pr['B']} H={pr['H']} Hkv={pr['Hkv']} N={pr['N']:,} M={pr['M']:,} E={pr['E']} "
             f"Ev={pr['Ev']} {pr['dtype']} {mask}; {mc['nodes']} node(s) x {mc['ranks_per_node']} "
             f"rank(s) on {mc['name']}; block {pr['block']}",
             "bytes: sent by the busiest rank, forward + backward; memory: peak per rank",
             f"{'strategy':<24} {'fwd s':>10} {'fwd+bwd s':>10} {'MiB inside':>11} "
             f"{'MiB between':>11} {'GiB/rank':>9} {'effic.':>7}"]
    for r in plan["rows"]:
        if not r["supported"]:
            lines.append(f"{r['strategy']:<24} {'-':>10}  ({r['why']})")
            continue
        note = "  <- auto" if r["auto"] else ("  (never auto)" if not r["pickable"] else "")
        if not r["fits"]:
            note += "  (does not fit)"
        lines.append(f"{r['strategy']:<24} {r['forward_s']:>10.4g} {r['fwdbwd_s']:>10.4g} "
                     f"{r['inside_bytes'] / MiB:>11.1f} {r['between_bytes'] / MiB:>11.1f} "
                     f"{r['memory_bytes'] / GiB:>9.2f} {r['efficiency']:>7.3f}{note}")
    lines.append(f"auto: {plan['auto']}")
    inf = plan["inference"]
    if inf is not None:
        d, f, P = inf["decode"], inf["prefill"], mc["nodes"] * mc["ranks_per_node"]
        chosen = f["pass_q_s"] if f["variant"] == "pass-q" else f["pass_kv_s"]
        lines += [f"inference against a cache of {inf['cache']:,} rows sharded over the ranks:",
                  f"  decode step, {inf['new_tokens']} new token(s): {d['step_s'] * 1e3:.4g} ms (compute "
                  f"{d['compute_s'] * 1e3:.3g}, memory read {d['read_s'] * 1e3:.3g}, merge "
                  f"{d['merge_s'] * 1e3:.3g} ms); one rank {d['one_rank_s'] * 1e3:.4g} ms: "
                  f"{d['speedup']:.3g}x, efficiency {d['speedup'] / P:.3f}",
                  f"  chunked prefill of {inf['chunk']:,} rows: pass-kv {f['pass_kv_s']:.4g} s, pass-q "
                  f"{f['pass_q_s']:.4g} s -> {f['variant']}; one rank {f['one_rank_s']:.4g} s: "
                  f"efficiency {f['one_rank_s'] / chosen / P:.3f}"]
    return "\n".join(lines)


def cmd_plan(args: Any, con: Any) -> int:
    """``mpiattn plan``: rank 0 prints (every rank computes the same plan)."""
    plan = build(args)
    if con.rank == 0:
        sys.stdout.write((json.dumps(plan, indent=1) if args.json else render(plan)) + "\n")
        sys.stdout.flush()
    return 0
