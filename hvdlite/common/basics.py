"""init / shutdown and the rank vocabulary, delegating to one Runtime object.

The module keeps exactly one piece of state, ``_STATE.runtime``; frameworks
(hvdlite.torch, later hvdlite.tensorflow) share it.  ``shutdown()`` followed by
``init()`` builds a fresh runtime and transport each time (elastic training
relies on that).
"""

import atexit
import logging
import threading
from typing import Optional

from hvdlite.common.config import Config
from hvdlite.common.exceptions import HvdliteInternalError, HvdliteNotInitializedError

log = logging.getLogger("hvdlite")


class _State:
    def __init__(self):
        self.lock = threading.RLock()
        self.runtime = None
        self.config: Optional[Config] = None
        self.generation = 0
        self.atexit_registered = False


_STATE = _State()


def _make_backend(config: Config):
    from hvdlite.common.backend.mpi import launched_by_mpi, mpi_available
    choice = config.cpu_operations
    if not choice:
        if launched_by_mpi() and mpi_available():
            choice = "mpi"
        elif config.size > 1:
            choice = "gloo"
        else:
            choice = "local"
    if choice == "mpi":
        from hvdlite.common.backend.mpi import MPIBackend
        return MPIBackend(config)
    if choice == "gloo" and config.size > 1:
        from hvdlite.common.backend.gloo import GlooBackend
        return GlooBackend(config, _STATE.generation)
    from hvdlite.common.backend.local import LocalBackend
    return LocalBackend(config)


def init(config: Optional[Config] = None) -> None:
    """Start the runtime (idempotent while initialized)."""
    with _STATE.lock:
        if _STATE.runtime is not None and _STATE.runtime.running():
            return
        if _STATE.runtime is not None:      # stopped by a peer or a failure: start over
            _shutdown_locked()
        from hvdlite.common.runtime import Runtime
        config = config or Config.from_env()
        logging.getLogger("hvdlite").setLevel(config.log_level)
        for on, what in ((config.timeline_filename, "the timeline (--timeline-filename)"),
                         (config.autotune, "autotuning (--autotune)")):
            if on:
                log.warning("%s is not implemented in this version of hvdlite; ignored", what)
        backend = _make_backend(config)
        config = config.replace(rank=backend.rank, size=backend.size,
                                local_rank=backend.local_rank, local_size=backend.local_size,
                                cross_rank=backend.cross_rank, cross_size=backend.cross_size)
        _STATE.generation += 1
        runtime = Runtime(config, backend)
        runtime.start()
        _STATE.runtime = runtime
        _STATE.config = config
        if not _STATE.atexit_registered:
            atexit.register(shutdown)
            _STATE.atexit_registered = True


def _shutdown_locked() -> None:
    runtime, _STATE.runtime = _STATE.runtime, None
    if runtime is None:
        return
    wait_s = runtime.config.op_timeout_s + 5.0
    if not runtime.stop(wait_s):
        raise HvdliteInternalError(
            f"rank {runtime.rank}: the background thread did not exit within {wait_s:.0f}s of "
            f"shutdown(); a peer may be hung (see --op-timeout-seconds)")


def shutdown() -> None:
    """Stop the runtime on this rank (and tell the other ranks); idempotent."""
    with _STATE.lock:
        _shutdown_locked()


def is_initialized() -> bool:
    return _STATE.runtime is not None


def runtime():
    """The live runtime; raises if init() was not called (or shutdown() was)."""
    rt = _STATE.runtime
    if rt is None:
        raise HvdliteNotInitializedError(
            "hvdlite has not been initialized; call hvd.init() first")
    return rt


def config() -> Config:
    """The configuration this rank's runtime was started with."""
    runtime()
    return _STATE.config


_cfg = config


def rank() -> int:
    return _cfg().rank


def size() -> int:
    return _cfg().size


def local_rank() -> int:
    return _cfg().local_rank


def local_size() -> int:
    return _cfg().local_size


def cross_rank() -> int:
    return _cfg().cross_rank


def cross_size() -> int:
    return _cfg().cross_size


def is_homogeneous() -> bool:
    cfg = _cfg()
    return cfg.size == cfg.local_size * cfg.cross_size


def backend_name() -> str:
    return runtime().backend.name


def gloo_enabled() -> bool:
    return is_initialized() and backend_name() == "gloo"


def mpi_enabled() -> bool:
    return is_initialized() and backend_name() == "mpi"


def gloo_built() -> bool:
    try:
        import torch.distributed as dist
        return dist.is_gloo_available()
    except ImportError:
        return False


def mpi_built() -> bool:
    from hvdlite.common.backend.mpi import mpi_available
    return mpi_available()
