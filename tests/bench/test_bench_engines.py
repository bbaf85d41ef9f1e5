"""Engines side by side (issue 11): ``engine=`` reaches attention only when a task names one.

Until ``mpiattn.strategies.attention`` takes ``engine=``, the engine path is
checked with a stand-in that does (it records the keyword and calls the real
function without it), and the real function's refusal is checked to turn
into ``skipped`` records. Once the keyword exists, the real engines run.
"""

import inspect

import numpy as np
import pytest

from mpiattn import strategies
from mpiattn.bench import workloads
from mpiattn.bench.tasks import Settings, Task
from mpiattn.bench.worker import run_in_job

_HAS_ENGINE = "engine" in inspect.signature(strategies.attention).parameters


def _run(comm, xp, tasks):
    out = []
    run_in_job(comm, tasks, Settings(device="cpu" if xp is np else "gpu", cores=64), out.extend)
    return [r for r in out if r["workload"] == "attention"]


def _task(P, **kw):
    return Task(impl="ring", H=2, N=64 * P, E=8, block=32, repeat=1, warmup=0, **kw)


@pytest.fixture
def engine_aware(monkeypatch):
    """attention/attention_backward that take ``engine=`` (recorded) and compute as today."""
    seen = []
    real_fwd, real_bwd = strategies.attention, strategies.attention_backward

    def attention(q, k, v, comm=None, *, engine=None, **kw):
        seen.append(("fwd", engine))
        return real_fwd(q, k, v, comm, **kw)

    def attention_backward(dout, q, k, v, out, lse, comm=None, *, engine=None, **kw):
        seen.append(("bwd", engine))
        return real_bwd(dout, q, k, v, out, lse, comm, **kw)

    monkeypatch.setattr(strategies, "attention", attention)
    monkeypatch.setattr(strategies, "attention_backward", attention_backward)
    return seen


def test_engines_reach_attention_only_when_named(comm, xp, engine_aware):
    assert workloads.engines_supported()
    recs = _run(comm, xp, [_task(comm.size, engine="native"), _task(comm.size, engine="torch"), _task(comm.size)])
    assert [(r["engine"], r["pass"], r["status"]) for r in recs] == [
        ("native", "fwd", "ok"), ("native", "fwdbwd", "ok"), ("torch", "fwd", "ok"), ("torch", "fwdbwd", "ok"),
        (None, "fwd", "ok"), (None, "fwdbwd", "ok")]
    # warm-up problem, one timed forward, one timed backward per task
    assert engine_aware == [(p, e) for e in ("native", "torch", None) for p in ("fwd", "bwd", "fwd", "bwd")]


def test_engine_on_a_strategy_without_engines_is_skipped(comm, xp, engine_aware):
    recs = _run(comm, xp, [_task(comm.size, engine="torch").replace(impl="materialized")])
    assert {r["status"] for r in recs} == {"skipped"}
    assert all(r["reason"] == "engines apply to ring, allgather, ulysses, auto, not materialized" for r in recs)
    assert engine_aware == []


@pytest.mark.skipif(_HAS_ENGINE, reason="attention() takes engine= now (issue 11 merged): nothing to refuse")
def test_attention_without_the_keyword_gives_skipped_records(comm, xp):
    assert not workloads.engines_supported()
    recs = _run(comm, xp, [_task(comm.size, engine="native")])
    assert [r["pass"] for r in recs] == ["fwd", "fwdbwd"]
    assert all(r["status"] == "skipped" and "engine= keyword" in r["reason"] for r in recs)


@pytest.mark.skipif(not _HAS_ENGINE, reason="attention() takes no engine= keyword yet (issue 11 not merged)")
def test_real_engines_run(comm, xp):
    recs = _run(comm, xp, [_task(comm.size, engine="native"), _task(comm.size, engine="auto")])
    assert [r["status"] for r in recs] == ["ok"] * 4
    assert [r["engine"] for r in recs] == ["native", "native", "auto", "auto"]
