"""A layer's file: its configuration as root attributes, its parameters as datasets.

:class:`mpiattn.MultiheadAttention`'s :meth:`~mpiattn.MultiheadAttention.save` and
:meth:`~mpiattn.MultiheadAttention.load`, through :mod:`mpiattn.io.checkpoint` (rank 0
writes, atomically; every rank reads). The file's root attributes are ``format``
(:data:`FORMAT`), ``format_version`` (:data:`FORMAT_VERSION`), ``embed_dim``, ``num_heads``,
``num_kv_heads``, ``kdim``, ``vdim``, ``bias``, ``dtype``, ``seed``; one dataset per parameter
under group ``params``. A file that lacks an attribute or holds a parameter of another shape
or dtype is refused on every rank.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from .. import backend
from ..comm.core import get_comm
from ..io.checkpoint import load_params, save_params

__all__ = ["FORMAT", "FORMAT_VERSION", "save", "load"]

#: The ``format`` attribute of a layer's file.
FORMAT = "mpiattn.MultiheadAttention"
#: The ``format_version`` attribute of a layer's file.
FORMAT_VERSION = 1


def save(layer: Any, path: str | os.PathLike, comm: Any = None) -> None:
    """Write ``layer``'s configuration and parameters (collective; see the module docstring)."""
    attrs = dict(format=FORMAT, format_version=FORMAT_VERSION, embed_dim=layer.embed_dim,
                 num_heads=layer.num_heads, num_kv_heads=layer.num_kv_heads, kdim=layer.kdim,
                 vdim=layer.vdim, bias=layer.bias, dtype=layer.dtype.name, seed=layer.seed)
    params = {name: backend.to_host(value) for name, value in layer.params.items()}
    save_params(path, params, attrs, comm)


def load(cls: type, path: str | os.PathLike, comm: Any = None) -> Any:
    """A layer of class ``cls`` read from a file :func:`save` wrote (collective; every rank
    reads it; the same error on every rank for a file that is not one)."""
    c = get_comm(comm)
    attrs, params = load_params(path, FORMAT, FORMAT_VERSION, c)
    layer = None
    with c.collective_errors():
        layer = _from_checkpoint(cls, os.fspath(path), attrs, params)
    return layer


def _from_checkpoint(cls: type, path: str, a: dict, params: dict) -> Any:
    """A layer of class ``cls`` made from a file's root attributes ``a`` and ``params`` (local:
    inside the caller's agreement)."""
    try:
        layer = cls(int(a["embed_dim"]), int(a["num_heads"]), num_kv_heads=int(a["num_kv_heads"]),
                    kdim=int(a["kdim"]), vdim=int(a["vdim"]), bias=bool(a["bias"]),
                    dtype=np.dtype(str(a["dtype"])), seed=int(a["seed"]))
    except KeyError as exc:
        raise ValueError(f"{path!r} lacks {exc} of a saved MultiheadAttention") from exc
    want = layer.param_shapes()
    if set(params) != set(want):
        raise ValueError(f"{path!r}: parameters {sorted(params)} do not match the expected {sorted(want)}")
    for name, shape in want.items():
        x = params[name]
        if tuple(x.shape) != shape or np.dtype(x.dtype) != layer.dtype:
            raise ValueError(f"{path!r}: parameter {name!r} has shape {tuple(x.shape)} and dtype "
                             f"{x.dtype}; expected {shape} and {layer.dtype}")
        layer.params[name] = x
    return layer
