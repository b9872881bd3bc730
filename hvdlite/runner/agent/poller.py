"""Asks host discovery again and again on its own thread.

A discovery script may take seconds (up to its timeout); on its own thread it
never delays the agent's reaction to a worker exit or a stop.  The poller keeps
the last good answer and wakes the agent when the answer changes.  A failed
discovery (:class:`~hvdlite.runner.hosts.source.HostDiscoveryError`) is
logged with the script's output and changes nothing.  A script that keeps failing
is logged in full once, then once per ``FAILURE_LOG_INTERVAL_S`` with the number of
failures since (and in full again when its error changes), and its recovery is
logged: a broken script does not flood the job's output with a line per poll.
A discovery script's answers reach it damped (:mod:`.settling`): a host that appears or
comes back is in them only once it has stayed listed for ``--discovery-settle-seconds``.
"""

import logging
import threading
import time
from typing import Callable, List, Optional

from hvdlite.runner.hosts.source import HostDiscoveryError, HostSource
from hvdlite.runner.hosts import HostSlots

log = logging.getLogger(__name__)

#: seconds between two discoveries (Horovod polls once a second too); tests make it tiny
DISCOVERY_INTERVAL_S = 1.0
#: while discovery keeps failing the same way, one line per this many seconds
FAILURE_LOG_INTERVAL_S = 30.0


class DiscoveryPoller:
    """Runs ``discovery.find()`` every ``interval_s`` seconds until :meth:`stop`.

    ``hosts`` is the last good answer (``None`` until the first one);
    ``on_change`` is called after every answer that differs from the previous one,
    and after the first answer.
    """

    def __init__(
        self,
        discovery: HostSource,
        on_change: Callable[[], None],
        interval_s: Optional[float] = None,
    ):
        self._discovery = discovery
        self._on_change = on_change
        self._interval_s = DISCOVERY_INTERVAL_S if interval_s is None else interval_s
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._hosts: Optional[List[HostSlots]] = None
        self.failures = 0  # discoveries that raised, for logs and tests
        self._failing_since: Optional[int] = None  # self.failures when this spell began
        self._last_error = ""  # the last error logged in full
        self._last_log = 0.0  # when a failure was last logged
        self._unlogged = 0  # failures since that line
        self._thread = threading.Thread(target=self._run, name="elastic-discovery", daemon=True)

    @property
    def hosts(self) -> Optional[List[HostSlots]]:
        with self._lock:
            return None if self._hosts is None else list(self._hosts)

    def start(self) -> "DiscoveryPoller":
        self._thread.start()
        return self

    def poll_once(self) -> None:
        """One discovery; on error log it (with the script's output) and keep the old hosts."""
        try:
            hosts = self._discovery.find()
        except HostDiscoveryError as exc:
            if not self._stop.is_set():
                self._log_failure(exc)
            self.failures += 1  # after the log line: tests wait on the count
            return
        if self._failing_since is not None:
            log.warning(
                "host discovery works again after %d failed attempts",
                self.failures - self._failing_since,
            )
            self._failing_since, self._last_error, self._unlogged = None, "", 0
        with self._lock:
            changed = hosts != self._hosts
            self._hosts = list(hosts)
        if changed:
            log.info("discovery: hosts are now %s", _describe(hosts))
            self._on_change()

    def _log_failure(self, exc: HostDiscoveryError) -> None:
        """The first failure of a spell, or one with a new error, in full; the same error
        again at most once per ``FAILURE_LOG_INTERVAL_S``, as a count."""
        now = time.monotonic()
        if self._failing_since is None:
            self._failing_since = self.failures
        text = str(exc)
        if text != self._last_error:
            self._last_error, self._last_log, self._unlogged = text, now, 0
            output = exc.output.rstrip() or "(no output)"
            log.warning(
                "host discovery failed; keeping the previous hosts (%s): %s\n  its output:\n%s",
                _describe(self.hosts),
                exc,
                "\n".join("    " + line for line in output.splitlines()),
            )
            return
        self._unlogged += 1
        if now - self._last_log >= FAILURE_LOG_INTERVAL_S:
            log.warning(
                "host discovery still failing: %d more failures in the last %.0fs, "
                "the same way (%s); keeping the previous hosts (%s)",
                self._unlogged,
                now - self._last_log,
                text,
                _describe(self.hosts),
            )
            self._last_log, self._unlogged = now, 0

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            self.poll_once()
            left = self._interval_s - (time.monotonic() - started)
            self._stop.wait(max(0.0, left))

    def stop(self, timeout_s: float = 2.0) -> None:
        """Stop polling and end a discovery in progress (bounded)."""
        self._stop.set()
        self._discovery.close()
        if self._thread.is_alive():
            self._thread.join(timeout_s)


def _describe(hosts: Optional[List[HostSlots]]) -> str:
    if hosts is None:
        return "none yet"
    return ", ".join(f"{h.hostname}:{h.slots}" for h in hosts) or "no hosts"
