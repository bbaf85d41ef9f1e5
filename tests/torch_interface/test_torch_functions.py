"""mpiattn.torch's autograd functions: gradcheck on the gathered result, references, errors.

``gather(f(shard(x)))`` is on every rank the single-process function of the
replicated ``x`` (``mpiattn.torch.shard``'s backward sums over ranks), so
``torch.autograd.gradcheck`` runs the same calls in the same order on every rank
and checks the distributed backward against finite differences, in float64.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
mt = pytest.importorskip("mpiattn.torch")

import mpiattn  # noqa: E402

from helpers import dense_attention, visible_matrix  # noqa: E402

F64 = torch.float64


def _global(seed, *shapes):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g, dtype=F64, requires_grad=True) for s in shapes]


ATTENTION_CASES = [
    dict(name="plain", causal=False),
    dict(name="causal-zigzag", causal=True, layout="zigzag"),
    dict(name="padding-gqa", causal=False, pad=True, H=4, Hkv=2),
    dict(name="window-documents", window=(2, 1), docs=True),
    dict(name="causal-cross", causal=True, N=7, M=9),
]


def _gradcheck(comm, f, inputs):
    """torch's gradcheck of ``f`` (a collective call): every Jacobian entry at one rank; on several,
    the fast mode (a random projection of the Jacobian, the same vectors on every rank: seeded),
    which fails as surely for a wrong gradient at a fraction of the collective calls."""
    torch.manual_seed(1234)
    return torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-7, rtol=1e-5,
                                    fast_mode=comm.size > 1)


@pytest.mark.parametrize("case", ATTENTION_CASES, ids=[c["name"] for c in ATTENTION_CASES])
def test_gradcheck_attention(comm, case):
    B, H, Hkv, N, E = 1, case.get("H", 2), case.get("Hkv", 2), case.get("N", 6), 3
    M = case.get("M", N)
    layout = case.get("layout", "contiguous")
    Q, K, V = _global(1, (B, H, N, E), (B, Hkv, M, E), (B, Hkv, M, E))
    rng = np.random.default_rng(3)
    pad = seg = None
    kw = dict(causal=case.get("causal", False), window=case.get("window"), layout=layout,
              block_size=2)
    if case.get("pad"):
        pad = torch.from_numpy(rng.random((B, M)) < 0.3)
        kw["key_padding_mask"] = mt.shard(pad, dim=-1, layout=layout)
    if case.get("docs"):
        seg = torch.from_numpy(np.sort(rng.integers(0, 2, (B, N)), axis=1))
        kw["segment_ids"] = mt.shard(seg, dim=-1, layout=layout)

    def f(q, k, v):
        out = mt.attention(mt.shard(q, layout=layout), mt.shard(k, layout=layout),
                           mt.shard(v, layout=layout), **kw)
        return mt.gather(out, layout=layout)

    assert _gradcheck(comm, f, (Q, K, V))
    # and the value itself against the tests' float64 reference
    vis = visible_matrix(B, N, M, kw["causal"], kw["window"], None if seg is None else seg.numpy(),
                         None if seg is None else seg.numpy(), None if pad is None else pad.numpy())
    ref = dense_attention(*(x.detach().numpy() for x in (Q, K, V)), vis[:, None])[0]
    np.testing.assert_allclose(f(Q, K, V).detach().numpy(), ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("engine", ["native", "torch"])
def test_gradcheck_attention_with_lse(comm, engine):
    """``lse`` is differentiable too (with the torch engine, whose kernel forms D itself, as well)."""
    B, H, N, E = 1, 2, 7, 3
    Q, K, V = _global(4, (B, H, N, E), (B, H, N, E), (B, H, N, 2))
    pad = torch.from_numpy(np.random.default_rng(8).random((B, N)) < 0.3)
    kw = dict(causal=True, layout="zigzag", engine=engine, block_size=2,
              key_padding_mask=mt.shard(pad, dim=-1, layout="zigzag"))

    def f(q, k, v):
        out, lse = mt.attention(*(mt.shard(x, layout="zigzag") for x in (q, k, v)), return_lse=True,
                                **kw)
        lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))  # rows that see nothing
        return mt.gather(out, layout="zigzag"), mt.gather(lse, dim=-1, layout="zigzag")

    assert _gradcheck(comm, f, (Q, K, V))

    def lse_only(q, k, v):  # the output unused: its gradient is None, lse's alone flows
        return f(q, k, v)[1]

    assert torch.autograd.gradcheck(lse_only, (Q, K, V), eps=1e-6, atol=1e-7, rtol=1e-5, fast_mode=True)


@pytest.mark.parametrize("op", ["nt", "nn", "tn"])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_gradcheck_products(comm, op, layout):
    N, M, d = 5, 7, 3
    shapes = {"nt": ((N, d), (M, d)), "nn": ((N, M), (M, d)), "tn": ((M, N), (M, d))}[op]
    A, Bm = _global(2, *shapes)
    fn = {"nt": mt.matmul_nt, "nn": mt.matmul_nn, "tn": mt.matmul_tn}[op]
    ref = {"nt": lambda a, b: a @ b.T, "nn": lambda a, b: a @ b, "tn": lambda a, b: a.T @ b}[op]

    def f(a, b):
        return mt.gather(fn(mt.shard(a, layout=layout), mt.shard(b, layout=layout), layout=layout,
                            block_size=2), layout=layout)

    assert _gradcheck(comm, f, (A, Bm))
    torch.testing.assert_close(f(A, Bm), ref(A, Bm), rtol=1e-13, atol=1e-13)


def test_gradients_match_single_process_autograd(comm):
    """The distributed gradients equal a float64 single-process attention's, whatever P."""
    B, H, N, E = 2, 2, 11, 4
    Q, K, V = _global(5, (B, H, N, E), (B, H, N, E), (B, H, N, E))
    dO = torch.randn(B, H, N, E, dtype=F64, generator=torch.Generator().manual_seed(6))
    out = mt.gather(mt.attention(*(mt.shard(x, layout="zigzag") for x in (Q, K, V)),
                                 causal=True, layout="zigzag"), layout="zigzag")
    out.backward(dO)
    got = [x.grad.clone() for x in (Q, K, V)]
    for x in (Q, K, V):
        x.grad = None
    ref = torch.nn.functional.scaled_dot_product_attention(Q, K, V, is_causal=True)
    ref.backward(dO)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for g, x in zip(got, (Q, K, V)):
        torch.testing.assert_close(g, x.grad, rtol=1e-11, atol=1e-12)


def test_same_memory_no_copies(comm):
    """q, k, v reach the library as views of the tensors; out and lse are the library's arrays."""
    q = torch.randn(1, 2, 4, 8, requires_grad=True)
    from mpiattn.torch.tensors import to_array, to_tensor
    a = to_array(q)
    assert a.__array_interface__["data"][0] == q.data_ptr()
    b = np.zeros((2, 3), np.float32)
    assert to_tensor(b).data_ptr() == b.__array_interface__["data"][0]
    out, lse = mt.attention(q, q, q, return_lse=True)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32 and lse.requires_grad
    assert out.is_contiguous()
    with torch.no_grad():
        assert not mt.attention(q, q, q, return_lse=True)[1].requires_grad


def test_bfloat16_tensors(comm):
    """bf16 tensors run (float32 accumulation) and their gradients come back in bf16."""
    pytest.importorskip("ml_dtypes")
    B, H, N, E = 1, 2, 40, 8
    Q, K, V = (x.detach() for x in _global(7, (B, H, N, E), (B, H, N, E), (B, H, N, E)))
    Qb, Kb, Vb = (x.to(torch.bfloat16).requires_grad_() for x in (Q, K, V))
    out = mt.gather(mt.attention(*(mt.shard(x) for x in (Qb, Kb, Vb)), causal=True))
    out.float().pow(2).sum().backward()
    assert out.dtype == torch.bfloat16 and Qb.grad.dtype == torch.bfloat16
    # against float64 on the bf16-rounded inputs, and no worse than torch's own bf16 attention
    Q64, K64, V64 = (x.detach().double().requires_grad_() for x in (Qb, Kb, Vb))
    ref = torch.nn.functional.scaled_dot_product_attention(Q64, K64, V64, is_causal=True)
    ref.pow(2).sum().backward()
    Qt, Kt, Vt = (x.detach().clone().requires_grad_() for x in (Qb, Kb, Vb))
    base = torch.nn.functional.scaled_dot_product_attention(Qt, Kt, Vt, is_causal=True)
    base.float().pow(2).sum().backward()
    for got, b, r in ((out, base, ref), (Qb.grad, Qt.grad, Q64.grad), (Kb.grad, Kt.grad, K64.grad),
                      (Vb.grad, Vt.grad, V64.grad)):
        err = (got.double() - r).abs().max().item()
        base_err = (b.double() - r).abs().max().item()
        step = 2.0 ** -8 * r.abs().max().item()
        assert err <= 3 * base_err + step, (err, base_err, step)


# ------------------------------------------------------------------ errors
def _raises_everywhere(comm, fn, exc, match):
    """``fn`` raises ``exc`` matching ``match`` on every rank (checked after the call)."""
    with pytest.raises(exc, match=match) as info:
        fn()
    assert isinstance(info.value, mpiattn.comm.errors.Agreed)
    got = comm.allgather_obj(str(info.value))
    assert all(g == got[0] for g in got)


def test_errors_are_clear_and_agreed(comm):
    q = torch.randn(1, 2, 4, 8)
    _raises_everywhere(comm, lambda: mt.attention(q.transpose(2, 3), q.transpose(2, 3),
                                                  q.transpose(2, 3)),
                       ValueError, "q is not contiguous")
    _raises_everywhere(comm, lambda: mt.attention(q, q.double(), q), TypeError,
                       "q and k have different dtypes")
    _raises_everywhere(comm, lambda: mt.attention(q, q, q.numpy()), TypeError,
                       "v must be a torch.Tensor")
    _raises_everywhere(comm, lambda: mt.attention(q.int(), q.int(), q.int()), TypeError,
                       "mpiattn computes in float16, bfloat16, float32 or float64")
    mask = torch.zeros(1, 4, requires_grad=True)
    _raises_everywhere(comm, lambda: mt.attention(q, q, q, key_padding_mask=mask), TypeError,
                       "key_padding_mask requires grad")
    _raises_everywhere(comm, lambda: mt.matmul_nt(q[0, 0], q[0, 0].T), ValueError,
                       "b is not contiguous")


def test_one_rank_faulty_all_ranks_raise(comm):
    """A fault on one rank only (here the last) raises the same error on every rank."""
    q = torch.randn(1, 2, 4, 8)
    k = q.transpose(2, 3).contiguous().transpose(2, 3) if comm.rank == comm.size - 1 else q
    _raises_everywhere(comm, lambda: mt.attention(q, k, q), ValueError, "k is not contiguous")


@pytest.mark.mpi(min_size=2)
def test_ranks_that_disagree_on_requires_grad(comm):
    """One rank's operands need grad and another's do not: its backward would wait forever."""
    q = torch.randn(1, 2, 4, 8, requires_grad=comm.rank == 0)
    _raises_everywhere(comm, lambda: mt.attention(q, q, q), ValueError,
                       r"ranks disagree on requires_grad \(q, k, v\)")


def test_second_order_gradients_are_refused_clearly(comm):
    """Issue 26 item 3: with create_graph=True the backward would return detached gradients, and a
    second-order loss silently wrong ones: every rank raises one clear error instead."""
    Q, K = _global(5, (1, 2, 6, 3), (1, 2, 6, 3))
    q, k = mt.shard(Q, dim=2), mt.shard(K, dim=2)
    out = mt.attention(q, k, k, causal=True)
    with pytest.raises(RuntimeError, match="second-order gradients .* are not supported"):
        torch.autograd.grad(out.pow(2).sum(), q, create_graph=True)
    a = mt.shard(_global(6, (6, 3))[0], dim=0)
    c = mt.matmul_nt(a, a)
    with pytest.raises(RuntimeError, match="mpiattn.torch.matmul_nt: second-order gradients"):
        torch.autograd.grad(c.sum(), a, create_graph=True)
    out = mt.attention(q, k, k, causal=True)  # every rank in step: a first-order backward works
    out.pow(2).sum().backward()
    assert Q.grad is not None and K.grad is not None


def test_a_rank_in_another_call_gets_one_clear_error(comm):
    """Issue 26 item 13: one rank backpropagates while another starts a new forward: both get
    "ranks are in different collective calls" (not an internal KeyError), then work again."""
    if comm.size == 1:
        pytest.skip("needs two ranks")
    Q, = _global(7, (1, 2, 6, 3))
    q = mt.shard(Q, dim=2)
    out = mt.attention(q, q, q)
    # (in the collective checking mode the call sites differ first: the same news, sooner)
    with pytest.raises(RuntimeError, match="(ranks are in different collective calls: rank 0 is in|"
                                           r"ranks reach different collectives of mpiattn \(.*\): "
                                           "rank 0 is at) attention_backward"):
        if comm.rank == 0:
            out.sum().backward()
        else:
            mt.attention(q.detach(), q.detach(), q.detach())
    out = mt.attention(q, q, q)
    out.sum().backward()
    assert Q.grad is not None


def test_the_transformers_adapter_is_imported_on_demand_and_names_its_extra(serial_only, monkeypatch):
    import subprocess
    import sys

    code = "import sys, mpiattn.torch, mpiattn.torch.hf; assert 'transformers' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if not installed
    from mpiattn.torch import hf
    with pytest.raises(ImportError, match=r'pip install "mpiattn\[hf\]"'):
        hf.register()


def test_the_keywords_and_one_score_object_are_the_same_call(comm):
    """softcap, ALiBi, max_logit and learnable sinks given as keywords, as one ``mpiattn.Score``
    (the sinks a tensor that requires grad inside it), or split between the two: the same bits
    (out, lse, every gradient, the sinks' included, max_logit) on every rank; a modifier given
    both ways is refused."""
    B, H, N, E = 1, 2, 5 * comm.size + 2, 4
    Q, K, V, DO = _global(31, *[(B, H, N, E)] * 4)
    slopes = np.array([0.5, 0.25])

    def run(make):
        sinks = torch.tensor([0.3, -0.4], dtype=F64, requires_grad=True)
        leaves = [x.detach().clone().requires_grad_(True) for x in (Q, K, V)]
        used = {}
        out, lse = mt.attention(*(mt.shard(x) for x in leaves), causal=True, return_lse=True,
                                details=used, **make(sinks))
        (out * mt.shard(DO.detach())).sum().backward()
        return [out.detach(), lse.detach(), *(x.grad for x in leaves), sinks.grad,
                torch.as_tensor(used["max_logit"])]

    one = run(lambda s: dict(softcap=1.5, alibi_slopes=slopes, sinks=s, max_logit=True))
    assert one[5] is not None and one[5].abs().sum() > 0
    for make in (lambda s: dict(score=mpiattn.Score(softcap=1.5, alibi_slopes=slopes, sinks=s,
                                                    max_logit=True)),
                 lambda s: dict(score=mpiattn.Score(sinks=s, max_logit=True), softcap=1.5,
                                alibi_slopes=slopes)):
        for a, b in zip(one, run(make)):
            assert torch.equal(a, b)
    with pytest.raises(ValueError, match="softcap is given twice"):
        mt.attention(*(mt.shard(x.detach()) for x in (Q, K, V)), score=mpiattn.Score(softcap=1.0),
                     softcap=2.0)
