"""Where does each strategy win? The cost model over a grid of problems and machines.

Runs nothing but the model (no MPI): for each machine profile and node count,
and each problem, every registered strategy and split is predicted
(:func:`mpiattn.strategies.registry.table`), together with two designs that
are modelled here but not registered: a hierarchical allgather (gather inside
the node, node leaders exchange, leaders broadcast inside) and the double
ring with its between-node moves sent a whole inner round ahead. Prints, per
strategy, in how many cases it is the fastest, and the cases where a
strategy other than ``hybrid`` wins.

    python benchmarks/two_level/sweep.py [--json FILE]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
from dataclasses import replace

from mpiattn.comm.topology import Topology
from mpiattn.kernels import engines
from mpiattn.strategies import AttentionSpec, Options, machines, registry
from mpiattn.strategies.base import Phase, Strategy, blocked_memory
from mpiattn.strategies.double_ring import DoubleRing, _moves
from mpiattn.strategies.model import predict


class HierarchicalAllgather(Strategy):
    """Modelled only: every node gathers its keys/values, node leaders exchange them, then
    broadcast them inside their node; no overlap with compute (as the flat allgather)."""

    name = "hier-allgather"

    def traffic(self, spec, topology, block, backward):
        P, R, w = topology.P, topology.n_nodes, topology.sizes[0]
        row = spec.M / P * spec.B * spec.Hkv * (spec.E + spec.Ev)
        words = row * (spec.itemsize + (spec.acc_dtype.itemsize if backward else 0))
        gather = Phase(inside=(w - 1) * words, messages=w - 1)
        exchange = Phase(between=(R - 1) * w * words, messages=R - 1)
        spread = Phase(inside=(w - 1) * (R - 1) * w * words, messages=w - 1)
        return [p for p in (gather, exchange, spread) if p.inside or p.between]

    def memory(self, spec, P, block, backward):
        return blocked_memory(spec, P, block, backward, circulation="gather")


class PrefetchDoubleRing(DoubleRing):
    """Modelled only: the double ring whose between-node move hides behind a whole inner round."""

    name = "double-ring-prefetch"

    def traffic(self, spec, topology, block, backward):
        phases = super().traffic(spec, topology, block, backward)
        w = topology.sizes[0]
        # one between-node move per inner round of w steps: as if it had w steps to hide behind
        return [replace(p, steps=p.steps * w) if p.between else p for p in phases]


EXTRA = [HierarchicalAllgather(), PrefetchDoubleRing()]
MACHINES = [("h200-nvlink-ndr", n, 8) for n in (2, 4, 16)] + [("cpu-node", n, 32) for n in (2, 8)]
PROBLEMS = [dict(N=N, H=H, Hkv=Hkv, E=128, causal=causal, dtype=dtype)
            for N, (H, Hkv), causal, dtype in itertools.product(
                (16384, 131072, 1048576), ((32, 8), (32, 1), (8, 8), (1, 1), (24, 24)),
                (True, False), ("bfloat16", "float32"))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    wins, notable, rows = {}, [], []
    for (mname, nodes, per), pr in itertools.product(MACHINES, PROBLEMS):
        machine = machines.PROFILES[mname]
        topo = Topology.blocks(nodes * per, per)
        o = Options(causal=pr["causal"], layout="zigzag" if pr["causal"] else "contiguous")
        spec = AttentionSpec.from_shapes((1, pr["H"], pr["N"], pr["E"]), (1, pr["Hkv"], pr["N"], pr["E"]),
                                         (1, pr["Hkv"], pr["N"], pr["E"]),
                                         "float16" if pr["dtype"] == "bfloat16" else pr["dtype"], o,
                                         device="cupy")
        block = engines.get(engines.AUTO[0]).block_rows(spec, -(-pr["N"] // topo.P))
        preds = [(r.label, r.prediction) for r in registry.table(spec, topo, block, machine, pr["dtype"])
                 if r.prediction is not None and r.pickable and r.fits]
        preds += [(s.name, predict(s, spec, topo, block, machine, rate_dtype=pr["dtype"])) for s in EXTRA
                  if s.supports(spec, topo) is None]
        best = min(preds, key=lambda lp: lp[1].fwdbwd_s)
        family = best[0].split(":")[0]
        wins[family] = wins.get(family, 0) + 1
        case = dict(machine=mname, nodes=nodes, per_node=per, **pr, best=best[0],
                    best_s=best[1].fwdbwd_s, efficiency=best[1].efficiency,
                    times={lbl: p.fwdbwd_s for lbl, p in preds})
        rows.append(case)
        if family != "hybrid":
            second = min((lp for lp in preds if lp[0].split(":")[0] != family), key=lambda lp: lp[1].fwdbwd_s)
            notable.append(f"{mname} {nodes}x{per} N={pr['N']} H={pr['H']} Hkv={pr['Hkv']} "
                           f"{pr['dtype']} {'causal' if pr['causal'] else 'full'}: {best[0]} "
                           f"{best[1].fwdbwd_s:.4g} s, next {second[0]} {second[1].fwdbwd_s:.4g} s "
                           f"({second[1].fwdbwd_s / best[1].fwdbwd_s - 1:+.1%})")
    print(f"{len(rows)} cases; fastest by family: " + ", ".join(f"{k} {v}" for k, v in sorted(wins.items())))
    for line in notable:
        print(" ", line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
