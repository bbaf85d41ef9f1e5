"""Communication: everything that crosses ranks.

Modules, bottom to top:

``errors``
    collective error agreement (the same exception on every rank, or abort);
``rows``
    row collectives as MPI calls (explicit datatypes; an all-to-all of point-to-point messages);
``core``
    :class:`Comm`, a thin wrapper of one duplicated intracommunicator:
    point-to-point and row collectives;
``ring``
    the ring pipeline :func:`circulate` (double-buffered ``Isend``/``Irecv``);
``transports``
    what every way of moving CuPy buffers offers (its methods, its stream
    contract, its requests);
``pinned``
    reusable page-locked host buffers;
``cuda_aware``, ``staged``
    CuPy buffers through CUDA-aware MPI, or staged through pinned host
    memory (NCCL: ``nccl``);
``device``
    the collective decision of which transport a Comm uses.
"""

from __future__ import annotations

from .core import Comm, Request, get_comm
from .errors import CollectiveError
from .ring import Piece, circulate, row_pieces

__all__ = ["Comm", "Request", "get_comm", "CollectiveError", "Piece", "circulate", "row_pieces"]
