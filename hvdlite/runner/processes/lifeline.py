"""Tie a child process's life to ours: when we die, even by SIGKILL, the kernel signals it.

Every process the launcher (or a host's task, or an MPI rank's output wrapper)
starts for a job is started through :func:`popen`, which asks Linux for a
*parent-death signal* (``prctl(PR_SET_PDEATHSIG)``) in the child before it
runs the command.  The ranks run in their own sessions (so that a tree kill
reaches their children), so nothing else would end them once the launcher is
gone: without this, ``kill -9`` of ``hvdlite-run`` leaves silent ranks running
forever.

Linux sends the signal when the *thread* that forked the child exits, not the
process.  Launch code runs on short-lived threads too (a task service answers
each connection on its own thread), so every child is forked from one spawner
thread that lives as long as the process (:class:`_Spawner`).

Elsewhere (not Linux) :func:`popen` is plain ``subprocess.Popen``; the SSH path's
stdin lifeline (``runner/tasks/task_service.py``) still ends a host's workers when the
launcher goes.
"""

import os
import queue
import signal
import subprocess
import sys
import threading
from concurrent.futures import Future
from typing import Callable, Optional

_PR_SET_PDEATHSIG = 1


def _prctl() -> Optional[Callable[..., int]]:
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _prctl()


def supported() -> bool:
    """Whether this platform has parent-death signals."""
    return _PRCTL is not None


def death_signal_preexec(sig: int, parent_pid: int) -> Optional[Callable[[], None]]:
    """A ``preexec_fn`` that has the kernel send ``sig`` to the child when its parent dies.

    It also closes the race where the parent died between ``fork`` and ``prctl``: the
    child is then already re-parented, so it signals itself.  libc is looked up in the
    parent; the child runs only the two calls.
    """
    prctl = _PRCTL
    if prctl is None:
        return None
    sig = int(sig)

    def preexec():
        prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
        if os.getppid() != parent_pid:
            os.kill(os.getpid(), sig)

    return preexec


def set_own_death_signal(sig: int) -> bool:
    """Ask for ``sig`` when *our* parent dies (for a wrapper whose parent is not ours to
    change, e.g. an MPI rank's wrapper under Hydra's proxy).  Returns whether it is set;
    signals us at once when the parent is already gone (we were re-parented to init)."""
    if _PRCTL is None:
        return False
    _PRCTL(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    if os.getppid() == 1:
        os.kill(os.getpid(), int(sig))
    return True


class _Spawner:
    """One daemon thread that forks every child, so their parent thread outlives them."""

    def __init__(self):
        self._jobs: "queue.Queue" = queue.Queue()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()

    def run(self, fn: Callable[[], subprocess.Popen]) -> subprocess.Popen:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._loop, name="hvdlite-spawner", daemon=True
                )
                self._thread.start()
        fut: Future = Future()
        self._jobs.put((fn, fut))
        return fut.result()

    def _loop(self) -> None:
        while True:
            fn, fut = self._jobs.get()
            try:
                fut.set_result(fn())
            except BaseException as exc:  # delivered to the caller, raised there
                fut.set_exception(exc)


_SPAWNER = _Spawner()


def popen(args, death_signal: int = signal.SIGKILL, **kwargs) -> subprocess.Popen:
    """``subprocess.Popen(args, **kwargs)`` whose child gets ``death_signal`` when this
    process dies.  A ``preexec_fn`` in ``kwargs`` still runs (after the prctl).

    Raises:
        OSError: as ``Popen`` (the command cannot be started).
    """
    tie = death_signal_preexec(death_signal, os.getpid())
    if tie is None:
        return subprocess.Popen(args, **kwargs)
    extra = kwargs.pop("preexec_fn", None)
    if extra is None:
        preexec = tie
    else:

        def preexec():
            tie()
            extra()

    return _SPAWNER.run(lambda: subprocess.Popen(args, preexec_fn=preexec, **kwargs))
