"""The command line in-process (``mpiattn.cli.main``) at any rank count.

Every rank calls ``main`` with the same argv, as under ``mpiexec``; the exit
code must be the same on every rank and messages must come from rank 0 only.
Output files are checked against the float64 reference on whole arrays read
with h5py. End-to-end runs through ``mpiexec`` are in test_cli_e2e.py.
"""

import os

import h5py
import numpy as np
import pytest

import mpiattn
from mpiattn import cli
from mpiattn.cli import commands, common, steps
from mpiattn.io import datagen

from helpers import bad_input, reference, run_cli as run, whole


def _assert_matches_reference(inp_path, out_path, causal, rtol=2e-4):
    data, _ = whole(inp_path)
    got, attrs = whole(out_path)
    ref = reference(data["q"], data["k"], data["v"], data.get("dout"), causal=causal,
                    key_padding_mask=data.get("key_padding_mask"))
    for name in got:
        want = getattr(ref, name)
        assert got[name].shape == want.shape, name
        fin = np.isfinite(want)
        assert np.array_equal(fin, np.isfinite(got[name])), name
        np.testing.assert_allclose(got[name][fin], want[fin], rtol=0,
                                   atol=rtol * max(1.0, np.abs(want[fin]).max()), err_msg=name)
    return got, attrs


def _make(comm, capsys, path, *extra):
    code, _, err = run(comm, capsys, "make-data", path, "--heads", 4, "--kv-heads", 2, "--seq", 70,
                       "--kv-seq", 45, "--dim", 8, "--value-dim", 6, "--with-dout", "--padding", 0.2,
                       "--seed", 5, "-q", *extra)
    assert code == 0, err
    return path


@pytest.mark.parametrize("strategy,layout,causal", [
    ("auto", "auto", True), ("ring", "contiguous", False), ("ring", "zigzag", True),
    ("allgather", "zigzag", False), ("materialized", "contiguous", True)])
def test_run_matches_reference(comm, capsys, shared_dir, strategy, layout, causal):
    inp = _make(comm, capsys, os.path.join(shared_dir, "in.h5"), *(["--causal"] if causal else []))
    out = os.path.join(shared_dir, "out.h5")
    code, text, err = run(comm, capsys, "run", inp, "-o", out, "--strategy", strategy, "--layout",
                          layout, "--block-size", 16, "--check", "--device", "cpu")
    assert code == 0, err
    if comm.rank == 0:
        assert "check" in text and "OK" in text and "causal" in text
    got, attrs = _assert_matches_reference(inp, out, causal)
    assert sorted(got) == ["dk", "dq", "dv", "lse", "out"]
    assert attrs["ranks"] == comm.size and attrs["causal"] == causal
    assert attrs["layout"] == (layout if layout != "auto" else ("zigzag" if causal else "contiguous"))
    assert attrs["input_path"] == os.path.abspath(inp) and attrs["input_size"] == os.path.getsize(inp)
    assert attrs["strategy"] == strategy and attrs["strategy_used"] != "auto"
    assert attrs["time_forward_s"] >= 0 and attrs["mpiattn_version"]
    assert sorted(os.listdir(shared_dir)) == ["in.h5", "out.h5"]


def test_make_data_content_is_rank_count_independent(comm, capsys, shared_dir):
    path = _make(comm, capsys, os.path.join(shared_dir, "in.h5"), "--causal", "--scale", 0.3)
    spec = datagen.Spec(batch=1, heads=4, kv_heads=2, seq=70, kv_seq=45, dim=8, value_dim=6,
                        with_dout=True, padding=0.2, seed=5)
    data, attrs = whole(path)
    for name, (shape, axis) in spec.datasets().items():
        np.testing.assert_array_equal(data[name], datagen.rows(spec, name, 0, shape[axis]))
    assert bool(attrs["causal"]) and attrs["scale"] == 0.3 and attrs["seed"] == 5


def test_low_dimensional_inputs_keep_their_shapes(comm, capsys, shared_dir):
    path = os.path.join(shared_dir, "in.h5")
    rng = np.random.default_rng(7)

    def make():
        with h5py.File(path, "w") as f:
            f["q"], f["k"], f["v"] = rng.standard_normal((9, 4)), rng.standard_normal((6, 4)), \
                rng.standard_normal((6, 3))
            f["dout"] = rng.standard_normal((9, 3))
            f.attrs["causal"] = True
    if comm.rank == 0:
        make()
    comm.barrier()
    out = os.path.join(shared_dir, "out.h5")
    code, _, err = run(comm, capsys, "run", path, "-o", out, "--check", "--dtype", "float64")
    assert code == 0, err
    data, _ = whole(path)
    got, _ = whole(out)
    assert {k: v.shape for k, v in got.items()} == {"out": (9, 3), "lse": (9,), "dq": (9, 4),
                                                    "dk": (6, 4), "dv": (6, 3)}
    ref = reference(data["q"][None, None], data["k"][None, None], data["v"][None, None],
                    data["dout"][None, None], causal=True)
    np.testing.assert_allclose(got["dk"], ref.dk[0, 0], atol=1e-12)
    np.testing.assert_allclose(got["out"], ref.out[0, 0], atol=1e-12)


def test_more_ranks_than_rows_is_allowed(comm, capsys, shared_dir):
    inp = os.path.join(shared_dir, "in.h5")
    assert run(comm, capsys, "make-data", inp, "--seq", 2, "--kv-seq", 3, "--dim", 4, "--heads", 2,
               "--with-dout", "-q")[0] == 0
    out = os.path.join(shared_dir, "out.h5")
    code, _, err = run(comm, capsys, "run", inp, "-o", out, "--check", "--strategy", "ring")
    assert code == 0, err
    _assert_matches_reference(inp, out, causal=False)


def test_no_backward_and_ulysses_heads(comm, capsys, shared_dir):
    inp = _make(comm, capsys, os.path.join(shared_dir, "in.h5"))
    out = os.path.join(shared_dir, "out.h5")
    code, _, err = run(comm, capsys, "run", inp, "-o", out, "--no-backward")
    assert code == 0, err
    assert sorted(whole(out)[0]) == ["lse", "out"]
    code, _, err = run(comm, capsys, "run", inp, "-o", out, "--force", "--strategy", "ulysses")
    assert code == 0, err  # H = 4, Hkv = 2 on 1-4 ranks: an even or uneven head split
    _assert_matches_reference(inp, out, causal=False)
    if comm.size > 1:  # one head for several ranks: an argument error once the input is known
        one = os.path.join(shared_dir, "one-head.h5")
        code, _, err = run(comm, capsys, "make-data", one, "--heads", 1, "--kv-heads", 1, "--seq", 9,
                           "--dim", 4, "-q")
        assert code == 0, err
        code, _, err = run(comm, capsys, "run", one, "-o", out, "--force", "--strategy", "ulysses")
        assert code == 2  # exit 2, like any bad argument
        if comm.rank == 0:
            assert "ulysses" in err and "one query head per rank" in err and err.count("error:") == 1
        assert sorted(whole(out)[0]) == ["dk", "dq", "dv", "lse", "out"]  # the earlier one, untouched


BAD_RUNS = [("missing", "does not exist"), ("not-hdf5", "cannot open"), ("no-k", "no dataset 'k'"),
            ("q-5d", "5 dimensions"), ("E", "feature size E"), ("M", "length M"),
            ("heads", "multiple of Hkv"), ("int", "dtype int32"), ("complex", "complex64"),
            ("mask-shape", "key_padding_mask has shape"), ("mask-dtype", "must be boolean"),
            ("dout-shape", "dout has shape"), ("nan", "--allow-nonfinite")]


@pytest.mark.parametrize("kind,message", BAD_RUNS, ids=[b[0] for b in BAD_RUNS])
def test_bad_input_exits_1(comm, capsys, shared_dir, kind, message):
    path = os.path.join(shared_dir, "in.h5")
    if kind != "missing":
        if comm.rank == 0:
            bad_input(kind, path)
        comm.barrier()
    out = os.path.join(shared_dir, "out.h5")
    code, _, err = run(comm, capsys, "run", path, "-o", out)
    assert code == 1
    if comm.rank == 0:
        assert err.startswith("mpiattn: error:") and message in err and err.count("\n") == 1, err
    assert not os.path.exists(out)
    if kind == "nan":
        code, _, err = run(comm, capsys, "run", path, "-o", out, "--allow-nonfinite")
        assert code == 0, err
        assert np.isnan(whole(out)[0]["out"]).any()


def test_a_scale_that_overflows_the_scores_writes_nothing(comm, capsys, shared_dir):
    """A finite --scale whose scores overflow float32: NaN results are refused (exit 1, nothing
    written; they were written with exit 0), unless --allow-nonfinite."""
    inp = _make(comm, capsys, os.path.join(shared_dir, "in.h5"))
    out = os.path.join(shared_dir, "out.h5")
    code, _, err = run(comm, capsys, "run", inp, "-o", out, "--scale", "1e308")
    assert code == 1 and not os.path.exists(out)
    if comm.rank == 0:
        assert "holds NaN or Inf" in err and "--scale" in err and err.count("\n") == 1, err
    code, _, err = run(comm, capsys, "run", inp, "-o", out, "--scale", "1e308",
                       "--allow-nonfinite", "-q")
    assert code == 0, err


def test_output_rules(comm, capsys, shared_dir):
    inp = _make(comm, capsys, os.path.join(shared_dir, "in.h5"))
    out = os.path.join(shared_dir, "out.h5")
    assert run(comm, capsys, "run", inp, "-o", out, "-q")[0] == 0
    first = whole(out)[0]
    code, _, err = run(comm, capsys, "run", inp, "-o", out, "--no-backward")
    assert code == 1 and (comm.rank or "already exists" in err)
    np.testing.assert_array_equal(whole(out)[0]["dq"], first["dq"])  # untouched
    assert run(comm, capsys, "run", inp, "-o", out, "--no-backward", "--force", "-q")[0] == 0
    assert "dq" not in whole(out)[0]
    code, _, err = run(comm, capsys, "run", inp, "-o", inp, "--force")
    assert code == 1 and (comm.rank or "is the input file" in err)
    code, _, err = run(comm, capsys, "run", inp, "-o", os.path.join(shared_dir, "no", "o.h5"))
    assert code == 1 and (comm.rank or "does not exist" in err)
    locked = "/sys" if os.geteuid() == 0 else os.path.join(shared_dir, "locked")
    if locked != "/sys" and comm.rank == 0:
        os.mkdir(locked, 0o555)
    comm.barrier()
    code, _, err = run(comm, capsys, "run", inp, "-o", os.path.join(locked, "o.h5"))
    assert code == 1 and (comm.rank or "cannot create files" in err)
    assert run(comm, capsys, "make-data", inp, "-q")[0] == 1  # make-data refuses too


def test_failed_check_exits_1(comm, capsys, shared_dir, monkeypatch):
    inp = _make(comm, capsys, os.path.join(shared_dir, "in.h5"))
    real = steps.dense_attention

    def skewed(*a, **kw):
        r = real(*a, **kw)
        return r._replace(dv=r.dv * 1.01)
    monkeypatch.setattr(steps, "dense_attention", skewed)
    code, _, err = run(comm, capsys, "run", inp, "-o", os.path.join(shared_dir, "o.h5"), "--check")
    assert code == 1 and (comm.rank or ("check failed" in err and "dv" in err))
    code, text, err = run(comm, capsys, "run", inp, "-o", os.path.join(shared_dir, "o2.h5"),
                          "--check", "--check-limit-gib", "1e-9")
    assert code == 0 and (comm.rank or "skipped" in text)


def test_check_reports_its_progress_like_the_other_phases(comm, capsys, shared_dir, monkeypatch):
    """--check prints a line per 10 % of the reference's rows (blocks of 256) once it runs long."""
    from mpiattn.cli import common

    code, _, err = run(comm, capsys, "make-data", os.path.join(shared_dir, "in.h5"), "--heads", 2,
                       "--seq", 600, "--dim", 4, "--with-dout", "-q")
    assert code == 0, err
    monkeypatch.setattr(common, "PROGRESS_AFTER_S", 0.0)  # every phase counts as long
    code, text, err = run(comm, capsys, "run", os.path.join(shared_dir, "in.h5"), "-o",
                          os.path.join(shared_dir, "o.h5"), "--check")
    assert code == 0, err
    lines = [ln for ln in text.splitlines() if ln.startswith("  check  ")]
    assert [ln.split(",")[0] for ln in lines[:3]] == [
        "  check     42 % (256/600 steps", "  check     85 % (512/600 steps",
        "  check    100 % (600/600 steps"], text
    assert lines[3].endswith("OK") and len(lines) == 4, text  # then the verdict
    assert any(ln.startswith("  forward  100 %") for ln in text.splitlines()), text


USAGE = [["run"], ["run", "in.h5"], ["run", "in.h5", "-o", "o.h5", "--block-size", "0"],
         ["run", "in.h5", "-o", "o.h5", "--strategy", "best"], ["run", "in.h5", "-o", "o.h5",
                                                                "--scale", "nan"],
         ["make-data", "o.h5", "--padding", "1.5"], ["make-data", "o.h5", "--heads", "3",
                                                     "--kv-heads", "2"],
         ["make-data", "o.h5", "--seq", "-4"], ["frobnicate"], ["--bogus"],
         ["run", "in.h5", "-o", "o.h5", "--causal", "--no-causal"],
         ["run", "in.h5", "-o", "o.h5", "--check-limit-gib", "-1"],
         ["run", "in.h5", "-o", "o.h5", "--watchdog", "0.001"],  # would "lose" every peer at once
         ["make-data", "o.h5", "--watchdog", "nan"], ["run", "in.h5", "-o", "o.h5", "--block-size",
                                                      "2147483648"]]


@pytest.mark.parametrize("argv", USAGE, ids=[" ".join(a) for a in USAGE])
def test_usage_errors_exit_2(comm, capsys, shared_dir, monkeypatch, argv):
    monkeypatch.chdir(shared_dir)
    code, _, err = run(comm, capsys, *argv)
    assert code == 2
    if comm.rank == 0:
        assert "error:" in err
    assert os.listdir(shared_dir) == []


def test_make_data_of_an_absurd_size_is_refused_by_the_space_check(comm, capsys, shared_dir):
    """Bytes past 64 bits are counted as they are (they wrapped round once, and the run went on to
    allocate): the free-space check refuses the output before any work."""
    big = 2**31 - 1
    code, _, err = run(comm, capsys, "make-data", os.path.join(shared_dir, "big.h5"), "--seq", big,
                       "--heads", big, "-q")  # 2**68 bytes of q: -2**38 in int64
    assert code == 1
    if comm.rank == 0:
        assert "not enough free space" in err and "TiB" in err and "allocate" not in err, err
    assert os.listdir(shared_dir) == []


def test_help_version_info(comm, capsys):
    code, text, _ = run(comm, capsys, "--help")
    assert code == 0 and (comm.rank or "make-data" in text)
    code, text, _ = run(comm, capsys, "run", "--help")
    assert code == 0 and (comm.rank or "--allow-nonfinite" in text)
    code, text, _ = run(comm, capsys, "--version")
    assert code == 0 and (comm.rank or text.startswith("mpiattn "))
    code, text, err = run(comm, capsys, "info")
    assert code == 0, err
    if comm.rank == 0:
        for word in ("mpi4py", "MPI", f"ranks      {comm.size} on", "parallel HDF5", "GPUs",
                     "CUDA-aware"):
            assert word in text, (word, text)


def test_info_says_an_engine_no_device_here_can_run_is_not_usable(comm, capsys, monkeypatch):
    from mpiattn.cli import commands

    # rank 1 (or 0 alone) has no GPU: the fused engine (CuPy only) is usable nowhere
    monkeypatch.setattr(commands, "gpu_status", lambda: (False, "none (cupy not installed)"))
    code, text, err = run(comm, capsys, "info")
    assert code == 0, err
    line = [ln for ln in text.splitlines() if ln.startswith("engines")]
    if comm.rank == 0:
        assert len(line) == 1, text
        assert line[0].startswith("engines    native: usable (CPU); fused: not usable (CuPy arrays "
                                  "only; rank 0: no usable GPU: cupy not installed); torch: "), line
        assert "fused: usable" not in line[0], line


def test_device_gpu_without_gpu_exits_1(comm, capsys, shared_dir):
    if steps.gpu_status()[0]:
        pytest.skip("a GPU is usable here")
    inp = _make(comm, capsys, os.path.join(shared_dir, "in.h5"))
    code, _, err = run(comm, capsys, "run", inp, "-o", os.path.join(shared_dir, "o.h5"), "--device", "gpu")
    assert code == 1 and (comm.rank or "no usable GPU" in err)
    code, text, err = run(comm, capsys, "run", inp, "-o", os.path.join(shared_dir, "o.h5"), "--device", "auto")
    assert code == 0, err


def test_example(comm, capsys, shared_dir, monkeypatch):
    monkeypatch.chdir(shared_dir)
    code, text, err = run(comm, capsys)
    assert code == 0, err
    if comm.rank == 0:
        assert "forward + backward, causal" in text and "OK" in text and f"{comm.size} rank(s)" in text
    got, attrs = whole(cli.EXAMPLE_OUTPUT)
    assert attrs[cli.EXAMPLE_ATTR] == 1 and sorted(got) == ["dk", "dq", "dv", "lse", "out"]
    _assert_matches_reference(attrs["input_path"], cli.EXAMPLE_OUTPUT, causal=True)
    assert run(comm, capsys, "-q", "--strategy", "ring")[0] == 0  # overwrites its own output
    assert whole(cli.EXAMPLE_OUTPUT)[1]["strategy"] == "ring"
    comm.barrier()  # everybody has read it
    if comm.rank == 0:  # someone else's file under that name
        os.remove(cli.EXAMPLE_OUTPUT)
        with h5py.File(cli.EXAMPLE_OUTPUT, "w") as f:
            f["precious"] = np.arange(3)
    comm.barrier()
    code, _, err = run(comm, capsys)
    assert code == 1 and (comm.rank or "refusing to overwrite" in err)
    assert list(whole(cli.EXAMPLE_OUTPUT)[0]) == ["precious"]


def test_example_without_bundled_file_regenerates_it(comm, capsys, shared_dir, monkeypatch):
    import contextlib

    monkeypatch.chdir(shared_dir)
    monkeypatch.setattr(commands, "_example_input", lambda: contextlib.nullcontext(None))
    code, text, err = run(comm, capsys, "--strategy", "ring")
    assert code == 0, err
    assert comm.rank or ("regenerating" in text and "OK" in text)
    assert os.listdir(shared_dir) == [cli.EXAMPLE_OUTPUT]  # the regenerated input is gone again
    bundled = os.path.join(os.path.dirname(mpiattn.__file__), "data", "example.h5")
    _assert_matches_reference(bundled, cli.EXAMPLE_OUTPUT, causal=True)  # same data as bundled


def test_bundled_example_is_reproducible():
    path = os.path.join(os.path.dirname(mpiattn.__file__), "data", "example.h5")
    assert os.path.getsize(path) <= 1_000_000
    data, attrs = whole(path)
    spec = datagen.Spec(**common.EXAMPLE_SPEC)
    assert sorted(data) == sorted(spec.datasets())
    for name, (shape, axis) in spec.datasets().items():
        np.testing.assert_array_equal(data[name], datagen.rows(spec, name, 0, shape[axis]))
    assert bool(attrs["causal"])


def test_top_level_data_holds_the_same_example():
    """data/example.h5 (the project layout's data folder) is a byte-for-byte copy of the packaged
    mpiattn/data/example.h5, which the CLI reads and the test above regenerates."""
    import filecmp

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    copy = os.path.join(repo, "data", "example.h5")
    packaged = os.path.join(repo, "mpiattn", "data", "example.h5")
    assert os.path.isfile(copy), "data/example.h5 is missing: cp mpiattn/data/example.h5 data/"
    assert filecmp.cmp(copy, packaged, shallow=False), \
        "data/example.h5 differs from mpiattn/data/example.h5: cp mpiattn/data/example.h5 data/"


def test_causal_takes_an_optional_alignment_before_the_input():
    from mpiattn.cli.parser import build_parser

    for argv, causal in ((["run", "--causal", "in.h5", "-o", "x.h5"], True),
                         (["run", "--causal", "bottom-right", "in.h5", "-o", "x.h5"], "bottom-right"),
                         (["run", "in.h5", "-o", "x.h5", "--causal"], True),
                         (["run", "in.h5", "-o", "x.h5", "--causal=top-left"], True),
                         (["run", "in.h5", "-o", "x.h5"], None)):
        args = build_parser("run").parse_args(argv)
        assert (args.input, args.causal) == ("in.h5", causal), argv
    args = build_parser("plan").parse_args(["plan", "--seq", "64", "--heads", "2", "--dim", "8", "--causal"])
    assert args.causal is True
