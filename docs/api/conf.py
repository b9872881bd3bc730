"""Sphinx configuration of hvdlite's API reference (``make docs`` builds it into build/docs).

The pages are generated from the docstrings by autodoc; napoleon reads their Google-style
``Args:`` / ``Returns:`` / ``Raises:`` sections.  The checkout's own ``hvdlite`` is put first
on ``sys.path``, so the reference describes these sources and not an installed copy.
"""

import os
import sys

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, REPO)

from hvdlite.version import __version__  # noqa: E402

project = "hvdlite"
author = "the hvdlite authors"
copyright = "the hvdlite authors"
version = release = __version__

extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon"]

napoleon_google_docstring = True
napoleon_numpy_docstring = False

# each page's automodule lists ``:members:`` itself (the members of the module's __all__, or
# the names given); a default of True here would override an explicit list
autodoc_default_options = {"member-order": "bysource"}
autodoc_typehints = "signature"
# show defaults as written in the source (``op=Average``), not as their repr
autodoc_preserve_defaults = True
# a method without a docstring of its own (a Keras callback hook, a torch Module method)
# is left out rather than shown with its base class's text
autodoc_inherit_docstrings = False
# keep the reference about the API: TensorFlow's and torch's own log lines stay out of it
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

html_theme = "alabaster"
html_title = f"hvdlite {release} API reference"
exclude_patterns = ["_build"]
