"""``mpiattn prefill`` and ``mpiattn decode`` in-process at any rank count, against the float64 reference."""

import os

import numpy as np
import pytest

from helpers import reference, run_cli as run, whole, write_h5


def test_prefill_then_decode_with_appends_equals_full_attention(comm, capsys, shared_dir):
    rng = np.random.default_rng(21)
    L, n0 = 52, 40
    Q = rng.standard_normal((1, 4, L, 8)).astype(np.float32)
    K = rng.standard_normal((1, 2, L, 8)).astype(np.float32)
    V = rng.standard_normal((1, 2, L, 6)).astype(np.float32)
    inp, cache = os.path.join(shared_dir, "prompt.h5"), os.path.join(shared_dir, "cache.h5")
    write_h5(comm, inp, q=Q[:, :, :n0], k=K[:, :, :n0], v=V[:, :, :n0])
    code, text, err = run(comm, capsys, "prefill", inp, "-o", cache, "--page", 3, "--window", "20,0",
                          "--layout", "zigzag", "-q")
    assert code == 0, err
    ref = reference(Q, K, V, causal=True, window=(20, 0))
    data, attrs = whole(cache)
    np.testing.assert_allclose(data["out"], ref.out[:, :, :n0], atol=2e-5)
    np.testing.assert_array_equal(data["k"], K[:, :, :n0])
    assert attrs["length"] == n0 and attrs["page"] == 3 and list(attrs["window"]) == [20, 0]
    pos = n0
    for t in (2, 1, 5):
        qf, out = os.path.join(shared_dir, f"q{pos}.h5"), os.path.join(shared_dir, f"out{pos}.h5")
        write_h5(comm, qf, q=Q[:, :, pos:pos + t], k=K[:, :, pos:pos + t], v=V[:, :, pos:pos + t])
        code, text, err = run(comm, capsys, "decode", cache, "--queries", qf, "-o", out, "--append")
        assert code == 0, err
        got, oattrs = whole(out)
        np.testing.assert_allclose(got["out"], ref.out[:, :, pos:pos + t], atol=2e-5)
        np.testing.assert_allclose(got["lse"], ref.lse[:, :, pos:pos + t], atol=2e-5)
        pos += t
        assert oattrs["cache_length"] == pos
    data, attrs = whole(cache)
    np.testing.assert_array_equal(data["k"], K[:, :, :pos])
    np.testing.assert_array_equal(data["v"], V[:, :, :pos])
    np.testing.assert_allclose(data["out"], ref.out[:, :, :n0], atol=2e-5)  # carried over
    assert attrs["length"] == pos and list(attrs["window"]) == [20, 0]


def test_decode_errors_leave_every_file_as_it_was(comm, capsys, shared_dir):
    rng = np.random.default_rng(22)
    Q = rng.standard_normal((1, 2, 20, 4)).astype(np.float32)
    K = rng.standard_normal((1, 1, 20, 4)).astype(np.float32)
    inp, cache = os.path.join(shared_dir, "p.h5"), os.path.join(shared_dir, "c.h5")
    write_h5(comm, inp, q=Q, k=K, v=K)
    assert run(comm, capsys, "prefill", inp, "-o", cache, "-q")[0] == 0
    before = open(cache, "rb").read() if comm.rank == 0 else None
    bad, out = os.path.join(shared_dir, "bad.h5"), os.path.join(shared_dir, "out.h5")
    write_h5(comm, bad, q=np.zeros((1, 2, 1, 5), np.float32), k=K[:, :, :1], v=K[:, :, :1])
    code, _, err = run(comm, capsys, "decode", cache, "--queries", bad, "-o", out, "--append")
    assert code == 1
    if comm.rank == 0:
        assert "E = 5" in err and "error:" in err
    write_h5(comm, bad, q=Q[:, :, -1:], k=K[:, :, :1].astype(np.float64), v=K[:, :, :1].astype(np.float64))
    code, _, err = run(comm, capsys, "decode", cache, "--queries", bad, "-o", out, "--append")
    assert code == 1
    if comm.rank == 0:
        assert "dtype float64" in err
    code, _, err = run(comm, capsys, "decode", cache, "--queries", bad, "-o", cache)
    assert code == 1
    if comm.rank == 0:
        assert "is the cache file" in err
        assert open(cache, "rb").read() == before  # the cache was never touched
        assert sorted(os.listdir(shared_dir)) == ["bad.h5", "c.h5", "p.h5"]
    comm.barrier()


#: Every subcommand that takes --scale, with the rest of its arguments (files that do not exist:
#: a bad scale is refused before anything is read).
SCALED = [["run", "in.h5", "-o", "out.h5"], ["make-data", "out.h5"], ["prefill", "in.h5", "-o", "cache.h5"],
          ["decode", "cache.h5", "--queries", "q.h5", "-o", "out.h5"]]


@pytest.mark.parametrize("scale", ["nan", "inf", "-inf", "1e999", "x"])
@pytest.mark.parametrize("argv", SCALED, ids=[a[0] for a in SCALED])
def test_every_scale_option_refuses_what_is_not_a_finite_number_alike(comm, capsys, shared_dir,
                                                                      monkeypatch, argv, scale):
    monkeypatch.chdir(shared_dir)
    code, _, err = run(comm, capsys, *argv, f"--scale={scale}")
    assert code == 2
    if comm.rank == 0:
        want = "expected a number" if scale == "x" else "must be finite"
        assert f"{argv[0]}: error: argument --scale: {want}" in err and "Traceback" not in err, err
    assert os.listdir(shared_dir) == []


def test_an_engine_that_cannot_take_the_call_is_a_usage_error_in_every_subcommand(comm, capsys, shared_dir):
    """--engine fused on NumPy arrays: exit 2 and one line before any work, from run, prefill and
    decode alike (prefill and decode left it to the library, exit 1)."""
    rng = np.random.default_rng(23)
    Q = rng.standard_normal((1, 2, 12, 4)).astype(np.float32)
    K = rng.standard_normal((1, 1, 12, 4)).astype(np.float32)
    inp, cache, new = (os.path.join(shared_dir, n) for n in ("p.h5", "c.h5", "q.h5"))
    write_h5(comm, inp, q=Q, k=K, v=K)
    write_h5(comm, new, q=Q[:, :, -1:], k=K[:, :, -1:], v=K[:, :, -1:])
    assert run(comm, capsys, "prefill", inp, "-o", cache, "-q")[0] == 0
    out = os.path.join(shared_dir, "out.h5")
    for argv in (["run", inp, "-o", out], ["prefill", inp, "-o", out],
                 ["decode", cache, "--queries", new, "-o", out], ["decode", cache, "--queries", new, "-o",
                                                                 out, "--append"]):
        code, _, err = run(comm, capsys, *argv, "--engine", "fused", "--device", "cpu")
        assert code == 2
        if comm.rank == 0:
            assert "error: --engine fused: the fused engine does not run on numpy arrays" in err, err
    assert sorted(os.listdir(shared_dir)) == ["c.h5", "p.h5", "q.h5"]
