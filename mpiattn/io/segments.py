"""MPI's shared-memory segments, unnamed once mapped, so that a killed job leaves none behind.

MPICH keeps the shared memory of each node's ranks in a file
``/dev/shm/mpich_shm_*`` for the whole run and removes it in
``MPI_Finalize``. A job that ends otherwise (``MPI_Abort``, which is how
mpiattn ends a job on a signal, a lost rank or a failure; a rank killed by
``SIGKILL``) leaves it there: with pip's MPICH 5.0.2, every aborted or
killed 2-rank job left one file of 1-4 MiB in ``/dev/shm`` (measured
2026-12-02), which stays until the machine reboots.

Once every rank of the node has mapped the segment, its name serves no
one. :func:`forget_names` (collective) removes the names of the segments
this process maps, after a barrier that every rank reaches only once its
``MPI_Init`` has mapped them: the memory stays mapped and is freed when the
last rank of the node ends, however it ends. MPICH's own removal at
``MPI_Finalize`` then finds nothing and says nothing (measured: exit code
0, no message). Files of other MPI libraries are left alone (Open MPI's
``prterun`` removes its session directory itself, also after a kill).

The command line calls it once, right after the first collective; the
library never does.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["PREFIXES", "mapped", "forget_names"]

#: Segment files of MPI libraries whose names may go once mapped.
PREFIXES = ("/dev/shm/mpich_shm_",)


def mapped(maps: str = "/proc/self/maps", prefixes: tuple = PREFIXES) -> list[str]:
    """The named files under ``prefixes`` this process maps (sorted; ``[]`` where it cannot tell)."""
    found = set()
    try:
        with open(maps) as fh:
            for line in fh:
                parts = line.split(maxsplit=5)
                path = parts[5].rstrip("\n") if len(parts) == 6 else ""
                if path.startswith(prefixes) and not path.endswith(" (deleted)"):
                    found.add(path)
    except OSError:
        return []
    return sorted(found)


def forget_names(comm: Any, maps: str = "/proc/self/maps") -> list[str]:
    """Remove the names of the MPI segments this process maps (collective on ``comm``, a Comm).

    Returns the paths removed here (another rank of the node may have removed
    a shared one first). Never raises for a file that is gone or cannot go.
    """
    comm.barrier()  # every rank's MPI_Init has mapped its node's segments
    removed = []
    for path in mapped(maps):
        try:
            os.unlink(path)
            removed.append(path)
        except OSError:
            pass
    return removed
