"""Hugging Face ``transformers`` models on sequence shards: ``attn_implementation="mpiattn"``.

Optional (``pip install "mpiattn[hf]"``): neither ``import mpiattn`` nor
``import mpiattn.torch`` imports ``transformers``; this module does.
:func:`register` adds an attention function (and a mask function) to
transformers' registries under one name; a model made with that name as its
``attn_implementation`` runs every attention layer through
:func:`mpiattn.torch.attention` on this rank's rows of the sequence, exactly.

Each rank passes its rows and their global positions::

    ids_r = mt.shard(input_ids, dim=1)                       # (B, n_r): this rank's tokens
    pos_r = mt.shard(torch.arange(N)[None], dim=1)           # their global positions
    logits_r = model(ids_r, position_ids=pos_r).logits       # (B, n_r, vocab): its rows

What a model passes to its attention function is honoured: causal masking
(``module.is_causal``) by global positions, a layer's ``sliding_window``
(transformers' ``kv > q - W`` is mpiattn's ``window=(W - 1, 0)``), ``softcap``
(Gemma 2), ``s_aux`` (gpt-oss's learnable sinks, with their gradient), GQA
(key/value heads are not repeated) and ``scaling``. A 2-D ``attention_mask``
``(B, n_r)`` (1 = token, 0 = padding) of this rank's rows becomes the keys'
padding. No dense mask is built: the mask function returns that padding, or
None.

Refused, with one error on every rank: ``position_ids`` that are not this
rank's global positions under the layout (the model would apply RoPE at local
positions), attention dropout while training, a 4-D ``attention_mask``,
keys that are not this rank's rows (a transformers cache: generate with
:func:`generate` instead), and any model with a layer of another kind than
full or sliding attention (:mod:`mpiattn.torch.hf_layers`, from the config's
``layer_types``): attention whose mask transformers builds itself and this
adapter does not read (:data:`REFUSED_LAYERS`: Llama 4's ``chunked_attention``,
...), and hybrids whose Mamba, linear-attention or convolution layers mix the
sequence without attention and would see only this rank's rows (Qwen3-Next,
Jamba, Nemotron-H, LFM2, ...). A forward is checked at its first attention
layer, the first that calls the adapter (a refused model: at every call), so a
refusal comes before the forward returns anything. A model without any
attention layer (Mamba, RWKV) never calls the adapter: only :func:`generate`
refuses it.

Llama 4's full-attention layers run; its layers are not handed ``position_ids``,
which the adapter then cannot check (:data:`UNCHECKED_POSITIONS`: pass them all
the same), and its NoPE layers scale their queries by local positions, which
the adapter makes global, exactly, up to ``floor_scale - 1`` rows per rank
(:mod:`mpiattn.torch.hf_llama4`).

Generation (:func:`generate`, greedy): the prompt (the whole of it on every
rank, checked) runs sharded and every layer keeps its rows' keys and values in
a :class:`mpiattn.inference.KVCache`
(:class:`Generation`, passed down as the model's ``mpiattn_cache=`` keyword);
each new token then runs on every rank alike, its keys and values appended to
the sharded caches and its queries attending them (``KVCache.attend``: causal,
the window, softcap and sinks as in the prompt).

Training: divide the loss on each rank's rows by the global token count, call
``backward()`` on every rank, then :func:`mpiattn.torch.reduce_gradients` gives
every parameter (the sinks and tied embeddings included) the single-process
gradient. transformers' own ``labels=`` loss shifts the labels inside each
shard and averages locally: shift the labels globally before sharding and pass
``shift_labels=`` with ``num_items_in_batch=`` (the global count), or compute
the loss by hand. Rotary embeddings that choose their frequencies from the
largest position seen (dynamic NTK, LongRoPE) see only this rank's positions.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from ..layouts import all_segments, local_lengths, positions
from ..masks.score import NAMES, Score
from . import hf_checks, hf_layers, hf_llama4
from .functions import attention
from .ops import compiled_attention
from .hf_layers import REFUSED_LAYERS

__all__ = ["register", "NAME", "REFUSED_LAYERS", "UNCHECKED_POSITIONS", "KeyPadding",
           "Generation", "generate"]

#: The default name of the attention implementation.
NAME = "mpiattn"

#: Models (a config's ``model_type``) whose decoder layers do not hand ``position_ids`` on to
#: attention: the adapter cannot check them, and runs on the caller's word.
UNCHECKED_POSITIONS = {"llama4_text": "Llama 4"}


class KeyPadding:
    """What the mask function hands the attention layers: this rank's keys' padding.

    Attributes
    ----------
    pad : torch.Tensor, bool, shape (B, n_r)
        True marks padding (transformers' ``attention_mask == 0``).
    """

    def __init__(self, pad: torch.Tensor) -> None:
        self.pad = pad


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise ImportError("mpiattn.torch.hf needs Hugging Face transformers: "
                          'pip install "mpiattn[hf]"') from exc
    return transformers


def register(comm: Any = None, *, name: str = NAME, layout: Any = "contiguous",
             **options: Any) -> str:
    """Make ``attn_implementation=name`` run attention through mpiattn on ``comm``'s shards.

    Parameters
    ----------
    comm : mpi4py.MPI.Intracomm, optional
        The ranks that share each sequence (default ``MPI.COMM_WORLD``).
    name : str
        The implementation's name in transformers' registries (default ``"mpiattn"``).
    layout : str or mpiattn.Layout
        How the sequence is sharded (the layout given to :func:`mpiattn.torch.shard`).
    **options
        More :class:`mpiattn.Options` fields for every call (``strategy``, ``engine``,
        ``block_size``, ...); not ``causal``, ``window`` or ``scale``, which each layer passes,
        nor a score modifier (a :class:`mpiattn.Score` field: each layer passes its own, e.g.
        Gemma 2's softcap, gpt-oss's sinks).

    Returns
    -------
    str
        ``name``, for ``from_config(..., attn_implementation=name)``.

    Notes
    -----
    transformers keeps its registries process-wide: registering again under a name
    replaces that name's functions.
    """
    from ..strategies import Options

    taken = {"causal", "window", "scale", "layout", "score", *NAMES} & set(options)
    if taken:
        raise TypeError(f"register() takes no {', '.join(sorted(taken))}: each layer passes them "
                        "(the layout is register's own keyword)")
    Options.of(**options)  # an unknown field raises here
    tf = _transformers()
    from transformers.masking_utils import AttentionMaskInterface

    tf.AttentionInterface.register(name, partial(_attention, comm=comm, layout=layout,
                                                 options=dict(options)))
    AttentionMaskInterface.register(name, _mask)
    return name


def _mask(batch_size: int, q_length: int, kv_length: int, *args: Any,
          attention_mask: Any = None, **kwargs: Any) -> KeyPadding | None:
    """transformers' mask function: the padding of this rank's keys, or None (no dense mask).
    Kept when it pads nothing: whether a call has padding is agreed by every rank."""
    if attention_mask is None:
        return None
    return KeyPadding(~attention_mask.to(torch.bool))


def _agreed(comm: Any) -> Any:
    from ..comm import get_comm

    return get_comm(comm)


def _facts(config: Any) -> tuple:
    """What the checks read of a model's config: ``(refusal, model_type, NoPE tuning)`` (plain
    values: a compiled call's operator holds them, :mod:`mpiattn.torch.ops`)."""
    return (hf_layers.refusal(config), getattr(config, "model_type", None), hf_llama4.tuning(config))


def _check_positions(model: str | None, position_ids: Any, want: torch.Tensor) -> None:
    """Raise unless the layer was handed this rank's global positions ``want`` (or none, by a
    model (``model_type``) of :data:`UNCHECKED_POSITIONS`)."""
    if position_ids is None:
        if model in UNCHECKED_POSITIONS:
            return
        raise ValueError(f"mpiattn.torch.hf: the model ({model}) does not hand position_ids on to "
                         "its attention layers, so the adapter cannot check that it placed this "
                         "rank's rows at their global positions; not supported")
    got = position_ids.detach().to("cpu").reshape(-1, len(want))
    if not bool((got == want).all()):
        raise ValueError("mpiattn.torch.hf: position_ids must be this rank's global positions "
                         "(position_ids=mpiattn.torch.shard(torch.arange(N)[None], dim=1)); "
                         "without them the model applies its positions locally")


def _check_rows(c: Any, facts: tuple, layout: Any, dropout: float, mask_shape: tuple | None,
                query: torch.Tensor, key: torch.Tensor, position_ids: Any) -> None:
    """The checks of a forward (its first attention layer), decided on every rank alike
    (``facts``: :func:`_facts` of the config; ``mask_shape``: the shape of an attention mask
    other than the 2-D one it takes, else None)."""
    n = int(query.shape[2])
    refusal, model, tuned = facts

    def local() -> int:
        if refusal is not None:
            raise ValueError(refusal)
        if dropout:
            raise ValueError(f"mpiattn.torch.hf: attention dropout {dropout} is not supported "
                             "(set the config's attention_dropout to 0, or call model.eval())")
        if mask_shape is not None:
            raise ValueError("mpiattn.torch.hf takes a 2-D attention_mask (B, n_r) of this rank's "
                             f"tokens, not a {mask_shape} one")
        if int(key.shape[2]) != n:
            raise ValueError(f"mpiattn.torch.hf: {key.shape[2]} keys beside {n} queries on this "
                             "rank: a transformers cache (generation) is not sharded; pass "
                             "use_cache=False, and decode with mpiattn.inference.KVCache")
        return n

    sizes = c.allgather_checked(local, call="mpiattn.torch.hf")

    def rows() -> None:
        N = sum(sizes)
        if list(sizes) != list(local_lengths(N, c.size, layout)):
            raise ValueError(f"mpiattn.torch.hf: the ranks hold {sizes} rows, not the {layout!r} "
                             f"layout's shares of {N}: shard with mpiattn.torch.shard(..., layout=)")
        want = _global_rows(c, N, layout)
        _check_positions(model, position_ids, want)
        hf_llama4.check_tuned(tuned, want)

    c.allgather_checked(rows, call="mpiattn.torch.hf")


def _global_rows(c: Any, N: int, layout: Any) -> torch.Tensor:
    """This rank's global positions of a sequence of ``N`` rows."""
    return torch.as_tensor(positions(all_segments(N, c.size, layout)[c.rank]))


class Generation:
    """The sharded key/value caches of a model's layers while it generates (see :func:`generate`).

    Parameters
    ----------
    comm : mpi4py.MPI.Intracomm, optional
    layout : str or mpiattn.Layout
        The prompt's layout (as registered).

    Attributes
    ----------
    caches : dict of int to mpiattn.inference.KVCache
        Per layer index, filled by the prompt's forward.
    plans : dict of int to mpiattn.inference.decode.DecodePlan
        Per layer index, the decode steps' plan (made at the first new token; the layer's
        settings and sinks do not change while the model generates).
    decoding : bool
        False while the prompt runs (sharded); True for the new tokens (the same on every rank).
    positions : torch.Tensor or None
        The global positions of the rows being run (this rank's of the prompt, then the new
        token's), where the model does not hand its layers ``position_ids``.
    """

    def __init__(self, comm: Any = None, layout: Any = "contiguous") -> None:
        self.comm, self.layout = comm, layout
        self.caches: dict = {}
        self.plans: dict = {}
        self.decoding = False
        self.positions: torch.Tensor | None = None

    def keep(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """The prompt's rows of one layer (collective)."""
        from ..inference import KVCache
        from .tensors import to_array

        self.plans.pop(layer, None)  # (a plan attends the cache it was made on)
        self.caches[layer] = KVCache.from_shards(to_array(key.detach().contiguous().clone()),
                                                 to_array(value.detach().contiguous().clone()),
                                                 self.comm, layout=self.layout)

    def step(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             score: Any, **settings: Any) -> torch.Tensor:
        """One new token of one layer (collective): append its keys and values, attend the cache
        with the layer's ``score`` (a :class:`mpiattn.Score`, its tensors made arrays here) and
        ``settings`` (``causal``, ``window``, ``scale``); ``(B, H, t, E)`` on every rank alike."""
        from .tensors import to_array, to_tensor

        cache = self.caches[layer]
        cache.append(to_array(key.detach().contiguous()), to_array(value.detach().contiguous()))
        q = to_array(query.detach().contiguous())
        plan = self.plans.get(layer)
        if plan is None or plan.shape != tuple(q.shape) or plan.dtype != q.dtype:
            host = score.map_arrays(lambda name, x: to_array(x.detach().to(torch.float64).contiguous())
                                    if isinstance(x, torch.Tensor) else x)
            plan = self.plans[layer] = cache.plan_attend(q, score=host, **settings)
        out, _ = plan(q)
        return to_tensor(out)


def _attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: Any, *, comm: Any, layout: Any, options: dict,
               dropout: float = 0.0, scaling: float | None = None,
               sliding_window: int | None = None, softcap: float | None = None,
               s_aux: Any = None, position_ids: Any = None, mpiattn_cache: Generation | None = None,
               **kwargs: Any) -> tuple:
    """transformers' attention function: ``(out (B, n_r, H, E), None)`` for this rank's rows."""
    window = None if sliding_window is None else (int(sliding_window) - 1, 0)
    causal = bool(getattr(module, "is_causal", True))
    layer = getattr(module, "layer_idx", None)
    config = getattr(module, "config", None)
    up_to = hf_layers.checked_up_to(config)
    first = layer is None or up_to is None or layer <= up_to  # (its first attention layer)
    mask_shape = None if attention_mask is None or isinstance(attention_mask, KeyPadding) else \
        tuple(getattr(attention_mask, "shape", ()))
    pad = attention_mask.pad if isinstance(attention_mask, KeyPadding) else None
    if torch.compiler.is_compiling():  # the checks inside the operator, with the positions
        check = (_check_rows, (_facts(config), layout, dropout, mask_shape)) if first else None
        out = compiled_attention(query.contiguous(), key.contiguous(), value.contiguous(), comm,
                                 {"sinks": s_aux, "key_padding_mask": pad},
                                 dict(options, causal=causal, window=window, scale=scaling,
                                      softcap=softcap, layout=layout), False,
                                 ("a Llama 4 NoPE layer",) if hf_llama4.rescales(module) else (),
                                 check, position_ids)
        return out.transpose(1, 2).contiguous(), None
    score = Score.of(softcap=softcap, sinks=s_aux)  # transformers' keywords, as one score
    if mpiattn_cache is not None and mpiattn_cache.decoding:
        query = hf_llama4.retuned(module, query, mpiattn_cache.positions)
        out = mpiattn_cache.step(layer, query, key, value, score, causal=causal, window=window,
                                 scale=scaling)
        return out.transpose(1, 2).contiguous(), None
    if first:
        _check_rows(_agreed(comm), _facts(config), layout, dropout, mask_shape, query, key,
                    position_ids)
    query = hf_llama4.retuned(module, query, partial(_rows, query, position_ids, mpiattn_cache,
                                                     comm, layout))
    out = attention(query.contiguous(), key.contiguous(), value.contiguous(), comm=comm,
                    causal=causal, window=window, scale=scaling, score=score,
                    key_padding_mask=pad, layout=layout, **options)
    if mpiattn_cache is not None:
        mpiattn_cache.keep(layer, key, value)
    return out.transpose(1, 2).contiguous(), None


def _rows(query: torch.Tensor, position_ids: Any, gen: Generation | None, comm: Any,
          layout: Any) -> torch.Tensor:
    """The global positions of a forward's rows on this rank (checked by its first attention
    layer); collective where neither the model nor :func:`generate` hands them."""
    if gen is not None and gen.positions is not None:
        return gen.positions
    n = int(query.shape[2])
    if position_ids is not None:
        return position_ids.detach().reshape(-1, n)[0]
    c = _agreed(comm)
    return _global_rows(c, sum(c.allgather_obj(n)), layout)


def _registration(model: Any) -> dict | None:
    """What :func:`register` gave the model's attention (``comm``, ``layout``), or None."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = getattr(getattr(model, "config", None), "_attn_implementation", None)
    fn = ALL_ATTENTION_FUNCTIONS.get(name) if isinstance(name, str) else None
    return dict(fn.keywords) if isinstance(fn, partial) and fn.func is _attention else None


@torch.no_grad()
def generate(model: Any, input_ids: torch.Tensor, max_new_tokens: int, *, comm: Any = None,
             layout: Any = None) -> torch.Tensor:
    """Greedy decoding of a model registered with :func:`register`, its prompt sharded (collective).

    Parameters
    ----------
    model : transformers.PreTrainedModel
        A causal LM made with ``attn_implementation=register(comm, layout=layout)``.
    input_ids : torch.Tensor, shape (B, N), int64 or int32
        The whole prompt, the same on every rank (each runs its rows of it; checked, by its
        CRC-32), long enough to give every rank rows under the layout, its ids in the vocabulary.
    max_new_tokens : int
        At least 1, the same on every rank.
    comm, layout
        As registered (default: the registered ones; others are refused).

    Returns
    -------
    torch.Tensor, shape (B, max_new_tokens), int64
        The new tokens, the same on every rank (what single-process greedy decoding gives).

    Raises
    ------
    ValueError, TypeError
        On every rank alike, before the model runs: a prompt not as above, a model not
        registered, another comm or layout, ``max_new_tokens`` below 1 or not the same everywhere,
        a layer kind the adapter cannot run (:mod:`mpiattn.torch.hf_layers`); after the prompt's
        forward, before any token: a model none of whose layers attended through the adapter.
    """
    from .collectives import shard

    reg = _registration(model) or {}
    comm = reg.get("comm") if comm is None else comm
    layout = reg.get("layout", "contiguous") if layout is None else layout
    c = _agreed(comm)
    hf_checks.agree_prompt(c.allgather_checked(
        partial(hf_checks.prompt, model, input_ids, max_new_tokens, comm, layout, c.size,
                _registration(model)), call="mpiattn.torch.hf.generate"))
    B, N = input_ids.shape
    gen = Generation(comm, layout)
    here = positions(all_segments(N, c.size, layout)[c.rank])
    gen.positions = torch.as_tensor(here)
    pos = shard(torch.arange(N, device=input_ids.device)[None].expand(B, N), comm=comm, dim=1,
                layout=layout)
    logits = model(shard(input_ids, comm=comm, dim=1, layout=layout), position_ids=pos,
                   use_cache=False, mpiattn_cache=gen).logits
    c.allgather_checked(partial(hf_checks.attended, gen), call="mpiattn.torch.hf.generate")
    owner = next(r for r, seg in enumerate(all_segments(N, c.size, layout))
                 if (N - 1) in positions(seg))
    last = logits[:, int((here == N - 1).argmax())] if c.rank == owner else None
    token = c.bcast_obj(None if last is None else last.argmax(-1).cpu(), root=owner)
    gen.decoding = True
    new = [token]
    for t in range(1, max_new_tokens):
        gen.positions = torch.tensor([N + t - 1])
        step = torch.full((B, 1), N + t - 1, dtype=torch.long, device=input_ids.device)
        logits = model(token[:, None].to(input_ids.device), position_ids=step, use_cache=False,
                       mpiattn_cache=gen).logits
        token = logits[:, -1].argmax(-1).cpu()
        new.append(token)
    return torch.stack(new, dim=1)
