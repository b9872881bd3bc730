"""init / shutdown and the rank vocabulary, delegating to one Runtime object.

The module keeps one piece of state, ``_STATE``: the live runtime, its config
and the rendezvous round this process last joined; the framework adapters
(hvdlite.torch, hvdlite.tensorflow) share it.  ``shutdown()`` followed by ``init()``
builds a fresh runtime and transport each time, in the next rendezvous round
(elastic training relies on that).  Under Gloo a rank learns its place (rank,
size, local and cross ranks) from the round's plan, keyed by its host and
local slot, so a fresh process can join survivors that are at their N-th
init.  A process whose slot has no place in the newest round (a stale one, or
its host left the job) is refused at once.  Under MPI the place comes from MPI
itself and there are no rounds: :func:`rendezvous_round` stays -1.  Layers
above register reset hooks (names, counters, caches) that run at every
``init()`` and ``shutdown()``.

``init()`` also calls ``gc.freeze()`` (``HVDLITE_GC_FREEZE``, on by default;
``--no-gc-freeze``).  Every op makes a few small objects that live until its
group completes, so a step of many small ops promotes thousands of them and
Python then runs a full collection every few steps, which would walk every
object torch brings.  Frozen, the objects alive at init (modules, classes)
are left out of those passes, which then stay short.
"""

import atexit
import gc
import inspect
import logging
import threading
import weakref
from typing import Callable, List, Optional

from hvdlite.common import arrays
from hvdlite.common.diagnostics import exit_report
from hvdlite.common.diagnostics import flight_recorder
from hvdlite.common.diagnostics import metrics_counters
from hvdlite.common.diagnostics import observers
from hvdlite.common.slurm import srun_step
from hvdlite.common.backend.local import LocalBackend
from hvdlite.common.backend.mpi import launched_by_mpi, mpi_available
from hvdlite.common.config import Config
from hvdlite.common.exceptions import (
    HvdliteConfigError,
    HvdliteInternalError,
    HvdliteNotInitializedError,
)
from hvdlite.common.diagnostics.recorder import NULL, Recorder
from hvdlite.common.engine.runtime import Runtime

log = logging.getLogger("hvdlite")


class _State:
    def __init__(self):
        self.lock = threading.RLock()
        self.runtime = None
        self.config: Optional[Config] = None
        #: the rendezvous round this process last joined (-1: none yet), and its job's id
        self.last_round = -1
        self.last_job: Optional[str] = None
        self.atexit_registered = False
        #: callables returning a hook, or None once its owner is gone
        self.reset_hooks: List[Callable[[], Optional[Callable[[], None]]]] = []
        #: run once, before this process first joins an elastic job (register_warmup)
        self.warmups: List[Callable[[], None]] = []


_STATE = _State()


def register_reset_hook(hook: Callable[[], None]) -> None:
    """Run ``hook()`` at every ``init()`` and ``shutdown()`` (resets names, counters, caches).

    A bound method is held weakly: registering an object's method does not keep the
    object alive, and the hook goes away with it.
    """
    ref = weakref.WeakMethod(hook) if inspect.ismethod(hook) else (lambda: hook)
    with _STATE.lock:
        _STATE.reset_hooks.append(ref)


def register_warmup(warmup: Callable[[], None]) -> None:
    """Run ``warmup()`` before this process first joins an elastic job's round.

    A worker that joins running survivors makes them wait for whatever it does between
    ``init()`` and its first collective; slow first-use work (a framework's lazy imports)
    done here instead is done while it waits to join.  A failing warm-up is logged and
    skipped: the work is then done later, as without it."""
    with _STATE.lock:
        _STATE.warmups.append(warmup)


def _warm_up(config: Config) -> None:
    if not config.elastic or _STATE.last_round >= 0:
        return
    for warmup in _STATE.warmups:
        try:
            warmup()
        except Exception as exc:  # noqa: BLE001 - an optimisation only
            log.debug("warm-up %r failed: %s", warmup, exc)


def _run_reset_hooks() -> None:
    alive = []
    for ref in _STATE.reset_hooks:
        hook = ref()
        if hook is not None:
            hook()
            alive.append(ref)
    _STATE.reset_hooks[:] = alive


def _make_backend(config: Config, comm=None):
    """The backend ``Config.cpu_operations`` names (``mpi``, ``gloo`` or ``local``); when
    it names none, MPI if MPI started this process and mpi4py is there, else Gloo for
    more than one rank, else the 1-rank local backend."""
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

        return MPIBackend.for_job(config.op_timeout_s, comm)
    if comm is not None:
        raise ValueError(
            f"hvd.init(comm=...) chooses MPI processes, but this job runs "
            f"{choice!r} (start it with hvdlite-run --mpi or mpiexec; under Gloo "
            f"use process sets for subsets of ranks)"
        )
    if choice == "gloo" and (config.size > 1 or config.rendezvous_addr is not None):
        _require_torch_for_gloo(config)
        from hvdlite.common.backend.gloo import GlooBackend

        return GlooBackend.for_job(config, _STATE.last_round)
    return LocalBackend(config)


def _require_torch_for_gloo(config: Config) -> None:
    """Refuse Gloo at once, on every rank alike, when torch is missing: the transport is
    torch.distributed's, so the job could only fail later (or hang on a peer that has it).

    Raises:
        HvdliteConfigError: torch cannot be imported.
    """
    if arrays.have_torch():
        return
    raise HvdliteConfigError(
        f"rank {config.rank}: the Gloo transport comes from torch.distributed, and torch is "
        f"not installed here; install torch (pip install torch), or run the job on MPI "
        f"(hvdlite-run --mpi ..., or mpiexec)"
    )


def start_runtime(config: Optional[Config] = None, recorder: Recorder = NULL, comm=None) -> None:
    """Start the runtime (idempotent while it runs): the part of ``hvd.init()``
    (:func:`hvdlite.common.rank_setup.init`, the only ``init``) below process sets.

    ``recorder`` receives the background thread's phase boundaries (default: none).
    ``comm`` (MPI only) picks the job's processes: an mpi4py communicator or a list of
    MPI_COMM_WORLD ranks.
    """
    with _STATE.lock:
        if _STATE.runtime is not None and _STATE.runtime.running():
            return
        if _STATE.runtime is not None:  # stopped by a peer or a failure: start over
            _shutdown_locked()
        if config is None:
            srun_step.adopt()
            config = Config.from_env()
        logging.getLogger("hvdlite").setLevel(config.log_level)
        _run_reset_hooks()
        _warm_up(config)
        # the slot this process joins rounds with, before the round renumbers it
        exit_report.install(
            config.rendezvous_addr,
            config.rendezvous_port,
            config.secret_key,
            config.hostname,
            config.local_rank,
        )
        if config.job_id != _STATE.last_job:
            # a process reused by a new job (a Ray actor, a Spark Python worker) joins the
            # new job's store from its first round
            _STATE.last_round = -1
        if config.torch_store_addr is not None and config.secret_key is None:
            from hvdlite.common.backend.torch_store_client import job_key

            config = config.replace(secret_key=job_key(config))
        backend = _make_backend(config, comm)
        _STATE.last_job = config.job_id
        config = config.replace(
            rank=backend.rank,
            size=backend.size,
            local_rank=backend.local_rank,
            local_size=backend.local_size,
            cross_rank=backend.cross_rank,
            cross_size=backend.cross_size,
        )
        exit_report.name_rank(backend.rank)
        _STATE.last_round = getattr(backend, "round", _STATE.last_round)
        flight_recorder.configure(config)
        runtime = Runtime(config, backend, recorder)
        observers.attach(runtime, config, recorder)
        runtime.start()
        metrics_counters.start_reporting(runtime, config)
        _STATE.runtime = runtime
        _STATE.config = config
        if config.gc_freeze:
            gc.freeze()
        if not _STATE.atexit_registered:
            atexit.register(shutdown)
            _STATE.atexit_registered = True


def _shutdown_locked() -> None:
    runtime, _STATE.runtime = _STATE.runtime, None
    if runtime is None:
        return
    _run_reset_hooks()
    wait_s = runtime.config.op_timeout_s + 5.0
    stopped = runtime.stop(wait_s)
    observers.detach()
    if not stopped:
        raise HvdliteInternalError(
            f"rank {runtime.rank}: the background thread did not exit within {wait_s:.0f}s of "
            f"shutdown(); a peer may be hung (see --op-timeout-seconds)"
        )


def shutdown() -> None:
    """Stop the runtime on this rank (and tell the other ranks); idempotent."""
    with _STATE.lock:
        _shutdown_locked()


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start writing rank 0's timeline to ``file_path`` (as ``--timeline-filename`` does);
    a running timeline is finished first.  Other ranks do nothing.

    Args:
        file_path: the Chrome-trace JSON file rank 0 writes.
        mark_cycles: also mark each cycle of the background thread in the timeline.

    Raises:
        HvdliteNotInitializedError: ``init()`` was not called (or ``shutdown()`` was).
    """
    observers.start_timeline(runtime(), file_path, mark_cycles)


def stop_timeline() -> None:
    """Stop rank 0's timeline and finish its file; idempotent."""
    observers.stop_timeline(runtime())


def is_initialized() -> bool:
    """Whether ``init()`` has run on this rank (and ``shutdown()`` not since)."""
    return _STATE.runtime is not None


def current_runtime():
    """The live runtime, or None (for waits that must notice a shutdown)."""
    return _STATE.runtime


def rendezvous_round() -> int:
    """The rendezvous round this process last joined (-1: none, e.g. MPI or one rank)."""
    return _STATE.last_round


def forget_rendezvous() -> None:
    """Shut down if running and forget the round this process joined, so its next
    ``init()`` joins another job's store from that job's first round (a process reused
    across jobs, as Spark reuses its Python workers)."""
    if is_initialized():
        shutdown()
    _STATE.last_round = -1


def newest_rendezvous_round() -> int:
    """The newest round the launcher has opened; newer than :func:`rendezvous_round` when
    the job's membership changed since this process joined (elastic mode)."""
    return runtime().backend.newest_round()


def runtime():
    """The live runtime; raises if init() was not called (or shutdown() was)."""
    rt = _STATE.runtime
    if rt is None:
        raise HvdliteNotInitializedError("hvdlite has not been initialized; call hvd.init() first")
    return rt


def config() -> Config:
    """The configuration this rank's runtime was started with."""
    runtime()
    started = _STATE.config
    if started is None:  # never: init() sets both together
        raise HvdliteNotInitializedError("hvdlite has no configuration; call hvd.init() first")
    return started


def rank() -> int:
    """This process's rank in the job, from 0 to ``size() - 1``.

    Returns:
        An int.

    Raises:
        HvdliteNotInitializedError: ``init()`` was not called (or ``shutdown()`` was).
    """
    return config().rank


def size() -> int:
    """The number of processes (ranks) in the job.

    Returns:
        An int.

    Raises:
        HvdliteNotInitializedError: ``init()`` was not called (or ``shutdown()`` was).
    """
    return config().size


def local_rank() -> int:
    """This process's rank among the processes of its host.

    Returns:
        An int.

    Raises:
        HvdliteNotInitializedError: ``init()`` was not called (or ``shutdown()`` was).
    """
    return config().local_rank


def local_size() -> int:
    """The number of the job's processes on this process's host.

    Returns:
        An int.

    Raises:
        HvdliteNotInitializedError: ``init()`` was not called (or ``shutdown()`` was).
    """
    return config().local_size


def cross_rank() -> int:
    """The rank of this process's host: its index among the processes that have
    the same local rank.

    Returns:
        An int.

    Raises:
        HvdliteNotInitializedError: ``init()`` was not called (or ``shutdown()`` was).
    """
    return config().cross_rank


def cross_size() -> int:
    """The number of processes with this process's local rank (with the same number
    of processes on every host: the number of hosts).

    Returns:
        An int.

    Raises:
        HvdliteNotInitializedError: ``init()`` was not called (or ``shutdown()`` was).
    """
    return config().cross_size


def is_homogeneous() -> bool:
    """Whether every host runs the same number of processes.

    Returns:
        A bool.

    Raises:
        HvdliteNotInitializedError: ``init()`` was not called (or ``shutdown()`` was).
    """
    cfg = config()
    return cfg.size == cfg.local_size * cfg.cross_size


def backend_name() -> str:
    return runtime().backend.name


def gloo_enabled() -> bool:
    """Whether the runtime is initialized and runs over Gloo."""
    return is_initialized() and backend_name() == "gloo"


def mpi_enabled() -> bool:
    """Whether the runtime is initialized and runs over MPI."""
    return is_initialized() and backend_name() == "mpi"


def gloo_built() -> bool:
    """Whether Gloo is available here (torch with torch.distributed's Gloo)."""
    try:
        import torch.distributed as dist

        return dist.is_gloo_available()
    except ImportError:
        return False


def mpi_built() -> bool:
    """Whether MPI is available here (mpi4py with an MPI library)."""
    return mpi_available()


def nccl_built() -> bool:
    """hvdlite is a CPU build: no NCCL, DDL, oneCCL, CUDA or ROCm (Horovod's probes)."""
    return False


ddl_built = ccl_built = cuda_built = rocm_built = nccl_built


def mpi_threads_supported() -> bool:
    """Whether MPI runs with full thread support (MPI_THREAD_MULTIPLE); False off MPI."""
    if not mpi_enabled():
        runtime()  # raises the not-initialized error
        return False
    from mpi4py import MPI

    return MPI.Query_thread() == MPI.THREAD_MULTIPLE
