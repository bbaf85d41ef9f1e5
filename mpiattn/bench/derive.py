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

from typing import Any

from .tasks import SINGLE_PROCESS, tile_key

__all__ = ["derive", "SHAPE_KEYS", "TARGET_N", "MEMORY_N", "impl_label"]

MiB = 2**20
#: Problem of the speed targets: N = 32k, B = H = 1, E = Ev = 64, float32, not causal.
TARGET_N = 32768
#: Sequence length of the memory target.
MEMORY_N = 65536
SHAPE_KEYS = ("B", "H", "Hkv", "E", "Ev", "dtype", "causal", "layout", "block", "device")
_PROBLEM = ("B", "H", "Hkv", "E", "Ev", "dtype", "causal", "N", "M", "device", "pass")


def impl_label(r: dict) -> str:
    """``impl``, ``impl/engine`` where one was passed, and ``(engine used)`` where mpiattn chose it.

    E.g. ``ring/torch``, ``ring(torch)`` (no engine passed, the default
    chose torch), ``ring/auto(native)``.
    """
    label = f"{r['impl']}/{r['engine']}" if r.get("engine") else str(r["impl"])
    used = r.get("engine_used")
    if used and used != r.get("engine"):
        label += f"({used})"
    return label


def _ok(r: dict) -> bool:
    return r.get("status") == "ok"


def _timed(r: dict) -> bool:
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
        if not _timed(r):
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
        if _timed(r) and r["P"] == 1 and not r.get("oversubscribed"):
            key = (r.get("run"),) + tuple(r.get(k) for k in _PROBLEM)
            if key not in best or r["time_s"] < best[key]["time_s"]:
                best[key] = r
    for r in records:
        if not _timed(r):
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
        if _timed(r) and not r.get("oversubscribed") and r["impl"] not in SINGLE_PROCESS:
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
def _is_target_shape(r: dict, N: int, causal: bool = False) -> bool:
    return (r["N"] == N and r["M"] == N and r["B"] == 1 and r["H"] == 1 and r["Hkv"] == 1
            and r["E"] == 64 and r["Ev"] == 64 and r["dtype"] == "float32" and bool(r["causal"]) == causal)


def _target(name: str, goal: str, measured: float | None, met: bool | None, detail: str,
            measured_cpu: float | None = None, met_cpu: bool | None = None) -> dict:
    return dict(workload="target", name=name, goal=goal, measured=measured, met=met, detail=detail,
                measured_cpu=measured_cpu, met_cpu=met_cpu)


def _ratio(a: dict, b: dict, fld: str = "time_cpu_s") -> float | None:
    return a[fld] / b[fld] if a.get(fld) and b.get(fld) else None


def _finder(records: list[dict]) -> Any:
    def find(impl: str, pass_: str, P: int, N: int = TARGET_N, engine: str | None = None,
             causal: bool = False) -> dict | None:
        hits = [r for r in records if _timed(r) and r["impl"] == impl and r.get("engine") == engine
                and r["pass"] == pass_ and r["P"] == P and _is_target_shape(r, N, causal)
                and not r.get("oversubscribed")]
        return hits[-1] if hits else None
    return find


def _targets(records: list[dict]) -> list[dict]:
    find = _finder(records)
    out = []
    for pass_, goal in (("fwd", 0.60), ("fwdbwd", 0.50)):
        r = find("ring", pass_, 1)
        if r and "frac_gemm_square" in r:
            tile, fc = r.get("frac_gemm_tile"), r.get("frac_gemm_square_cpu")
            out.append(_target(f"ring {pass_} N=32k, 1 rank: fraction of GEMM ceiling", f">= {goal:.0%}",
                               r["frac_gemm_square"], r["frac_gemm_square"] >= goal,
                               f"{r['gflops_per_rank']:.1f} GFLOP/s vs square GEMM {r['gemm_square_gflops']:.1f}"
                               + (f"; {tile:.0%} of the tile-shaped GEMMs ({r['gemm_tile_gflops']:.1f})"
                                  if tile else ""), fc, None if fc is None else fc >= goal))
    for pass_ in ("fwd", "fwdbwd"):
        r, t = find("ring", pass_, 1), find("torch", pass_, 1)
        if r and t:
            ratio, rc = t["time_s"] / r["time_s"], _ratio(t, r)
            out.append(_target(f"ring {pass_} N=32k vs torch SDPA, 1 process", "torch time / ring time >= 1",
                               ratio, ratio >= 1.0, f"ring {r['time_s']:.2f} s, torch {t['time_s']:.2f} s",
                               rc, None if rc is None else rc >= 1.0))
    for pass_ in ("fwd", "fwdbwd"):
        one, two = find("ring", pass_, 1), find("ring", pass_, 2)
        if one and two:
            s, sc = one["time_s"] / two["time_s"], _ratio(one, two)
            sq1, sq2 = one.get("gemm_square_gflops"), two.get("gemm_square_gflops")
            out.append(_target(f"ring {pass_} N=32k: 2 ranks vs 1", "speedup >= 1.8", s, s >= 1.8,
                               f"{one['time_s']:.2f} s -> {two['time_s']:.2f} s"
                               + (f"; square GEMM per rank {sq1:.0f} GF/s alone, {sq2:.0f} with 2 ranks busy "
                                  f"(bound on the speedup: {2 * sq2 / sq1:.2f})" if sq1 and sq2 else ""),
                               sc, None if sc is None else sc >= 1.8))
    for r in records:
        if not (_timed(r) and r["impl"] == "ring" and _is_target_shape(r, MEMORY_N) and "peak_bytes" in r):
            continue
        if r["pass"] == "fwd":
            shard, what = r["shard_bytes"], "q, k, v, out"
        else:
            shard, what = r["shard_bytes_grads"], "q, k, v, out, dout, dq, dk, dv"
        limit = 2 * shard + 64 * MiB
        peak = r["peak_bytes"]
        out.append(_target(f"{impl_label(r)} {r['pass']} N=64k, P={r['P']}: peak memory per rank",
                           f"<= 2 x ({what}) + 64 MiB = {limit / MiB:.0f} MiB", peak / MiB, peak <= limit,
                           f"peak {peak / MiB:.0f} MiB (process baseline {r['baseline_bytes'] / MiB:.0f} MiB, "
                           f"above it {(peak - r['baseline_bytes']) / MiB:.0f} MiB); shards {shard / MiB:.0f} MiB"))
    return out + _engine_targets(find)


def _engine_targets(find: Any) -> list[dict]:
    """Issue 11's targets at N = 16k and 32k (only where the records hold both sides)."""
    out = []
    for N in (16384, 32768):
        tag = f"N={N // 1024}k"
        for pass_ in ("fwd", "fwdbwd"):
            sdpa = find("torch", pass_, 1, N)
            for engine, goal in (("torch", 0.95), ("native", 0.80 if pass_ == "fwd" else 0.85)):
                r = find("ring", pass_, 1, N, engine)
                if r and sdpa:
                    ratio, rc = sdpa["time_s"] / r["time_s"], _ratio(sdpa, r)
                    out.append(_target(f"ring/{engine} {pass_} {tag}, 1 rank vs torch SDPA",
                                       f"SDPA time / ring time >= {goal:.2f}", ratio, ratio >= goal,
                                       f"ring/{engine} {r['time_s']:.3f} s, SDPA {sdpa['time_s']:.3f} s",
                                       rc, None if rc is None else rc >= goal))
            for engine, causal, goal in (("torch", False, 0.85), ("torch", True, 0.80), ("native", True, 0.80)):
                r = find("ring", pass_, 2, N, engine, causal)
                if r and "frac_ideal" in r:
                    fc = r.get("frac_ideal_cpu")
                    out.append(_target(f"ring/{engine} {pass_} {tag}{' causal' if causal else ''}, 2 ranks: "
                                       "fraction of ideal", f">= {goal:.0%}", r["frac_ideal"],
                                       r["frac_ideal"] >= goal,
                                       f"T_best {r['ideal_time_s']:.3f} s ({r['ideal_impl']}), "
                                       f"T_2 {r['time_s']:.3f} s", fc, None if fc is None else fc >= goal))
    return out
