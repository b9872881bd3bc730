"""The agent's two ports for a Spark job: its tasks as the starter and as the host source.

Spark decides where a task runs, so a worker cannot be started on a chosen host:
the tasks come first and register with the driver's pool; :class:`SparkTaskHosts` offers
the live ones, grouped by executor host, as the job's hosts; :class:`SparkTaskStarter`
"starts" the worker of a slot by ordering the task holding that slot to run the
function with the rank's environment, and "stops" it by ordering it to end its
Python worker.  Exits come from the pool: 0 after a result, 1 after a traceback,
137 when the task died without a report.
"""

import logging
import threading
import time
from typing import Callable, Dict, List, Sequence, Tuple

from hvdlite.runner.hosts import HostSlots, SlotInfo
from hvdlite.runner.hosts.source import HostSource
from hvdlite.runner.processes.workers import slot_env
from hvdlite.runner.hosts import SlotId, slot_id
from hvdlite.runner.starters.base import Starter
from hvdlite.spark.pool import LOST_EXIT, TaskPool

log = logging.getLogger(__name__)

#: bound on :meth:`SparkTaskStarter.stop_all` waiting for stopped tasks to end
STOP_WAIT_S = 20.0


class SparkTaskHosts(HostSource):
    """The executors' hosts with live tasks (an elastic job's host source)."""

    def __init__(self, pool: TaskPool):
        self._pool = pool

    def find(self) -> List[HostSlots]:
        return self._pool.live_hosts()


class SparkTaskStarter(Starter):
    """Orders the pool's tasks to run as the agent's workers.

    ``job_env()`` is the environment every rank shares (the store's address is known only
    once the first round is published); ``missing_is_exit``: a slot whose task has ended
    is reported as a worker that exited 137 (elastic: the agent blacklists it) instead of
    one that could not start (static: the job fails to start).
    """

    def __init__(
        self,
        pool: TaskPool,
        job_env: Callable[[], Dict[str, str]],
        rendezvous_addr: str,
        missing_is_exit: bool,
    ):
        self._pool = pool
        self._job_env = job_env
        self._addr = rendezvous_addr
        self._missing_is_exit = missing_is_exit
        self._lock = threading.Lock()
        self._early: List[Tuple[SlotId, int]] = []

    @property
    def rendezvous_addr(self) -> str:
        return self._addr

    def results(self) -> Dict[SlotId, bytes]:
        """Each rank's pickled result (the caller unpickles it)."""
        return dict(self._pool.results)

    def failures(self) -> Dict[SlotId, str]:
        return dict(self._pool.failures)

    def start(self, slots: Sequence[SlotInfo]) -> Dict[SlotId, str]:
        refused: Dict[SlotId, str] = {}
        env = self._job_env()
        for slot in slots:
            sid = slot_id(slot)
            task = self._pool.by_slot(sid)
            if task is None and self._missing_is_exit:
                with self._lock:
                    self._early.append((sid, LOST_EXIT))
                self._pool.failures[sid] = "its Spark task ended before it was started"
                continue
            if task is None:
                refused[sid] = f"no live Spark task holds slot {sid[0]}:{sid[1]}"
                continue
            self._pool.order(task, "run", slot_env(slot, {}, env))
        if self._early:
            threading.Thread(target=self._pool.on_change, daemon=True).start()
        return refused

    def stop(self, ids: Sequence[SlotId]) -> None:
        for sid in ids:
            task = self._pool.by_slot(sid)
            if task is not None:
                self._pool.order(task, "stop")

    def poll(self) -> List[Tuple[SlotId, int]]:
        with self._lock:
            early, self._early = self._early, []
        return early + self._pool.take_exits()

    def stop_all(self) -> None:
        """Stop every running task and wait (bounded) until the pool saw them end."""
        running = self._pool.running()
        for task in running:
            self._pool.order(task, "stop")
        deadline = time.monotonic() + STOP_WAIT_S
        while self._pool.running() and time.monotonic() < deadline:
            self._pool.take_exits()
            time.sleep(0.2)
        left = self._pool.running()
        if left:
            log.warning(
                "hvdlite.spark: %d task(s) did not end within %gs of being stopped: %s",
                len(left),
                STOP_WAIT_S,
                ", ".join(f"{t.host} pid {t.pid}" for t in left),
            )
