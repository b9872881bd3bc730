"""Make this process behave as if torch were not installed (tests only).

:func:`block_torch` puts a finder first on ``sys.meta_path`` that refuses ``torch`` and every
``torch.*`` module with the ImportError a missing package raises, so code that probes for
torch (``import torch`` in a ``try``) takes its no-torch path.  Call it before anything
imports hvdlite.
"""

import importlib.abc
import sys


class _TorchBlocker(importlib.abc.MetaPathFinder):
    """Refuses torch like an environment without it."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "torch" or fullname.startswith("torch."):
            raise ModuleNotFoundError(
                f"No module named {fullname!r} (blocked by the test)", name=fullname
            )
        return None


def block_torch() -> None:
    """Refuse torch from now on in this process (torch must not be imported yet)."""
    loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
    if loaded:
        raise RuntimeError(f"block_torch(): torch is already imported ({loaded[:3]})")
    if not any(isinstance(f, _TorchBlocker) for f in sys.meta_path):
        sys.meta_path.insert(0, _TorchBlocker())


def torch_modules() -> list:
    """The torch modules this process has imported (none, if the blocker held)."""
    return sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
