"""``python -m mpiattn.bench [options]`` and the worker jobs' ``python -m mpiattn.bench --worker FILE``."""

import sys

from .app import main

sys.exit(main())
