"""Communication: everything that crosses ranks.

Modules, bottom to top:

``errors``
    collective error agreement (the same exception on every rank, or abort);
``core``
    :class:`Comm`, a thin wrapper of one duplicated intracommunicator:
    point-to-point and row collectives with explicit datatypes;
``ring``
    the ring pipeline :func:`circulate` (double-buffered ``Isend``/``Irecv``);
``transports``
    how CuPy buffers move (CUDA-aware MPI, pinned staging, NCCL);
``device``
    the collective decision of which transport a Comm uses.
"""

from __future__ import annotations

from .core import Comm, Request, get_comm
from .errors import CollectiveError
from .ring import Piece, circulate, row_pieces

__all__ = ["Comm", "Request", "get_comm", "CollectiveError", "Piece", "circulate", "row_pieces"]
