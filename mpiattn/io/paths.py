"""What is wrong with a path that cannot be used: told precisely, for one-line errors."""

from __future__ import annotations

import errno
import os

__all__ = ["missing"]


def missing(path: str, what: str) -> FileNotFoundError | OSError | None:
    """The error to raise when ``path`` (described as ``what``) cannot be reached, or None.

    Tells a missing file from a dangling symbolic link, a symbolic link
    loop and a directory that cannot be searched. The messages carry no
    ``[Errno N]`` prefix (they are printed as they are).
    """
    try:
        os.stat(path)
    except FileNotFoundError:
        if os.path.islink(path):
            return FileNotFoundError(f"{what} {path} is a symbolic link to {os.readlink(path)}, "
                                     "which does not exist")
        return FileNotFoundError(f"{what} {path} does not exist")
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return OSError(f"{what} {path} is a symbolic link loop (a link that leads back to "
                           "itself)")
        return OSError(f"{what} {path} cannot be reached: {exc.strerror}")
    return None
