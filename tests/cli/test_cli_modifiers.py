"""The command line with score modifiers: --softcap and the sinks, alibi_slopes and attn_mask datasets.

In-process (``mpiattn.cli.main``) at any rank count; the output file is compared with the
tests' float64 torch reference on the whole arrays (``helpers.torch_reference``).
"""

import os

import h5py
import numpy as np
import pytest

from helpers import run_cli as run
from helpers import torch_reference, visible_matrix, whole, write_h5

pytest.importorskip("torch")


@pytest.mark.parametrize("mask_kind", ["bool", "float"])
def test_run_with_every_modifier_writes_what_the_reference_computes(comm, capsys, shared_dir,
                                                                    mask_kind):
    rng = np.random.default_rng(31)
    B, H, N, E = 1, 2, 4 * comm.size + 3, 4
    q, k, v, dout = (rng.standard_normal((B, H, N, E)) for _ in range(4))
    sinks, slopes = rng.standard_normal(H), rng.uniform(0.1, 0.5, H)
    mask = rng.random((N, N)) < 0.8 if mask_kind == "bool" else rng.standard_normal((1, H, N, N))
    path, out = (os.path.join(shared_dir, f"{w}-{mask_kind}.h5") for w in ("in", "out"))
    write_h5(comm, path, q=q, k=k, v=v, dout=dout, sinks=sinks, alibi_slopes=slopes, attn_mask=mask)
    code, text, err = run(comm, capsys, "run", path, "-o", out, "--causal", "--softcap", "3",
                          "--layout", "zigzag", "--check")
    assert code == 0, err
    assert "OK" in text and "dsinks" in text
    got = whole(out)[0]
    vis = visible_matrix(B, N, N, True)[:, None]
    bias = -slopes[None, :, None, None] * np.abs(np.arange(N)[:, None] - np.arange(N)[None, :])
    if mask_kind == "bool":
        vis = vis & mask[None, None]
    else:
        bias = bias + mask
    ref = torch_reference(q, k, v, dout, vis, softcap=3.0, bias=bias, sinks=sinks)
    for name, r in zip(("out", "lse", "dq", "dk", "dv", "dsinks"), ref):
        np.testing.assert_allclose(got[name], r, rtol=1e-11, atol=1e-11, err_msg=name)


def test_make_data_writes_sinks_and_slopes_and_run_uses_them(comm, capsys, shared_dir):
    path, out = (os.path.join(shared_dir, n) for n in ("made.h5", "made-out.h5"))
    code, _, err = run(comm, capsys, "make-data", path, "--seq", 16, "--heads", 4, "--dim", 8,
                       "--dtype", "float64", "--with-dout", "--sinks", "--alibi", "-q")
    assert code == 0, err
    with h5py.File(path, "r") as f:
        assert f["sinks"].shape == (4,) and f["alibi_slopes"].shape == (4,)
        np.testing.assert_allclose(f["alibi_slopes"][...], 2.0 ** (-2.0 * np.arange(1, 5)))
    code, text, err = run(comm, capsys, "run", path, "-o", out, "--check")
    assert code == 0 and "OK" in text, err
    assert whole(out)[0]["dsinks"].shape == (4,)


def test_bad_modifier_datasets_are_refused_before_any_work(comm, capsys, shared_dir):
    x = np.zeros((1, 2, 8, 4))
    path, out = (os.path.join(shared_dir, n) for n in ("bad.h5", "bad-out.h5"))
    write_h5(comm, path, q=x, k=x, v=x, sinks=np.zeros(3))
    code, _, err = run(comm, capsys, "run", path, "-o", out)
    assert code != 0 and "sinks has shape (3,)" in err
    assert not os.path.exists(out)


def _causal_reference(q, k, v, softcap, slopes, sinks):
    """float64 ``out, lse`` of causal attention over all ``L`` rows of ``q``, ``k``, ``v`` with the
    softcap, ALiBi (``slopes`` (H,) or (B, H)) and the sinks (every decode row's reference)."""
    B, H, L, _ = q.shape
    dist = np.abs(np.arange(L)[:, None] - np.arange(L)[None, :])
    bias = -np.broadcast_to(slopes, (B, H))[:, :, None, None] * dist
    vis = visible_matrix(B, L, L, True)[:, None]
    dout = np.zeros((B, H, L, v.shape[3]))
    return torch_reference(q, k, v, dout, vis, softcap=softcap, bias=bias, sinks=sinks)[:2]


def test_prefill_then_decode_with_sinks_alibi_and_softcap_equal_the_reference(comm, capsys, shared_dir):
    rng = np.random.default_rng(41)
    B, H, Hkv, n0, E = 2, 4, 2, 4 * comm.size + 3, 4
    q = rng.standard_normal((B, H, n0 + 1, E))
    k, v = (rng.standard_normal((B, Hkv, n0 + 1, E)) for _ in range(2))
    sinks, slopes = rng.standard_normal(H), rng.uniform(0.1, 0.5, (B, H))
    ref_out, ref_lse = _causal_reference(q, k, v, 2.5, slopes, sinks)
    prompt, cache, new, step = (os.path.join(shared_dir, n) for n in ("p.h5", "c.h5", "n.h5", "s.h5"))
    write_h5(comm, prompt, q=q[:, :, :n0], k=k[:, :, :n0], v=v[:, :, :n0], sinks=sinks,
             alibi_slopes=slopes)
    code, _, err = run(comm, capsys, "prefill", prompt, "-o", cache, "--softcap", 2.5,
                       "--layout", "zigzag", "-q")
    assert code == 0, err
    data, attrs = whole(cache)
    np.testing.assert_allclose(data["out"], ref_out[:, :, :n0], rtol=1e-11, atol=1e-11)
    np.testing.assert_allclose(data["lse"], ref_lse[:, :, :n0], rtol=1e-11, atol=1e-11)
    np.testing.assert_array_equal(data["sinks"], sinks)
    np.testing.assert_array_equal(data["alibi_slopes"], slopes)
    assert attrs["softcap"] == 2.5
    # the new token's q, k, v; the sinks and the softcap come from the cache, the slopes repeat its own
    write_h5(comm, new, q=q[:, :, n0:], k=k[:, :, n0:], v=v[:, :, n0:], alibi_slopes=slopes)
    code, text, err = run(comm, capsys, "decode", cache, "--queries", new, "-o", step, "--append")
    assert code == 0, err
    assert "softcap 2.5, alibi_slopes, sinks" in text
    got, oattrs = whole(step)
    np.testing.assert_allclose(got["out"], ref_out[:, :, n0:], rtol=1e-11, atol=1e-11)
    np.testing.assert_allclose(got["lse"], ref_lse[:, :, n0:], rtol=1e-11, atol=1e-11)
    assert oattrs["softcap"] == 2.5 and oattrs["score_modifiers"] == "alibi_slopes,sinks"
    data, attrs = whole(cache)  # grown; its modifiers carried over
    assert attrs["length"] == n0 + 1 and attrs["softcap"] == 2.5
    np.testing.assert_array_equal(data["sinks"], sinks)
    np.testing.assert_array_equal(data["alibi_slopes"], slopes)


def test_prefill_and_decode_refuse_masks_bad_shapes_and_modifiers_other_than_the_caches(
        comm, capsys, shared_dir):
    rng = np.random.default_rng(42)
    q, k, v = (rng.standard_normal((1, 2, 7, 4)) for _ in range(3))
    sinks, slopes = rng.standard_normal(2), rng.uniform(0.1, 0.5, 2)
    path = lambda name: os.path.join(shared_dir, name)  # noqa: E731
    prompt = dict(q=q[:, :, :6], k=k[:, :, :6], v=v[:, :, :6])
    int8 = "'attn_mask' has dtype int8; it must be boolean (True = the pair takes part) or real floating"
    for more, why in [({"attn_mask": np.ones((6, 5), bool)}, "attn_mask has shape (1, 1, 6, 5)"),
                      ({"attn_mask": np.ones((6, 6), np.int8)}, int8),
                      ({"sinks": np.zeros(3)}, "sinks has shape (3,), expected (H,) = (2,)")]:
        write_h5(comm, path("bad.h5"), **prompt, **more)
        code, _, err = run(comm, capsys, "prefill", path("bad.h5"), "-o", path("none.h5"))
        assert code == 1 and why in err, err
        assert not os.path.exists(path("none.h5"))
    write_h5(comm, path("p.h5"), **prompt, sinks=sinks)
    assert run(comm, capsys, "prefill", path("p.h5"), "-o", path("c.h5"), "--softcap", 2, "-q")[0] == 0
    before = open(path("c.h5"), "rb").read() if comm.rank == 0 else None
    token = dict(q=q[:, :, 6:], k=k[:, :, 6:], v=v[:, :, 6:])
    decode = ("decode", path("c.h5"), "--queries", path("n.h5"), "-o", path("s.h5"))
    for more, flags, why in [({"attn_mask": np.ones((1, 6), bool)}, (), "must span the whole cache"),
                             ({"attn_mask": np.ones((1, 7), np.int8)}, (), int8),  # not a 0/1 bias
                             ({"sinks": sinks + 1}, (), "holds sinks that differ from those"),
                             ({}, ("--softcap", 3), "softcap 3 differs from the softcap 2"),
                             ({"alibi_slopes": np.ones(3)}, (), "alibi_slopes has shape (3,)")]:
        write_h5(comm, path("n.h5"), **token, **more)
        code, _, err = run(comm, capsys, *decode, "--append", *flags)
        assert code == 1 and why in err, err
        assert not os.path.exists(path("s.h5"))
        if comm.rank == 0:
            assert open(path("c.h5"), "rb").read() == before  # nothing appended
    # what the cache does not record the queries file gives (slopes); a repeated --softcap is fine
    write_h5(comm, path("n.h5"), **token, alibi_slopes=slopes)
    code, _, err = run(comm, capsys, *decode, "--append", "--softcap", 2, "-q")
    assert code == 0, err
    ref_out, ref_lse = _causal_reference(q, k, v, 2.0, slopes, sinks)
    got = whole(path("s.h5"))[0]
    np.testing.assert_allclose(got["out"], ref_out[:, :, 6:], rtol=1e-11, atol=1e-11)
    np.testing.assert_allclose(got["lse"], ref_lse[:, :, 6:], rtol=1e-11, atol=1e-11)


def test_prefill_and_decode_take_the_attn_mask_of_their_queries(comm, capsys, shared_dir):
    """The prompt's mask (rows as slabs, not kept in the cache) and a step's over the grown cache:
    the float64 reference of the whole sequence under the same mask."""
    rng = np.random.default_rng(43)
    B, H, Hkv, n0, E = 1, 2, 1, 3 * comm.size + 2, 4
    L = n0 + 1
    q = rng.standard_normal((B, H, L, E))
    k, v = (rng.standard_normal((B, Hkv, L, E)) for _ in range(2))
    mask = np.tril(rng.random((1, H, L, L)) < 0.7) | np.eye(L, dtype=bool)
    vis = visible_matrix(B, L, L, True)[:, None] & mask
    ref_out, ref_lse = torch_reference(q, k, v, np.zeros((B, H, L, E)), vis)[:2]
    prompt, cache, new, step = (os.path.join(shared_dir, n) for n in ("mp.h5", "mc.h5", "mn.h5", "ms.h5"))
    write_h5(comm, prompt, q=q[:, :, :n0], k=k[:, :, :n0], v=v[:, :, :n0],
             attn_mask=mask[:, :, :n0, :n0])
    code, _, err = run(comm, capsys, "prefill", prompt, "-o", cache, "--layout", "zigzag", "-q")
    assert code == 0, err
    data, _ = whole(cache)
    assert "attn_mask" not in data
    np.testing.assert_allclose(data["out"], ref_out[:, :, :n0], rtol=1e-11, atol=1e-11)
    write_h5(comm, new, q=q[:, :, n0:], k=k[:, :, n0:], v=v[:, :, n0:], attn_mask=mask[:, :, n0:])
    code, _, err = run(comm, capsys, "decode", cache, "--queries", new, "-o", step, "--append", "-q")
    assert code == 0, err
    got, attrs = whole(step)
    np.testing.assert_allclose(got["out"], ref_out[:, :, n0:], rtol=1e-11, atol=1e-11)
    np.testing.assert_allclose(got["lse"], ref_lse[:, :, n0:], rtol=1e-11, atol=1e-11)
    assert attrs["score_modifiers"] == "attn_mask"
