"""The data-safety promises of ``run`` kept by ``prefill``, ``decode --append``, ``calibrate`` and
``plan`` (issue 26), in-process at any rank count: one clear error on every rank, checked before
any work, nothing published, every file as it was; modes kept; read-only caches refused."""

import json
import os
import stat

import h5py
import numpy as np
import pytest

from helpers import run_cli as run, whole, write_h5


def _bytes(comm, path):
    return comm.bcast_obj(open(path, "rb").read() if comm.rank == 0 else None)


@pytest.fixture
def cache(comm, capsys, shared_dir):
    """A prefilled cache of 12 rows (``cache.h5``) and one new token (``new.h5``: q, k, v)."""
    rng = np.random.default_rng(3)
    q = rng.standard_normal((1, 2, 13, 4)).astype(np.float32)
    k = rng.standard_normal((1, 1, 13, 4)).astype(np.float32)
    prompt, path = os.path.join(shared_dir, "p.h5"), os.path.join(shared_dir, "cache.h5")
    write_h5(comm, prompt, q=q[:, :, :12], k=k[:, :, :12], v=k[:, :, :12])
    write_h5(comm, os.path.join(shared_dir, "new.h5"), q=q[:, :, 12:], k=k[:, :, 12:],
           v=k[:, :, 12:])
    assert run(comm, capsys, "prefill", prompt, "-o", path, "-q")[0] == 0
    return path


def _decode(comm, capsys, shared_dir, *more):
    return run(comm, capsys, "decode", os.path.join(shared_dir, "cache.h5"), "--queries",
               os.path.join(shared_dir, "new.h5"), "-o", os.path.join(shared_dir, "out.h5"),
               "--append", "-q", *more)


@pytest.mark.parametrize("mode", [0o600, 0o660, 0o644])
def test_the_grown_cache_keeps_its_mode(comm, capsys, shared_dir, cache, mode):
    if comm.rank == 0:
        os.chmod(cache, mode)
    comm.barrier()
    code, _, err = _decode(comm, capsys, shared_dir)
    assert code == 0, err
    assert stat.S_IMODE(os.stat(cache).st_mode) == mode
    assert whole(cache)[1]["length"] == 13


def test_a_read_only_cache_is_not_replaced(comm, capsys, shared_dir, cache):
    if comm.rank == 0:
        os.chmod(cache, 0o444)
    comm.barrier()
    before = _bytes(comm, cache)
    code, _, err = _decode(comm, capsys, shared_dir)
    assert code == 1 and "is read-only (mode 444): not replaced" in err, err
    assert _bytes(comm, cache) == before
    assert not os.path.exists(os.path.join(shared_dir, "out.h5"))  # checked before any work
    assert sorted(os.listdir(shared_dir)) == ["cache.h5", "new.h5", "p.h5"]


def test_a_cache_replaced_meanwhile_is_not_overwritten(comm, capsys, shared_dir, cache,
                                                       monkeypatch):
    """Issue 26 item 1, in one run: the cache changes between this run's read and its publish
    (another run's append): one error, neither file published, the other run's cache kept."""
    from mpiattn.io import publishing

    real = publishing.Outputs.publish

    def another_run_appends_first(self, items):
        with h5py.File(cache, "r+") as f:  # (rank 0 publishes: the other run's append lands now)
            f.attrs["other"] = 1
        return real(self, items)
    monkeypatch.setattr(publishing.Outputs, "publish", another_run_appends_first)
    code, _, err = _decode(comm, capsys, shared_dir)
    assert code == 1 and "was modified while this run was using it" in err, err
    assert "run again" in err
    assert whole(cache)[1]["other"] == 1 and whole(cache)[1]["length"] == 12
    assert not os.path.exists(os.path.join(shared_dir, "out.h5"))
    assert sorted(os.listdir(shared_dir)) == ["cache.h5", "new.h5", "p.h5"]


def test_queries_and_new_rows_must_be_the_same_tokens(comm, capsys, shared_dir, cache):
    rng = np.random.default_rng(4)
    write_h5(comm, os.path.join(shared_dir, "new.h5"),
           q=rng.standard_normal((1, 2, 2, 4)).astype(np.float32),
           k=rng.standard_normal((1, 1, 3, 4)).astype(np.float32),
           v=rng.standard_normal((1, 1, 3, 4)).astype(np.float32))
    code, _, err = _decode(comm, capsys, shared_dir)
    assert code == 1 and "holds 2 queries but 3 new keys and 3 new values" in err, err
    assert whole(cache)[1]["length"] == 12


def test_nan_in_the_new_rows_or_the_cache_is_refused_unless_allowed(comm, capsys, shared_dir, cache):
    rng = np.random.default_rng(5)
    k = rng.standard_normal((1, 1, 1, 4)).astype(np.float32)
    k[0, 0, 0, 1] = np.nan
    write_h5(comm, os.path.join(shared_dir, "new.h5"),
           q=rng.standard_normal((1, 2, 1, 4)).astype(np.float32), k=k, v=k)
    code, _, err = _decode(comm, capsys, shared_dir)
    assert code == 1 and "k_new holds NaN or Inf" in err and "--allow-nonfinite" in err, err
    assert whole(cache)[1]["length"] == 12
    code, _, err = _decode(comm, capsys, shared_dir, "--allow-nonfinite")
    assert code == 0, err
    out, _ = whole(os.path.join(shared_dir, "out.h5"))
    assert np.isnan(out["out"]).all()  # the new query sees its own NaN key: NaN at every P
    code, _, err = run(comm, capsys, "decode", cache, "--queries", os.path.join(shared_dir, "new.h5"),
                       "-o", os.path.join(shared_dir, "out2.h5"), "-q")
    assert code == 1 and "holds NaN or Inf keys or values" in err, err  # the grown cache, reloaded


def test_a_malformed_window_attribute_is_one_error(comm, capsys, shared_dir, cache):
    if comm.rank == 0:
        with h5py.File(cache, "r+") as f:
            f.attrs["window"] = "wide"
    comm.barrier()
    code, _, err = _decode(comm, capsys, shared_dir)
    assert code == 1 and "attribute 'window'" in err and "Traceback" not in err, err


def test_prefill_pages_are_bounded(comm, capsys, shared_dir, cache):
    code, _, err = run(comm, capsys, "prefill", os.path.join(shared_dir, "p.h5"), "-o",
                       os.path.join(shared_dir, "c2.h5"), "--page", "2147483647")
    assert code == 2 and "page must be 1 to 1048576 rows" in err, err
    if comm.rank == 0:
        with h5py.File(cache, "r+") as f:
            f.attrs["page"] = 2**40
    comm.barrier()
    code, _, err = _decode(comm, capsys, shared_dir)
    assert code == 1 and "attribute 'page' must be an integer from 1 to 1048576" in err, err


def test_calibrate_checks_its_output_first_and_never_overwrites_unasked(comm, capsys, shared_dir):
    out = os.path.join(shared_dir, "m.json")
    small = ["--rows", "64", "--heads", "1", "--dim", "8", "--megabytes", "1", "--repeat", "1"]
    code, text, err = run(comm, capsys, "calibrate", "-o", os.path.join(shared_dir, "no", "m.json"),
                          *small)
    assert code == 1 and "does not exist" in err and "measuring" not in text, (text, err)
    if comm.rank == 0:
        with open(out, "w") as f:
            f.write("{}")
        os.chmod(out, 0o640)
    comm.barrier()
    code, text, err = run(comm, capsys, "calibrate", "-o", out, *small)
    assert code == 1 and "already exists" in err and "measuring" not in text, (text, err)
    assert open(out).read() == "{}"
    code, _, err = run(comm, capsys, "calibrate", "-o", out, "--force", *small, "-q")
    assert code == 0, err
    assert json.load(open(out))["rates"]["float32"] > 0
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o640
    assert sorted(os.listdir(shared_dir)) == ["m.json"]
    code, _, err = run(comm, capsys, "calibrate", "-o", out, "--force", "--rows", "2000000000")
    assert code == 2 and "the measurement needs about" in err and "Traceback" not in err, err


@pytest.mark.parametrize("field,value,why", [
    ("overlap", 2.0, "overlap must be >= 0 and <= 1"),
    ("overlap", -0.1, "overlap must be >= 0 and <= 1"),
    ("backward_ratio", 0, "backward_ratio must be > 0"),
    ("memory", float("nan"), "memory must be a finite number"),
    ("memory_bandwidth", float("inf"), "memory_bandwidth must be a finite number"),
    ("inside", {"latency_s": 1e-6, "bandwidth": 0}, "inside.bandwidth must be > 0"),
    ("between", {"latency_s": -1, "bandwidth": 1e9}, "between.latency_s must be >= 0"),
    ("rates", {"float32": 0}, "rates.float32 must be > 0"),
])
def test_plan_refuses_a_calibration_out_of_range(comm, capsys, shared_dir, field, value, why):
    from mpiattn.strategies import machines

    d = machines.PROFILES["cpu-node"].to_dict()
    d[field] = value
    path = os.path.join(shared_dir, "bad.json")
    if comm.rank == 0:
        with open(path, "w") as f:
            json.dump(d, f)
    comm.barrier()
    code, _, err = run(comm, capsys, "plan", "--seq", "4096", "--heads", "8", "--dim", "64",
                       "--calibration", path)
    assert code == 2 and why in err and "Traceback" not in err, err


def test_plan_inference_options_need_a_cache(comm, capsys):
    for extra, word in ((["--new-tokens", "4"], "--new-tokens describes"),
                        (["--chunk", "64"], "--chunk describes"),
                        (["--new-tokens", "4", "--chunk", "64"], "--new-tokens and --chunk describe")):
        code, _, err = run(comm, capsys, "plan", "--seq", "4096", "--heads", "8", "--dim", "64", *extra)
        assert code == 2 and word in err and "give --cache M too" in err, err
    assert run(comm, capsys, "plan", "--seq", "4096", "--heads", "8", "--dim", "64", "--cache",
               "1000", "--new-tokens", "4")[0] == 0
