"""Long-context inference: a key/value cache sharded over the ranks, decode, chunked prefill.

``placement``
    where appended rows go: whole pages, each to the rank with the fewest rows;
``shard``
    one rank's rows: adopted blocks and pages, with their global positions;
``merge``
    the exact lse merge of partial results, and its tree over the ranks;
``local``
    one rank's partial attention of queries at known positions;
``decode``
    a few new queries (every rank holds them) against the cache; :class:`DecodePlan`, a loop's
    steps planned once (:meth:`KVCache.plan_attend`);
``prefill``
    a sharded chunk against the cache: pass-KV and pass-Q, and the rule between them;
``stored``
    a cache's file: read back at any rank count, written whole or not at all;
``cache``
    :class:`KVCache`, the public object (``mpiattn.KVCache``).
"""

from __future__ import annotations

from .cache import KVCache
from .decode import DecodePlan
from .placement import PAGE_ROWS, Placement

__all__ = ["KVCache", "DecodePlan", "Placement", "PAGE_ROWS"]
