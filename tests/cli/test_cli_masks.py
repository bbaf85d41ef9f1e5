"""The command line with masks: --window, --layout balanced, make-data --docs, segment ids in HDF5.

In-process (``mpiattn.cli.main``) at any rank count; outputs are compared with
an independent float64 reference on the whole arrays, its mask written out
from the file's datasets and attributes.
"""

import h5py
import numpy as np
import pytest

from mpiattn.io import datagen, reading

from helpers import run_cli as run, whole


def reference(data, causal, window):
    """float64 out/lse/dq/dk/dv from the file's arrays; visible pairs written out directly."""
    Q, K, V, dO = (np.asarray(data[n], np.float64) for n in ("q", "k", "v", "dout"))
    B, H, N, E = Q.shape
    M, G = K.shape[2], H // K.shape[1]
    i, j = np.arange(N)[:, None], np.arange(M)[None, :]
    vis = np.ones((B, N, M), bool)
    if causal:
        vis &= (j <= i)[None]
    if window is not None:
        if window[0] is not None:
            vis &= (j >= i - window[0])[None]
        if window[1] is not None:
            vis &= (j <= i + window[1])[None]
    if "segment_ids" in data:
        sk = data.get("kv_segment_ids", data["segment_ids"])
        vis &= data["segment_ids"][:, :, None] == sk[:, None, :]
    if "key_padding_mask" in data:
        vis &= ~data["key_padding_mask"][:, None, :]
    Kr, Vr = np.repeat(K, G, 1), np.repeat(V, G, 1)
    v4 = vis[:, None]
    S = np.where(v4, Q @ Kr.swapaxes(-1, -2) / np.sqrt(E), -np.inf)
    seen = v4.any(-1)
    m = np.where(seen, S.max(-1, initial=-np.inf), 0)
    Pe = np.where(v4, np.exp(S - m[..., None]), 0)
    l = Pe.sum(-1)
    Pm = Pe / np.where(seen, l, 1)[..., None]
    dP = dO @ Vr.swapaxes(-1, -2)
    dS = Pm * (dP - (dP * Pm).sum(-1, keepdims=True))
    fold = lambda x: x.reshape(B, K.shape[1], G, *x.shape[2:]).sum(2)  # noqa: E731
    return {"out": Pm @ Vr, "lse": np.where(seen, m + np.log(np.where(seen, l, 1)), -np.inf),
            "dq": dS @ Kr / np.sqrt(E), "dk": fold(dS.swapaxes(-1, -2) @ Q) / np.sqrt(E),
            "dv": fold(Pm.swapaxes(-1, -2) @ dO)}


def compare(got, want, tol):
    for name, w in want.items():
        fin = np.isfinite(w)
        assert np.array_equal(fin, np.isfinite(got[name])), name
        np.testing.assert_allclose(got[name][fin], w[fin], rtol=0, atol=tol * max(1, np.abs(w[fin]).max()),
                                   err_msg=name)


@pytest.mark.parametrize("layout", ["balanced", "zigzag", "contiguous"])
def test_make_data_docs_and_run_with_window(comm, capsys, shared_dir, layout):
    inp, out = f"{shared_dir}/in.h5", f"{shared_dir}/out.h5"
    code, _, err = run(comm, capsys, "make-data", inp, "--batch", 2, "--heads", 2, "--kv-heads", 1,
                       "--seq", 300, "--dim", 8, "--with-dout", "--docs", 40, "--padding", 0.1,
                       "--window", "60,0", "--causal", "--dtype", "float64", "--seed", 3, "-q")
    assert code == 0, err
    data, attrs = whole(inp)
    assert data["segment_ids"].shape == (2, 300) and data["segment_ids"].dtype.kind == "i"
    assert list(attrs["window"]) == [60, 0]
    assert 3 < len(np.unique(data["segment_ids"][0])) < 30
    code, text, err = run(comm, capsys, "run", inp, "-o", out, "--layout", layout, "--block-size", 16,
                          "--check")
    assert code == 0, err
    if comm.rank == 0:
        assert "window 60,0" in text and "segment_ids" in text and "OK" in text
        assert f"layout {layout}" in text
    got, out_attrs = whole(out)
    assert out_attrs["layout"] == layout and list(out_attrs["window"]) == [60, 0]
    compare(got, reference(data, True, (60, 0)), 1e-10)
    # the flag overrides the attribute; 'none' is an unbounded side
    code, _, err = run(comm, capsys, "run", inp, "-o", out, "-f", "--window", "none,3", "--no-causal",
                       "--layout", layout, "-q")
    assert code == 0, err
    compare(whole(out)[0], reference(data, False, (None, 3)), 1e-10)


def test_cross_attention_ids_and_balanced_keys(comm, capsys, shared_dir):
    """N != M with kv_segment_ids: balanced queries, contiguous keys."""
    path, out = f"{shared_dir}/cross.h5", f"{shared_dir}/cross_out.h5"
    rng = np.random.default_rng(4)
    B, H, N, M, E = 1, 2, 40, 29, 4
    data = {"q": rng.standard_normal((B, H, N, E)), "k": rng.standard_normal((B, 1, M, E)),
            "v": rng.standard_normal((B, 1, M, 3)), "dout": rng.standard_normal((B, H, N, 3)),
            "segment_ids": np.sort(rng.integers(0, 5, (B, N)), axis=1),
            "kv_segment_ids": np.sort(rng.integers(0, 5, (B, M)), axis=1).astype(np.int32)}
    if comm.rank == 0:
        with h5py.File(path, "w") as f:
            for name, x in data.items():
                f[name] = x
            f.attrs["window"] = np.array([-1, 4])
    comm.barrier()
    code, _, err = run(comm, capsys, "run", path, "-o", out, "--layout", "balanced", "--check", "-q")
    assert code == 0, err
    compare(whole(out)[0], reference(data, False, (None, 4)), 1e-10)


BAD_FILES = {
    "float-ids": (lambda d: d.update(segment_ids=np.zeros((1, 6))), "document ids must be integers"),
    "ids-shape": (lambda d: d.update(segment_ids=np.zeros((1, 5), np.int64)), "segment_ids has shape"),
    "kv-ids-alone": (lambda d: d.update(kv_segment_ids=np.zeros((1, 6), np.int64)),
                     "kv_segment_ids needs segment_ids"),
    "window-attr": (lambda d: d.update(_window=np.array([-2, 0])), "attribute 'window'"),
    "window-attr-3": (lambda d: d.update(_window=np.array([1, 2, 3])), "attribute 'window'"),
    "int8-attn-mask": (lambda d: d.update(attn_mask=np.ones((1, 1, 6, 6), np.int8)),
                       "'attn_mask' has dtype int8; it must be boolean (True = the pair takes part) "
                       "or real floating point (float16, bfloat16, float32 or float64"),
}


@pytest.mark.parametrize("kind", list(BAD_FILES))
def test_bad_mask_inputs(comm, capsys, shared_dir, kind):
    path, out = f"{shared_dir}/bad.h5", f"{shared_dir}/bad_out.h5"
    edit, message = BAD_FILES[kind]
    data = {"q": np.ones((1, 1, 6, 4)), "k": np.ones((1, 1, 6, 4)), "v": np.ones((1, 1, 6, 4))}
    edit(data)
    if comm.rank == 0:
        with h5py.File(path, "w") as f:
            for name, x in data.items():
                if name == "_window":
                    f.attrs["window"] = x
                else:
                    f[name] = x
    comm.barrier()
    code, _, err = run(comm, capsys, "run", path, "-o", out, "-q")
    assert code == 1
    if comm.rank == 0:
        assert message in err


@pytest.mark.parametrize("argv, message", [
    (["--window=-1,0"], "window left must be >= 0"),
    (["--window", "5"], "expected LEFT,RIGHT"),
    (["--window", "a,0"], "expected an integer or none"),
    (["--layout", "striped"], "invalid choice"),
    (["--window", "1,99999999999999999999"], "window right must be >= 0 and <= 2147483647"),
    (["--mask-mod", "chunked:100000000000000000000"], "size must be <= 9223372036854775807"),
    (["--mask-mod", "streaming:1,-1"], "left must be >= 0"),
])
def test_bad_flags(comm, capsys, shared_dir, argv, message):
    code, _, err = run(comm, capsys, "run", f"{shared_dir}/x.h5", "-o", f"{shared_dir}/y.h5", *argv)
    assert code == 2
    if comm.rank == 0:
        assert message in err


def test_make_data_docs_needs_equal_lengths(comm, capsys, shared_dir):
    code, _, err = run(comm, capsys, "make-data", f"{shared_dir}/d.h5", "--seq", 20, "--kv-seq", 30,
                       "--docs", 4)
    assert code == 2
    if comm.rank == 0:
        assert "--docs needs --kv-seq equal to --seq" in err


# ------------------------------------------------------------------ io level
def test_document_ids_do_not_depend_on_the_rank_split():
    spec = datagen.Spec(batch=3, seq=3000, kv_seq=3000, docs=150, seed=7)
    full = datagen.rows(spec, "segment_ids", 0, 3000)
    assert (np.diff(full, axis=1) >= 0).all() and (full[:, 0] == 0).all()
    for a, b in [(0, 1), (1000, 1700), (2999, 3000), (256, 512), (40, 40)]:
        np.testing.assert_array_equal(datagen.rows(spec, "segment_ids", a, b), full[:, a:b])
    mean = 3000 * 3 / sum(len(np.unique(r)) for r in full)
    assert 100 < mean < 220


def test_read_input_with_ids_and_explicit_layouts(comm, shared_dir):
    import mpiattn

    path = f"{shared_dir}/ids.h5"
    N, M = 13, 9
    rng = np.random.default_rng(0)
    seg, kseg = rng.integers(0, 3, (2, N)), rng.integers(0, 3, (2, M))
    if comm.rank == 0:
        with h5py.File(path, "w") as f:
            f["q"] = rng.standard_normal((2, 1, N, 4))
            f["k"] = rng.standard_normal((2, 1, M, 4))
            f["v"] = rng.standard_normal((2, 1, M, 4))
            f["segment_ids"] = seg
            f["kv_segment_ids"] = kseg.astype(np.uint16)
            f.attrs["window"] = [3, -1]
    comm.barrier()
    lay = mpiattn.balance(N, comm.size, causal=True)
    kl = mpiattn.Layout([list(reversed(r)) for r in mpiattn.balance(M, comm.size, causal=True).ranges])
    inp = reading.read_input(path, comm, layout=lay, kv_layout=kl)
    np.testing.assert_array_equal(inp.segment_ids, seg[:, mpiattn.partition(N, layout=lay)])
    np.testing.assert_array_equal(inp.kv_segment_ids, kseg[:, mpiattn.partition(M, layout=kl)])
    assert inp.kv_segment_ids.dtype == np.int64 and inp.window == (3, None)
    shapes, ids = reading.read_whole(path, "segment_ids", comm)
    np.testing.assert_array_equal(ids, seg)
    assert shapes["k"][2] == M


@pytest.mark.mpi(min_size=2)
def test_read_input_refuses_layouts_that_differ_between_ranks(comm, shared_dir):
    import mpiattn

    path = f"{shared_dir}/lay.h5"
    N = 4 * comm.size
    if comm.rank == 0:
        with h5py.File(path, "w") as f:
            for name in ("q", "k", "v"):
                f[name] = np.ones((1, 1, N, 2))
    comm.barrier()
    mine = mpiattn.balance(N, comm.size, causal=comm.rank == 0)  # zigzag-like on rank 0 only
    with pytest.raises(ValueError, match="ranks disagree on read_input's layouts"):
        reading.read_input(path, comm, layout=mine)
