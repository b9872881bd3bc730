"""The package version, in a leaf module of its own.

``hvdlite/__init__.py`` re-exports it and the launcher prints it; keeping it
out of ``__init__`` lets the launcher read it without importing the package
module that lazily exposes :func:`hvdlite.run` (which would be an import cycle).
"""

__version__ = "0.1.0"
