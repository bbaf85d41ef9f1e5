"""Sphinx configuration of mpiattn's documentation site.

Build (warnings are errors; the second command runs every ``>>>`` example of the
docstrings shown in the API reference, in one process)::

    pip install -e ".[mpich,docs]"
    sphinx-build -W -b html docs docs/_build/html
    sphinx-build -W -b doctest docs docs/_build/doctest

The pages are the Markdown files of this folder (MyST); the API reference is
generated from the numpydoc docstrings (``api.rst``).
"""

import os
import sys

sys.path.insert(0, os.path.abspath(".."))

from mpiattn import __version__  # noqa: E402

project = "mpiattn"
author = "the mpiattn developers"
copyright = "2020-2026, the mpiattn developers"  # noqa: A001
release = version = __version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.doctest",
    "sphinx.ext.mathjax",
    "numpydoc",
    "myst_parser",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]
root_doc = "index"

# API reference: numpydoc renders the docstrings; members are listed by autosummary
autosummary_generate = True
autodoc_default_options = {"members": True, "undoc-members": False, "show-inheritance": False}
autodoc_typehints = "none"            # the numpydoc sections carry the types
numpydoc_show_class_members = False   # classes document their attributes themselves
numpydoc_class_members_toctree = False
numpydoc_xref_param_type = False

# doctests: the docstrings' examples, run in one process (COMM_WORLD of size 1)
doctest_test_doctest_blocks = "default"
doctest_global_setup = "import numpy as np"

# Markdown pages: headings become anchors; links to files of the repository that are not
# pages of this site (tests/README.md, jobs/, benchmarks/) stay plain links
myst_heading_anchors = 3
suppress_warnings = ["myst.xref_missing"]

html_theme = "alabaster"
html_static_path: list = []
html_title = f"mpiattn {release}"


def setup(app):
    """The ``layers`` fence of architecture.md (read by tests/core/test_architecture.py) is plain text."""
    from pygments.lexers.special import TextLexer

    app.add_lexer("layers", TextLexer)
