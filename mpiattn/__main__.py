"""``python -m mpiattn``: see :mod:`mpiattn.cli`."""

import sys

from .cli.main import main

if __name__ == "__main__":
    sys.exit(main())
