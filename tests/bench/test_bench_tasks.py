"""Tasks, settings, the worker's JSON file and the presets (no MPI traffic)."""

import dataclasses

import pytest

from mpiattn.bench import launcher, presets
from mpiattn.bench.launcher import largest_n, memory_curve
from mpiattn.bench.memory import estimate_bytes
from mpiattn.bench.tasks import WORKLOADS, Settings, Task, read_job, write_job


def test_task_defaults_and_validation():
    t = Task(H=4, N=100, E=16)
    assert (t.Hkv, t.M, t.Ev, t.engine) == (4, 100, 16, None)
    assert Task(impl="reference").impl == "dense"               # the old name reads as the new one
    with pytest.raises(ValueError, match="unknown implementation 'flash'"):
        Task(impl="flash")
    with pytest.raises(ValueError, match="unknown engine 'fast'"):
        Task(engine="fast")
    with pytest.raises(ValueError, match="unknown benchmark workload 'nap'"):
        Task(workload="nap")
    with pytest.raises(ValueError, match="unknown pass 'bwd'"):
        Task(passes=("bwd",))
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


def test_overrides_and_engines_side_by_side():
    plans = presets.plans_for("strategies", dict(n=[512], ranks=[2], engines=["native", "torch"],
                                                 peers=["reference"], impl=None))
    tasks, _ = presets.build_tasks(plans)
    got = [(P, t.impl, t.engine) for P, t in tasks if not t.causal]
    assert got == [(2, "ring", "native"), (2, "ring", "torch"), (2, "allgather", "native"),
                   (2, "allgather", "torch"), (2, "ulysses", "native"), (2, "ulysses", "torch"),
                   (2, "materialized", None), (1, "dense", None)]
    assert all(t.N == 512 and not t.ceilings for _, t in tasks)      # "reference" peer read as dense, no gemm
    default, _ = presets.build_tasks(presets.plans_for("quick", dict(n=[256])))
    assert {t.engine for _, t in default} == {None}
    assert {t.impl for _, t in default if t.workload == "attention"} == {"ring", "dense", "torch"}


def test_memory_curve_shrinks_until_the_cap_holds(monkeypatch):
    plan = dataclasses.replace(presets.SUITES["memory"][0], memory_ranks=(2,), memory_cap=100 * 2**20)
    base = 60 * 2**20
    runs = []

    def fake_spawn(P, tasks, settings, log, mpiexec=None):
        (t,) = tasks
        assert t.engine == "native"                               # the memory preset's engine, probe included
        if t.workload == "baseline":
            return [dict(workload="baseline", status="ok", baseline_bytes=base)]
        runs.append(t.N)
        est = base + estimate_bytes(t, P, t.passes[0])
        peak = est + (20 * 2**20 if len(runs) == 1 else 0)        # the first run overshoots the model
        return [dict(workload="attention", status="ok", **{"pass": t.passes[0]}, peak_bytes=peak,
                     baseline_bytes=base)]

    monkeypatch.setattr(launcher, "spawn", fake_spawn)
    (rec,) = memory_curve(plan, Settings(), lambda msg: None)
    t = plan.attention_task(0, False, "cpu", False, impl="ring", engine="native").replace(passes=("fwdbwd",))
    assert rec["N_estimate"] == largest_n(t, 2, 100 * 2**20 - base, 512) == runs[0]
    assert rec["status"] == "ok" and rec["attempts"] == 2 and runs[1] < runs[0]
    assert rec["N_verified"] == runs[1] and runs[1] % 512 == 0
