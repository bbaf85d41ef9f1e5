"""Between replicated and sequence-sharded tensors, and the one reduction of parameter gradients.

``shard`` and ``gather`` are differentiable:

* ``shard(x)`` takes this rank's rows of a tensor that every rank holds whole
  (replicated); its backward scatters the rows' gradient into the whole shape
  and sums it over ranks, which is the gradient of the replicated input.
* ``gather(y)`` puts every rank's rows together on every rank; its backward
  keeps this rank's rows of the (replicated) gradient.

So ``gather(f(shard(x)))`` is, on every rank, the single-process function
``f`` of ``x`` with its single-process gradient: what the tests hand to
``torch.autograd.gradcheck``.

``reduce_gradients`` is the step a sequence-sharded model needs before its
optimizer: every parameter is replicated, but each rank's autograd saw only
its rows, so each rank's ``.grad`` is a partial sum. One call sums them over
the ranks that share a sequence (bitwise the same on every rank); with data
parallelism, a second call on the communicator across replicas averages them
(``average=True``).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch.autograd.function import once_differentiable

from ..comm import errors
from ..comm.core import Comm, get_comm
from ..comm.device import prepare
from ..sharding import gather as np_gather
from ..sharding import partition
from .tensors import check_operands, on_device, to_array, to_tensor

__all__ = ["shard", "gather", "reduce_gradients"]


def _rows(c: Comm, n: int, layout: Any, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(partition(n, c, layout)).to(device)


class _Shard(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, c: Comm, dim: int, layout: Any) -> torch.Tensor:
        rows = _rows(c, x.shape[dim], layout, x.device)
        ctx.c, ctx.dim, ctx.rows, ctx.shape = c, dim, rows, x.shape
        return x.index_select(dim, rows).contiguous()

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, g: torch.Tensor) -> tuple:
        whole = torch.zeros(ctx.shape, dtype=torch.float64 if g.dtype == torch.float64
                            else torch.float32, device=g.device)
        whole.index_copy_(ctx.dim, ctx.rows, g.to(whole.dtype))
        with on_device(whole.device):
            arr = to_array(whole)
            prepare(ctx.c, arr)
            ctx.c.allreduce_(arr)
        return whole.to(g.dtype), None, None, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, c: Comm, dim: int, layout: Any) -> torch.Tensor:
        with on_device(y.device):
            whole = to_tensor(np_gather(to_array(y), c, axis=dim, layout=layout, root=None))
        ctx.dim, ctx.rows = dim, _rows(c, whole.shape[dim], layout, y.device)
        return whole

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, g: torch.Tensor) -> tuple:
        return g.index_select(ctx.dim, ctx.rows).contiguous(), None, None, None


def _dim(x: torch.Tensor, dim: int) -> int:
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim {dim} is out of range for a {x.dim()}-D tensor")
    return dim % x.dim()


def shard(x: torch.Tensor, *, comm: Any = None, dim: int = -2,
          layout: Any = "contiguous") -> torch.Tensor:
    """This rank's rows of ``x``, a tensor every rank holds whole; differentiable.

    Parameters
    ----------
    x : torch.Tensor
        The same on every rank (not checked: it is the caller's replicated
        tensor).
    comm : mpi4py.MPI.Intracomm, optional
    dim : int
        The sequence axis (default -2, as in ``(B, H, N, E)``).
    layout : str or Layout
        Which rows this rank takes (:func:`mpiattn.partition`).

    Returns
    -------
    torch.Tensor
        Contiguous. Its backward sums the gradient over the ranks (one
        allreduce, collective), so ``x.grad`` is the whole gradient on every
        rank.
    """
    c = get_comm(comm)
    return _Shard.apply(x, c, _dim(x, dim), layout)


def gather(y: torch.Tensor, *, comm: Any = None, dim: int = -2,
           layout: Any = "contiguous") -> torch.Tensor:
    """Every rank's rows of ``y`` together, on every rank; differentiable.

    Parameters
    ----------
    y : torch.Tensor
        This rank's rows (any strides: the rows are copied anyway).
    comm, dim, layout
        As in :func:`shard`.

    Returns
    -------
    torch.Tensor
        The whole tensor in global row order. Its backward keeps this rank's
        rows of the gradient (which must be the same on every rank, as the
        result is).

    Examples
    --------
    >>> import torch, mpiattn.torch as mt
    >>> x = torch.arange(6.0).reshape(3, 2)
    >>> bool((mt.gather(mt.shard(x)) == x).all())
    True
    """
    c = get_comm(comm)
    y = y.contiguous()  # gather copies the rows anyway
    check_operands({"y": y})
    return _Gather.apply(y, c, _dim(y, dim), layout)


# ------------------------------------------------------------------ gradients
def _parameters(params: Any) -> list[torch.Tensor]:
    if isinstance(params, torch.nn.Module):
        params = params.parameters()
    if isinstance(params, torch.Tensor):
        params = [params]
    return [p for p in params if p.requires_grad]


def reduce_gradients(params: torch.nn.Module | Iterable[torch.Tensor], comm: Any = None, *,
                     average: bool = False) -> None:
    """Sum (or average) the ``.grad`` of replicated parameters over ranks, in place.

    Call it on every rank after ``loss.backward()`` and before the optimizer
    step: with the rows of a sequence sharded over ``comm``, each rank's
    gradients are partial sums over its rows, and their sum is the gradient
    of the whole sequence's loss (take the loss as a sum over this rank's
    rows divided by the global count, and the sum is the gradient of the
    global mean). Every parameter that a sequence-sharded model replicates
    needs it (embeddings, norms, feed-forward layers, not only attention), so
    it is one call on the whole model rather than a hook of one module.

    Parameters
    ----------
    params : torch.nn.Module or iterable of torch.Tensor
        The parameters (those with ``requires_grad``), in the same order and
        of the same shapes and dtypes on every rank.
    comm : mpi4py.MPI.Intracomm, optional
        The ranks to reduce over (default ``MPI.COMM_WORLD``).
    average : bool
        Divide by the number of ranks (data parallelism: replicas that each
        computed a mean over their own batch).

    Raises
    ------
    ValueError, TypeError
        On every rank alike, when the ranks' parameter lists differ.

    Notes
    -----
    Collective: one metadata allgather and one allreduce per accumulation
    dtype (float64 parameters in float64, the others in float32, so
    bfloat16 and float16 gradients are summed in float32 and rounded once).
    The sums are bitwise the same on every rank (:meth:`mpiattn.comm.Comm.allreduce_`),
    so replicated parameters stay identical. A parameter whose ``.grad`` is
    None on some ranks counts as zero there; None on every rank stays None.

    Data parallelism composes: with ``world`` split into sequence groups
    (``seq = world.Split(rank // P)``) and replicas (``dp = world.Split(rank % P)``),
    ``reduce_gradients(model, seq)`` then ``reduce_gradients(model, dp, average=True)``.
    """
    c = get_comm(comm)
    ps = _parameters(params)

    def local() -> tuple:
        return tuple((tuple(p.shape), str(p.dtype), p.device.type, p.grad is not None) for p in ps)

    metas = c.allgather_checked(local)
    with errors.alike():
        errors.same_everywhere([[m[:3] for m in meta] for meta in metas],
                               "the parameters (shape, dtype, device)")
    present = [any(meta[i][3] for meta in metas) for i in range(len(ps))]
    groups: dict[torch.dtype, list[int]] = {}
    for i, p in enumerate(ps):
        if present[i]:
            groups.setdefault(torch.float64 if p.dtype == torch.float64 else torch.float32,
                              []).append(i)
    for acc, idx in groups.items():
        device = ps[idx[0]].device
        flat = torch.cat([(ps[i].grad if ps[i].grad is not None else torch.zeros_like(ps[i]))
                          .detach().reshape(-1).to(acc) for i in idx])
        with on_device(device):
            arr = to_array(flat)
            prepare(c, arr)
            c.allreduce_(arr)
        if average:
            flat /= c.size
        off = 0
        for i in idx:
            p = ps[i]
            part = flat[off:off + p.numel()].view(p.shape).to(p.dtype)
            off += p.numel()
            if p.grad is None:
                p.grad = part.clone()
            else:
                p.grad.copy_(part)
