"""Liveness of the hosts' task services: the launcher pings each one once a second.

A worker's exit reaches the launcher through its host's task service.  A host whose link
is cut, or that froze, sends nothing: without a heartbeat the launcher would learn of it
only when the ranks on the other side of the cut fail their collectives
(``--op-timeout-seconds`` later), and it would blame them.  So every registered task is
pinged once a second (op ``ping`` over the job's authenticated channel, on a connection of
its own so that no other request delays it).  A host that has not answered for
:data:`UNREACHABLE_S` is unreachable: the starter reports its workers lost and the failure
summary names that host.  The task service's side of the same cut is
``hvdlite.runner.tasks.task_service.LAUNCHER_SILENT_S``: a task that has heard nothing
from the launcher for that long ends its workers and exits, so no rank is left running on
the far side of a cut.
"""

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Dict, Tuple

from hvdlite.common.exceptions import HvdliteError
from hvdlite.common.net.service import Client

log = logging.getLogger(__name__)

#: how often each task is pinged, and how long one ping may take
PERIOD_S = 1.0
PING_TIMEOUT_S = 2.0
#: a host silent this long is unreachable: its workers count as lost
UNREACHABLE_S = 8.0
#: a host silent this long is suspected: a failure summary names it first
SUSPECT_S = 3.0
#: a task service silent while its host's ranks still report to the launcher's store (a
#: paused or overloaded service, not a dead host) is given this long before its workers
#: count as lost
SERVICE_ONLY_S = 60.0

#: index of a task -> (address, port, hostname)
Targets = Dict[int, Tuple[str, int, str]]


class TaskHeartbeats:
    """Pings the tasks ``targets()`` names, on a daemon thread; :meth:`silent_for` says for
    how long each one has not answered."""

    def __init__(self, key: bytes, targets: Callable[[], Targets]):
        self._key = key
        self._targets = targets
        self._heard: Dict[int, float] = {}
        self._clients: Dict[int, Client] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="hvdlite-task-heartbeats", daemon=True
        )
        self._started = False

    def start(self) -> None:
        if not self._started:
            self._started = True
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._started:
            self._thread.join(PING_TIMEOUT_S + 1.0)
        for client in list(self._clients.values()):
            client.close()

    def silent_for(self, index: int) -> float:
        """Seconds since task ``index`` last answered (since it was first pinged, before
        its first answer); 0 for a task not pinged yet."""
        with self._lock:
            heard = self._heard.get(index)
        return 0.0 if heard is None else max(0.0, time.monotonic() - heard)

    def _run(self) -> None:
        with ThreadPoolExecutor(max_workers=16, thread_name_prefix="hvdlite-ping") as pool:
            while not self._stop.wait(PERIOD_S):
                targets = self._targets()
                with self._lock:
                    now = time.monotonic()
                    for index in targets:
                        self._heard.setdefault(index, now)
                list(pool.map(self._ping, targets.items()))

    def _ping(self, item: Tuple[int, Tuple[str, int, str]]) -> None:
        index, (addr, port, hostname) = item
        client = self._clients.get(index)
        if client is None:
            client = self._clients[index] = Client(
                (addr, port), self._key, PING_TIMEOUT_S, name=f"task service on {hostname}"
            )
        try:
            client.request({"op": "ping"}, timeout_s=PING_TIMEOUT_S)
        except (HvdliteError, OSError) as exc:
            log.debug("no heartbeat from %s: %s", hostname, exc)
            client.close()
            return
        with self._lock:
            self._heard[index] = time.monotonic()
