"""``python -m mpiattn`` and the ``mpiattn`` script: see :mod:`mpiattn.cli`."""

import sys
import threading

from .cli.startup import Watcher  # light: the signals are caught before the heavy imports


def program() -> int:
    """The program: signals watched from here on, then the imports, MPI and the command line
    (:mod:`mpiattn.cli.startup`); returns the exit code."""
    watcher = Watcher() if threading.current_thread() is threading.main_thread() else None
    from .cli.dispatch import main

    return main(watcher=watcher)


if __name__ == "__main__":
    sys.exit(program())
