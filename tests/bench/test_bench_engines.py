"""Engines side by side: ``engine=`` reaches attention as the task names it, and the records say what ran.

The bench passes the task's :class:`mpiattn.Options` whole; a stand-in for
:func:`mpiattn.strategies.attention` records the options it receives, so
what the bench asks for is checked apart from what the library does with it.
"""

import numpy as np
import pytest

from mpiattn import strategies
from mpiattn.bench.tasks import Settings, Task
from mpiattn.bench.worker import run_in_job
from mpiattn.kernels import engines


def _run(comm, xp, tasks):
    out = []
    run_in_job(comm, tasks, Settings(device="cpu" if xp is np else "gpu", cores=64), out.extend)
    return [r for r in out if r["workload"] == "attention"]


def _task(P, **kw):
    return Task(impl="ring", H=2, N=64 * P, E=8, block=32, repeat=1, warmup=0, **kw)


@pytest.fixture
def seen(monkeypatch):
    """attention/attention_backward that record the options they get and compute as usual."""
    calls = []
    real_fwd, real_bwd = strategies.attention, strategies.attention_backward

    def attention(q, k, v, comm=None, *, options, **kw):
        calls.append(("fwd", options.strategy, options.engine))
        return real_fwd(q, k, v, comm, options=options, **kw)

    def attention_backward(dout, q, k, v, out, lse, comm=None, *, options, **kw):
        calls.append(("bwd", options.strategy, options.engine))
        return real_bwd(dout, q, k, v, out, lse, comm, options=options, **kw)

    monkeypatch.setattr(strategies, "attention", attention)
    monkeypatch.setattr(strategies, "attention_backward", attention_backward)
    return calls


def test_engines_reach_attention_as_named(comm, xp, seen):
    recs = _run(comm, xp, [_task(comm.size, engine="native"), _task(comm.size, engine="auto"),
                           _task(comm.size).replace(impl="auto")])
    assert [(r["impl"], r["engine"], r["pass"], r["status"]) for r in recs] == [
        ("ring", "native", "fwd", "ok"), ("ring", "native", "fwdbwd", "ok"), ("ring", "auto", "fwd", "ok"),
        ("ring", "auto", "fwdbwd", "ok"), ("auto", None, "fwd", "ok"), ("auto", None, "fwdbwd", "ok")]
    # warm-up problem (forward + backward), one timed forward, one timed backward per task;
    # no engine named: the options' default, "auto"
    assert seen == [(p, s, e) for s, e in (("ring", "native"), ("ring", "auto"), ("auto", "auto"))
                    for p in ("fwd", "bwd", "fwd", "bwd")]
    assert {r["engine_used"] for r in recs} == {engines.AUTO[0]}
    assert {r["strategy_used"] for r in recs} == {"ring"}        # what auto picks here


def test_every_registered_engine_runs_or_says_why(comm, xp):
    tasks = [_task(comm.size, engine=name) for name in engines.ENGINES]
    recs = _run(comm, xp, tasks)
    assert [r["engine"] for r in recs] == [name for name in engines.ENGINES for _ in range(2)]
    for r in recs:
        device = "cupy" if xp is not np else "numpy"
        why = engines.get(r["engine"]).usable(device)
        if device not in engines.get(r["engine"]).capabilities.dtypes:  # e.g. fused on the host
            assert r["status"] == "skipped" and f"does not run on {device}" in r["reason"], r
        elif why is None:
            assert r["status"] == "ok" and r["engine_used"] == r["engine"], r
        else:                                                    # e.g. torch not installed
            assert r["status"] == "skipped" and why in r["reason"], r


def test_an_engine_unusable_here_is_skipped_on_every_rank(comm, xp, monkeypatch):
    engine = engines.get("torch")
    monkeypatch.setattr(type(engine), "usable", lambda self, device: "no torch here (a test)")
    recs = _run(comm, xp, [_task(comm.size, engine="torch")])
    assert [(r["status"], r["reason"]) for r in recs] == [("skipped", "no torch here (a test)")] * 2
