"""transformers models on sequence shards (``mpiattn.torch.hf``) against the single-process model.

Tiny configurations (built, not downloaded) of Llama, Qwen 3 (alternating sliding windows),
Mistral (a sliding window), Gemma 2 (softcap, alternating windows) and gpt-oss (learnable
sinks, windows, experts). The reference is the same model in one process whose attention is
written here in plain torch (causal, the window ``kv > q - W``, softcap, sinks as one more
softmax column: what the models' eager functions do, in the inputs' dtype throughout); the
sharded model runs every layer through mpiattn on this rank's rows. Logits and every
parameter's gradient (after ``reduce_gradients``) must equal the reference's.
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
}


def _models(family, dtype):
    name, extra = MODELS[family]
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
        # Gemma 2's RMSNorm scales by (1 + w) in float32 even in a float64 model: its weights'
        # gradients are float32 sums, of all rows at once here, of each rank's rows there
        f32 = family == "gemma2" and "norm" in name
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
    with pytest.raises(TypeError, match="each layer passes"):
        hf.register(causal=True)


def test_a_layer_kind_it_cannot_mask_is_refused_on_every_rank(comm):
    """Llama 4's chunked layers (transformers builds their mask itself): one error everywhere,
    naming the layer, instead of attention over every earlier key."""
    hf.register()
    config = transformers.Llama4TextConfig(
        vocab_size=61, hidden_size=32, intermediate_size=40, intermediate_size_mlp=40,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_local_experts=2, num_experts_per_tok=1, attention_chunk_size=4,
        no_rope_layers=[1, 0], max_position_embeddings=64)
    assert config.layer_types == ["chunked_attention", "full_attention"]
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=hf.NAME)
    N = 3 * comm.size + 1
    ids = mt.shard(torch.arange(N)[None] % 50, dim=1)
    pos = mt.shard(torch.arange(N)[None], dim=1)
    with pytest.raises(ValueError, match="layer 0 is a 'chunked_attention' layer") as info:
        model(ids, position_ids=pos, use_cache=False)
    seen = comm.allgather_obj(str(info.value))
    assert all(s == seen[0] for s in seen)


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


@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt_oss"])
def test_greedy_generation_equals_the_single_process_model(comm, family, monkeypatch):
    """The prompt sharded, each new token against the sharded caches (windows, softcap, sinks):
    the tokens of a single-process greedy loop; each layer's steps planned once."""
    from mpiattn.inference import KVCache

    layout = "zigzag"
    hf.register(layout=layout)
    ref, sharded = _models(family, torch.float64)
    ref.eval(), sharded.eval()
    ids = torch.randint(0, SMALL["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(8))
    planned, real = [], KVCache.plan_attend
    monkeypatch.setattr(KVCache, "plan_attend", lambda self, *a, **kw: planned.append(1) or real(self, *a, **kw))
    monkeypatch.setattr(KVCache, "attend", None)  # (no one-shot step)
    got = hf.generate(sharded, ids, 6, layout=layout)
    assert len(planned) == sharded.config.num_hidden_layers
    seq = ids
    with torch.no_grad():
        for _ in range(6):
            nxt = ref(seq, use_cache=False).logits[:, -1].argmax(-1)
            seq = torch.cat([seq, nxt[:, None]], dim=1)
    assert torch.equal(got, seq[:, ids.shape[1]:])
    with pytest.raises(ValueError, match="max_new_tokens"):
        hf.generate(sharded, ids, 0)


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
