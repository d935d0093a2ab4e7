"""Sphinx configuration for the pingpong documentation.

Build (warnings are errors)::

    pip install -r docs/requirements.txt   # or: pip install -e .[docs]
    sphinx-build -W -b html docs docs/_build/html
"""

from __future__ import annotations

import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
# Document the checkout next to this file, even without an editable install.
sys.path.insert(0, str(ROOT))

import pingpong  # noqa: E402

project = "pingpong"
author = "the pingpong developers"
copyright = "2026, the pingpong developers"
release = pingpong.__version__
version = release

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    # Markdown pages: reliability.md and the benchmark result files that
    # benchmarks/*.py write (docs/benchmarks/*.md).
    "myst_parser",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store", "requirements.txt"]

# -- autodoc / napoleon (Google-style "Args:" / "Raises:" docstrings) --------
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"members": True, "show-inheritance": True}
autoclass_content = "class"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
# Render "Attributes:" sections as field lists, not attribute directives that
# would duplicate autodoc's own entries (e.g. Batch's named-tuple fields).
napoleon_use_ivar = True

# -- MyST ------------------------------------------------------------------
myst_heading_anchors = 3

# -- HTML ------------------------------------------------------------------
html_theme = "alabaster"
html_title = f"pingpong {release}"
html_theme_options = {
    "description": "Mini-batch GNN training that stops waiting for data.",
    "fixed_sidebar": True,
}
html_static_path: list[str] = []
