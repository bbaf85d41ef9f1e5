"""``KVCache``: the keys and values of one growing sequence, sharded over the ranks of a communicator.

Made from a prefill's shards (:meth:`KVCache.from_shards`) or a file
(:meth:`KVCache.load`, at any rank count); grown by tokens every rank holds
alike (:meth:`KVCache.append`, placed in pages by
:mod:`mpiattn.inference.placement`) or by a sharded chunk
(:meth:`KVCache.prefill`); attended by a few new queries every rank holds
(:meth:`KVCache.attend`, :mod:`mpiattn.inference.decode`); saved
(:meth:`KVCache.save`; the file: :mod:`mpiattn.inference.stored`). Every row keeps its
global position, so causal and window rules hold in positions whatever
rank a row lives on. NumPy and CuPy arrays run the same code.

Every rank holds the same small state (shapes, dtype, length, the placement
with each rank's row count), updated by the same arithmetic after each
agreed call; each rank holds its own rows (:class:`~mpiattn.inference.shard.Shard`).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from .. import backend
from ..comm import errors
from ..comm.core import Comm, get_comm
from ..comm.device import prepare
from ..io.atomic import Target
from ..io.naming import NEW, Rule
from ..io.publishing import Outputs
from ..kernels import engines
from ..layouts import Layout, all_segments, check_layout, check_shares, layout_key, positions
from ..masks.score import Score, agree_answers
from ..strategies import machines
from ..strategies.problem import visible_pairs
from ..strategies.spec import SKIP_FINITE
from . import stored
from .decode import DecodePlan, checksum, decode
from .placement import PAGE_ROWS, Placement, check_page
from .prefill import choose, chunk_checks, pass_kv, pass_q, runs_of
from .pricing import chunk_spec
from .shard import Shard, nonfinite

__all__ = ["KVCache"]


class KVCache:
    """Keys and values of one sequence, sharded over the ranks (see the module docstring).

    Made by :meth:`from_shards` or :meth:`load`, not directly.

    Attributes
    ----------
    comm : Comm
    length : int
        Rows in the sequence (``M``), the same on every rank.
    B, Hkv, E, Ev : int
    dtype : numpy.dtype
    device : {"numpy", "cupy"}
    placement : Placement
        Rows per rank and the page appends fill.
    """

    def __init__(self, c: Comm, shard: Shard, placement: Placement):
        self.comm, self.shard, self.placement = c, shard, placement
        #: The file :meth:`load` read, ``(device, inode, size, mtime_ns)``; None otherwise.
        self.identity: tuple | None = None

    # ------------------------------------------------------------ properties
    length = property(lambda self: self.placement.total)
    B = property(lambda self: self.shard.B)
    Hkv = property(lambda self: self.shard.Hkv)
    E = property(lambda self: self.shard.E)
    Ev = property(lambda self: self.shard.Ev)
    dtype = property(lambda self: self.shard.dtype)
    device = property(lambda self: self.shard.xp.__name__)
    page = property(lambda self: self.placement.page)

    @property
    def rows(self) -> int:
        """Rows this rank holds."""
        return self.shard.rows

    @property
    def nbytes(self) -> int:
        """Bytes of key/value storage this rank holds (less than one page above its rows)."""
        return self.shard.nbytes

    def positions(self) -> np.ndarray:
        """Global positions of this rank's rows (increasing), ``(rows,)`` int64."""
        return np.sort(self.shard.positions())

    def local(self) -> tuple[Any, Any, np.ndarray]:
        """This rank's rows as ``(k (B, Hkv, m_r, E), v (B, Hkv, m_r, Ev), positions (m_r,))``,
        in increasing position (a copy unless stored as one block)."""
        return self.shard.whole()

    def layout(self) -> Layout:
        """Who holds which positions, as a :class:`mpiattn.Layout` (collective: one allgather)."""
        return Layout(self.comm.allgather_obj(runs_of(self.positions())))

    def __repr__(self) -> str:
        return (f"KVCache(length={self.length}, B={self.B}, Hkv={self.Hkv}, E={self.E}, Ev={self.Ev}, "
                f"dtype={self.dtype}, device={self.device}, ranks={self.comm.size}, page={self.page})")

    # --------------------------------------------------------------- making
    @classmethod
    def from_shards(cls, k: Any, v: Any, comm: Any = None, *, layout: Any = "contiguous",
                    page: int = PAGE_ROWS, check_finite: bool = True) -> "KVCache":
        """Adopt every rank's rows of a prefilled sequence (collective).

        Parameters
        ----------
        k : array, shape (B, Hkv, m_r, E)
            This rank's key rows of a global length ``M`` by ``layout``.
        v : array, shape (B, Hkv, m_r, Ev)
        comm : mpi4py.MPI.Intracomm or Comm, optional
            Default ``MPI.COMM_WORLD``.
        layout : str or Layout
            The rows' layout (as in :func:`mpiattn.attention`).
        page : int
            Rows per page of later appends, 1 to
            :data:`~mpiattn.inference.placement.MAX_PAGE_ROWS`
            (:mod:`mpiattn.inference.placement`).
        check_finite : bool
            Refuse keys or values holding NaN or Inf (a NaN key makes every
            query that sees it NaN).

        Returns
        -------
        KVCache
            It keeps ``k`` and ``v`` (C-contiguous arrays whose rows are in
            increasing position are not copied: do not modify them afterwards).

        Raises
        ------
        ValueError, TypeError
            On every rank alike: bad shapes or dtypes, a bad page, NaN or Inf
            values, ranks that disagree, lengths that do not match the layout.
        """
        c = get_comm(comm)

        def local() -> dict:
            xp = backend.array_module(k, v)
            for name, x in (("k", k), ("v", v)):
                if x.ndim != 4:
                    raise ValueError(f"{name} must be 4-D (batch, kv heads, rows, feature), got "
                                     f"shape {x.shape}")
                backend.check_dtype(x.dtype, name)
            if k.dtype != v.dtype:
                raise TypeError(f"k and v must share one dtype, got {k.dtype} and {v.dtype}")
            if k.shape[:3] != v.shape[:3]:
                raise ValueError(f"k {k.shape} and v {v.shape} must agree in batch, heads and rows")
            if k.shape[1] < 1:
                raise ValueError("k has no key/value head")
            bad = nonfinite(xp, ("k", k), ("v", v)) if check_finite else None
            if bad:
                raise ValueError(f"{bad} holds NaN or Inf ({SKIP_FINITE})")
            check_layout(layout)
            return {"shapes (B, Hkv, E, Ev)": (k.shape[0], k.shape[1], k.shape[3], v.shape[3]),
                    "dtype": str(k.dtype), "backend": xp.__name__, "layout": layout_key(layout),
                    "page": check_page(page), "_m": int(k.shape[2])}

        got = c.agree(local)
        with errors.alike():
            counts = [g["_m"] for g in got]
            M = sum(counts)
            check_shares(counts, layout, "key/value rows (k, v)")
        prepare(c, k, v)
        xp = backend.array_module(k)
        B, Hkv, E, Ev = got[0]["shapes (B, Hkv, E, Ev)"]
        shard = Shard(xp, k.dtype, B, Hkv, E, Ev, got[0]["page"])
        shard.adopt(k, v, positions(all_segments(M, c.size, layout)[c.rank]))
        return cls(c, shard, Placement.start(counts, got[0]["page"]))

    @classmethod
    def load(cls, path: str | os.PathLike, comm: Any = None, *, page: int | None = None,
             device: str = "numpy", check_finite: bool = True) -> "KVCache":
        """Read a cache saved by :meth:`save`, at any number of ranks (collective).

        The rows are rebalanced: rank ``r`` reads the ``r``-th of ``P``
        contiguous ranges of positions (``numpy.array_split``'s sizes).

        Parameters
        ----------
        path : path-like
        comm : optional
        page : int, optional
            Rows per page of later appends; default the saved one.
        device : {"numpy", "cupy"}
            Where the rows go (``cupy``: each rank's current device).
        check_finite : bool
            Refuse a cache holding NaN or Inf.

        Raises
        ------
        FileNotFoundError, OSError, ValueError, TypeError
            On every rank alike: a missing, unreadable, truncated or
            replaced file, one that is no cache of this format, or NaN or
            Inf values.

        Notes
        -----
        :attr:`identity` records the file read ``(device, inode, size,
        mtime_ns)``: ``save(path, grow=True)`` replaces it only while it is
        still that file.
        """
        c = get_comm(comm)
        shard, placement, identity = stored.read(c, path, page, device, check_finite)
        cache = cls(c, shard, placement)
        cache.identity = identity
        return cache

    # -------------------------------------------------------------- growing
    def append(self, k_new: Any, v_new: Any, *, check_finite: bool = True) -> None:
        """Add ``t`` new tokens (collective): the same ``k_new``, ``v_new`` on every rank.

        Parameters
        ----------
        k_new : array, shape (B, Hkv, t, E)
        v_new : array, shape (B, Hkv, t, Ev)
            The cache's dtype and device. They take positions ``length ..
            length + t - 1``; each page of them goes to one rank
            (:class:`~mpiattn.inference.placement.Placement`), which copies
            its rows; nothing is sent.
        check_finite : bool
            Refuse new rows holding NaN or Inf.

        Raises
        ------
        ValueError, TypeError, MemoryError
            On every rank alike: wrong shape, dtype or device, NaN or Inf,
            arrays that differ between ranks (their CRC-32 is compared), or
            no memory for the pages (allocated before any row is placed).
        """
        s = self.shard
        reserved: list = []

        def local() -> dict:
            xp = backend.array_module(k_new, v_new)
            if xp is not s.xp:
                raise TypeError(f"append: the new rows are {xp.__name__} arrays, the cache holds "
                                f"{s.xp.__name__} arrays")
            for name, x, F in (("k_new", k_new, s.E), ("v_new", v_new, s.Ev)):
                if x.dtype != s.dtype:
                    raise TypeError(f"append: {name} has dtype {x.dtype}, the cache holds {s.dtype}")
                if x.ndim != 4 or x.shape[:2] != (s.B, s.Hkv) or x.shape[3] != F:
                    raise ValueError(f"append: {name} must have shape (B, Hkv, t, {F}) = "
                                     f"({s.B}, {s.Hkv}, t, {F}), got {x.shape}")
            if k_new.shape[2] != v_new.shape[2]:
                raise ValueError(f"append: k_new has {k_new.shape[2]} rows, v_new {v_new.shape[2]}")
            bad = nonfinite(xp, ("k_new", k_new), ("v_new", v_new)) if check_finite else None
            if bad:
                raise ValueError(f"append: {bad} holds NaN or Inf ({SKIP_FINITE})")
            runs, _ = self.placement.place(int(k_new.shape[2]))  # every rank places alike
            reserved.extend(s.reserve(sum(b - a for owner, a, b in runs if owner == self.comm.rank)))
            return {"append's rows": int(k_new.shape[2]),
                    "append's values (CRC-32 of k_new, v_new)": (checksum(k_new), checksum(v_new))}

        try:
            self.comm.agree(local)
        except Exception:
            s.unreserve(reserved)
            raise
        t = int(k_new.shape[2])
        runs, after = self.placement.place(t)
        base = self.length
        for owner, a, b in runs:
            if owner == self.comm.rank:
                s.extend(k_new[:, :, a:b], v_new[:, :, a:b], np.arange(base + a, base + b, dtype=np.int64))
        self.placement = after

    # ------------------------------------------------------------- attending
    def attend(self, q: Any, *, causal: bool = True, window: Any = None, scale: float | None = None,
               softcap: float | None = None, alibi_slopes: Any = None, sinks: Any = None,
               attn_mask: Any = None, mask_mod: Any = None, score_mod: Any = None,
               score: Score | None = None, engine: str = "auto", check_finite: bool = True,
               details: dict | None = None) -> tuple[Any, Any]:
        """Decode: ``t`` new queries, the same on every rank, against the whole cache (collective).

        The queries stand at the last ``t`` positions (``length - t ..
        length - 1``: append their keys first). Each rank attends its rows
        with its engine; the partial results are merged exactly by a tree
        (:mod:`mpiattn.inference.decode`).

        Parameters
        ----------
        q : array, shape (B, H, t, E)
            ``H`` a multiple of ``Hkv`` (GQA/MQA); the cache's dtype and device.
        causal : bool or "bottom-right"
            Query ``i`` sees keys ``j <= length - t + i`` (bottom-right
            aligned); False: every key (within the window).
        window : (left, right), optional
            Keys ``p - left <= j <= p + right`` of a query at position ``p``.
        scale : float, optional
            Default ``1/sqrt(E)``.
        softcap, alibi_slopes, sinks : optional
            Score modifiers, as in :func:`mpiattn.attention` (ALiBi measures ``|p - j|``
            between absolute positions; the sinks join the merged rows), the same on every rank.
        attn_mask : array, shape (B or 1, H or 1, t, length), optional
            Bool (True = the pair takes part) or float (added), its key axis absolute positions;
            the same on every rank.
        mask_mod, score_mod : optional
            As in :func:`mpiattn.attention`, given absolute positions: ``q_idx`` of query ``i``
            is ``length - t + i``, ``kv_idx`` the key's position in the cache.
        score : mpiattn.Score, optional
            The score modifiers as one object; the keywords above add to it.
        engine : str
            ``"auto"`` (native) or a registered engine.
        check_finite : bool
            Raise when ``q`` holds NaN or Inf.
        details : dict, optional
            Filled with ``engine``, ``blocks`` (computed on this rank),
            ``merge_words`` (sent per rank).

        Returns
        -------
        out : array, shape (B, H, t, Ev), the cache's dtype
        lse : array, shape (B, H, t), float32 (float64 for float64)
            Bitwise identical on every rank; ``out = 0``, ``lse = -inf`` for
            a query that sees no key.
        """
        settings = dict(causal="bottom-right" if causal else False, window=window, scale=scale,
                        engine=engine, check_finite=check_finite)
        return decode(self.comm, self.shard, self.length, q, settings, details,
                      Score.of(score, alibi_slopes=alibi_slopes, sinks=sinks, attn_mask=attn_mask,
                               mask_mod=mask_mod, score_mod=score_mod, softcap=softcap))

    def plan_attend(self, q: Any, *, causal: bool = True, window: Any = None,
                    scale: float | None = None, softcap: float | None = None,
                    alibi_slopes: Any = None, sinks: Any = None, attn_mask: Any = None,
                    mask_mod: Any = None, score_mod: Any = None, score: Score | None = None,
                    engine: str = "auto", check_finite: bool = True) -> DecodePlan:
        """Decode steps of ``q``'s shape, planned once (collective): a
        :class:`~mpiattn.inference.decode.DecodePlan` whose calls ``plan(q, attn_mask=None)``
        are :meth:`attend` with these settings, against the cache as it is at each call.

        The keywords are :meth:`attend`'s and are agreed now, with ``q`` (an example of the
        steps' queries: its shape and dtype are the plan's) and ``attn_mask`` (given here
        when the steps take one: its kind, bool or float, is the plan's; each step passes its
        own, spanning the cache then). A step then checks only that its queries fit and are
        the same on every rank (one small allgather).

        Examples
        --------
        >>> plan = cache.plan_attend(q)            # doctest: +SKIP
        >>> for token in range(steps):             # doctest: +SKIP
        ...     cache.append(k_new, v_new)
        ...     out, lse = plan(q)
        """
        settings = dict(causal="bottom-right" if causal else False, window=window, scale=scale,
                        engine=engine, check_finite=check_finite)
        return DecodePlan(self.comm, self.shard, lambda: self.length, q, settings,
                          Score.of(score, alibi_slopes=alibi_slopes, sinks=sinks, attn_mask=attn_mask,
                                   mask_mod=mask_mod, score_mod=score_mod, softcap=softcap))

    def prefill(self, q: Any, k: Any, v: Any, *, layout: Any = "contiguous", variant: str = "auto",
                window: Any = None, scale: float | None = None, softcap: float | None = None,
                alibi_slopes: Any = None, sinks: Any = None, attn_mask: Any = None,
                mask_mod: Any = None, score_mod: Any = None, score: Score | None = None,
                engine: str = "auto", check_finite: bool = True, append: bool = True,
                machine: str | None = None, details: dict | None = None) -> tuple[Any, Any]:
        """Chunked prefill: a sharded chunk attends the cache and itself, bottom-right causal (collective).

        Parameters
        ----------
        q : array, shape (B, H, c_r, E)
            This rank's rows of a chunk of ``C`` queries (by ``layout``), at
            positions ``length .. length + C - 1``.
        k, v : arrays, shapes (B, Hkv, c_r, E) and (B, Hkv, c_r, Ev)
            The chunk's keys and values, the same rows.
        layout : str or Layout
            The chunk's layout of ``C`` rows.
        variant : {"auto", "pass-kv", "pass-q"}
            :mod:`mpiattn.inference.prefill`; ``auto`` asks its cost rule on
            ``machine`` (a profile or calibration file; default the device's).
        window, scale, softcap, alibi_slopes, sinks, engine, check_finite
            As in :meth:`attend`.
        attn_mask : array, shape (B or 1, H or 1, c_r, length + C), optional
            This rank's chunk rows of a mask over the cache and the chunk (absolute key
            positions), as in :func:`mpiattn.attention`.
        mask_mod, score_mod, score : optional
            As in :meth:`attend` (absolute positions: chunk row ``i`` at ``length + i``), on
            either variant.
        append : bool
            Keep the chunk's rows in the cache afterwards (each rank its own).
        details : dict, optional
            Filled with ``variant`` and ``reason``.

        Returns
        -------
        out : array, shape (B, H, c_r, Ev), the cache's dtype
        lse : array, shape (B, H, c_r)

        Raises
        ------
        ValueError, TypeError
            On every rank alike.
        """
        c, s = self.comm, self.shard
        options = dict(window=window, scale=scale, engine=engine, check_finite=check_finite)
        kept: dict = {}
        score = Score.of(score, alibi_slopes=alibi_slopes, sinks=sinks, attn_mask=attn_mask,
                         mask_mod=mask_mod, score_mod=score_mod, softcap=softcap)
        got = c.agree(lambda: chunk_checks(s, self.length, q, k, v, options, layout, variant,
                                           machine, score, kept), call="KVCache.prefill")
        with errors.alike():
            counts = [g["_n"] for g in got]
            C = sum(counts)
            check_shares(counts, layout, "the chunk's rows (q, k, v)")
            if any(g["_keys"] not in (None, self.length + C) for g in got):
                raise ValueError(f"attn_mask must span the cache and the chunk: its last axis must "
                                 f"be {self.length + C}")
            engines.agreed_choice([g["_engine"] for g in got], engine)
            agree_answers(c, kept["score"], C, self.length + C, self.length, "KVCache.prefill")
            chosen, reason = variant, "requested"
            if variant == "auto" and c.size > 1:
                spec = chunk_spec(s.B, int(q.shape[1]), s.Hkv, C, self.length, s.E, s.Ev, s.dtype,
                                  window, layout)
                pairs = None
                if any(g["_hides"] for g in got):  # agreed: every rank counts, or none
                    pairs = visible_pairs(c, spec, kept["score"].shifted(self.length).modifiers())
                ch = choose(spec, c.topology, machines.load(got[0]["machine"]), pairs,
                            page=self.placement.page)
                chosen, reason = ch.variant, ch.reason
            elif variant == "auto":
                chosen, reason = "pass-q", "one rank: nothing travels"
        chunk_pos = positions(all_segments(C, c.size, layout)[c.rank])
        if chosen == "pass-kv":
            out, lse = pass_kv(c, s, self.length, q, k, v, chunk_pos, layout, options,
                               score.shifted(self.length))
        else:
            prepare(c, q, k, v)
            with c.abort_on_error():
                out, lse = pass_q(c, s, self.length, q, k, v, chunk_pos, counts,
                                  engines.get(got[0]["_engine"][0]), got[0]["_spec"], check_finite,
                                  kept["score"])
        if details is not None:
            details.update({"variant": chosen, "reason": reason})
        if append:
            s.adopt(k, v, self.length + chunk_pos)
            self.placement = self.placement.adopted(counts)
        return out, lse

    # --------------------------------------------------------------- saving
    def target(self, path: str | os.PathLike, *, rule: Rule = NEW, extra: dict | None = None,
               attrs: dict | None = None) -> Target:
        """The cache as a file to publish (collective): :meth:`save`'s file, named by ``rule``,
        for :func:`mpiattn.io.publish` beside other files (an output and the cache grown for it)."""
        return stored.target(self, path, rule, extra, attrs)

    def save(self, path: str | os.PathLike, *, force: bool = False, grow: bool = False,
             extra: dict | None = None, attrs: dict | None = None,
             outputs: Outputs | None = None) -> None:
        """Write the cache to HDF5 (collective; :mod:`mpiattn.io.kvstore`), atomically.

        Each rank writes its own rows at their global positions (a host copy
        of them); the file records the length, the page and the placement
        policy, and the writer's rows per rank. :meth:`load` reads it at any
        rank count.

        Parameters
        ----------
        path : path-like
            The same on every rank.
        force : bool
            Replace an existing file (atomically; its permission bits are kept).
        grow : bool
            Replace the file :meth:`load` read, and only while it is still
            that file (:attr:`identity`): of two programs growing one cache
            file at once, the second to save gets an error instead of
            silently dropping the first one's rows. Refuses a read-only file.
        extra : dict of str to mpiattn.io.Rows, optional
            Other datasets to write beside ``k`` and ``v``.
        attrs : dict, optional
            More root attributes.
        outputs : mpiattn.io.Outputs, optional
            The program's outputs (a signal handler can stop the write).

        Raises
        ------
        OSError, ValueError
            On every rank alike (``mpiattn.io.ChangedError`` when ``grow``
            finds another file); ``path`` is then unchanged.
        """
        stored.save(self, path, force, grow, extra, attrs, outputs)
