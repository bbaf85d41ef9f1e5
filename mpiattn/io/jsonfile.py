"""Small JSON files (a machine description for the cost model): read, and written whole or not at all."""

from __future__ import annotations

import json
import os
from typing import Any

__all__ = ["read_json", "write_json", "dump_json"]


def read_json(path: str) -> Any:
    """The JSON document in ``path``.

    Raises
    ------
    FileNotFoundError
        ``path`` does not exist.
    ValueError
        It cannot be read or is not JSON (the message names the file).
    """
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None


def dump_json(path: str, obj: Any) -> None:
    """Write ``obj`` as JSON to the new file ``path`` (flushed to disk)."""
    with open(path, "x", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def write_json(path: str, obj: Any) -> None:
    """Write ``obj`` as JSON to ``path`` (local): inside a temporary that names its writer
    (:class:`mpiattn.io.temporaries.Temporary`, which ``clean`` knows), then renamed over it,
    keeping an existing file's mode; a reader sees the old file or the new one, never a part."""
    from .naming import REPLACE, publish_together
    from .temporaries import Temporary

    tmp = Temporary.reserve(os.path.abspath(path))
    try:
        dump_json(tmp.data, obj)
        publish_together([(tmp.data, os.path.abspath(path), REPLACE)])
    finally:
        tmp.remove()
