"""Small JSON files (a machine description for the cost model): read, and written whole or not at all."""

from __future__ import annotations

import json
import os
from typing import Any

__all__ = ["read_json", "write_json"]


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


def write_json(path: str, obj: Any) -> None:
    """Write ``obj`` as JSON to ``path`` through a temporary file renamed over it (a reader sees
    the old file or the new one, never a part)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=2, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
