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
