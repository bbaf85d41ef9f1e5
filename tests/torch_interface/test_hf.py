"""transformers models on sequence shards (``mpiattn.torch.hf``) against the single-process model.

Tiny configurations (built, not downloaded) of Llama, Qwen 3 (alternating sliding windows),
Mistral (a sliding window), Gemma 2 (softcap, alternating windows), gpt-oss (learnable
sinks, windows, experts), Llama 4 (full attention; a NoPE layer that scales its queries by
position, and layers not handed position_ids) and Nemotron-H (an MLP block before its attention
layer). The reference is the same model in one process
whose attention is written here in plain torch (causal, the window ``kv > q - W``, softcap,
sinks as one more softmax column: what the models' eager functions do, in the inputs' dtype
throughout); the sharded model runs every layer through mpiattn on this rank's rows. Logits and
every parameter's gradient (after ``reduce_gradients``) must equal the reference's. Then what
:func:`hf.generate` and a forward refuse, with one error on every rank: hybrids among them
(Qwen3-Next's gated delta rule layers), whose non-attention layers would see this rank's rows
alone.
"""

import copy

import numpy as np

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
mt = pytest.importorskip("mpiattn.torch")

from mpiattn.torch import hf  # noqa: E402

REFERENCE = "mpiattn-tests-reference"


def _reference(module, query, key, value, attention_mask, *, scaling, dropout=0.0,
               sliding_window=None, softcap=None, s_aux=None, **kwargs):
    """Dense attention of the whole sequence, written out (the models' eager functions' math)."""
    assert attention_mask is None  # (no mask function is registered under this name)
    G = query.shape[1] // key.shape[1]
    k, v = key.repeat_interleave(G, 1), value.repeat_interleave(G, 1)
    s = query @ k.transpose(-1, -2) * scaling
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(s.shape[-2])[:, None]
    j = torch.arange(s.shape[-1])[None, :]
    seen = j <= i if module.is_causal else torch.ones_like(j >= i)
    if sliding_window is not None:
        seen = seen & (j > i - sliding_window)
    s = s.masked_fill(~seen, float("-inf"))
    if s_aux is not None:
        col = s_aux.view(1, -1, 1, 1).expand(*s.shape[:3], 1).to(s.dtype)
        p = torch.softmax(torch.cat([s, col], -1), -1)[..., :-1]
    else:
        p = torch.softmax(s, -1)
    return (p @ v).transpose(1, 2).contiguous(), None


transformers.AttentionInterface.register(REFERENCE, _reference)

SMALL = dict(vocab_size=61, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
             attention_dropout=0.0)
TWO_KINDS = ["sliding_attention", "full_attention"]
MODELS = {
    "llama": ("LlamaConfig", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(use_sliding_window=True, sliding_window=4, layer_types=TWO_KINDS)),
    "mistral": ("MistralConfig", dict(sliding_window=5)),
    "gemma2": ("Gemma2Config", dict(sliding_window=4, attn_logit_softcapping=0.6,
                                    final_logit_softcapping=8.0, query_pre_attn_scalar=8,
                                    layer_types=TWO_KINDS)),
    "gpt_oss": ("GptOssConfig", dict(sliding_window=4, num_local_experts=4, num_experts_per_tok=2,
                                     layer_types=TWO_KINDS, experts_implementation="eager",
                                     rope_parameters={"rope_type": "yarn", "factor": 2.0,
                                                      "beta_fast": 32.0, "beta_slow": 1.0,
                                                      "rope_theta": 150000.0, "truncate": False,
                                                      "original_max_position_embeddings": 32})),
    # full attention only (no chunks); layer 1 NoPE: queries scaled by 1 + log1p((p + 1) // 8)
    "llama4": ("Llama4TextConfig", dict(intermediate_size_mlp=40, num_local_experts=2,
                                        num_experts_per_tok=1, attention_chunk_size=None,
                                        no_rope_layers=[1, 0], floor_scale=8, attn_scale=1.0)),
    # an MLP block (no sequence mixing) first: the checks run at layer 1, its first attention layer
    "nemotron_h": ("NemotronHConfig", dict(layer_types=["mlp", "full_attention"])),
}


def _transformers_runs(name, extra):
    """Skip when this transformers cannot run the configuration itself, in one process with its
    own attention (5.23 builds Llama 4's chunked mask even with attention_chunk_size=None and
    raises; 5.25 builds only the masks of the layers present)."""
    config = getattr(transformers, name)(**SMALL, **extra)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    try:
        with torch.no_grad():
            model(torch.arange(4)[None], use_cache=False)
    except ValueError as exc:
        pytest.skip(f"transformers {transformers.__version__} cannot run this {name} itself: {exc}")


def _models(family, dtype):
    name, extra = MODELS[family]
    if family == "llama4":
        _transformers_runs(name, extra)
    config = getattr(transformers, name)(**SMALL, **extra)
    torch.manual_seed(7)
    ref = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config),
                                                        attn_implementation=REFERENCE)
    ref = ref.to(dtype).train()
    with torch.no_grad():  # every parameter away from its initial constant (the sinks' zeros)
        for p in ref.parameters():
            p.add_(0.05 * torch.randn_like(p))
    sharded = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config),  # (its own)
                                                            attn_implementation=hf.NAME)
    sharded = sharded.to(dtype).train()
    sharded.load_state_dict(ref.state_dict())
    return ref, sharded


# float64: entrywise to rounding. float32: the logits entrywise; a gradient, a sum of float32
# products over every row whose order differs with the shards, as a whole (relative norm)
TOLERANCES = {torch.float64: (1e-10, 1e-11, 1e-9), torch.float32: (2e-5, 2e-6, 1e-5)}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("family", list(MODELS))
def test_a_sharded_model_equals_the_single_process_model(comm, family, layout, dtype):
    hf.register(layout=layout)
    rtol_out, atol_out, rtol_grad = TOLERANCES[dtype]
    ref, sharded = _models(family, dtype)
    B, N = 2, 13
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, SMALL["vocab_size"], (B, N), generator=gen)
    w = torch.randn(B, N, SMALL["vocab_size"], generator=gen, dtype=dtype)
    want = ref(ids, use_cache=False).logits
    (want * w).sum().backward()
    shard = lambda x: mt.shard(x, dim=1, layout=layout)  # noqa: E731
    pos = shard(torch.arange(N)[None].expand(B, N))
    got = sharded(shard(ids), position_ids=pos, use_cache=False).logits
    (got * shard(w)).sum().backward()
    mt.reduce_gradients(sharded)
    full = mt.gather(got.detach(), dim=1, layout=layout)
    torch.testing.assert_close(full, want.detach(), rtol=rtol_out, atol=atol_out)
    grads = dict(sharded.named_parameters())
    for name, p in ref.named_parameters():
        assert grads[name].grad is not None, name
        # Gemma 2's RMSNorm scales by (1 + w), Nemotron-H's by w, in float32 even in a float64
        # model: its weights' gradients are float32 sums, of all rows at once here, of each
        # rank's rows there
        f32 = family in ("gemma2", "nemotron_h") and "norm" in name
        if dtype == torch.float32:
            err = float((grads[name].grad - p.grad).norm() / p.grad.norm().clamp_min(1e-30))
            assert err <= (10 * rtol_grad if f32 else rtol_grad), f"{name}: relative error {err:.2e}"
            continue
        torch.testing.assert_close(grads[name].grad, p.grad, rtol=1e-5 if f32 else rtol_grad,
                                   atol=1e-6 if f32 else 1e-11,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_what_it_cannot_honour_is_refused_on_every_rank(comm):
    hf.register()
    _, sharded = _models("llama", torch.float64)
    N = 3 * comm.size + 1
    ids = mt.shard(torch.arange(N)[None] % 50, dim=1)
    pos = mt.shard(torch.arange(N)[None], dim=1)
    if comm.size > 1:  # (one rank's local positions are the global ones)
        with pytest.raises(ValueError, match="global positions"):
            sharded(ids, use_cache=False)  # the model's own: every rank's 0, 1, ...
    with pytest.raises(ValueError, match="global positions"):
        sharded(ids, position_ids=pos + 1, use_cache=False)
    with pytest.raises(ValueError, match="cache"):
        sharded(ids, position_ids=pos, use_cache=True, past_key_values=_cache_with(sharded, ids))
    sharded.config.attention_dropout = 0.1
    for layer in sharded.model.layers:
        layer.self_attn.attention_dropout = 0.1
    with pytest.raises(ValueError, match="dropout"):
        sharded(ids, position_ids=pos, use_cache=False)
    for taken in ("causal", "softcap", "sinks", "score"):  # a score modifier is each layer's own
        with pytest.raises(TypeError, match=f"takes no {taken}: each layer passes"):
            hf.register(**{taken: True})


def test_the_checks_run_at_the_first_attention_layer(comm):
    """Nemotron-H's layer 0 is an MLP block, which never calls the attention function: the
    forward's checks run at layer 1 (they once ran at layer 0 only, and so never here)."""
    hf.register()
    _, sharded = _models("nemotron_h", torch.float64)
    N = 3 * comm.size + 1
    ids = mt.shard(torch.arange(N)[None] % 50, dim=1)
    pos = mt.shard(torch.arange(N)[None], dim=1)
    _agreed_error(comm, ValueError, "global positions",
                  lambda: sharded(ids, position_ids=pos + 1, use_cache=False))
    assert sharded(ids, position_ids=pos, use_cache=False).logits.shape == (1, len(ids[0]), 61)


def _qwen3_next(kinds):
    """A tiny Qwen3-Next: gated delta rule ('linear_attention') and full-attention layers."""
    config = transformers.Qwen3NextConfig(**SMALL, layer_types=kinds, num_experts=2,
                                          num_experts_per_tok=1, moe_intermediate_size=16,
                                          shared_expert_intermediate_size=16,
                                          linear_num_key_heads=2, linear_num_value_heads=2,
                                          linear_key_head_dim=8, linear_value_head_dim=8)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=hf.NAME)


HYBRID = "layer {} is a 'linear_attention' layer, which mixes the sequence without attention and " \
         "would see only this rank's rows"


@pytest.mark.parametrize("kinds", [["linear_attention", "full_attention"],
                                   ["full_attention", "linear_attention"]],
                         ids=["linear_first", "attention_first"])
def test_a_hybrid_model_is_refused_on_every_rank_before_it_returns(comm, kinds):
    """Qwen3-Next's gated delta rule layers carry a state along the sequence: on shards each
    would see this rank's rows alone, a silently wrong result. One error naming the layer on
    every rank, at the first attention layer, which does not finish: no later layer runs and
    the model returns nothing (it once ran unchecked, layer 0 not being attention)."""
    hf.register()
    model = _qwen3_next(kinds)
    done = []
    for i, layer in enumerate(model.model.layers):
        layer.register_forward_hook(lambda *args, i=i: done.append(i))
    N = 3 * comm.size + 1
    ids = mt.shard(torch.arange(N)[None] % 50, dim=1)
    pos = mt.shard(torch.arange(N)[None], dim=1)
    _agreed_error(comm, ValueError, HYBRID.format(kinds.index("linear_attention")),
                  lambda: model(ids, position_ids=pos, use_cache=False))
    assert done == list(range(kinds.index("full_attention")))


def test_generate_refuses_a_hybrid_or_a_model_without_attention(comm):
    """generate refuses a hybrid before the model runs, and a model none of whose layers calls
    the attention function (RWKV) after its prompt, before any token: both once decoded tokens
    regardless, each rank's rows and each new token mixed alone."""
    hf.register()
    hybrid = _qwen3_next(["linear_attention", "full_attention"]).eval()
    ran = []
    hybrid.register_forward_hook(lambda *args: ran.append(1))
    _agreed_error(comm, ValueError, HYBRID.format(0), lambda: hf.generate(hybrid, _prompt(), 2))
    assert not ran
    config = transformers.RwkvConfig(vocab_size=61, hidden_size=32, num_hidden_layers=2,
                                     attention_hidden_size=32, intermediate_size=40)
    rwkv = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=hf.NAME)
    _agreed_error(comm, ValueError, "no layer of the model called its attention",
                  lambda: hf.generate(rwkv.eval(), _prompt(), 2))


@pytest.mark.parametrize("fields,match", [
    (dict(layers_block_type=["attention", "mamba"]), "layer 1 is a 'linear_attention' layer"),
    (dict(hybrid_override_pattern="*-EM"), "layer 3 is a 'linear_attention' layer"),
    (dict(mamba_d_state=16), "has mamba_d_state .* and no layer_types"),
    (dict(layer_types=["sliding_attention", "hybrid"]), "layer 1 is a 'hybrid' layer, which runs "
                                                        r"a state-space \(Mamba\) mixer beside"),
    (dict(layer_types=["full_attention", "indexed_attention"]),
     "layer 1 is a 'indexed_attention' layer, which attends the keys an indexer picks"),
], ids=["layers_block_type", "hybrid_override_pattern", "mamba_fields", "hybrid", "indexed"])
def test_hybrids_are_known_by_their_config(fields, match):
    """Configs without layer_types (older hybrids) and layer kinds of attention the adapter does
    not mask are refused from the config alone; token-wise blocks (MLP, MoE) are not."""
    from types import SimpleNamespace

    from mpiattn.torch import hf_layers

    with pytest.raises(ValueError, match=match):
        hf_layers.check(SimpleNamespace(**fields))
    assert hf_layers.checked_up_to(SimpleNamespace(**fields)) is None  # (every call checks)
    fine = SimpleNamespace(hybrid_override_pattern="-E*", conv_L_cache=3)
    assert hf_layers.refusal(fine) is None and hf_layers.checked_up_to(fine) == 2
    assert hf_layers.checked_up_to(SimpleNamespace()) == 0


def _llama4(**extra):
    """A tiny Llama 4 (text) with the adapter's attention."""
    if extra.get("attention_chunk_size") is None:
        _transformers_runs("Llama4TextConfig", {**MODELS["llama4"][1], **extra})
    config = transformers.Llama4TextConfig(**{**SMALL, **MODELS["llama4"][1], **extra})
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=hf.NAME)


def _agreed_error(comm, exc_type, match, call):
    """``call()`` raises ``exc_type`` matching ``match`` on this rank; every rank's message is the
    same (gathered after the call, so a rank that did not raise fails here, not in a hang)."""
    with pytest.raises(exc_type, match=match) as info:
        call()
    seen = comm.allgather_obj(str(info.value))
    assert all(s == seen[0] for s in seen), seen
    return str(info.value)


@pytest.mark.parametrize("chunked", [0, 1])
def test_a_layer_kind_it_cannot_mask_is_refused_on_every_rank(comm, chunked):
    """Llama 4's chunked layers (transformers builds their mask itself): one error everywhere,
    naming the layer, instead of attention over every earlier key; the first layer refuses a
    later chunked one, before anything runs (it once failed on position_ids instead)."""
    hf.register()
    model = _llama4(attention_chunk_size=4, no_rope_layers=[int(i == chunked) for i in range(2)])
    assert model.config.layer_types[chunked] == "chunked_attention"
    N = 3 * comm.size + 1
    ids = mt.shard(torch.arange(N)[None] % 50, dim=1)
    pos = mt.shard(torch.arange(N)[None], dim=1)
    _agreed_error(comm, ValueError, f"layer {chunked} is a 'chunked_attention' layer",
                  lambda: model(ids, position_ids=pos, use_cache=False))


def test_llama4_runs_where_its_nope_scales_can_be_made_global(comm, monkeypatch):
    """Llama 4's NoPE layers scale each query by its local position; the adapter rescales them
    exactly where the local scale is 1 (the model tests above), and refuses a rank whose rows
    the model scaled as local positions past floor_scale - 1. Its layers are not handed
    position_ids: a model of a kind not known to be so is refused with that reason."""
    hf.register()
    model = _llama4(floor_scale=2)  # (a rank may hold 1 row away from its global position)
    N = 2 * comm.size
    ids = mt.shard(torch.arange(N)[None] % 50, dim=1)
    pos = mt.shard(torch.arange(N)[None], dim=1)
    if comm.size > 1:
        _agreed_error(comm, ValueError, "scaled as position 1.*at most 1 rows per rank",
                      lambda: model(ids, position_ids=pos, use_cache=False))
    else:  # (one rank: every row at its global position)
        assert model(ids, position_ids=pos, use_cache=False).logits.shape == (1, N, 61)
    monkeypatch.delitem(hf.UNCHECKED_POSITIONS, "llama4_text")
    _agreed_error(comm, ValueError, r"\(llama4_text\) does not hand position_ids on",
                  lambda: model(ids, position_ids=pos, use_cache=False))


def _cache_with(model, ids):
    """A transformers cache already holding a few tokens (generation's second step)."""
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        model.config._attn_implementation_internal = REFERENCE
        try:
            model(ids[:, :1], use_cache=True, past_key_values=cache)
        finally:
            model.config._attn_implementation_internal = hf.NAME
    return cache


def test_a_left_padded_batch_entry_attends_its_tokens_only(comm):
    """A 2-D attention_mask becomes the keys' padding: a left-padded entry's tokens give the
    logits of the same tokens alone at the same positions."""
    hf.register()
    ref, sharded = _models("mistral", torch.float64)
    B, N, pad = 2, 11, 4
    ids = torch.randint(0, SMALL["vocab_size"], (B, N), generator=torch.Generator().manual_seed(5))
    mask = torch.ones(B, N, dtype=torch.long)
    mask[1, :pad] = 0
    shard = lambda x: mt.shard(x, dim=1)  # noqa: E731
    pos = torch.arange(N)[None].expand(B, N)
    got = mt.gather(sharded(shard(ids), attention_mask=shard(mask), position_ids=shard(pos),
                            use_cache=False).logits.detach(), dim=1)
    with torch.no_grad():
        alone = ref(ids[1:, pad:], position_ids=pos[1:, pad:], use_cache=False).logits
        whole = ref(ids[:1], use_cache=False).logits
    torch.testing.assert_close(got[1:, pad:], alone, rtol=1e-10, atol=1e-11)
    torch.testing.assert_close(got[:1], whole, rtol=1e-10, atol=1e-11)


@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt_oss", "llama4"])
def test_greedy_generation_equals_the_single_process_model(comm, family, monkeypatch):
    """The prompt sharded, each new token against the sharded caches (windows, softcap, sinks,
    Llama 4's query scale at its global position): the tokens of a single-process greedy loop,
    and each step's logits those of the single-process model at its position (a token can
    survive a wrong step); each layer's steps planned once."""
    from mpiattn.inference import KVCache

    layout = "zigzag"
    hf.register(layout=layout)
    ref, sharded = _models(family, torch.float64)
    ref.eval(), sharded.eval()
    ids = torch.randint(0, SMALL["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(8))
    planned, real = [], KVCache.plan_attend
    monkeypatch.setattr(KVCache, "plan_attend", lambda self, *a, **kw: planned.append(1) or real(self, *a, **kw))
    monkeypatch.setattr(KVCache, "attend", None)  # (no one-shot step)
    steps = []  # (every forward's logits: the prompt's rows on this rank, then each new token's)
    sharded.register_forward_hook(lambda module, args, out: steps.append(out.logits[:, -1]))
    got = hf.generate(sharded, ids, 6, layout=layout)
    assert len(planned) == sharded.config.num_hidden_layers
    seq = ids
    with torch.no_grad():
        for _ in range(6):
            nxt = ref(seq, use_cache=False).logits[:, -1].argmax(-1)
            seq = torch.cat([seq, nxt[:, None]], dim=1)
        whole = ref(seq, use_cache=False).logits
    assert torch.equal(got, seq[:, ids.shape[1]:])
    N = ids.shape[1]
    for t, step in enumerate(steps[1:], start=1):  # (the token at N + t - 1 predicts N + t)
        torch.testing.assert_close(step, whole[:, N + t - 1], rtol=1e-10, atol=1e-11)
    with pytest.raises(ValueError, match="max_new_tokens"):
        hf.generate(sharded, ids, 0)


def _generator(layout="contiguous"):
    hf.register(layout=layout)
    _, sharded = _models("llama", torch.float64)
    return sharded.eval()


def _prompt(B=2, N=9):
    return torch.randint(0, SMALL["vocab_size"], (B, N), generator=torch.Generator().manual_seed(8))


def test_generate_refuses_what_differs_between_ranks(comm):
    """generate takes the whole prompt on every rank: its tokens (by their CRC-32), its shape and
    max_new_tokens must be the same everywhere, one error on every rank (not tokens regardless,
    nor a rank decoding alone)."""
    if comm.size == 1:
        pytest.skip("needs ranks to differ")
    model, ids = _generator(), _prompt()
    mine = ids.clone()
    mine[1, 4] = (mine[1, 4] + comm.rank) % SMALL["vocab_size"]
    msg = _agreed_error(comm, ValueError, "generate's prompt \\(the CRC-32",
                        lambda: hf.generate(model, mine, 3))
    assert "rank 0 has 0x" in msg and "rank 1 has 0x" in msg
    _agreed_error(comm, ValueError, r"generate's prompt shape \(B, N\): rank 0 has \(2, 9\)",
                  lambda: hf.generate(model, _prompt(N=9 + comm.rank), 3))
    _agreed_error(comm, ValueError, "generate's max_new_tokens: rank 0 has 3, rank 1 has 4",
                  lambda: hf.generate(model, ids, 3 + comm.rank))


def test_generate_refuses_a_prompt_that_leaves_a_rank_without_rows(comm):
    """Fewer prompt tokens than the layout needs to give every rank some: one error on every
    rank (the rank without rows once failed inside transformers, the others waited)."""
    model = _generator()
    _agreed_error(comm, ValueError, f"prompts of {comm.size - 1} tokens leave rank "
                  f"{comm.size - 1} no rows",
                  lambda: hf.generate(model, _prompt(N=comm.size - 1), 2))
    assert hf.generate(model, _prompt(N=comm.size), 2).shape == (2, 2)


@pytest.mark.parametrize("bad,at", [(61, (1, -1)), (-1, (0, 0))], ids=["vocab_size", "negative"])
def test_generate_refuses_a_token_outside_the_vocabulary(comm, bad, at):
    """A token id outside the embedding, in one rank's rows: one error naming it and the
    vocabulary on every rank, before the model runs (that rank once failed in the embedding)."""
    model, ids = _generator(), _prompt()
    ids[at] = bad
    b, i = at[0], at[1] % ids.shape[1]
    _agreed_error(comm, ValueError, f"token id {bad} at input_ids\\[{b}, {i}\\] is not in the "
                  "model's vocabulary of 61 \\(ids 0 to 60\\)", lambda: hf.generate(model, ids, 2))


def test_generate_refuses_a_prompt_not_of_token_ids_b_n(comm):
    """A 1-D prompt (or floats): an error saying the shape (dtype) wanted, on every rank."""
    model, ids = _generator(), _prompt()
    _agreed_error(comm, ValueError, r"input_ids of shape \(B, N\).*input_ids\[None\].*got \(9,\)",
                  lambda: hf.generate(model, ids[0], 2))
    _agreed_error(comm, TypeError, "token ids, a torch.Tensor of int64 or int32, not torch.float32",
                  lambda: hf.generate(model, ids.float(), 2))


def test_generate_refuses_a_model_or_layout_not_registered(comm):
    """A model whose attention is not the adapter's would attend each rank's rows alone (wrong
    tokens, silently); a layout other than the registered one would fail on position_ids:
    both refused by name. generate's comm and layout default to the registered ones."""
    model, ids = _generator("zigzag"), _prompt()
    want = hf.generate(model, ids, 2)
    assert torch.equal(hf.generate(model, ids, 2, layout="zigzag"), want)
    _agreed_error(comm, ValueError, "layout 'contiguous', but the model's attention was "
                  "registered with 'zigzag'",
                  lambda: hf.generate(model, ids, 2, layout="contiguous"))
    model.config._attn_implementation_internal = "eager"
    _agreed_error(comm, ValueError, "attn_implementation \\('eager'\\) is not one made by "
                  "mpiattn.torch.hf.register", lambda: hf.generate(model, ids, 2))


def test_the_example_trains_the_same_curve_on_two_ranks(serial_only, tmp_path):
    """examples/hf_lm.py, tiny: the eager model and mpiattn at 2 ranks follow one loss curve and
    decode the same bytes."""
    import json
    import os
    import sys

    from helpers import mpiexec, run_group

    script = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "hf_lm.py")
    args = [script, "--context", "96", "--steps", "3", "--generate", "5"]
    env = dict(os.environ, OMP_NUM_THREADS="1", MPIR_CVAR_ENABLE_HEAVY_YIELD="1")
    env.pop("MPIATTN_TEST_RANKLOG_DIR", None)
    runs = {"eager": [sys.executable, *args, "--attention", "eager"],
            "P2": [mpiexec(), "-n", "2", sys.executable, *args]}
    got = {}
    for name, cmd in runs.items():
        rc, out, err = run_group(cmd + ["--history", str(tmp_path / f"{name}.json")], 180,
                                 cwd=tmp_path, env=env)
        assert rc == 0, err
        got[name] = json.loads((tmp_path / f"{name}.json").read_text())
    losses = [[h["loss"] for h in got[n]["history"]] for n in runs]
    assert np.allclose(*losses, rtol=1e-5, atol=1e-6) and losses[0][0] > losses[0][-1]
    assert got["eager"]["generated"] == got["P2"]["generated"]
