"""The local starter: every worker a child process of the launcher (every host is this
machine), one :class:`~hvdlite.runner.processes.workers.WorkerGroup` each, so that one can be
stopped alone."""

import logging
import threading
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from hvdlite.common.exceptions import HvdliteLaunchError
from hvdlite.runner.hosts import SlotInfo
from hvdlite.runner.processes import py_spy
from hvdlite.runner.processes.workers import OutputTarget, WorkerGroup, terminate_groups
from hvdlite.runner.hosts import SlotId, slot_id
from hvdlite.runner.starters.base import Starter

log = logging.getLogger(__name__)


class LocalStarter(Starter):
    """Workers as child processes of the launcher, one :class:`WorkerGroup` each.

    ``job_env`` is called at each start: the rendezvous store's address is known only
    once the first round is published.  Output goes to ``sink`` prefixed with the rank
    the worker started with.
    """

    def __init__(
        self,
        command: Sequence[str],
        job_env: Callable[[], Dict[str, str]],
        sink: OutputTarget,
        base_env: Optional[Dict[str, str]] = None,
        on_exit: Callable[[], None] = lambda: None,
    ):
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
            threading.Thread(
                target=self._watch,
                args=(proc,),
                daemon=True,
                name=f"elastic-watch-{sid[0]}-{sid[1]}",
            ).start()
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

    def suspended(self) -> List[SlotId]:
        with self._lock:
            live = list(self._live.items())
        return [sid for sid, group in live if group.stopped_slots()]

    def outside_stacks(
        self, ids: Sequence[SlotId], timeout_s: float
    ) -> Dict[SlotId, py_spy.OutsideStack]:
        """py-spy of each live worker's process tree (the workers are our children)."""
        with self._lock:
            live = {sid: self._live[sid] for sid in ids if sid in self._live}
        pids = {
            sid: group.procs[0].pid
            for sid, group in live.items()
            if group.procs and group.procs[0].returncode is None
        }
        return py_spy.dumps(pids, timeout_s)
