"""hvdlite: a Horovod-style distributed training runtime (Gloo and MPI) in Python.

``import hvdlite`` stays light: ``hvdlite.run`` (Horovod's ``horovod.run``) is
imported from the launcher only when first used.
"""

from hvdlite.version import __version__  # noqa: F401

__all__ = ["__version__", "run"]


def __getattr__(name):
    """Lazily provide :func:`hvdlite.runner.api.run` as ``hvdlite.run``."""
    if name == "run":
        from hvdlite.runner.api import run

        return run
    raise AttributeError(f"module 'hvdlite' has no attribute {name!r}")
