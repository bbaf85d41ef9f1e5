"""Where a growing sequence's new rows go: whole pages, each to the rank with the fewest rows.

A key/value cache sharded over ``P`` ranks grows by tokens that every rank
receives alike (:meth:`mpiattn.KVCache.append`). They are placed in *pages*
of ``page`` consecutive positions: the rows of an append first fill the page
that is still open (it belongs to one rank), then open new pages, each given
to the rank that holds the fewest rows, ties going round-robin from the rank
after the last page's owner. With equal shards this is the round-robin
interleaving of vLLM's decode context parallelism, one page at a time; after
an uneven start (a prefill on an uneven layout, a cache loaded at another
rank count) the new pages even the shards out. Every rank holds the same
:class:`Placement` and updates it by the same arithmetic, so placing rows
needs no message.

Bounds: no rank holds more than ``ceil(total / P) + page`` rows once the
appended rows dominate, and a rank's storage (whole pages) exceeds its rows
by less than one page (:mod:`mpiattn.inference.shard`): the memory per rank
is ``size / P + one page``.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, replace
from typing import Any

from ..io.kvstore import MAX_PAGE_ROWS  # a page is allocated whole by its first append

__all__ = ["Placement", "PAGE_ROWS", "MAX_PAGE_ROWS", "POLICY", "check_page"]

#: Default rows per page (the unit of placement and of storage growth).
PAGE_ROWS = 4096

#: The policy's name, as saved with a cache.
POLICY = "pages to the rank with the fewest rows, ties round-robin"


def check_page(page: Any) -> int:
    """``page`` as an int in ``1 ..`` :data:`MAX_PAGE_ROWS` (TypeError / ValueError otherwise)."""
    if isinstance(page, bool):
        raise TypeError(f"page must be a positive integer (rows), got {page!r}")
    try:
        page = operator.index(page)
    except TypeError:
        raise TypeError(f"page must be a positive integer (rows), got {page!r}") from None
    if not 1 <= page <= MAX_PAGE_ROWS:
        raise ValueError(f"page must be 1 to {MAX_PAGE_ROWS} rows (a page is allocated whole), "
                         f"got {page}")
    return int(page)


@dataclass(frozen=True)
class Placement:
    """The placement state of one sharded sequence, the same on every rank.

    Attributes
    ----------
    page : int
        Rows per page.
    counts : tuple of int
        Rows each rank holds.
    owner : int
        The rank whose last page still has room (-1: none open).
    room : int
        Rows left in that page.
    cursor : int
        Where the round-robin search for a tie starts.
    """

    page: int
    counts: tuple
    owner: int = -1
    room: int = 0
    cursor: int = 0

    @classmethod
    def start(cls, counts: Any, page: int = PAGE_ROWS) -> "Placement":
        """The state after an adoption of shards of ``counts`` rows (no page open)."""
        return cls(check_page(page), tuple(int(n) for n in counts))

    @property
    def total(self) -> int:
        """Rows in the sequence."""
        return sum(self.counts)

    def place(self, t: int) -> tuple[list, "Placement"]:
        """Place ``t`` new rows (the next ``t`` positions).

        Returns
        -------
        runs : list of (owner, start, stop)
            Consecutive runs of the new rows (``start``, ``stop`` counted from
            the first new row) and the rank each goes to, in order.
        placement : Placement
            The state after them.
        """
        counts, owner, room, cursor = list(self.counts), self.owner, self.room, self.cursor
        runs: list = []
        done = 0
        while done < t:
            if room == 0:
                owner = min(range(len(counts)), key=lambda r: (counts[r], (r - cursor) % len(counts)))
                room, cursor = self.page, (owner + 1) % len(counts)
            take = min(room, t - done)
            if runs and runs[-1][0] == owner:
                runs[-1] = (owner, runs[-1][1], done + take)
            else:
                runs.append((owner, done, done + take))
            counts[owner] += take
            room -= take
            done += take
        return runs, replace(self, counts=tuple(counts), owner=owner if room else -1, room=room,
                             cursor=cursor)

    def adopted(self, counts: Any) -> "Placement":
        """The state after every rank adopts ``counts[r]`` more rows of its own (a prefill
        chunk's rows, sharded by its layout); an open page stays open for later appends."""
        return replace(self, counts=tuple(a + int(b) for a, b in zip(self.counts, counts)))
