"""Numbers derived from ``mpiattn bench`` records, without running anything.

:func:`derive` adds to every timed attention record

* ``frac_gemm_square`` / ``frac_gemm_tile``: its GFLOP/s per rank over the
  GEMM ceilings measured in the same records at the same ``P`` (every rank
  multiplying at once): a large square GEMM (the machine's ceiling) and
  GEMMs of attention's own tile shapes (``_cpu``: the same by CPU time);
* ``frac_ideal`` (issue 11): ``T_best / (P * T_P)``, where ``T_best`` is the
  fastest single-process time for the whole problem (same shape, ``N``,
  pass and device) in the same run (``run`` stamp): torch SDPA, the dense
  peer or any mpiattn implementation at ``P = 1``; ``ideal_impl`` names it
  and ``ideal_time_s`` gives it (``frac_ideal_cpu`` by CPU time);

and returns new records:

* ``scaling``: strong scaling (same ``N``, ``P`` ranks vs one: speedup and
  efficiency) and weak scaling (``N`` proportional to ``P``: per-rank
  GFLOP/s relative to one rank), per implementation and engine;
* ``target``: the goals of the benchmark issues (6 and 11), measured vs
  wanted (reported, never asserted).
"""

from __future__ import annotations

import types

from .tasks import PEERS, SDPA, MiB, tile_key

__all__ = ["derive", "timed", "impl_label", "SHAPE_KEYS", "TARGET_N", "MEMORY_N", "IDEAL_N", "GEMM_GOALS"]

#: Problem of the speed targets: N = 32k, B = H = 1, E = Ev = 64, float32, not causal.
TARGET_N = 32768
#: Sequence length of the memory target.
MEMORY_N = 65536
#: Sequence lengths of the fraction-of-ideal targets (issue 11).
IDEAL_N = (16384, 32768)
#: Fraction of the square-GEMM ceiling wanted at one rank, per pass (issue 6).
GEMM_GOALS = types.MappingProxyType({"fwd": 0.60, "fwdbwd": 0.50})
SHAPE_KEYS = ("B", "H", "Hkv", "E", "Ev", "dtype", "causal", "layout", "block", "device")
_PROBLEM = ("B", "H", "Hkv", "E", "Ev", "dtype", "causal", "N", "M", "device", "pass")


def impl_label(r: dict) -> str:
    """``impl``, ``impl/engine`` where one was passed, and ``(what mpiattn chose)`` where it chose.

    E.g. ``ring/torch``, ``ring(native)`` (no engine passed, the default
    chose native), ``auto/torch(ring)``, ``auto(ring, native)``.
    """
    label = f"{r['impl']}/{r['engine']}" if r.get("engine") else str(r["impl"])
    chosen = [r[used] for used, asked in (("strategy_used", r["impl"]), ("engine_used", r.get("engine")))
              if r.get(used) and r[used] != asked]
    return label + (f"({', '.join(chosen)})" if chosen else "")


def _ok(r: dict) -> bool:
    return r.get("status") == "ok"


def timed(r: dict) -> bool:
    """An attention record with a time (measured, status ok)."""
    return _ok(r) and r.get("workload") == "attention" and "time_s" in r


def _fractions_of_ceilings(records: list[dict]) -> None:
    best: dict[tuple, float] = {}
    for r in records:
        if not _ok(r) or r.get("workload") not in ("gemm_square", "gemm_tile"):
            continue
        if r["workload"] == "gemm_square":
            key: tuple = ("square", r["P"], r["dtype"], r.get("device", "cpu"))
        else:
            key = ("tile", tuple(r["tile_key"]), r["pass"])
        for clock, fld in (("wall", "gflops_per_rank"), ("cpu", "gflops_per_rank_cpu")):
            if r.get(fld):
                best[key + (clock,)] = max(best.get(key + (clock,), 0.0), r[fld])
    for r in records:
        if not timed(r):
            continue
        keys = {"square": ("square", r["P"], r["dtype"], r.get("device", "cpu")),
                "tile": ("tile", tuple(tile_key(r, r["P"])), r["pass"])}
        for kind, key in keys.items():
            for clock, fld, suffix in (("wall", "gflops_per_rank", ""), ("cpu", "gflops_per_rank_cpu", "_cpu")):
                ceiling = best.get(key + (clock,))
                if ceiling and r.get(fld):
                    r[f"gemm_{kind}_gflops{suffix}"] = ceiling
                    r[f"frac_gemm_{kind}{suffix}"] = r[fld] / ceiling


def _fractions_of_ideal(records: list[dict]) -> None:
    best: dict[tuple, dict] = {}
    for r in records:
        if timed(r) and r["P"] == 1 and not r.get("oversubscribed"):
            key = (r.get("run"),) + tuple(r.get(k) for k in _PROBLEM)
            if key not in best or r["time_s"] < best[key]["time_s"]:
                best[key] = r
    for r in records:
        if not timed(r):
            continue
        b = best.get((r.get("run"),) + tuple(r.get(k) for k in _PROBLEM))
        if b is None:
            continue
        r["ideal_time_s"] = b["time_s"]
        r["ideal_impl"] = impl_label(b)
        r["frac_ideal"] = b["time_s"] / (r["P"] * r["time_s"])
        if b.get("time_cpu_s") and r.get("time_cpu_s"):
            r["frac_ideal_cpu"] = b["time_cpu_s"] / (r["P"] * r["time_cpu_s"])


def derive(records: list[dict]) -> list[dict]:
    """Add ceiling fractions and fractions of ideal to attention records; return scaling and target records.

    The ceilings are the best GFLOP/s per rank measured anywhere in the
    records for the same ``P`` (and tile shape): load from other work on the
    machine only ever lowers a GEMM's rate, so the best one is the closest
    to the machine's, and a fraction of it never flatters attention.

    Parameters
    ----------
    records : list of dict
        All records of a run (modified in place).

    Returns
    -------
    list of dict
        New ``scaling`` and ``target`` records.
    """
    _fractions_of_ceilings(records)
    _fractions_of_ideal(records)
    return _scaling(records) + _targets(records)


def _scaling(records: list[dict]) -> list[dict]:
    out = []
    by_group: dict[tuple, dict[tuple[int, int], dict]] = {}
    for r in records:
        if timed(r) and not r.get("oversubscribed") and r["impl"] not in PEERS:
            key = (r["impl"], r.get("engine"), r["pass"]) + tuple(r.get(k) for k in SHAPE_KEYS)
            by_group.setdefault(key, {})[(r["N"], r["P"])] = r
    for key, runs in by_group.items():
        impl, engine, pass_ = key[:3]
        for (N, P), r in sorted(runs.items()):
            shape = {k: r.get(k) for k in SHAPE_KEYS}
            one = runs.get((N, 1))
            if P > 1 and one:
                s = one["time_s"] / r["time_s"]
                out.append(dict(workload="scaling", kind="strong", impl=impl, engine=engine, **{"pass": pass_},
                                N=N, P=P, time_1_s=one["time_s"], time_P_s=r["time_s"], speedup=s,
                                efficiency=s / P, **shape))
            if P > 1 and N % P == 0 and (N // P, 1) in runs:
                base = runs[(N // P, 1)]
                eff = r["gflops_per_rank"] / base["gflops_per_rank"]
                out.append(dict(workload="scaling", kind="weak", impl=impl, engine=engine, **{"pass": pass_},
                                N=N, P=P, N_1=N // P, time_1_s=base["time_s"], time_P_s=r["time_s"],
                                efficiency=eff, **shape))
    return out


# ----------------------------------------------------------------- targets
def _target(name: str, goal: str, measured: float | None, met: bool | None, detail: str,
            measured_cpu: float | None = None, met_cpu: bool | None = None) -> dict:
    return dict(workload="target", name=name, goal=goal, measured=measured, met=met, detail=detail,
                measured_cpu=measured_cpu, met_cpu=met_cpu)


def _ratio(a: dict, b: dict, goal: float, fld: str = "time_cpu_s") -> tuple[float | None, bool | None]:
    """``a[fld] / b[fld]`` by CPU time, and whether it meets ``goal`` (None where not measured)."""
    x = a[fld] / b[fld] if a.get(fld) and b.get(fld) else None
    return x, None if x is None else x >= goal


def _target_runs(records: list[dict]) -> dict[tuple, dict]:
    """Timed records of the targets' problem (B = H = 1, E = Ev = 64, float32, N = M), the last of each case."""
    out = {}
    for r in records:
        if (timed(r) and not r.get("oversubscribed") and r["N"] == r["M"] and r["B"] == r["H"] == r["Hkv"] == 1
                and r["E"] == r["Ev"] == 64 and r["dtype"] == "float32"):
            out[(r["impl"], r.get("engine"), r["pass"], r["P"], r["N"], bool(r["causal"]))] = r
    return out


def _targets(records: list[dict]) -> list[dict]:
    """The goals of issues 6 and 11, for every mpiattn implementation (strategy and engine) measured."""
    runs = _target_runs(records)
    out = []
    for (impl, engine, pass_, P, N, causal), r in runs.items():
        if impl in PEERS:
            continue
        name = f"{impl_label(r)} {pass_} N={N // 1024}k{' causal' if causal else ''}"
        if P == 1 and N == TARGET_N and not causal:
            goal = GEMM_GOALS[pass_]
            if "frac_gemm_square" in r:
                fc, tile = r.get("frac_gemm_square_cpu"), r.get("frac_gemm_tile")
                out.append(_target(f"{name}, 1 rank: fraction of GEMM ceiling", f">= {goal:.0%}",
                                   r["frac_gemm_square"], r["frac_gemm_square"] >= goal,
                                   f"{r['gflops_per_rank']:.1f} GFLOP/s vs square GEMM {r['gemm_square_gflops']:.1f}"
                                   + (f"; {tile:.0%} of the tile-shaped GEMMs" if tile else ""),
                                   fc, None if fc is None else fc >= goal))
            sdpa = runs.get((SDPA, None, pass_, 1, N, False))
            if sdpa:
                x = sdpa["time_s"] / r["time_s"]
                out.append(_target(f"{name} vs torch SDPA, 1 process", "torch time / mpiattn time >= 1", x,
                                   x >= 1.0, f"mpiattn {r['time_s']:.2f} s, torch {sdpa['time_s']:.2f} s",
                                   *_ratio(sdpa, r, 1.0)))
            two = runs.get((impl, engine, pass_, 2, N, False))
            if two:
                x = r["time_s"] / two["time_s"]
                out.append(_target(f"{name}: 2 ranks vs 1", "speedup >= 1.8", x, x >= 1.8,
                                   f"{r['time_s']:.2f} s -> {two['time_s']:.2f} s", *_ratio(r, two, 1.8)))
        if N == MEMORY_N and not causal and "peak_bytes" in r:
            shard, what = ((r["shard_bytes"], "q, k, v, out") if pass_ == "fwd" else
                           (r["shard_bytes_grads"], "q, k, v, out, dout, dq, dk, dv"))
            limit, peak = 2 * shard + 64 * MiB, r["peak_bytes"]
            out.append(_target(f"{name}, P={P}: peak memory per rank",
                               f"<= 2 x ({what}) + 64 MiB = {limit / MiB:.0f} MiB", peak / MiB, peak <= limit,
                               f"peak {peak / MiB:.0f} MiB (process baseline {r['baseline_bytes'] / MiB:.0f} MiB); "
                               f"shards {shard / MiB:.0f} MiB"))
        if P == 2 and N in IDEAL_N and "frac_ideal" in r:
            goal = 0.80 if causal else 0.85
            fc = r.get("frac_ideal_cpu")
            out.append(_target(f"{name}, 2 ranks: fraction of ideal", f">= {goal:.0%}", r["frac_ideal"],
                               r["frac_ideal"] >= goal, f"T_best {r['ideal_time_s']:.3f} s ({r['ideal_impl']}), "
                               f"T_2 {r['time_s']:.3f} s", fc, None if fc is None else fc >= goal))
    return out
