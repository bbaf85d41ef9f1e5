"""What :func:`mpiattn.torch.hf.generate` checks before it runs a model, and after its prompt.

Each rank checks its own arguments (:func:`prompt`: the model registered with
this comm and layout, its layer kinds runnable on shards, the prompt's dtype,
shape and token ids, long enough to give every rank rows) and sums up what the
ranks must agree on (the prompt's shape, the CRC-32 of its tokens,
``max_new_tokens``); ``generate`` gathers both with
:meth:`mpiattn.comm.Comm.allgather_checked` and :func:`agree_prompt` compares
them, so every rank raises the same error, before the model runs. After the
prompt's forward :func:`attended` refuses a model none of whose layers called
the adapter's attention (it has none: RWKV, xLSTM), which would have mixed the
sequence on each rank's rows alone.
"""

from __future__ import annotations

import zlib
from typing import Any

import torch

from ..comm import errors
from ..layouts import describe_key, layout_key, local_lengths
from . import hf_layers

__all__ = ["prompt", "agree_prompt", "attended", "check_tokens", "same_comm", "text_config"]


def same_comm(a: Any, b: Any) -> bool:
    """Whether two communicators (None: ``COMM_WORLD``) hold the same ranks in the same order."""
    from mpi4py import MPI

    a, b = (MPI.COMM_WORLD if x is None else getattr(x, "mpi", x) for x in (a, b))
    return MPI.Comm.Compare(a, b) in (MPI.IDENT, MPI.CONGRUENT)


def check_tokens(model: Any, ids: torch.Tensor) -> None:
    """Raise for the first token id outside the model's input embedding (its vocabulary)."""
    vocab = int(model.get_input_embeddings().num_embeddings)
    bad = ((ids < 0) | (ids >= vocab)).nonzero()
    if len(bad):
        b, i = (int(x) for x in bad[0])
        raise ValueError(f"mpiattn.torch.hf.generate: token id {int(ids[b, i])} at input_ids[{b}, "
                         f"{i}] is not in the model's vocabulary of {vocab} (ids 0 to {vocab - 1})")


def prompt(model: Any, input_ids: Any, max_new_tokens: Any, comm: Any, layout: Any, size: int,
           reg: dict | None) -> dict:
    """This rank's checks of a :func:`~mpiattn.torch.hf.generate` call (local), and what the ranks
    must agree on; ``reg``: what ``register`` gave the model's attention (None: not registered)."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if reg is None:
        name = getattr(getattr(model, "config", None), "_attn_implementation", None)
        raise ValueError(f"mpiattn.torch.hf.generate: the model's attn_implementation ({name!r}) "
                         "is not one made by mpiattn.torch.hf.register(): every rank would attend "
                         "its own rows only")
    mine, theirs = layout_key(layout), layout_key(reg["layout"])
    if mine != theirs:
        raise ValueError(f"mpiattn.torch.hf.generate: layout {describe_key(mine)}, but the model's "
                         f"attention was registered with {describe_key(theirs)} (leave it out)")
    if not same_comm(comm, reg["comm"]):
        raise ValueError("mpiattn.torch.hf.generate: comm is not the one the model's attention was "
                         "registered with (leave it out)")
    hf_layers.check(text_config(model.config))
    if not isinstance(input_ids, torch.Tensor) or input_ids.dtype not in (torch.int64, torch.int32):
        raise TypeError("mpiattn.torch.hf.generate: input_ids must be token ids, a torch.Tensor of "
                        f"int64 or int32, not {getattr(input_ids, 'dtype', type(input_ids))}")
    if input_ids.dim() != 2:
        raise ValueError("mpiattn.torch.hf.generate takes input_ids of shape (B, N), B prompts of "
                         "N tokens, the whole of them on every rank (one prompt: input_ids[None]); "
                         f"got {tuple(input_ids.shape)}")
    N, shares = input_ids.shape[1], local_lengths(input_ids.shape[1], size, layout)
    if min(shares) < 1:
        raise ValueError(f"mpiattn.torch.hf.generate: prompts of {N} tokens leave rank "
                         f"{shares.index(0)} no rows under the {describe_key(layout_key(layout))} "
                         f"layout over {size} ranks: every rank needs some (longer prompts, or "
                         "fewer ranks)")
    if not len(input_ids):
        raise ValueError("mpiattn.torch.hf.generate: no prompts (input_ids of shape (0, N))")
    ids = input_ids.detach().to("cpu").contiguous()
    check_tokens(model, ids)
    return {"shape": tuple(ids.shape), "crc": zlib.crc32(ids.to(torch.int64).numpy().tobytes()),
            "new": max_new_tokens}


def text_config(config: Any) -> Any:
    """The config of a model's decoder (a multimodal model's text config), else ``config``."""
    try:
        return config.get_text_config(decoder=True)
    except (AttributeError, TypeError, ValueError):
        return config


def attended(gen: Any) -> None:
    """Raise where no layer of the prompt's forward attended through the adapter."""
    if not gen.caches:
        raise ValueError("mpiattn.torch.hf.generate: no layer of the model called its attention "
                         "(a model without attention layers: RWKV, xLSTM, ...); its layers mix "
                         "the sequence some other way and would see only this rank's rows, and "
                         "each new token alone; not supported")


def agree_prompt(got: list) -> None:
    """Raise (every rank alike) unless every rank passed the same prompt and token count."""
    with errors.alike():
        errors.same_everywhere([g["shape"] for g in got], "generate's prompt shape (B, N)")
        errors.same_everywhere([g["crc"] for g in got], "generate's prompt (the CRC-32 of its "
                               "tokens; every rank passes the whole prompt, the same tokens)",
                               show=lambda crc: f"{crc:#010x}")
        errors.same_everywhere([g["new"] for g in got], "generate's max_new_tokens")
