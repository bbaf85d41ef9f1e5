"""The named mask rules (:class:`mpiattn.masks.maskmod.MaskMod`), one module each, found here.

Every module of this package that defines a :class:`~mpiattn.masks.maskmod.MaskMod`
subclass with a ``name`` adds it to the registry; nothing else lists them.
Pass one as ``mask_mod=`` to any call (:func:`mpiattn.attention`,
:func:`mpiattn.balance`, :func:`mpiattn.torch.attention`, ...), or name it on the
command line (``run --mask-mod chunked:4096``).

>>> from mpiattn.masks import mods
>>> mods.parse("chunked:4")
Chunked(size=4)
>>> sorted(mods.MASK_MODS)[:1]
['chunked']
"""

from __future__ import annotations

import importlib
import pkgutil

from ..maskmod import MaskMod

__all__ = ["MASK_MODS", "parse", "names"]


def _found() -> dict[str, type[MaskMod]]:
    """Every ``MaskMod`` subclass defined in a module of this package, by its ``name``."""
    out: dict[str, type[MaskMod]] = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        module = importlib.import_module(f"{__name__}.{info.name}")
        for obj in vars(module).values():
            if (isinstance(obj, type) and issubclass(obj, MaskMod) and obj is not MaskMod
                    and obj.__module__ == module.__name__ and obj.name):
                if obj.name in out:
                    raise RuntimeError(f"two mask_mods are named {obj.name!r}: "
                                       f"{out[obj.name].__module__} and {module.__name__}")
                out[obj.name] = obj
    return out


#: The named rules: ``name -> MaskMod subclass``.
MASK_MODS: dict[str, type[MaskMod]] = _found()


def names() -> tuple[str, ...]:
    """The rules' names, sorted."""
    return tuple(sorted(MASK_MODS))


def parse(text: str) -> MaskMod:
    """The rule written ``name:p1,p2`` (:attr:`MaskMod.key`), e.g. ``chunked:4096``.

    Raises ValueError naming the known rules for an unknown name, and the rule's own
    message for wrong parameters.
    """
    name, _, args = str(text).partition(":")
    cls = MASK_MODS.get(name.strip())
    if cls is None:
        raise ValueError(f"unknown mask_mod {name.strip()!r}; expected one of {', '.join(names())} "
                         "(written name:PARAMETERS, e.g. chunked:4096)")
    return cls.parse(args)
