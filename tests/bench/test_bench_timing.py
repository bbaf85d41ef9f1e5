"""The package's one timer (:mod:`mpiattn.timing`, the bench's harness): barrier-delimited, counted calls,
no module state."""

import time

import numpy as np

from mpiattn import timing
from mpiattn.timing import Measurement, Timer, measure


def _module_state():
    return {k: v for k, v in vars(timing).items() if not k.startswith("__")}


def test_timer_keeps_no_global_state(comm):
    mutable = [k for k, v in _module_state().items() if isinstance(v, (dict, list, set, bytearray))]
    assert mutable == []
    before = _module_state()
    a, b = Timer(comm), Timer(comm)
    m = a.measure(lambda: time.sleep(0.01), warmup=1, repeat=2)
    assert len(m.times) == 2
    assert b.wall_total == 0.0 and b.cpu_total == 0.0          # another timer saw nothing
    assert a.wall_total >= 0.03                                 # warm-up calls count for the ratio
    ratio = a.cpu_wall_ratio()
    assert ratio == min(comm.allgather_obj(ratio))              # the same lowest ratio on every rank
    if comm.size == 1:                                          # (ranks waiting in MPI may poll)
        assert ratio < 0.5                                      # sleeping uses no CPU
    assert a.wall_total == 0.0 and a.cpu_total == 0.0           # the ratio resets its own timer only
    after = _module_state()
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)


def test_calls_are_counted_and_results_kept_only_when_asked(comm):
    calls = []

    def fn():
        calls.append(len(calls))
        return len(calls)

    m = Timer(comm).measure(fn, warmup=2, repeat=3)
    assert len(calls) == 5 and len(m.times) == len(m.cpus) == 3 and m.result is None
    m = Timer(comm).measure(fn, warmup=0, repeat=2, keep_last=True)
    assert m.result == 7
    assert m.median == float(np.median(m.times)) and m.best == min(m.times)


def _everywhere(comm, ok):
    """One verdict for all ranks (a rank failing alone would leave the others waiting in the next test)."""
    return all(comm.allgather_obj(bool(ok)))


def test_wall_time_is_the_slowest_ranks(comm):
    """Between barriers, every rank reads the time of the slowest one (here the last rank's 50 ms)."""
    last = comm.size - 1
    m = measure(comm, lambda: time.sleep(0.05 if comm.rank == last else 0.005), repeat=2)
    assert _everywhere(comm, all(t >= 0.04 for t in m.times)), m.times
    if comm.size == 1:                                          # (ranks waiting in MPI may poll)
        assert all(c < 0.04 for c in m.cpus)                    # CPU time: sleeping costs none


def test_cpu_time_is_the_largest_over_ranks(comm):
    def spin():
        if comm.rank == comm.size - 1:                          # only the last rank computes
            t0 = time.process_time()
            while time.process_time() - t0 < 0.02:
                pass

    m = measure(comm, spin, repeat=1)
    assert _everywhere(comm, m.cpus[0] >= 0.02), m.cpus         # on every rank


def test_device_sync_is_called_for_cupy_like_modules(comm):
    synced = []

    class FakeDevice:
        def synchronize(self):
            synced.append(1)

    class FakeXp:
        cuda = type("cuda", (), {"Device": FakeDevice})

    Timer(comm, FakeXp).measure(lambda: None, repeat=2)
    assert len(synced) == 4                                      # before and after each call
    assert Measurement([1.0, 3.0, 2.0], [1.0, 1.0, 1.0]).median == 2.0
