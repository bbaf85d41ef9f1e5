"""What a score is: which (query, key) pairs a call may use and how their scores are formed, in one place.

``spec``
    :class:`MaskSpec`, the rules of a call (causal, window, documents,
    padding), the modifiers it uses, and their checks;
``score``
    :class:`~mpiattn.masks.score.Score`: every score modifier of a call as one object, checked
    and agreed by one rule;
``modifiers``
    :class:`Modifiers`: softcap, ALiBi, ``attn_mask``, ``mask_mod`` (one rank's arrays);
``maskmod``
    :class:`MaskMod`, a ``mask_mod`` with a name, parameters and its own tile rule;
``mods``
    the named mask rules, one module each (``chunked``, ...), found by their registry;
``softcap``
    :class:`~mpiattn.masks.softcap.Softcap`, the one score transform ``c tanh(x / c)``: its
    formula and chain rule, which every kernel calls;
``scoremod``, ``temperature``, ``relbias``
    a user's transform (``ScoreMod``), a per-head temperature and a relative-position bias
    from a table (``RelativeBias``: Toeplitz views, no per-score gather), the other transforms;
``sinks``
    learnable sinks, added to each merged row, and their gradient;
``tiles``
    :class:`BlockMask`, the rules decided per tile of one block (none, all
    or some pairs visible), on the host;
``dense``
    the rules materialised, for references and cross-checks;
``ids``
    document ids and padding gathered whole, for every rank.
"""

from __future__ import annotations

from .dense import visible
from .maskmod import MaskMod
from .modifiers import MODIFIERS, Modifiers
from .spec import ALIGNMENTS, RULES, MaskSpec, check_causal, check_window, diagonal, softmax_scale
from .tiles import BlockMask, QuerySide, block_mask, padding_bias

__all__ = ["RULES", "ALIGNMENTS", "MaskSpec", "check_window", "check_causal", "diagonal",
           "softmax_scale", "BlockMask", "QuerySide", "block_mask", "padding_bias", "visible",
           "MODIFIERS", "Modifiers", "MaskMod"]
