"""The layer kinds of a transformers model, from its config: which run on shards, which not.

On sequence shards every layer that mixes the sequence must see all of it.
The adapter (:mod:`mpiattn.torch.hf`) gives that to attention layers whose mask
it builds itself, causal or not, with or without a sliding window
(:data:`ATTENTION_LAYERS`); layers that touch each token alone (Nemotron-H's
MLP and MoE blocks, :data:`TOKENWISE_LAYERS`) need nothing. Every other kind
is refused: attention whose mask transformers builds and the adapter does not
read (:data:`REFUSED_LAYERS`: Llama 4's chunks, DeepSeek's indexed and
compressed attention, ...), and a layer that mixes the sequence without
attention (Mamba, gated delta rule and other linear-attention or recurrent
mixers, short convolutions: Qwen3-Next, Qwen 3.5, Jamba, Bamba, Zamba,
Falcon-H1, Granite 4 hybrids, Nemotron-H, LFM2, MiniMax, Kimi Linear,
RecurrentGemma, OLMo hybrid, ...), which would run on this rank's rows alone and
return a silently wrong result.

Such a layer never calls the attention function, so the kinds are read from
the config (:func:`layer_kinds`): ``layer_types``, else the older
``layers_block_type`` or ``hybrid_override_pattern``; a config with none of
them but a state-space or convolution setting (:data:`MIXER_FIELDS`) is
refused too, its layers unknown. The adapter checks a forward at its first
attention layer (:func:`checked_up_to`), the first that calls it, and a refused
model at every call, so that the refusal comes, on every rank alike, before
the forward returns anything.

A model with no attention layer at all (Mamba, RWKV, xLSTM) never calls the
adapter: a forward cannot refuse it, :func:`mpiattn.torch.hf.generate` does.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ATTENTION_LAYERS", "TOKENWISE_LAYERS", "REFUSED_LAYERS", "MIXER_FIELDS",
           "layer_kinds", "refusal", "check", "checked_up_to"]

#: Layer kinds whose attention runs through the adapter, masked by it.
ATTENTION_LAYERS = ("full_attention", "sliding_attention")

#: Layer kinds that touch each token alone (no sequence mixing): run as they are.
TOKENWISE_LAYERS = ("mlp", "moe")

#: Layer kinds refused with a reason of their own (any other kind: it mixes the sequence without
#: attention).
REFUSED_LAYERS = {
    "chunked_attention": "masks chunks of attention_chunk_size keys that transformers builds into "
                         "its own mask (Llama 4)",
    "indexed_attention": "attends the keys an indexer picks for each query (DeepSeek V3.2's "
                         "sparse attention), which the adapter does not read",
    "compressed_sparse_attention": "attends compressed keys (DeepSeek V4), which the adapter does "
                                   "not build",
    "heavily_compressed_attention": "attends compressed keys (DeepSeek V4), which the adapter does "
                                    "not build",
    "minimax_m3_sparse": "attends the keys an indexer picks for each query, which the adapter "
                         "does not read",
    "window_attention": "attends non-overlapping windows, a mask the adapter does not build",
    "reference_sliding_attention": "attends the prompt and a ring buffer of generated tokens, a "
                                   "mask the adapter does not build",
    "hybrid": "runs a state-space (Mamba) mixer beside its attention, which would see only this "
              "rank's rows",
    "hybrid_sliding": "runs a state-space (Mamba) mixer beside its attention, which would see only "
                      "this rank's rows",
}

#: Config fields of state-space, linear-attention and convolution layers: with no layer list
#: beside them, the model is refused (which of its layers attend is unknown).
MIXER_FIELDS = ("mamba_d_state", "mamba_expand", "ssm_state_size", "conv_L_cache",
                "linear_num_value_heads", "linear_key_head_dim")

# older spellings: layers_block_type's entries, hybrid_override_pattern's characters
_OLD_KINDS = {"attention": "full_attention", "mamba": "linear_attention"}
_PATTERN = {"*": "full_attention", "M": "linear_attention", "-": "mlp", "E": "moe"}


def layer_kinds(config: Any) -> list | None:
    """Each layer's kind (``layer_types``, ``layers_block_type`` or ``hybrid_override_pattern``),
    or None where the config has none of them."""
    kinds = getattr(config, "layer_types", None)
    if kinds is not None:
        return list(kinds)
    kinds = getattr(config, "layers_block_type", None)
    if kinds is not None:
        return [_OLD_KINDS.get(k, k) for k in kinds]
    pattern = getattr(config, "hybrid_override_pattern", None)
    if isinstance(pattern, str):
        return [_PATTERN.get(ch, ch) for ch in pattern]
    return None


def refusal(config: Any) -> str | None:
    """Why the model cannot run on sequence shards (its first layer that cannot), or None."""
    kinds = layer_kinds(config)
    if kinds is None:
        field = next((f for f in MIXER_FIELDS if getattr(config, f, None) is not None), None)
        if field is None:
            return None
        return (f"mpiattn.torch.hf: the config has {field} (a state-space, linear-attention or "
                "convolution layer's setting) and no layer_types saying which layers attend; a "
                "layer that mixes the sequence without attention would see only this rank's "
                "rows; not supported")
    for layer, kind in enumerate(kinds):
        if kind in ATTENTION_LAYERS or kind in TOKENWISE_LAYERS:
            continue
        why = REFUSED_LAYERS.get(kind, "mixes the sequence without attention and would see only "
                                       "this rank's rows")
        return f"mpiattn.torch.hf: layer {layer} is a {kind!r} layer, which {why}; not supported"
    return None


def check(config: Any) -> None:
    """Raise :func:`refusal`'s reason, if any."""
    why = refusal(config)
    if why is not None:
        raise ValueError(why)


def checked_up_to(config: Any) -> int | None:
    """The layer index up to which the adapter's attention calls check a forward: its first
    attention layer (0 where the config lists no kinds), the first that calls the adapter;
    None (every call) for a refused model, whose first call, of whatever kind, then refuses."""
    if refusal(config) is not None:
        return None
    kinds = layer_kinds(config)
    if not kinds:
        return 0
    return next((i for i, k in enumerate(kinds) if k in ATTENTION_LAYERS), len(kinds))
