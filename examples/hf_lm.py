#!/usr/bin/env python
"""A Hugging Face transformers causal LM trained on one long context split over ranks, then sampled.

A small model of one of transformers' families (``--family``: Llama, Qwen 3,
Mistral, Gemma 2, gpt-oss) is built from its configuration (nothing is
downloaded: byte vocabulary, ``--hidden`` wide, ``--layers`` deep) and
trained with Adam on one context of ``--context`` bytes per step of the same
corpus as ``char_lm.py`` (the standard library's top-level ``.py`` files).

``--attention mpiattn`` (the default) registers ``attn_implementation="mpiattn"``
(:func:`mpiattn.torch.hf.register`, zigzag layout): every rank runs the whole
model on its rows of the context with their global ``position_ids``, attention
is exact over all rows, each rank adds its rows' cross-entropy divided by the
global count, and :func:`mpiattn.torch.reduce_gradients` sums the parameters'
gradients before every step. ``--attention eager`` is the same model, weights
and data on one process with transformers' own attention: the reference.

After training, ``--generate K`` decodes ``K`` bytes greedily after the last
context (:func:`mpiattn.torch.hf.generate`: the prompt sharded, the new tokens
against per-layer sharded key/value caches; the reference uses ``model.generate``).

Run (rank 0 writes the JSON history)::

    python examples/hf_lm.py --attention eager --history examples/lm/hf-eager.json
    mpiexec -n 2 python examples/hf_lm.py --history examples/lm/hf-P2.json
    mpiexec -n 4 python examples/hf_lm.py --history examples/lm/hf-P4.json

A pretrained model runs the same way on a machine that can fetch it:
``AutoModelForCausalLM.from_pretrained(name, attn_implementation=hf.register(comm))``.
"""

from __future__ import annotations

import argparse
import math
import resource
import time

import numpy as np
import torch
import torch.nn.functional as F
import transformers
from mpi4py import MPI

from char_lm import corpus, write_history

import mpiattn
import mpiattn.torch as mt
from mpiattn.torch import hf

FAMILIES = {"llama": "LlamaConfig", "qwen3": "Qwen3Config", "mistral": "MistralConfig",
            "gemma2": "Gemma2Config", "gpt_oss": "GptOssConfig"}


def config(family: str, hidden: int, layers: int, heads: int, context: int) -> object:
    """A small configuration of ``family`` for byte tokens (its own windows and softcaps kept)."""
    extra = {"gemma2": dict(sliding_window=256, query_pre_attn_scalar=hidden // heads),
             "gpt_oss": dict(sliding_window=256, num_local_experts=4, num_experts_per_tok=2),
             "mistral": dict(sliding_window=512),
             "qwen3": dict(use_sliding_window=True, sliding_window=256)}.get(family, {})
    return getattr(transformers, FAMILIES[family])(
        vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=max(heads // 2, 1), head_dim=hidden // heads,
        max_position_embeddings=2 * context, attention_dropout=0.0, **extra)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--attention", choices=("mpiattn", "eager"), default="mpiattn")
    ap.add_argument("--family", choices=sorted(FAMILIES), default="llama")
    ap.add_argument("--context", type=int, default=2048, help="bytes per step (default 2048)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--generate", type=int, default=32, help="bytes to decode after training")
    ap.add_argument("--history", help="JSON file for the per-step history (rank 0 writes it)")
    args = ap.parse_args()

    comm = MPI.COMM_WORLD
    P, rank = comm.Get_size(), comm.Get_rank()
    if args.attention == "eager" and P != 1:
        raise SystemExit("--attention eager is the single-process reference: run it without mpiexec")
    torch.set_num_threads(1)
    data, info = corpus()
    N, layout = args.context, "zigzag"
    cfg = config(args.family, args.hidden, args.layers, args.heads, N)
    name = hf.register(comm, layout=layout) if args.attention == "mpiattn" else "eager"
    torch.manual_seed(args.seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=name).train()
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    rows = mpiattn.partition(N, comm, layout=layout)  # this rank's global positions
    history = []
    for step in range(args.steps):
        offset = int(np.random.default_rng([args.seed, step]).integers(0, data.size - N - 1))
        x = torch.from_numpy(data[offset + rows].astype(np.int64))[None]
        y = torch.from_numpy(data[offset + rows + 1].astype(np.int64))
        comm.Barrier()
        t0 = time.perf_counter()
        logits = model(x, position_ids=torch.from_numpy(rows)[None], use_cache=False).logits[0]
        loss = F.cross_entropy(logits.float(), y, reduction="sum") / N  # this rank's part
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if name != "eager":
            mt.reduce_gradients(model, comm)
        opt.step()
        comm.Barrier()
        seconds = time.perf_counter() - t0
        total = comm.allreduce(loss.item())
        history.append({"step": step, "loss": total, "seconds": seconds})
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss {total:.6f}  {seconds:.2f} s", flush=True)
    peak = comm.gather(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    model.eval()
    prompt = torch.from_numpy(data[:N].astype(np.int64))[None]
    if name == "eager":
        new = model.generate(prompt, max_new_tokens=args.generate, do_sample=False)[:, N:]
    else:
        new = hf.generate(model, prompt, args.generate, comm=comm, layout=layout)
    if rank == 0:
        times = [h["seconds"] for h in history[1:]] or [history[0]["seconds"]]
        text = bytes(new[0].tolist()).decode("latin-1")
        summary = {"attention": args.attention, "family": args.family, "ranks": P, "context": N,
                   "steps": args.steps, "hidden": args.hidden, "layers": args.layers,
                   "heads": args.heads, "seed": args.seed, "torch": torch.__version__,
                   "transformers": transformers.__version__, "corpus": info,
                   "median_seconds_per_step": float(np.median(times)),
                   "peak_rss_mib_per_rank": peak, "generated": text, "history": history}
        print(f"done: {args.attention} {args.family} P={P}: loss {history[0]['loss']:.4f} -> "
              f"{history[-1]['loss']:.4f} ({history[-1]['loss'] / math.log(2):.3f} bits/byte), "
              f"median {summary['median_seconds_per_step']:.2f} s/step; generated {text!r}")
        write_history(args.history, summary)


if __name__ == "__main__":
    main()
