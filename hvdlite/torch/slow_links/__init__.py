"""For links too slow to reduce every gradient at every step (two sites, 100 Mbit/s, cheap
cloud networking): talk less often (:class:`DiLoCo`: inner steps alone, an outer step on
the averaged change every few of them) and send fewer bytes (:class:`Int8`: 8-bit
exchanges with a scale per chunk and error feedback, for ``DistributedOptimizer`` and for
DiLoCo's outer step)."""

from hvdlite.torch.slow_links.int8 import Int8  # noqa: F401

__all__ = ["DiLoCo", "Int8"]


def __getattr__(name):
    """``DiLoCo`` on first use: ``hvdlite.torch.compression`` imports ``Int8`` from here,
    and DiLoCo's module needs the optimizer, which needs the compression module."""
    if name == "DiLoCo":
        from hvdlite.torch.slow_links.diloco import DiLoCo

        return DiLoCo
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
