"""Which recorders watch the live runtime: the caller's, rank 0's timeline and autotuner.

Kept apart from ``basics.py`` so that init/shutdown only call :func:`attach` and
:func:`detach`; the timeline can also be started and stopped while the job runs
(``hvd.start_timeline`` / ``hvd.stop_timeline``).  Only rank 0 writes a timeline
and only rank 0 tunes (its decisions travel to the others in the control vector).

The recorders wanted are joined by :func:`recorder.combine` (a :class:`Tee` when
several are active) and handed over with ``Runtime.set_recorder``, which the
background thread takes at its next cycle start, so no group is reported half.
"""

import os
import threading
import time
from typing import Dict, Optional

from hvdlite.common.diagnostics.recorder import NULL, Recorder, combine


class _Observers:
    def __init__(self, runtime, user: Recorder):
        self.runtime = runtime
        self.user = user
        self.timeline = None
        self.autotuner = None

    def install(self, timeout_s: float = 2.0) -> None:
        """Hand the runtime the recorders now wanted (a finished autotuner no longer is) and
        wait until its thread took them, so two swaps never race."""
        tuner = self.autotuner
        if tuner is not None and tuner.finished.is_set():
            tuner = None
        runtime = self.runtime
        runtime.set_recorder(
            combine([r for r in (self.user, self.timeline, tuner) if r is not None])
        )
        deadline = time.monotonic() + timeout_s
        while runtime.running() and not runtime.recorder_switched() and time.monotonic() < deadline:
            time.sleep(0.001)

    def retire_autotuner(self) -> None:
        """The tuner kept its best: stop paying for its events (it stays for inspection)."""
        with _LOCK:
            if _CURRENT is self:
                self.install()


_LOCK = threading.Lock()
_CURRENT: Optional[_Observers] = None
#: timeline paths this process has written from the configuration, and how often
_CONFIGURED_PATHS: Dict[str, int] = {}


def _fresh_path(path: str) -> str:
    """``path`` the first time; ``trace.1.json``, ``trace.2.json``, ... at later ``init()``s of
    this process (an elastic reset, a benchmark's restart), so a new runtime never
    overwrites the trace of the one before."""
    n = _CONFIGURED_PATHS.get(path, 0)
    _CONFIGURED_PATHS[path] = n + 1
    if n == 0:
        return path
    stem, ext = os.path.splitext(path)
    return f"{stem}.{n}{ext}"


def attach(runtime, config, user: Recorder = NULL) -> None:
    """Give a new (not yet started) runtime its recorders, as ``config`` asks.

    Raises:
        HvdliteConfigError: the timeline file cannot be written, or autotuning lacks
            scikit-optimize.
    """
    global _CURRENT
    obs = _Observers(runtime, user)
    try:
        if runtime.rank == 0 and config.timeline_filename:
            obs.timeline = _new_timeline(
                runtime, _fresh_path(config.timeline_filename), config.timeline_mark_cycles
            )
        if runtime.rank == 0 and config.autotune:
            from hvdlite.common.engine.autotune import Autotuner

            obs.autotuner = Autotuner(
                config, runtime.propose_parameters, runtime.params, on_finish=obs.retire_autotuner
            )
    except BaseException:
        if obs.timeline is not None:
            obs.timeline.close()
        runtime.backend.close()  # the runtime never started; nothing else owns it
        raise
    with _LOCK:
        _CURRENT = obs
    if obs.timeline or obs.autotuner:
        obs.install()


def _new_timeline(runtime, path: str, mark_cycles: bool):
    from hvdlite.common.diagnostics.timeline_writer import Timeline

    return Timeline(
        path,
        mark_cycles=mark_cycles,
        backend_name=getattr(runtime.backend, "name", ""),
        max_bytes=runtime.config.timeline_max_bytes,
    )


def detach() -> None:
    """The runtime stopped: finish the timeline file and stop the tuner."""
    global _CURRENT
    with _LOCK:
        obs, _CURRENT = _CURRENT, None
    if obs is None:
        return
    if obs.autotuner is not None:
        obs.autotuner.close()
    if obs.timeline is not None:
        obs.timeline.close()


def current():
    """The live observers (tests and benchmarks read ``.timeline`` / ``.autotuner``)."""
    return _CURRENT


def start_timeline(runtime, path: str, mark_cycles: bool = False) -> None:
    """Start (or restart into ``path``) rank 0's timeline; other ranks do nothing."""
    if runtime.rank != 0:
        return
    stop_timeline(runtime)
    with _LOCK:
        obs = _CURRENT
        if obs is None or obs.runtime is not runtime:
            return
        obs.timeline = _new_timeline(runtime, path, mark_cycles)
        obs.install()


def stop_timeline(runtime, timeout_s: float = 2.0) -> None:
    """Stop rank 0's timeline and close its file (complete JSON); idempotent."""
    with _LOCK:
        obs = _CURRENT
        if obs is None or obs.runtime is not runtime or obs.timeline is None:
            return
        timeline, obs.timeline = obs.timeline, None
        obs.install(timeout_s)  # returns once the loop no longer calls it
    timeline.close()
