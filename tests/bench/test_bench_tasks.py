"""Tasks, settings, the worker's JSON file and the presets (no MPI traffic)."""

import dataclasses

import pytest

from mpiattn.bench import launcher, presets
from mpiattn.bench.launcher import largest_n, memory_curve
from mpiattn.bench.memory import estimate_bytes
from mpiattn.bench.tasks import WORKLOADS, Settings, Task, read_job, write_job
from mpiattn.kernels import engines
from mpiattn.strategies import registry


def test_task_defaults_and_validation():
    t = Task(H=4, N=100, E=16)
    assert (t.impl, t.Hkv, t.M, t.Ev, t.engine) == ("auto", 4, 100, 16, None)
    strategies = ", ".join(registry.NAMES)
    with pytest.raises(ValueError, match=f"unknown implementation 'flash'; expected one of {strategies}, dense, torch"):
        Task(impl="flash")
    with pytest.raises(ValueError, match=f"unknown engine 'fast'; expected one of {', '.join(engines.NAMES)}$"):
        Task(engine="fast")
    with pytest.raises(ValueError, match="unknown benchmark workload 'nap'"):
        Task(workload="nap")
    with pytest.raises(ValueError, match="unknown pass 'bwd'; expected one of fwd, fwdbwd"):
        Task(passes=("fwd", "bwd"))
    with pytest.raises(ValueError, match=r"unknown task field\(s\): colour"):
        Task.from_dict({"workload": "attention", "colour": "red"})


def test_records_carry_only_their_workloads_fields():
    t = Task(workload="product", op="nn", N=64, d=8)
    assert list(t.to_dict()) == list(WORKLOADS["product"])
    a = Task(engine="torch").to_dict()
    assert a["engine"] == "torch" and "op" not in a and a["passes"] == ["fwd", "fwdbwd"]


def test_job_file_round_trip(tmp_path):
    tasks = [Task(engine="native", causal=True, N=96, block=32),
             Task(workload="gemm_tile", tile_key=(1, "float32", 1, 1, 1, 64, 64, 512, 512, "cpu")),
             Task(workload="overlap", N=256, d=8, rows=16)]
    settings = Settings(seed=3, threads=2, cores=4, max_memory=2**30, fresh=True)
    path = tmp_path / "job.json"
    write_job(str(path), settings, tasks, "/tmp/out.jsonl")
    s2, t2, out = read_job(str(path))
    assert s2 == settings and out == "/tmp/out.jsonl"
    for a, b in zip(tasks, t2):
        assert a.to_dict() == b.to_dict()
    assert t2[1].tile_key == tasks[1].tile_key and isinstance(t2[1].tile_key, tuple)


@pytest.mark.parametrize("suite", sorted(presets.SUITES))
def test_every_preset_expands(suite):
    tasks, curves = presets.build_tasks(presets.plans_for(suite, {}))
    assert tasks or curves
    for P, t in tasks:
        assert P >= 1 and Task.from_dict(t.to_dict()).to_dict() == t.to_dict()
        if t.single_process:
            assert P == 1
        if t.workload == "attention":
            assert estimate_bytes(t, P, t.passes[0]) > 0
            assert t.impl in registry.NAMES + ("dense", "torch") and t.engine in (None,) + engines.NAMES


def test_overrides_and_engines_side_by_side():
    plans = presets.plans_for("strategies", dict(n=[512], ranks=[2], engines=["native", "torch"],
                                                 peers=["dense"], impl=None))
    tasks, _ = presets.build_tasks(plans)
    got = [(P, t.impl, t.engine) for P, t in tasks if not t.causal]
    want = [(2, name, e) for name, s in registry.STRATEGIES.items()
            for e in (("native", "torch") if s.uses_engine else ("native",))]  # no engine: once
    assert got == want + [(1, "dense", None)]
    assert all(t.N == 512 and not t.ceilings for _, t in tasks)      # no gemm peer: no ceilings
    default, _ = presets.build_tasks(presets.plans_for("quick", dict(n=[256])))
    assert {t.engine for _, t in default} == {None}
    assert {t.impl for _, t in default if t.workload == "attention"} == {"auto", "dense", "torch"}
    every, _ = presets.build_tasks(presets.plans_for("engines", {}))
    assert {t.engine for _, t in every if t.impl == "auto"} == {  # the CPU suite's engines
        n for n, e in engines.ENGINES.items() if "numpy" in e.capabilities.dtypes}


def test_the_dense_peer_is_priced_in_float32_and_a_refused_strategy_is_an_error():
    """The dense peer computes float16 inputs in float32 (``spec.acc_dtype``): its estimate is
    the float32 task's, not half of it. A strategy the registry refuses for the call is an
    error with the registry's reason (the task is skipped with it)."""
    dense = Task(impl="dense", H=4, N=4096, E=32, dtype="float32")
    assert estimate_bytes(dense.replace(dtype="float16"), 1, "fwd") == estimate_bytes(dense, 1, "fwd")
    with pytest.raises(ValueError, match="strategy 'ulysses' needs at least one query head per rank: H = 2"):
        estimate_bytes(Task(impl="ulysses", H=2, N=4096, E=32, block=256), 3, "fwd")


def test_memory_curve_shrinks_until_the_cap_holds(monkeypatch):
    plan = dataclasses.replace(presets.SUITES["memory"][0], memory_ranks=(2,), memory_cap=100 * 2**20)
    base = 60 * 2**20
    runs = []

    def fake_spawn(P, tasks, settings, log, mpiexec=None):
        (t,) = tasks
        assert t.engine is None and t.impl in ("auto", "ring")    # the library's choice, probe included
        if t.workload == "baseline":
            return [dict(workload="baseline", status="ok", baseline_bytes=base)]
        runs.append(t.N)
        est = base + estimate_bytes(t, P, t.passes[0])
        peak = est + (20 * 2**20 if len(runs) == 1 else 0)        # the first run overshoots the model
        return [dict(workload="attention", status="ok", **{"pass": t.passes[0]}, peak_bytes=peak,
                     baseline_bytes=base)]

    monkeypatch.setattr(launcher, "spawn", fake_spawn)
    (rec,) = memory_curve(plan, Settings(), lambda msg: None)
    t = plan.attention_task(0, False, "cpu", False, impl="auto").replace(passes=("fwdbwd",))
    assert rec["N_estimate"] == largest_n(t, 2, 100 * 2**20 - base, 512) == runs[0]
    assert rec["status"] == "ok" and rec["attempts"] == 2 and runs[1] < runs[0]
    assert rec["N_verified"] == runs[1] and runs[1] % 512 == 0
