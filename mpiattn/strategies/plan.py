"""Plans: a call validated, agreed and planned once, then run cheaply on arrays of its shapes.

:func:`plan_attention` does what every one-shot :func:`mpiattn.attention`
call does before it computes (the local checks of every rank, one metadata
allgather, the agreement of every field, the engine, the block size, the
strategy the cost model picks, the device transport, the gathered document
ids) and keeps the result, an :class:`AttentionPlan`. Its :meth:`~AttentionPlan.forward`
and :meth:`~AttentionPlan.backward` then only check, on every rank, that the
arrays are the planned ones (shapes, dtype, backend, and finiteness when
``check_finite``), agreed in one small allgather tagged with the call, and
run the strategy: the form for a training or decode loop, as mpi4py-fft's
``PFFT(comm, shape, ...)`` is made once and called cheaply.
:func:`mpiattn.attention` and :func:`mpiattn.attention_backward` are the
one-shot forms on top of it: the first makes a plan and runs it, the second
validates its call (``dout``, ``out`` and ``lse`` checked with the rest) and
runs :func:`backward_problem`, the backward every plan runs. A layer keeps its
last plan while it fits (:func:`reuse_or_plan`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from .. import backend
from ..comm import errors
from ..comm.core import Comm, get_comm
from ..masks.score import Score
from ..masks.maxlogit import HeadMax
from ..masks.sinks import add_sinks, check_sinks, sink_gradient
from .base import Progress
from .problem import Arguments, Problem, validate
from .spec import SKIP_FINITE, AttentionSpec, Options

__all__ = ["AttentionPlan", "plan_attention", "forward_problem", "backward_problem", "reuse_or_plan"]


class AttentionPlan:
    """One attention call, planned for arrays of given shapes (made by :func:`plan_attention`).

    Attributes
    ----------
    comm : Comm
    problem : Problem
        The validated call: its :attr:`spec`, strategy, engine and block sizes.
    """

    def __init__(self, c: Comm, problem: Problem, shapes: dict, padding: tuple | None):
        self.comm, self.problem = c, problem
        self._shapes, self._padding = shapes, padding

    @property
    def spec(self) -> AttentionSpec:
        """The planned call (global shapes, dtype, rules, options)."""
        return self.problem.spec

    def details(self) -> dict:
        """What the plan uses: ``strategy``, ``engine`` and their reasons, ``block_size``."""
        return self.problem.details()

    def __repr__(self) -> str:
        s = self.spec
        return (f"AttentionPlan(B={s.B}, H={s.H}, Hkv={s.Hkv}, N={s.N}, M={s.M}, E={s.E}, "
                f"Ev={s.Ev}, dtype={s.dtype}, strategy={self.problem.strategy.label!r}, "
                f"engine={self.problem.engine.name!r}, ranks={self.comm.size})")

    # ------------------------------------------------------------------ checks
    def _misfit(self, call: str, arrays: dict, mask: Any, options: dict | None) -> str | None:
        """Why this rank's arrays (and ``options``) are not the planned ones, or None (local).
        NaN or Inf with ``check_finite`` raises instead (an error, not another plan)."""
        s = self.spec
        for name, x in arrays.items():
            want = self._shapes[name]
            xp_name = backend.array_module(x).__name__
            dtype_ok = x.dtype == want[1] if want[1] is not None else x.dtype.kind == "f"
            if xp_name != s.device or tuple(x.shape) != want[0] or not dtype_ok:
                return (f"{call}: {name} is a {xp_name} array of shape {tuple(x.shape)} and dtype "
                        f"{x.dtype}; the plan is for {s.device} arrays of {want[0]} "
                        f"{want[1] or 'floating point'} (make another plan for other shapes)")
        if (mask is None) != (self._padding is None):
            return (f"{call}: the plan was made {'without' if self._padding is None else 'with'} "
                    "a key_padding_mask; pass one exactly when the plan has one")
        if mask is not None and (tuple(mask.shape) != self._padding or mask.dtype != bool):
            return (f"{call}: key_padding_mask has shape {tuple(mask.shape)} ({mask.dtype}); the "
                    f"plan is for a bool mask of {self._padding}")
        if options is not None and Options.of(
                options.get("options"), **{k: v for k, v in options.items() if k != "options"}
        ).by_field() != s.options.by_field():
            return f"{call}: other options than the plan's"
        if s.options.check_finite:
            xp = backend.array_module(*arrays.values())
            for name, x in arrays.items():
                if name != "lse" and x.size and not bool(xp.isfinite(x).all()):
                    raise ValueError(f"{name} contains NaN or Inf ({SKIP_FINITE})")
        return None

    def fits(self, q: Any, k: Any, v: Any, *, key_padding_mask: Any = None,
             options: dict | None = None) -> bool:
        """Whether every rank's ``q``, ``k``, ``v`` (and mask, and :class:`mpiattn.Options`
        keywords ``options``) are the planned ones (collective; the same answer everywhere).

        Raises ValueError on every rank for NaN or Inf (``check_finite``).
        """
        got = self.comm.allgather_checked(
            lambda: self._misfit("AttentionPlan.fits", {"q": q, "k": k, "v": v}, key_padding_mask,
                                 options), call="AttentionPlan.fits")
        return all(why is None for why in got)

    def _check(self, call: str, arrays: dict, mask: Any, sinks: Any = None) -> np.ndarray | None:
        """Every rank: the arrays are the planned ones (one small allgather; errors alike).
        Returns the call's own ``sinks`` (checked, the same on every rank) or None."""
        def local() -> tuple | None:
            why = self._misfit(call, arrays, mask, None)
            if why is not None:
                raise ValueError(why)
            if sinks is None:
                return None
            if self.problem.sinks is None:
                raise ValueError(f"{call}: the plan was made without sinks; make one with sinks=")
            return tuple(check_sinks(sinks, self.spec.H))
        got = self.comm.allgather_checked(local, call=call)
        errors.same_everywhere(got, f"the sinks {call} is given")
        return None if got[0] is None else np.asarray(got[0], dtype=np.float64)

    # ------------------------------------------------------------------- calls
    def forward(self, q: Any, k: Any, v: Any, *, key_padding_mask: Any = None, sinks: Any = None,
                progress: Progress = None, details: dict | None = None) -> tuple[Any, Any]:
        """:func:`mpiattn.attention` of the planned call on this rank's ``q``, ``k``, ``v``
        (collective); returns ``out (B, H, n_r, Ev)`` in q's dtype and ``lse (B, H, n_r)``.

        ``sinks`` (H,): this call's values of the plan's sinks (default the plan's). ``details``
        gets ``max_logit`` when the plan returns it.
        Raises ValueError/TypeError on every rank alike when an array is not the planned one.
        """
        own = self._check("AttentionPlan.forward", {"q": q, "k": k, "v": v}, key_padding_mask, sinks)
        return self.run_forward(q, k, v, key_padding_mask, progress, own, details)

    def backward(self, dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, *,
                 key_padding_mask: Any = None, sinks: Any = None,
                 progress: Progress = None) -> tuple:
        """:func:`mpiattn.attention_backward` of the planned call (collective): ``dq``, ``dk``,
        ``dv`` in the inputs' dtype, and ``dsinks`` (float64 ``(H,)``) when the plan has sinks."""
        own = self._check("AttentionPlan.backward", {"dout": dout, "q": q, "k": k, "v": v,
                                                     "out": out, "lse": lse}, key_padding_mask, sinks)
        return self.run_backward(dout, q, k, v, out, lse, key_padding_mask, progress, own)

    def run_forward(self, q: Any, k: Any, v: Any, mask: Any, progress: Progress,
                    sinks: Any = None, details: dict | None = None) -> tuple[Any, Any]:
        """The forward on arrays known to fit the plan (no check): :func:`forward_problem`."""
        return forward_problem(self.comm, self.problem, q, k, v, mask, progress, sinks, details)

    def run_backward(self, dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, mask: Any,
                     progress: Progress, sinks: Any = None) -> tuple:
        """The backward on arrays known to fit the plan (no check): :func:`backward_problem`."""
        return backward_problem(self.comm, self.problem, dout, q, k, v, out, lse, mask, progress,
                                sinks)


def forward_problem(c: Comm, pb: Problem, q: Any, k: Any, v: Any, mask: Any, progress: Progress,
                    sinks: Any = None, details: dict | None = None) -> tuple[Any, Any]:
    """The forward of a validated call ``pb`` on arrays it was validated for (collective; no check).

    Parameters
    ----------
    c : Comm
    pb : Problem
        From :func:`mpiattn.strategies.problem.validate` (every rank's, agreed).
    q, k, v, mask, progress
        This rank's arrays, its ``key_padding_mask`` (or None), the progress callback.
    sinks : ndarray (H,), host float64, optional
        This call's sinks (default the problem's).
    details : dict, optional
        Gets ``max_logit`` when the call returns it.

    Returns
    -------
    out : array (B, H, n_r, Ev), the call's dtype
    lse : array (B, H, n_r), the accumulation dtype
    """
    sinks = pb.sinks if sinks is None else sinks
    tally = HeadMax.of(pb.spec)
    if tally is not None:
        pb = replace(pb, tally=tally)
    with c.abort_on_error():
        o, lse = pb.strategy.forward(c, pb, q, k, v, mask, progress)
        if sinks is not None:
            o, lse = add_sinks(o.astype(pb.spec.acc_dtype, copy=False),
                               lse.astype(pb.spec.acc_dtype, copy=False), sinks)
    if tally is not None:
        tally.report(c, details)
    return o.astype(pb.spec.dtype, copy=False), lse.astype(pb.spec.acc_dtype, copy=False)


def backward_problem(c: Comm, pb: Problem, dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any,
                     mask: Any, progress: Progress, sinks: Any = None) -> tuple:
    """The backward of a validated call ``pb`` on arrays it was validated for (collective; no
    check): what :meth:`AttentionPlan.backward` and the one-shot
    :func:`mpiattn.attention_backward` run once their checks have passed.

    Parameters
    ----------
    c, pb, q, k, v, mask, progress, sinks
        As in :func:`forward_problem`.
    dout, out, lse
        The output's gradient, the forward's ``out`` and ``lse``.

    Returns
    -------
    tuple
        ``dq, dk, dv`` in the call's dtype, and ``dsinks`` (float64 host ``(H,)``, summed over
        every rank) when the call has sinks.
    """
    sinks = pb.sinks if sinks is None else sinks
    acc = pb.spec.acc_dtype
    D = (dout.astype(acc) * out.astype(acc)).sum(axis=-1)
    with c.abort_on_error():
        dq, dk, dv = pb.strategy.backward(c, pb, dout, q, k, v, out, lse, D, mask, progress)
    dt = pb.spec.dtype
    grads = (dq.astype(dt, copy=False), dk.astype(dt, copy=False), dv.astype(dt, copy=False))
    if sinks is None:
        return grads
    return grads + (sink_gradient(c, sinks, lse.astype(acc, copy=False), D),)


def plan_attention(q: Any, k: Any, v: Any, comm: Any = None, *, key_padding_mask: Any = None,
                   segment_ids: Any = None, kv_segment_ids: Any = None, attn_mask: Any = None,
                   mask_mod: Any = None, score_mod: Any = None, alibi_slopes: Any = None,
                   sinks: Any = None, softcap: float | None = None, max_logit: bool = False,
                   score: Score | None = None, **options: Any) -> AttentionPlan:
    """Validate, agree and plan an attention call once (collective); see the module docstring.

    Parameters
    ----------
    q, k, v : arrays, shapes (B, H, n_r, E), (B, Hkv, m_r, E), (B, Hkv, m_r, Ev)
        This rank's arrays of the shapes to plan for (as :func:`mpiattn.attention`; their
        values are checked for NaN and Inf when ``check_finite``).
    comm : mpi4py.MPI.Intracomm, optional
    key_padding_mask : bool array, shape (B, m_r), optional
        A mask of the shape later calls pass (its values may differ per call).
    segment_ids, kv_segment_ids : integer arrays, optional
        The documents: part of the plan (gathered once; another set needs another plan).
    attn_mask, mask_mod, score_mod, alibi_slopes, softcap, max_logit : optional
        Score modifiers (as :func:`mpiattn.attention`): part of the plan.
    sinks : array (H,), optional
        The sinks; a call may pass new values (``forward(..., sinks=)``), e.g. a training step's.
    score : mpiattn.Score, optional
        The score modifiers as one object (as :func:`mpiattn.attention`).
    **options
        :class:`mpiattn.Options` fields, or ``options=``.

    Returns
    -------
    AttentionPlan

    Raises
    ------
    ValueError, TypeError
        On every rank alike, as :func:`mpiattn.attention`.

    Examples
    --------
    >>> import numpy as np, mpiattn
    >>> x = np.random.default_rng(0).standard_normal((1, 2, 6, 4))
    >>> plan = mpiattn.plan_attention(x, x, x, causal=True)
    >>> out, lse = plan.forward(x, x, x)
    >>> dq, dk, dv = plan.backward(np.ones_like(out), x, x, x, out, lse)
    >>> bool(np.allclose(out[:, :, 0], x[:, :, 0]))
    True
    """
    c = get_comm(comm)
    pb = validate(c, Arguments(q, k, v, key_padding_mask=key_padding_mask, segment_ids=segment_ids,
                               kv_segment_ids=kv_segment_ids, settings=options,
                               score=Score.of(score, attn_mask=attn_mask, mask_mod=mask_mod,
                                              score_mod=score_mod, alibi_slopes=alibi_slopes,
                                              sinks=sinks, softcap=softcap, max_logit=max_logit)))
    B, H, n, _ = q.shape
    shapes = {"q": (tuple(q.shape), q.dtype), "k": (tuple(k.shape), k.dtype),
              "v": (tuple(v.shape), v.dtype), "dout": ((B, H, n, v.shape[3]), q.dtype),
              "out": ((B, H, n, v.shape[3]), q.dtype), "lse": ((B, H, n), None)}
    padding = None if key_padding_mask is None else tuple(key_padding_mask.shape)
    return AttentionPlan(c, pb, shapes, padding)


def reuse_or_plan(plan: AttentionPlan | None, q: Any, k: Any, v: Any, c: Comm, *,
                  key_padding_mask: Any = None, **options: Any) -> AttentionPlan:
    """``plan`` when every rank's arrays and options fit it, else a new plan for them
    (collective; the same answer on every rank).

    What a layer that attends arrays of the same shapes call after call keeps between calls
    (:class:`mpiattn.MultiheadAttention`, :class:`mpiattn.torch.MultiheadAttention`): while the
    shapes stay, a call costs :meth:`AttentionPlan.fits` (one small agreement) instead of a
    validation.

    Parameters
    ----------
    plan : AttentionPlan or None
        The plan of the previous call (None: none yet).
    q, k, v, c, key_padding_mask
        As in :func:`plan_attention` (``c`` a Comm: a plan of another one never fits).
    **options
        :class:`mpiattn.Options` fields, or ``options=``.

    Returns
    -------
    AttentionPlan
    """
    if plan is not None and plan.comm is c and plan.fits(q, k, v, key_padding_mask=key_padding_mask,
                                                          options=options):
        return plan
    return plan_attention(q, k, v, c, key_padding_mask=key_padding_mask, **options)
