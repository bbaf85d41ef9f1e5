"""Plans (issue 27 item 5): made once, called on arrays of their shapes; the same bits as the one-shot
calls; an array that does not fit is one error on every rank. Any rank count."""

import numpy as np
import pytest

import mpiattn
from mpiattn.comm import errors
from mpiattn.strategies import registry

from helpers import count_validations


def _rows(comm, x, layout="contiguous"):
    return mpiattn.shard(x, layout=layout, comm=comm)


def _problem(seed=0, N=24, M=24, H=4, Hkv=2):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((2, H, N, 8))
    k = rng.standard_normal((2, Hkv, M, 8))
    v = rng.standard_normal((2, Hkv, M, 6))
    return q, k, v


@pytest.mark.parametrize("strategy", ["auto", *[s for s in registry.STRATEGIES if s != "hybrid"]])
def test_a_plan_gives_the_one_shot_bits(comm, strategy):
    Q, K, V = _problem()
    if strategy != "auto" and registry.get(strategy).supports(
            mpiattn.AttentionSpec.from_shapes(Q.shape, K.shape, V.shape, Q.dtype), comm.topology):
        pytest.skip(f"{strategy} does not take this call at {comm.size} ranks")
    q, k, v = (_rows(comm, x) for x in (Q, K, V))
    pad = np.zeros((2, k.shape[2]), dtype=bool)
    pad[:, ::5] = True
    kw = dict(causal=True, strategy=strategy, block_size=4)
    plan = mpiattn.plan_attention(q, k, v, comm, key_padding_mask=pad, **kw)
    for step in range(2):  # called more than once, the same plan
        out, lse = plan.forward(q * (1 + step), k, v, key_padding_mask=pad)
        ref = mpiattn.attention(q * (1 + step), k, v, comm, key_padding_mask=pad, **kw)
        np.testing.assert_array_equal(out, ref[0])
        np.testing.assert_array_equal(lse, ref[1])
        dout = np.ones_like(out)
        got = plan.backward(dout, q * (1 + step), k, v, out, lse, key_padding_mask=pad)
        want = mpiattn.attention_backward(dout, q * (1 + step), k, v, out, lse, comm,
                                          key_padding_mask=pad, **kw)
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a, b)
    assert plan.details()["strategy"] == (plan.problem.strategy.label)


def test_an_array_that_does_not_fit_is_one_error_everywhere(comm):
    Q, K, V = _problem(1)
    q, k, v = (_rows(comm, x) for x in (Q, K, V))
    plan = mpiattn.plan_attention(q, k, v, comm)
    bad = q[:, :, :-1] if comm.rank == comm.size - 1 and q.shape[2] else q
    shape_err = comm.allgather_obj(bad.shape != q.shape)
    if any(shape_err):
        with pytest.raises(ValueError, match="the plan is for") as info:
            plan.forward(bad, k, v)
        assert isinstance(info.value, errors.Agreed)
    with pytest.raises(ValueError, match="the plan was made without a key_padding_mask"):
        plan.forward(q, k, v, key_padding_mask=np.zeros((2, k.shape[2]), dtype=bool))
    with pytest.raises(ValueError, match="and dtype float32; the plan is for"):
        plan.forward(q.astype(np.float32), k, v)
    nan = q.copy()
    if comm.rank == 0 and nan.size:
        nan[0, 0, 0, 0] = np.nan
    if comm.allgather_obj(bool(np.isnan(nan).any()))[0]:
        with pytest.raises(ValueError, match="q contains NaN or Inf"):
            plan.forward(nan, k, v)
    out, lse = plan.forward(q, k, v)  # every rank still in step
    assert out.shape == (2, 4, q.shape[2], 6)


def test_a_plan_keeps_its_documents(comm):
    Q, K, V = _problem(2)
    seg = np.repeat(np.arange(4), 6)[None].repeat(2, 0)
    q, k, v = (_rows(comm, x) for x in (Q, K, V))
    s = mpiattn.shard(seg, axis=-1, comm=comm)
    plan = mpiattn.plan_attention(q, k, v, comm, segment_ids=s)
    out, _ = plan.forward(q, k, v)
    ref, _ = mpiattn.attention(q, k, v, comm, segment_ids=s)
    np.testing.assert_array_equal(out, ref)


def test_a_plan_is_validated_once_and_each_one_shot_call_once(comm, monkeypatch):
    """Validation (local checks, agreement, the cost model) runs when a plan is made, never
    when it is used again; a one-shot forward or backward validates once."""
    validations = count_validations(monkeypatch)
    Q, K, V = _problem(3)
    q, k, v = (_rows(comm, x) for x in (Q, K, V))
    plan = mpiattn.plan_attention(q, k, v, comm, causal=True)
    assert len(validations) == 1
    for step in range(3):
        out, lse = plan.forward(q * (1 + step), k, v)
        plan.backward(np.ones_like(out), q * (1 + step), k, v, out, lse)
        assert plan.fits(q, k, v, options={"causal": True})
    assert len(validations) == 1
    out, lse = mpiattn.attention(q, k, v, comm, causal=True)
    assert len(validations) == 2
    mpiattn.attention_backward(np.ones_like(out), q, k, v, out, lse, comm, causal=True)
    assert len(validations) == 3
