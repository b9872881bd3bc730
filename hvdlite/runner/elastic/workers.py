"""Where an elastic job's workers run: the interface the driver uses, and this host's version.

The driver names a worker by its :data:`SlotId` -- (host name, local rank) --
which is also how the rendezvous store knows it; one process keeps its slot id
for its whole life, whatever rank later rounds give it.  A slot id is used again
only after its previous process has exited (a host back from the blacklist).

:class:`WorkerLauncher` is what the driver needs: get hosts ready, start workers
on slots, stop some, and report exits.  :class:`LocalWorkers` runs them as child
processes of the launcher (every host is this machine);
:mod:`hvdlite.runner.elastic.tasks` runs them through each host's task service.
"""

import abc
import logging
import threading
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from hvdlite.common.exceptions import HvdliteLaunchError
from hvdlite.runner.hosts import HostSlots, SlotInfo
from hvdlite.runner.procs import OutputTarget, WorkerGroup, terminate_groups

log = logging.getLogger(__name__)

#: (host name, local rank): one worker process for its whole life
SlotId = Tuple[str, int]


def slot_id(slot: SlotInfo) -> SlotId:
    return (slot.hostname, slot.local_rank)


class WorkerLauncher(abc.ABC):
    """Starts, stops and watches the workers of an elastic job.

    Every method is called from the driver's thread; ``on_exit`` (given to the
    constructor of an implementation) may be called from any thread whenever a
    worker exits, so that the driver wakes at once.
    """

    def prepare(self, hosts: Sequence[HostSlots]) -> Dict[str, str]:
        """Make these hosts ready to take workers; returns ``{host name: why not}`` for
        the hosts that cannot (the driver blacklists them).  Default: every host is ready.

        Raises:
            HvdliteLaunchError: a job-level problem no other host can fix (the driver
                fails the job with this message).
        """
        return {}

    @property
    def rendezvous_addr(self) -> str:
        """The address the rendezvous store must listen on (valid after :meth:`prepare`)."""
        return "127.0.0.1"

    @abc.abstractmethod
    def start(self, slots: Sequence[SlotInfo]) -> Dict[SlotId, str]:
        """Start one worker per slot; returns ``{slot id: why}`` for the workers that could
        not be started (every other one runs, and its exit will be reported)."""

    @abc.abstractmethod
    def stop(self, ids: Sequence[SlotId]) -> None:
        """End these workers' process trees; returns at once, their exits come through
        :meth:`poll`."""

    @abc.abstractmethod
    def poll(self) -> List[Tuple[SlotId, int]]:
        """Workers that exited since the last call, with their exit codes."""

    @abc.abstractmethod
    def stop_all(self) -> None:
        """End every worker on every host and wait for them (bounded)."""

    def close(self) -> None:
        """Release what :meth:`stop_all` left (services, connections).  Default: nothing."""


class LocalWorkers(WorkerLauncher):
    """Workers as child processes of the launcher, one :class:`WorkerGroup` each.

    ``job_env`` is called at each start: the rendezvous store's address is known only
    once the first round is published.  Output goes to ``sink`` prefixed with the rank
    the worker started with.
    """

    def __init__(self, command: Sequence[str], job_env: Callable[[], Dict[str, str]],
                 sink: OutputTarget, base_env: Optional[Dict[str, str]] = None,
                 on_exit: Callable[[], None] = lambda: None):
        self._command = list(command)
        self._job_env = job_env
        self._sink = sink
        self._base_env = base_env
        self._on_exit = on_exit
        self._live: Dict[SlotId, WorkerGroup] = {}
        self._all: List[WorkerGroup] = []
        self._lock = threading.Lock()

    def start(self, slots: Sequence[SlotInfo]) -> Dict[SlotId, str]:
        failed: Dict[SlotId, str] = {}
        env = self._job_env()
        for slot in slots:
            sid = slot_id(slot)
            if sid in self._live:
                log.warning("slot %s:%d already has a worker; not starting another", *sid)
                continue
            group = WorkerGroup([slot], self._command, env, self._sink, base_env=self._base_env)
            try:
                group.start()
            except HvdliteLaunchError as exc:
                failed[sid] = str(exc)
                continue
            with self._lock:
                self._live[sid] = group
                self._all.append(group)
            proc = group.procs[0]
            threading.Thread(target=self._watch, args=(proc,), daemon=True,
                             name=f"elastic-watch-{sid[0]}-{sid[1]}").start()
        return failed

    def _watch(self, proc) -> None:
        proc.wait()
        self._on_exit()

    def stop(self, ids: Sequence[SlotId]) -> None:
        groups = [self._live[i] for i in ids if i in self._live]
        for g in groups:
            threading.Thread(target=g.terminate, daemon=True, name="elastic-stop").start()

    def poll(self) -> List[Tuple[SlotId, int]]:
        done = []
        with self._lock:
            for sid, group in list(self._live.items()):
                for slot, code in group.poll():
                    done.append((sid, code))
                    del self._live[sid]
        return done

    def stop_all(self) -> None:
        with self._lock:
            groups = list(self._all)
        terminate_groups(groups)
