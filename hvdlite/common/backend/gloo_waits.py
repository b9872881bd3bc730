"""Waiting for a Gloo operation, and letting go of one whose round is over (elastic jobs).

A Gloo collective whose peer vanished without closing its connections (a cut link, a frozen
host) blocks until ``--op-timeout-seconds``.  In an elastic job the launcher has usually
opened the next round long before: the survivors should join it at once instead of waiting
out the timeout.  So an elastic job's waits are taken in slices of :data:`SLICE_S`, and
after each slice that ends without the operation a :class:`RoundWatch` checks whether a
newer round is open; if so the wait ends with ``HvdliteRoundSupersededError`` (an
``HvdliteInternalError``: the elastic loop rolls back to the last commit and joins the new
round).  The check costs nothing: each process keeps one :class:`RoundWatcher` thread
holding an ``await_round`` request open at the launcher's store, which answers as soon as a
round opens, so a survivor lets go within a slice of the new round (the store is asked
directly only when the watcher cannot reach it).

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
from typing import Any, Callable, Dict, List, Optional, Tuple

from hvdlite.common.exceptions import HvdliteRoundSupersededError

_LOCK = threading.Lock()

#: one slice of an elastic job's wait for a Gloo operation
SLICE_S = 0.05
#: how long the watcher's request is held at the store before it asks again
AWAIT_S = 20.0
#: what a Gloo work's wait(timeout) raises when the timeout, not the operation, ended it
_SLICE_OVER = "Operation timed out"


class RoundWatcher:
    """The newest round of one job's store, kept current by a daemon thread (one per
    process and store) whose ``await_round`` request the store answers when a round opens.

    ``make_client()`` gives the thread its own store connection.  When the thread cannot
    reach the store it ends; :attr:`alive` is then False and callers ask the store
    themselves (the next :func:`watcher_for` starts a new thread)."""

    def __init__(self, make_client: Callable[[], Any]):
        self._make_client = make_client
        self.newest = -1
        self.alive = True
        threading.Thread(target=self._run, name="hvdlite-round-watcher", daemon=True).start()

    def _run(self) -> None:
        client = None
        try:
            client = self._make_client()
            while True:
                self.newest = max(self.newest, client.await_round(self.newest, AWAIT_S))
        except Exception:  # the store is gone (job over) or unreachable: callers ask it
            self.alive = False
        finally:
            if client is not None:
                client.close()


_WATCHERS: Dict[Tuple[str, int], RoundWatcher] = {}


def watcher_for(addr: Tuple[str, int], make_client: Callable[[], Any]) -> RoundWatcher:
    """This process's watcher of the store at ``addr`` (started on first use)."""
    with _LOCK:
        watcher = _WATCHERS.get(addr)
        if watcher is None or not watcher.alive:
            watcher = _WATCHERS[addr] = RoundWatcher(make_client)
        return watcher


class RoundWatch:
    """Tells whether a round newer than ``round_`` is open: from the process's
    :class:`RoundWatcher` when it runs, else by asking the store through ``client`` (a
    ``KVClient``), at most once a second."""

    def __init__(self, client, round_: int, who: str, watcher: Optional[RoundWatcher] = None):
        self._client, self._round, self._who = client, round_, who
        self._watcher = watcher
        self._asked = 0.0
        #: a wait was given up: the groups must be buried, not dropped (see bury)
        self.gave_up = False

    def newest(self) -> int:
        """The newest round known now (asks the store only without a live watcher)."""
        if self._watcher is not None and self._watcher.alive and self._watcher.newest >= 0:
            return self._watcher.newest
        return self._client.newest_round()

    def check(self, what: str) -> None:
        """Raises HvdliteRoundSupersededError when a newer round is open."""
        if self._watcher is not None and self._watcher.alive:
            newest = self._watcher.newest
        elif time.monotonic() - self._asked >= 1.0:
            self._asked = time.monotonic()
            newest = self._client.newest_round()
        else:
            return
        if newest > self._round:
            self.gave_up = True
            raise HvdliteRoundSupersededError(
                f"{self._who}: gave up waiting for the Gloo {what}: round {self._round} was "
                f"replaced by round {newest} (a peer left the job, or its host stopped "
                f"answering); joining the new round",
                newest,
            )


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


def build(make: Callable[[], Any], watch: Optional[RoundWatch], what: str) -> Any:
    """``make()`` (e.g. a process group's constructor, which connects to every peer and
    retries a dead one until the op timeout), given up once a newer round is open: it runs
    on a daemon thread the caller waits for in slices; an abandoned one ends on its own
    (its result dropped).

    Raises:
        HvdliteRoundSupersededError: a newer round is open.
        Exception: what ``make()`` raised.
    """
    if watch is None:
        return make()
    done: dict = {}

    def run() -> None:
        try:
            done["value"] = make()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            done["error"] = exc

    thread = threading.Thread(target=run, name="hvdlite-gloo-connect", daemon=True)
    thread.start()
    while True:
        thread.join(SLICE_S)
        if not thread.is_alive():
            break
        watch.check(what)
    if "error" in done:
        raise done["error"]
    return done["value"]


_GRAVES: List[Tuple[float, list]] = []


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
