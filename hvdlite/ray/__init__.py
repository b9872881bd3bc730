"""hvdlite on a Ray cluster: ``from hvdlite.ray import RayExecutor`` (as ``horovod.ray``).

Imports Ray only when an executor starts, so ``import hvdlite.ray`` works without it
installed (``pip install hvdlite[ray]`` brings it).
"""

from hvdlite.ray.ray_executor import HvdliteRayError, RayExecutor, RaySettings  # noqa: F401

__all__ = ["RayExecutor", "RaySettings", "HvdliteRayError"]
