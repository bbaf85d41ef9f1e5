"""torch.compile(fullgraph=True) over mpiattn.torch: one graph, no graph break, the eager numbers.

Under compilation ``mpiattn.torch.attention`` and the products are custom operators
(:mod:`mpiattn.torch.ops`); these tests compile a small model of ``MultiheadAttention``,
``attention`` (sinks, softcap, ``lse`` in the loss, a padding mask) and the three products,
the products alone on a zigzag layout, and a transformers model through the adapter, at every
rank count, with the ``aot_eager`` backend (dynamo's graph and AOTAutograd's backward, no code
generation: the eager bits exactly), and count dynamo's graph
breaks with its own counter. Inductor's code generation is checked once, at one rank.
"""

import shutil

import pytest

torch = pytest.importorskip("torch")
mt = pytest.importorskip("mpiattn.torch")

from torch._dynamo.utils import counters  # noqa: E402

import mpiattn  # noqa: E402

F64 = torch.float64


def _compiled(fn, backend="aot_eager"):
    torch._dynamo.reset()
    counters.clear()
    return torch.compile(fn, fullgraph=True, backend=backend)


def _breaks():
    return sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]


class _Model(torch.nn.Module):
    """A MultiheadAttention layer, then attention with learnable sinks, a softcap and ``lse``,
    and the three products (``matmul_nt``'s columns and ``matmul_tn``'s rows are lengths the
    compiler learns only when they have run)."""

    def __init__(self, E=16, H=4):
        super().__init__()
        torch.manual_seed(3)
        self.layer = mt.MultiheadAttention(E, H, batch_first=True, causal=True, dtype=F64)
        self.sinks = torch.nn.Parameter(torch.randn(H, dtype=F64))
        self.H = H

    def forward(self, x_r, pad_r):
        y, _ = self.layer(x_r, key_padding_mask=pad_r)
        B, n, E = y.shape
        q = y.reshape(B, n, self.H, E // self.H).transpose(1, 2).contiguous()
        o, lse = mt.attention(q, q, q, causal=True, sinks=self.sinks, softcap=3.0, return_lse=True,
                              key_padding_mask=pad_r)
        p = torch.softmax(mt.matmul_nt(o, q) / 2, dim=-1)  # (B, H, n_r, N)
        t = mt.matmul_tn(q, mt.matmul_nn(p, o))  # (B, H, this rank's share of E / H, E / H)
        return o.pow(2).sum() + 0.1 * lse.sum() + t.pow(2).sum()


def _run(model, fn, comm):
    model.zero_grad()
    N = 9 * comm.size + 2
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, N, 16, generator=g, dtype=F64)
    pad = torch.rand(2, N, generator=g) < 0.2
    pad[:, 0] = False
    loss = fn(mt.shard(x, dim=1), mt.shard(pad, dim=1))
    loss.backward()
    mt.reduce_gradients(model)
    return [loss.detach()] + [p.grad.clone() for p in model.parameters()]


def test_a_compiled_model_is_one_graph_with_the_eager_numbers(comm):
    model = _Model()
    eager = _run(model, model, comm)
    compiled = _compiled(model)
    for _ in range(2):  # compiled once, run twice
        got = _run(model, compiled, comm)
        assert len(got) == len(eager) and all(torch.equal(a, b) for a, b in zip(got, eager))
    assert _breaks() == (0, 1)


def test_inductor_compiles_it_too(serial_only, comm):
    """The default backend generates code around the operators: the same numbers to rounding."""
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("inductor needs a C compiler")
    model = _Model()
    eager = _run(model, model, comm)
    got = _run(model, _compiled(model, backend="inductor"), comm)
    for a, b in zip(got, eager):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert _breaks() == (0, 1)


def test_compiled_products_on_a_zigzag_layout(comm):
    """``A·Bᵀ``, ``A·B`` and ``Aᵀ·B`` on rows in zigzag order, compiled: the eager bits, one graph."""
    g = torch.Generator().manual_seed(11)
    N = 6 * comm.size + 1
    a, b = (torch.randn(3, N, 5, generator=g, dtype=F64) for _ in range(2))
    w = torch.randn(5, 5, generator=g, dtype=F64, requires_grad=True)
    zz = dict(layout="zigzag", block_size=2)

    def loss(a_r, b_r):
        x = a_r @ w
        s = mt.matmul_nt(x, b_r, **zz)
        torch._check(s.shape[-1] == N)  # (the README's advice: then Python may branch on it)
        c = mt.matmul_nn(s.tanh() if s.shape[-1] > 1 else s, b_r, **zz)
        return mt.matmul_tn(x, c, **zz).pow(2).sum() + c.sum()

    def run(fn):
        w.grad = None
        out = fn(*(mt.shard(t, dim=1, layout="zigzag") for t in (a, b)))
        out.backward()
        return out.detach(), w.grad.clone()

    eager = run(loss)
    got = run(_compiled(loss))
    assert all(torch.equal(x, y) for x, y in zip(got, eager))
    assert _breaks() == (0, 1)


def test_the_operators_pass_torchs_opcheck(serial_only, comm):
    """torch's own checks of a custom operator (schema, autograd registration, the fake
    implementation against the real outputs, AOT dispatch with dynamic shapes)."""
    from mpiattn.torch import ops

    g = torch.Generator().manual_seed(2)
    a, b = (torch.randn(2, 5, 3, generator=g, dtype=F64, requires_grad=True) for _ in range(2))
    p = torch.randn(2, 5, 5, generator=g, dtype=F64, requires_grad=True)
    q = torch.randn(1, 2, 5, 4, generator=g, dtype=F64, requires_grad=True)
    sinks = torch.randn(2, generator=g, dtype=F64, requires_grad=True)
    h = ops.handle(comm.mpi, {"layout": "contiguous", "block_size": 2}, False, ())
    cases = [(ops.MATMUL_NT, (a, b, h)), (ops.MATMUL_NN, (p, b, h)), (ops.MATMUL_TN, (a, b, h)),
             (torch.ops.mpiattn.attention, (q, q, q, sinks) + (None,) * 6 + (
                 ops.handle(comm.mpi, {"causal": True, "softcap": 2.0}, True, ()),))]
    for op, args in cases:
        got = torch.library.opcheck(op, args)
        assert set(got.values()) == {"SUCCESS"}, (op, got)


def test_what_a_compiled_call_cannot_take_is_named(comm):
    q = torch.randn(1, 2, 4 * comm.size, 4, dtype=F64)

    def with_details(q):
        return mt.attention(q, q, q, details={})

    def with_max_logit(q):
        return mt.attention(q, q, q, max_logit=True)

    for fn, name in ((with_details, "details"), (with_max_logit, "max_logit")):
        with pytest.raises(Exception, match=f"takes no {name}"):
            _compiled(fn)(mt.shard(q, dim=2))


transformers = pytest.importorskip("transformers")


def test_a_compiled_transformers_model_through_the_adapter(comm):
    """A small Llama with attn_implementation="mpiattn", compiled whole: one graph, the eager
    logits and gradients; its first layer's checks still run (inside the operator) and refuse
    positions that are not the global ones on every rank."""
    from mpiattn.torch import hf

    config = transformers.LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=4, max_position_embeddings=64)
    torch.manual_seed(7)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation=hf.register()).to(F64)
    N = 5 * comm.size + 1
    ids_r = mt.shard(torch.arange(N)[None] % 50, dim=1)
    pos_r = mt.shard(torch.arange(N)[None], dim=1)

    def loss(ids, pos):
        return model(ids, position_ids=pos, use_cache=False).logits.pow(2).sum() / N

    def run(fn, pos=pos_r):
        model.zero_grad()
        out = fn(ids_r, pos)
        out.backward()
        mt.reduce_gradients(model)
        return [out.detach()] + [p.grad.clone() for p in model.parameters() if p.grad is not None]

    eager = run(loss)
    compiled = _compiled(loss)
    got = run(compiled)
    assert len(got) == len(eager) and all(torch.equal(a, b) for a, b in zip(got, eager))
    assert _breaks() == (0, 1)
    with pytest.raises(Exception, match="global positions"):
        run(compiled, pos_r + 1)
    mpiattn.get_comm(comm.mpi).barrier()
