"""mpiattn.torch.MultiheadAttention against torch.nn.MultiheadAttention with the same weights.

Output and every gradient (inputs and parameters, after ``reduce_gradients``),
float64, at any rank count; the parity of arguments; the initial parameters of
the NumPy layer; data parallelism on a second communicator.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
mt = pytest.importorskip("mpiattn.torch")

import mpiattn  # noqa: E402

from helpers import count_validations  # noqa: E402

F64 = torch.float64


def _pair(E, H, *, kdim=None, vdim=None, bias=True, batch_first=True, **options):
    torch.manual_seed(0)
    ref = torch.nn.MultiheadAttention(E, H, bias=bias, kdim=kdim, vdim=vdim, batch_first=batch_first,
                                      dtype=F64)
    with torch.no_grad():  # non-zero biases, so their gradients are tested too
        for p in ref.parameters():
            p.add_(0.1 * torch.randn_like(p))
    mine = mt.MultiheadAttention(E, H, bias=bias, kdim=kdim, vdim=vdim, batch_first=batch_first,
                                 dtype=F64, **options).load_torch(ref)
    return ref, mine


def _param_grads(module):
    if isinstance(module, torch.nn.MultiheadAttention) and module.in_proj_weight is not None:
        wq, wk, wv = module.in_proj_weight.grad.split(module.embed_dim)
    elif isinstance(module, torch.nn.MultiheadAttention):
        wq, wk, wv = (module.q_proj_weight.grad, module.k_proj_weight.grad, module.v_proj_weight.grad)
    else:
        wq, wk, wv = (module.q_proj_weight.grad, module.k_proj_weight.grad, module.v_proj_weight.grad)
    out = {"wq": wq, "wk": wk, "wv": wv, "wo": module.out_proj.weight.grad}
    if module.in_proj_bias is not None:
        out.update(bqkv=module.in_proj_bias.grad, bo=module.out_proj.bias.grad)
    return out


CASES = [
    dict(name="self-causal-zigzag", E=8, H=2, causal=True, layout="zigzag"),
    dict(name="cross-kdim-vdim-padding", E=8, H=4, kdim=5, vdim=3, M=9, pad=True),
    dict(name="sequence-first-no-bias", E=6, H=3, bias=False, batch_first=False, causal=True),
]


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_matches_torch_multihead_attention(comm, case):
    E, H, N, B = case["E"], case["H"], 10, 2
    M = case.get("M", N)
    layout = case.get("layout", "contiguous")
    bf = case.get("batch_first", True)
    ref, mine = _pair(E, H, kdim=case.get("kdim"), vdim=case.get("vdim"), bias=case.get("bias", True),
                      batch_first=bf, layout=layout)
    g = torch.Generator().manual_seed(1)
    shape = (lambda L, D: (B, L, D)) if bf else (lambda L, D: (L, B, D))
    seq = 1 if bf else 0
    xq = torch.randn(*shape(N, E), dtype=F64, generator=g, requires_grad=True)
    cross = "kdim" in case
    xk = torch.randn(*shape(M, case.get("kdim", E)), dtype=F64, generator=g, requires_grad=True) if cross else xq
    xv = torch.randn(*shape(M, case.get("vdim", E)), dtype=F64, generator=g, requires_grad=True) if cross else xq
    dy = torch.randn(*shape(N, E), dtype=F64, generator=g)
    pad = torch.from_numpy(np.random.default_rng(2).random((B, M)) < 0.3) if case.get("pad") else None
    causal = case.get("causal", False)

    # single process, torch
    mask = torch.triu(torch.ones(N, M, dtype=torch.bool), 1) if causal else None
    y_ref, _ = ref(xq, xk, xv, key_padding_mask=pad, attn_mask=mask, need_weights=False)
    y_ref.backward(dy)
    ref_in = [x.grad.clone() for x in ((xq, xk, xv) if cross else (xq,))]
    ref_p = _param_grads(ref)
    for x in (xq, xk, xv):
        x.grad = None

    # sharded, mpiattn
    sh = lambda x: mt.shard(x, dim=seq, layout=layout)  # noqa: E731
    kw = dict(is_causal=causal,
              key_padding_mask=None if pad is None else mpiattn.shard(pad.numpy(), axis=-1, layout=layout))
    y_r, w = mine(sh(xq), sh(xk), sh(xv), **kw) if cross else mine(sh(xq), **kw)
    assert w is None
    y = mt.gather(y_r, dim=seq, layout=layout)
    y.backward(dy)
    mt.reduce_gradients(mine)

    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    for got, want in zip((xq, xk, xv) if cross else (xq,), ref_in):
        torch.testing.assert_close(got.grad, want, rtol=1e-11, atol=1e-12)
    # gather's backward gave each rank its rows of dy: partial parameter gradients, summed by
    # reduce_gradients (the inputs' by shard's backward)
    for name, want in ref_p.items():
        torch.testing.assert_close(_param_grads(mine)[name], want, rtol=1e-11, atol=1e-12,
                                   msg=lambda m: f"{name}: {m}")
    same = comm.allgather_obj(mine.q_proj_weight.grad.numpy().tobytes())
    assert all(s == same[0] for s in same)  # bitwise the same on every rank


def test_initial_parameters_are_the_numpy_layers():
    a = mt.MultiheadAttention(8, 4, num_kv_heads=2, kdim=6, vdim=5, batch_first=True, seed=3)
    b = mpiattn.MultiheadAttention(8, 4, num_kv_heads=2, kdim=6, vdim=5, seed=3)
    np.testing.assert_array_equal(a.q_proj_weight.detach().numpy(), b.params["wq"].T)
    np.testing.assert_array_equal(a.k_proj_weight.detach().numpy(), b.params["wk"].T)
    np.testing.assert_array_equal(a.v_proj_weight.detach().numpy(), b.params["wv"].T)
    np.testing.assert_array_equal(a.out_proj.weight.detach().numpy(), b.params["wo"].T)
    assert a.in_proj_bias.shape == (8 + 2 * 4,)


def test_same_output_as_the_numpy_layer(comm):
    """GQA: no torch counterpart, so the NumPy layer (hand-derived gradients) is the reference."""
    a = mt.MultiheadAttention(8, 4, num_kv_heads=2, batch_first=True, seed=4, dtype=F64)
    b = mpiattn.MultiheadAttention(8, 4, num_kv_heads=2, seed=4, dtype=np.float64)
    x = np.random.default_rng(5).standard_normal((2, 9, 8))
    xr = mpiattn.shard(x, axis=1)
    y, _ = a(torch.from_numpy(xr), is_causal=True)
    y.sum().backward()
    mt.reduce_gradients(a)
    y_np = b.forward(xr, causal=True)
    b.backward(np.ones_like(y_np))
    np.testing.assert_allclose(y.detach().numpy(), y_np, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(a.k_proj_weight.grad.numpy(), b.grads["wk"].T, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(a.in_proj_bias.grad.numpy()[:8], b.grads["bq"], rtol=1e-10, atol=1e-12)


def test_a_call_of_the_last_shapes_is_not_validated_again(comm, monkeypatch):
    """The module keeps the plan of its last call while every rank's tensors fit it
    (:func:`mpiattn.torch.functions.plan_for`, i.e. :func:`mpiattn.strategies.plan.reuse_or_plan`):
    forwards and backwards of the same shapes validate once; other shapes make a new plan."""
    validations = count_validations(monkeypatch)
    layer = mt.MultiheadAttention(8, 2, batch_first=True, seed=1, dtype=F64)
    x = torch.from_numpy(mpiattn.shard(np.random.default_rng(3).standard_normal((2, 10, 8)), axis=1))
    for step in range(3):
        y, _ = layer(x * (1 + step), x, x, is_causal=True)
        y.sum().backward()
    assert len(validations) == 1
    longer = mpiattn.shard(np.random.default_rng(4).standard_normal((2, 12, 8)), axis=1)
    layer(torch.from_numpy(longer), is_causal=True)
    assert len(validations) == 2


def test_arguments_without_a_counterpart_are_refused(comm):
    with pytest.raises(ValueError, match="dropout"):
        mt.MultiheadAttention(8, 2, dropout=0.1)
    with pytest.raises(ValueError, match="add_bias_kv"):
        mt.MultiheadAttention(8, 2, add_bias_kv=True)
    layer = mt.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(1, 3, 8)
    with pytest.raises(ValueError, match="need_weights"):
        layer(x, x, x, need_weights=True)
    with pytest.raises(ValueError, match="attn_mask"):
        layer(x, x, x, attn_mask=torch.zeros(3, 3, dtype=torch.bool))


def test_bad_inputs_raise_on_every_rank(comm):
    """The last rank alone passes a wrong width: every rank raises its error (none waits)."""
    layer = mt.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(1, 3, 7 if comm.rank == comm.size - 1 else 8)
    with pytest.raises(ValueError, match="query must be a 3-D tensor with 8 features") as info:
        layer(x)
    assert isinstance(info.value, mpiattn.comm.errors.Agreed)
    with pytest.raises(TypeError, match="the layer's parameters are torch.float32"):
        layer(torch.randn(1, 3, 8, dtype=torch.float64))


@pytest.mark.mpi(min_size=4)
def test_composes_with_data_parallelism(comm):
    """4 ranks: 2 sequences (data parallel) x 2 shards each (sequence parallel).

    reduce_gradients over the sequence's ranks, then averaged over the replicas, equals the
    single-process gradient of the mean of the two sequences' losses.
    """
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    if world.Get_size() != 4:
        pytest.skip("exactly 4 ranks")
    seq_comm = world.Split(world.Get_rank() // 2, world.Get_rank())  # the ranks of one sequence
    dp_comm = world.Split(world.Get_rank() % 2, world.Get_rank())    # the same rows of each sequence
    try:
        E, H, N = 8, 2, 12
        xs = torch.randn(2, 1, N, E, dtype=F64, generator=torch.Generator().manual_seed(9))
        mine = mt.MultiheadAttention(E, H, batch_first=True, dtype=F64, seed=1, comm=seq_comm)
        x = xs[world.Get_rank() // 2]
        x_r = mt.shard(x, comm=seq_comm, dim=1)
        y_r, _ = mine(x_r, is_causal=True)
        (y_r.pow(2).sum() / N).backward()       # this rank's part of its sequence's mean
        mt.reduce_gradients(mine, seq_comm)
        mt.reduce_gradients(mine, dp_comm, average=True)

        ref = mt.MultiheadAttention(E, H, batch_first=True, dtype=F64, seed=1, comm=MPI.COMM_SELF)
        loss = sum(ref(xs[i], is_causal=True)[0].pow(2).sum() / N for i in range(2)) / 2
        loss.backward()
        for (name, p), q in zip(mine.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-11, atol=1e-13, msg=lambda m: f"{name}: {m}")
    finally:
        seq_comm.Free()
        dp_comm.Free()
