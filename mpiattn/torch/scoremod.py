"""A ``score_mod`` written with torch ops, differentiated by autograd, tile by tile.

:func:`mpiattn.torch.attention` takes ``score_mod(score, b, h, q_idx, kv_idx)`` written with
torch ops (FlexAttention's convention). :class:`TorchScoreMod` makes it the kernels' score
transform (:mod:`mpiattn.masks.scoremod`): on each score tile, the tile and its global indices
become tensors on the tile's memory (no copy), the function gives the values, and in the
backward autograd gives both ``dS * dy/dx`` (a vector-Jacobian product, never an ``N x M``
array) and the gradients of the tensors the function captures that require grad (a
relative-position bias table, a per-head temperature), summed over this rank's tiles: this
rank's part, which :func:`mpiattn.torch.reduce_gradients` sums over the ranks like every
replicated parameter's.

Which tensors: those the function holds in its closure, its default arguments or the global
names it reads (:func:`captured`). A tensor reached through an object (``self.bias`` inside the function)
is not found: bind it to a local name first (``bias = self.bias``), as in the examples.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch

from .tensors import to_tensor

__all__ = ["TorchScoreMod", "captured"]


def captured(fn: Callable) -> tuple[torch.Tensor, ...]:
    """The tensors that require grad among ``fn``'s closure cells, default arguments and the
    global names it reads (and in tuples, lists or dicts there), in a fixed order, each once."""
    found: list[torch.Tensor] = []

    def visit(x: Any, depth: int = 0) -> None:
        if isinstance(x, torch.Tensor):
            if x.requires_grad and not any(x is y for y in found):
                found.append(x)
        elif depth < 3 and isinstance(x, (tuple, list)):
            for y in x:
                visit(y, depth + 1)
        elif depth < 3 and isinstance(x, dict):
            for key in sorted(x, key=repr):
                visit(x[key], depth + 1)

    cells = getattr(fn, "__closure__", None) or ()
    for cell in cells:
        try:
            visit(cell.cell_contents)
        except ValueError:  # an empty cell
            pass
    visit(tuple(getattr(fn, "__defaults__", None) or ()))
    code, names = getattr(fn, "__code__", None), getattr(fn, "__globals__", {})
    for name in (() if code is None else code.co_names):  # the globals it reads by name
        if name in names:
            visit(names[name])
    return tuple(found)


def _index(a: Any) -> torch.Tensor:
    return torch.as_tensor(np.ascontiguousarray(a)) if isinstance(a, np.ndarray) else to_tensor(a)


class TorchScoreMod:
    """The kernels' transform for a torch ``score_mod`` (the module docstring).

    Parameters
    ----------
    fn : callable
        ``fn(score, b, h, q_idx, kv_idx) -> score`` with torch ops, elementwise on broadcasting
        tensors (``score`` float32, or float64 for float64 inputs; the indices int64).
    params : tuple of torch.Tensor
        The tensors it captures whose gradients are wanted (:func:`captured`).
    """

    #: Its backward needs no derivative from the caller: autograd gives it.
    differentiable = True

    def __init__(self, fn: Callable, params: tuple = ()):
        self.fn, self.params = fn, tuple(params)
        self._grads: list | None = None

    def start_backward(self) -> None:
        """Forget the captured tensors' gradients of an earlier backward (local)."""
        self._grads = [None] * len(self.params)

    def gradients(self) -> list:
        """This rank's part of each captured tensor's gradient, summed over the backward's
        tiles (None where no tile reached it)."""
        return list(self._grads or [None] * len(self.params))

    def _values(self, S: Any, at: Any) -> torch.Tensor:
        x = to_tensor(S)
        with torch.no_grad():
            y = self.fn(x, *(_index(a) for a in at.arrays()))
        return x, y

    def forward_(self, S: Any, at: Any) -> Any:
        """``S <- fn(S)`` in place; returns ``S``."""
        x, y = self._values(S, at)
        x.copy_(y)
        return S

    def saving_(self, S: Any, out: Any, at: Any) -> Any:
        """``out <- fn(S)``; ``S`` keeps the raw scores; returns ``out``."""
        _, y = self._values(S, at)
        to_tensor(out).copy_(y)
        return out

    def chain_(self, dS: Any, saved: Any, at: Any) -> Any:
        """``dS <- dS * dy/dx`` in place (autograd's vector-Jacobian product on the tile), and the
        captured tensors' gradients added up; returns ``dS``."""
        g = to_tensor(dS)
        x = to_tensor(saved).detach().requires_grad_(True)
        with torch.enable_grad():
            y = torch.broadcast_to(self.fn(x, *(_index(a) for a in at.arrays())), x.shape)
            got = torch.autograd.grad(y, (x, *self.params), grad_outputs=g.to(y.dtype),
                                      allow_unused=True)
        if got[0] is None:
            g.zero_()
        else:
            g.copy_(got[0])
        if self._grads is None:
            self.start_backward()
        for i, d in enumerate(got[1:]):
            if d is not None:
                self._grads[i] = d if self._grads[i] is None else self._grads[i] + d
        return dS

    def __repr__(self) -> str:
        return f"TorchScoreMod({getattr(self.fn, '__qualname__', self.fn)!r}, {len(self.params)} tensor(s))"
