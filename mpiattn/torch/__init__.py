"""mpiattn for PyTorch: autograd functions and a module over sequence-sharded tensors.

Optional (``pip install "mpiattn[torch]"``): ``import mpiattn`` never imports
torch; ``import mpiattn.torch`` does. Tensors cross to the library on their
own memory (:mod:`mpiattn.torch.tensors`); every function is collective over
its communicator, forward and backward.

Modules, bottom to top: ``tensors`` (tensors as NumPy/CuPy arrays, the local
checks), ``ops`` (attention and the products as custom operators, for ``torch.compile(fullgraph=True)``),
``functions`` (:func:`attention`, :func:`matmul_nt`,
:func:`matmul_nn`, :func:`matmul_tn`), ``collectives`` (:func:`shard`,
:func:`gather`, :func:`reduce_gradients`), ``modules``
(:class:`MultiheadAttention`).

Examples
--------
>>> import torch, mpiattn.torch as mt
>>> x = torch.randn(2, 7, 16)                     # this rank's rows: (B, n_r, E)
>>> layer = mt.MultiheadAttention(16, 4, batch_first=True, causal=True)
>>> y, _ = layer(x)
>>> y.sum().backward()
>>> mt.reduce_gradients(layer)                    # sum the parameter gradients over ranks
>>> layer.q_proj_weight.grad.shape
torch.Size([16, 16])
"""

from __future__ import annotations

from .collectives import gather, reduce_gradients, shard
from .functions import attention, matmul_nn, matmul_nt, matmul_tn
from .modules import MultiheadAttention

__all__ = ["attention", "matmul_nt", "matmul_nn", "matmul_tn", "shard", "gather",
           "reduce_gradients", "MultiheadAttention"]
