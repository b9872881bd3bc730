"""The driver's task service: the Spark tasks of a job, what each is told, how each ended.

Every task of a job (:mod:`hvdlite.spark.task`) registers here over an authenticated
connection, asks for its order, beats while it runs the user's function and reports
its result or traceback.  The pool is the single record the job's starter
(:mod:`hvdlite.spark.starter`) and host source read: which tasks are alive on which
host, which slot each holds, and which have ended (result: exit 0, traceback: exit 1,
lost -- its Spark task or heartbeat ended without a report: exit 137).
"""

import dataclasses
import threading
import time
from typing import Callable, Dict, List, Optional, Tuple

from hvdlite.common.exceptions import HvdliteError
from hvdlite.common.net.service import Header, Service, ServiceError
from hvdlite.runner.hosts import HostSlots
from hvdlite.runner.hosts import SlotId

#: a running task whose heartbeat has been silent this long is lost
TASK_LOST_S = 15.0
#: the longest an ``order`` request is held waiting for an order
ORDER_POLL_S = 1.0
#: the exit code of a task that ended without a report (its worker died)
LOST_EXIT = 137


class HvdliteSparkError(HvdliteError, RuntimeError):
    """A Spark job of hvdlite failed: a rank raised or died (named with its host), or the
    tasks did not start in time."""


@dataclasses.dataclass
class Task:
    """One registered Spark task."""

    task: int
    host: str  # the executor's host name (ranks are grouped by it)
    address: str  # the address the driver sees it connect from
    pid: int
    partition: int
    tag: int  # the Spark job that runs it (its end ends the task)
    sid: Optional[SlotId] = None
    order: str = "wait"  # wait | run | stop | exit
    env: Dict[str, str] = dataclasses.field(default_factory=dict)
    state: str = "idle"  # idle | running | ended
    last_seen: float = dataclasses.field(default_factory=time.monotonic)


class TaskPool(Service):
    """Registers tasks, hands out orders and records how each ended.

    ``on_change`` is called (from a connection thread) whenever a task registers or ends,
    so the agent wakes at once.  ``slot_of(host, partition)`` gives a registering task its
    slot id now (elastic jobs); a static job assigns slots later with :meth:`assign`.
    """

    def __init__(
        self,
        key: bytes,
        bind_addr: str,
        expected: int,
        on_change: Callable[[], None] = lambda: None,
    ):
        self._lock = threading.Condition()
        self._tasks: Dict[int, Task] = {}
        self._next_index: Dict[str, int] = {}
        self.number_slots = False
        self.on_change = on_change
        #: (slot id, exit code) not yet taken by :meth:`take_exits`
        self._exits: List[Tuple[SlotId, int]] = []
        #: slot id -> pickled result / traceback text of the task that held it
        self.results: Dict[SlotId, bytes] = {}
        self.failures: Dict[SlotId, str] = {}
        #: Spark job tag -> why it ended ("" when it succeeded)
        self.jobs_ended: Dict[int, str] = {}
        super().__init__(
            "hvdlite.spark task service", key, bind_addr=bind_addr, expected_peers=max(2, expected)
        )

    # -- the tasks' requests ---------------------------------------------------------------
    def handle(self, header: Header, blob: bytes, client) -> Tuple[Header, bytes]:
        op = header.get("op")
        if op == "register":
            return self._register(header, client[0]), b""
        task = self._task(header.get("task"))
        if op == "order":
            return self._order(task), b""
        with self._lock:
            task.last_seen = time.monotonic()
            if op == "beat":
                return {"order": task.order}, b""
            if op in ("result", "failure") and task.state == "running":
                if op == "result":
                    self.results[task.sid] = blob
                else:
                    self.failures[task.sid] = str(header.get("traceback", ""))
                self._end(task, 0 if op == "result" else 1)
                return {}, b""
            if op in ("result", "failure"):
                return {}, b""  # a late report of a task already counted as ended
        raise ServiceError(f"unknown request {op!r}")

    def _task(self, number) -> Task:
        with self._lock:
            task = self._tasks.get(number) if isinstance(number, int) else None
        if task is None:
            raise ServiceError(f"task {number!r} is not registered")
        return task

    def _register(self, header: Header, address: str) -> Header:
        with self._lock:
            number = len(self._tasks)
            host = str(header.get("host") or address)
            task = Task(
                number,
                host,
                address,
                int(header.get("pid", 0)),
                int(header.get("partition", -1)),
                int(header.get("tag", 0)),
            )
            if self.number_slots:
                index = self._next_index.get(host, 0)
                self._next_index[host] = index + 1
                task.sid = (host, index)
            self._tasks[number] = task
            self._lock.notify_all()
        self.on_change()
        return {"task": number, "address": address}

    def _order(self, task: Task) -> Header:
        with self._lock:
            task.last_seen = time.monotonic()
            self._lock.wait_for(lambda: task.order != "wait", ORDER_POLL_S)
            if task.order == "run":
                task.state = "running"
                task.last_seen = time.monotonic()
                return {"order": "run", "env": task.env}
            return {"order": task.order}

    # -- the driver's side -----------------------------------------------------------------
    def _end(self, task: Task, code: int) -> None:
        """Record a task's end (holding the lock); a started task's end is an exit."""
        was = task.state
        task.state = "ended"
        if was == "running" or (was == "idle" and task.order == "run"):
            self._exits.append((task.sid, code))
        self._lock.notify_all()
        threading.Thread(target=self.on_change, daemon=True).start()

    def tasks(self) -> List[Task]:
        with self._lock:
            return list(self._tasks.values())

    def wait_registered(
        self, count: int, timeout_s: float, failed: Callable[[], Optional[str]]
    ) -> List[Task]:
        """The first ``count`` tasks, once registered.

        Raises:
            HvdliteSparkError: ``failed()`` says why the Spark job ended first, or
                ``timeout_s`` passed (names how many registered).
        """
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while len(self._tasks) < count:
                why = failed()
                if why is not None:
                    raise HvdliteSparkError(
                        f"the Spark job ended before its {count} tasks "
                        f"started ({len(self._tasks)} did): {why}"
                    )
                left = deadline - time.monotonic()
                if left <= 0:
                    raise HvdliteSparkError(
                        f"only {len(self._tasks)} of {count} Spark tasks started within "
                        f"start_timeout={timeout_s:g}s; does the cluster have {count} free "
                        f"task slots (spark.task.cpus each)?"
                    )
                self._lock.wait(min(left, 0.5))
            return [self._tasks[i] for i in range(count)]

    def assign(self, task: Task, sid: SlotId) -> None:
        with self._lock:
            task.sid = sid

    def by_slot(self, sid: SlotId) -> Optional[Task]:
        with self._lock:
            found = [t for t in self._tasks.values() if t.sid == sid and t.state != "ended"]
        return found[0] if found else None

    def order(self, task: Task, order: str, env: Optional[Dict[str, str]] = None) -> None:
        with self._lock:
            if env is not None:
                task.env = dict(env)
            task.order = order
            self._lock.notify_all()

    def take_exits(self) -> List[Tuple[SlotId, int]]:
        """Exits since the last call; a running task silent for ``TASK_LOST_S`` is lost."""
        now = time.monotonic()
        with self._lock:
            for t in self._tasks.values():
                if t.state == "running" and now - t.last_seen > TASK_LOST_S:
                    self.failures[t.sid] = (
                        f"its heartbeat stopped {now - t.last_seen:.0f}s "
                        f"ago (the Python worker died or hangs)"
                    )
                    self._end(t, LOST_EXIT)
            out, self._exits = self._exits, []
        return out

    def job_ended(self, tag: int, why: str) -> None:
        """A Spark job ended: its tasks that did not report are lost (``why``: Spark's
        error, "" when the job succeeded)."""
        with self._lock:
            self.jobs_ended[tag] = why
            for t in self._tasks.values():
                if t.tag == tag and t.state != "ended":
                    if t.state == "running" or t.order == "run":
                        self.failures.setdefault(
                            t.sid, f"its Spark task ended without a result: {why or 'no error'}"
                        )
                    self._end(t, LOST_EXIT)
            self._lock.notify_all()

    def live_hosts(self) -> List[HostSlots]:
        """Hosts with live tasks, in registration order; slots up to the highest live one."""
        with self._lock:
            top: Dict[str, int] = {}
            for t in self._tasks.values():
                if t.state != "ended" and t.sid is not None and t.order in ("wait", "run"):
                    top[t.sid[0]] = max(top.get(t.sid[0], 0), t.sid[1] + 1)
        return [HostSlots(hostname=h, slots=n) for h, n in top.items()]

    def running(self) -> List[Task]:
        with self._lock:
            return [
                t
                for t in self._tasks.values()
                if t.state == "running" or (t.state == "idle" and t.order == "run")
            ]
