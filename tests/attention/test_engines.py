"""Engine selection and the engine contract (native vs torch), against float64 on gathered arrays."""

import subprocess
import sys

import numpy as np
import pytest

import mpiattn
from mpiattn.kernels import engines, torch_engine, torch_ops
from mpiattn.masks.modifiers import MODIFIERS
from mpiattn.strategies import AttentionSpec, Options, problem

from helpers import host


def _case(comm, dtype=np.float32, N=40, causal=False, seed=0):
    rng = np.random.default_rng(seed)
    Q = rng.standard_normal((1, 2, N, 8)).astype(dtype)
    K = rng.standard_normal((1, 1, N, 8)).astype(dtype)
    V = rng.standard_normal((1, 1, N, 8)).astype(dtype)
    return tuple(mpiattn.shard(x) for x in (Q, K, V))


def _chosen(comm, monkeypatch, **kw):
    """The engine validate() agrees on for a small call."""
    q, k, v = _case(comm, kw.pop("dtype", np.float32))
    c = mpiattn.get_comm(comm.mpi)
    pb = problem.validate(c, problem.Arguments(q, k, v, settings=dict(strategy="ring", **kw)))
    return pb.engine.name, pb.engine_reason


def _spec(dtype=np.float32, device="numpy", E=8, softcap=None, **options):
    return AttentionSpec.from_shapes((1, 2, 16, E), (1, 1, 16, E), (1, 1, 16, E), dtype,
                                     Options(**options), device=device, softcap=softcap)


def test_engines_declare_what_they_support():
    native, torch_ = engines.get("native"), engines.get("torch")
    for dtype in (np.float16, np.float32, np.float64):
        for device in ("numpy", "cupy"):
            assert native.supports(_spec(dtype, device, causal=True, window=(3, 0))) is None
    assert torch_.supports(_spec(np.float32, causal=True)) is None
    assert "window" in torch_.supports(_spec(np.float32, window=(3, 0)))
    assert "float64" in torch_.supports(_spec(np.float64, "cupy"))
    assert "multiples of 8" in torch_.supports(_spec(np.float32, "cupy", E=12))
    assert torch_.capabilities.needs_out and not native.capabilities.needs_out
    assert torch_.capabilities.modifiers == ("alibi", "attn_mask", "mask_mod")
    assert set(torch_.capabilities.modifiers) <= set(MODIFIERS)
    assert "has no softcap" in torch_.supports(_spec(np.float32, causal=True, softcap=2.0))
    assert native.supports(_spec(np.float32, causal=True, softcap=2.0)) is None
    with pytest.raises(ValueError, match="unknown engine 'fast'"):
        engines.get("fast")


def test_auto_is_the_native_engine_whatever_was_imported(comm, monkeypatch):
    """The rule is deterministic: the same call picks the same engine, torch imported or not."""
    for imported in (False, True):
        if imported:
            monkeypatch.setitem(sys.modules, "torch", sys.modules.get("torch", object()))
        else:
            monkeypatch.delitem(sys.modules, "torch", raising=False)
        assert engines.local_choice("auto", _spec(causal=True)) == engines.AUTO
        name, why = _chosen(comm, monkeypatch, engine="auto", causal=True)
        assert (name, why) == engines.AUTO
    assert engines.local_choice("native", _spec())[0] == "native"


def test_torch_absent_is_an_error_only_when_asked_for(comm, monkeypatch):
    monkeypatch.setattr(torch_ops, "available", lambda: "torch not importable: No module named 'torch'")
    assert _chosen(comm, monkeypatch, engine="auto")[0] == "native"
    with pytest.raises(ValueError, match="engine 'torch' cannot run on rank 0: torch not importable"):
        _chosen(comm, monkeypatch, engine="torch")
    name, why = engines.local_choice("torch", _spec(np.float32, window=(2, 2)))
    assert name == "" and "window" in why


def test_one_rank_without_torch_is_one_error_everywhere(comm, monkeypatch):
    if comm.size == 1:
        pytest.skip("needs two ranks to disagree")
    if engines.get("torch").usable("numpy") is not None:
        pytest.skip("torch engine not usable here")
    if comm.rank == comm.size - 1:
        monkeypatch.setattr(torch_ops, "available", lambda: "torch missing on this node")
    assert _chosen(comm, monkeypatch, engine="auto")[0] == "native"
    with pytest.raises(ValueError, match=f"cannot run on rank {comm.size - 1}"):
        _chosen(comm, monkeypatch, engine="torch")


def test_torch_support_is_decided_by_its_op_schemas(monkeypatch):
    """A torch whose kernels have other signatures is refused with the reason, whatever its version."""
    if engines.get("torch").usable("numpy") is not None:
        pytest.skip("torch engine not usable here")
    monkeypatch.setitem(torch_ops._SCHEMAS, torch_ops._CPU_F, "(Tensor query) -> Tensor")
    why = torch_ops.available()
    assert why is not None and "another signature" in why and torch_ops._CPU_F in why


def test_a_torch_with_other_op_schemas_is_refused_by_name_and_auto_stays_native(comm, monkeypatch):
    """A torch the engine does not know (an op's signature changed): engine='torch' fails on every
    rank with the op named, engine='auto' runs native and gives the float64 answer."""
    if engines.get("torch").usable("numpy") is not None:
        pytest.skip("torch engine not usable here")
    monkeypatch.setitem(torch_ops._SCHEMAS, torch_ops._CPU_F + "_backward", "(Tensor grad_out) -> Tensor")
    with pytest.raises(ValueError, match=f"engine 'torch' cannot run on rank 0: .*another "
                                         f"signature.*{torch_ops._CPU_F}_backward"):
        _chosen(comm, monkeypatch, engine="torch")
    assert _chosen(comm, monkeypatch, engine="auto")[0] == "native"
    q, k, v = _case(comm, np.float64)
    out, lse = mpiattn.attention(q, k, v, engine="auto")
    Q, K, V = (np.concatenate(comm.allgather_obj(x), axis=2) for x in (q, k, v))
    s = Q @ np.repeat(K, 2, axis=1).swapaxes(-1, -2) / np.sqrt(8)
    p = np.exp(s - s.max(-1, keepdims=True))
    ref = (p / p.sum(-1, keepdims=True)) @ np.repeat(V, 2, axis=1)
    np.testing.assert_allclose(np.concatenate(comm.allgather_obj(host(out)), axis=2), ref,
                               rtol=1e-12, atol=1e-12)


def test_unknown_engine_same_error_everywhere(comm):
    q, k, v = _case(comm)
    with pytest.raises(ValueError, match="unknown engine 'fast'"):
        mpiattn.attention(q, k, v, engine="fast" if comm.rank == 0 else "auto")


def test_ranks_must_agree_on_engine(comm):
    if comm.size == 1:
        pytest.skip("needs two ranks")
    q, k, v = _case(comm)
    with pytest.raises(ValueError, match="ranks disagree on engine"):
        mpiattn.attention(q, k, v, engine="native" if comm.rank else "auto")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_torch_matches_native_no_nan(comm, causal, layout):
    """Both engines, rows with no visible key included: same numbers, never NaN."""
    if engines.get("torch").usable("numpy") is not None:
        pytest.skip("torch engine not usable here")
    rng = np.random.default_rng(3)
    B, H, Hkv, N, E = 2, 4, 2, 37, 8
    X = [rng.standard_normal(s) for s in ((B, H, N, E), (B, Hkv, N, E), (B, Hkv, N, E), (B, H, N, E))]
    pad = rng.random((B, N)) < 0.4
    pad[1] = True  # batch 1: no key at all
    sh = lambda x, axis=-2: mpiattn.shard(x, axis=axis, layout=layout)  # noqa: E731
    q, k, v, do = (sh(x) for x in X)
    kw = dict(causal=causal, layout=layout, key_padding_mask=sh(pad, -1), block_size=5)
    got = {}
    for engine in ("native", "torch"):
        o, lse = mpiattn.attention(q, k, v, engine=engine, **kw)
        grads = mpiattn.attention_backward(do, q, k, v, o, lse, engine=engine, **kw)
        got[engine] = [host(x) for x in (o, lse, *grads)]
    for a, b in zip(got["native"], got["torch"]):
        assert not np.isnan(b).any()
        np.testing.assert_array_equal(np.isneginf(a), np.isneginf(b))
        fin = np.isfinite(a)
        np.testing.assert_allclose(b[fin], a[fin], rtol=1e-10, atol=1e-10)
    assert np.all(got["torch"][0][1] == 0) and np.all(np.isneginf(got["torch"][1][1]))


def test_causal_calls_cover_each_visible_pair_once():
    """The causal split of a block into torch calls: every visible pair exactly once, nothing hidden."""
    from mpiattn.masks import BlockMask
    rng = np.random.default_rng(5)
    for _ in range(50):
        q_pos = np.sort(rng.choice(60, size=rng.integers(1, 30), replace=False))
        k0 = int(rng.integers(0, 50))
        k_pos = np.concatenate([np.arange(k0, k0 + int(rng.integers(1, 10))),
                                np.arange(k0 + 20, k0 + 20 + int(rng.integers(0, 8)))])
        mask = BlockMask(q_pos, k_pos, causal=True)
        seen = np.zeros((q_pos.size, k_pos.size), int)
        for i0, i1, j0, j1, aligned in torch_engine._calls(mask):
            vis = np.ones((i1 - i0, j1 - j0), bool)
            if aligned:
                vis = np.arange(j1 - j0)[None, :] <= np.arange(i1 - i0)[:, None]
            seen[i0:i1, j0:j1] += vis
        want = (k_pos[None, :] <= q_pos[:, None]).astype(int)
        np.testing.assert_array_equal(seen, want)


def test_import_does_not_import_torch(serial_only):
    code = ("import sys, numpy as np, mpiattn\n"
            "from mpiattn.kernels import engines\n"
            "assert 'torch' not in sys.modules, 'import mpiattn imported torch'\n"
            "q = np.ones((1, 1, 4, 2)); o, l = mpiattn.attention(q, q, q, engine='native')\n"
            "assert 'torch' not in sys.modules, 'the native engine imported torch'\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr


MEASURED = {"native": {"float32": [50e9, 60e9], "float16": [40e9, 50e9]},
            "torch": {"float32": [60e9, 61e9], "float16": [41e9, 70e9]}}


def test_auto_runs_the_engine_measured_fastest_beyond_the_margin():
    """torch 1.2x native's forward in float32 (beyond engines.MARGIN): torch; its backward 1.02x
    (within): native; float16's forward within, backward 1.4x: native then torch; a dtype no
    engine was measured in, a call torch cannot run, or no native measurement: native."""
    f32, f16 = _spec(np.float32, causal=True), _spec(np.float16, causal=True)
    name, why = engines.local_choice("auto", f32, MEASURED)
    assert name == "torch" and "1.20x the native engine's forward speed in float32" in why
    assert engines.local_choice("auto", f32, MEASURED, backward=True) == engines.AUTO
    assert engines.local_choice("auto", f16, MEASURED) == engines.AUTO
    assert engines.local_choice("auto", f16, MEASURED, backward=True)[0] == "torch"
    assert engines.local_choice("auto", _spec(np.float64), MEASURED) == engines.AUTO
    assert engines.local_choice("auto", _spec(np.float32, window=(2, 0)), MEASURED) == engines.AUTO
    assert engines.local_choice("auto", f32, {"torch": MEASURED["torch"]}) == engines.AUTO
    assert engines.local_choice("auto", f32, {"torch": MEASURED["torch"], "gone": {"float32": [
        1e15, 1e15]}, "native": MEASURED["native"]})[0] == "torch"  # (an engine not installed)
    # the ranks' choices differ: every rank runs native; an explicit engine is not overruled
    assert engines.agreed_choice([("torch", "a"), ("native", "b")], "auto")[0] == "native"
    assert engines.agreed_choice([("torch", "a"), ("torch", "a")], "auto") == ("torch", "a")


def test_a_calibrated_machine_decides_auto_on_every_rank(comm, monkeypatch, shared_dir):
    """A machine file with measured engine speeds makes auto run torch, the same on every rank,
    with the same result as the native engine (to float32 rounding); where one rank cannot run
    torch, every rank runs native; explicit engines and machines without speeds are unchanged."""
    pytest.importorskip("torch")
    from mpiattn.strategies import machines

    path = f"{shared_dir}/engines-machine.json"
    if comm.rank == 0:
        machines.Machine.from_dict({**machines.PROFILES["cpu-node"].to_dict(),
                                    "engines": MEASURED}).save(path)
    comm.mpi.Barrier()
    q, k, v = _case(comm, np.float32, causal=True)
    used, plain = {}, {}
    out, lse = mpiattn.attention(q, k, v, causal=True, machine=path, details=used)
    ref, ref_lse = mpiattn.attention(q, k, v, causal=True, details=plain)
    assert used["engine"] == "torch" and "measured 1.20x" in used["engine_reason"]
    assert plain["engine"] == "native"
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(lse, ref_lse, rtol=2e-5, atol=2e-5)
    back = {}
    mpiattn.attention_backward(out, q, k, v, out, lse, causal=True, machine=path, details=back)
    assert back["engine"] == "native"  # torch's backward was measured within the margin
    assert mpiattn.attention(q, k, v, causal=True, machine=path, engine="native", details=back)
    assert back["engine"] == "native"
    if comm.size > 1:
        if comm.rank == 1:
            monkeypatch.setattr(torch_ops, "available", lambda: "torch not importable here")
        mpiattn.attention(q, k, v, causal=True, machine=path, details=used)
        assert used["engine"] == "native" and "differ" in used["engine_reason"]
