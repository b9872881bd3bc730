"""Waiting for a Gloo operation, and letting go of one whose round is over (elastic jobs).

A Gloo collective whose peer vanished without closing its connections (a cut link, a frozen
host) blocks until ``--op-timeout-seconds``.  In an elastic job the launcher has usually
opened the next round long before: the survivors should join it at once instead of waiting
out the timeout.  So an elastic job's waits are taken in slices of :data:`SLICE_S`, and
after each slice that ends without the operation a :class:`RoundWatch` asks the launcher's
store whether a newer round is open; if so the wait ends with
``HvdliteRoundSupersededError`` (an ``HvdliteInternalError``: the elastic loop rolls back to
the last commit and joins the new round).

The abandoned operation is still pending inside Gloo, and dropping the last reference to its
process group then blocks until it fails (the op timeout) -- or, at interpreter exit, aborts
the process.  So the backend hands the groups of an abandoned round to :func:`bury`, which
keeps them referenced until their operations must have failed, and releases them then
(:func:`reap`, at every new round); at exit the ones still pending are leaked on purpose.
"""

import atexit
import ctypes
import datetime
import threading
import time
from typing import Any, List, Optional, Tuple

from hvdlite.common.exceptions import HvdliteRoundSupersededError

#: one slice of an elastic job's wait for a Gloo operation
SLICE_S = 1.0
#: what a Gloo work's wait(timeout) raises when the timeout, not the operation, ended it
_SLICE_OVER = "Operation timed out"


class RoundWatch:
    """Asks the launcher's store (``client``, a ``KVClient``) whether a round newer than
    ``round_`` is open."""

    def __init__(self, client, round_: int, who: str):
        self._client, self._round, self._who = client, round_, who
        #: a wait was given up: the groups must be buried, not dropped (see bury)
        self.gave_up = False

    def check(self, what: str) -> None:
        """Raises HvdliteRoundSupersededError when a newer round is open."""
        newest = self._client.newest_round()
        if newest > self._round:
            self.gave_up = True
            raise HvdliteRoundSupersededError(
                f"{self._who}: gave up waiting for the Gloo {what}: round {self._round} was "
                f"replaced by round {newest} (a peer left the job, or its host stopped "
                f"answering); joining the new round", newest)


def wait(work, timeout_s: float, what: str, watch: Optional[RoundWatch]) -> Any:
    """``work.wait()``, bound by ``timeout_s``; with a ``watch``, in slices between which a
    newer round ends the wait.

    Raises:
        HvdliteRoundSupersededError: a newer round is open (the work is left pending).
        RuntimeError: Gloo's own failure or timeout of the operation.
    """
    if watch is None:
        return work.wait(datetime.timedelta(seconds=timeout_s))
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        try:
            return work.wait(datetime.timedelta(seconds=max(0.001, min(SLICE_S, left))))
        except RuntimeError as exc:
            if _SLICE_OVER not in str(exc) or left <= SLICE_S:
                raise
        watch.check(what)


_GRAVES: List[Tuple[float, list]] = []
_LOCK = threading.Lock()


def bury(objects: list, keep_s: float) -> None:
    """Keep ``objects`` (process groups, pending works, groups holding them) referenced for
    ``keep_s`` seconds, by when their pending operations have failed inside Gloo."""
    reap()
    with _LOCK:
        _GRAVES.append((time.monotonic() + keep_s, list(objects)))


def reap() -> None:
    """Release the buried objects whose time is up."""
    with _LOCK:
        now = time.monotonic()
        _GRAVES[:] = [g for g in _GRAVES if g[0] > now]


@atexit.register
def _leak_at_exit() -> None:
    """At exit, the groups still buried are leaked on purpose (one more reference that is
    never dropped): destroying a process group whose operation is pending would block
    until that operation times out, or abort the process at interpreter exit.  The
    process is ending; the operating system takes back what they hold."""
    reap()
    with _LOCK:
        graves, _GRAVES[:] = list(_GRAVES), []
    for _, objects in graves:
        for obj in objects:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))
