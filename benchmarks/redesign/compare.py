"""Pre-redesign (65097b6) vs now: the quick suite, two runs each, interleaved (old, new, old, new)."""
import json, statistics, sys
def load(p):
    out = {}
    for l in open(p):
        r = json.loads(l)
        if r.get("status") != "ok" or "time_s" not in r:
            continue
        impl = r.get("impl") or r.get("op")
        if impl == "auto":
            impl = r.get("strategy_used")
        key = (r["workload"], impl, r.get("pass", ""), r["P"], r.get("N"))
        out[key] = r["time_s"]
    return out
old = [load(f"benchmarks/redesign/bench-old{s}.jsonl") for s in ("", "2")]
new = [load(f"benchmarks/redesign/bench-new{s}.jsonl") for s in ("", "2")]
keys = [k for k in old[0] if all(k in d for d in old + new)]
print(f"{'case':<44} {'old s (2 runs)':>18} {'new s (2 runs)':>18} {'new/old':>8} {'old run-to-run':>14}")
ratios, noise = [], []
for k in keys:
    o = [d[k] for d in old]; n = [d[k] for d in new]
    r = statistics.mean(n) / statistics.mean(o); ratios.append(r)
    nz = max(o) / min(o) - 1; noise.append(nz)
    name = f"{k[1]} {k[2]} P={k[3]} N={k[4]}"
    print(f"{name:<44} {o[0]:>8.4f} {o[1]:>8.4f} {n[0]:>8.4f} {n[1]:>8.4f} {r:>8.3f} {nz:>13.1%}")
print(f"{len(keys)} cases: new/old median {statistics.median(ratios):.3f}, range {min(ratios):.3f}-{max(ratios):.3f}; "
      f"old's own run-to-run spread median {statistics.median(noise):.1%}, max {max(noise):.1%}")
