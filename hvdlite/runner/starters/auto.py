"""The auto starter: this machine's workers directly, or every host's through tasks.

Decided once, by the first round: when its hosts are all this machine
(``localhost``, ``127.0.0.1``, this host's names), the launcher starts the workers
itself (:mod:`.local`) and the rendezvous store listens on 127.0.0.1 only;
otherwise (or when the host list names a remote host from the start) every host
gets a task service (:mod:`.ssh_tasks`).  A job that started local-only refuses
remote hosts a source offers later (the store is not reachable from them): the
message says so.
"""

import logging
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from hvdlite.runner.hosts import HostSlots, SlotInfo, is_local
from hvdlite.runner.hosts import SlotId
from hvdlite.runner.processes.py_spy import OutsideStack
from hvdlite.runner.starters.base import Starter

log = logging.getLogger(__name__)


class AutoStarter(Starter):
    """This machine's workers directly, or every host's through tasks (decided once)."""

    def __init__(
        self,
        make_local: Callable[[], Starter],
        make_tasks: Callable[[], Starter],
        tasks_from_start: bool = False,
    ):
        self._make_local = make_local
        self._make_tasks = make_tasks
        self._impl: Optional[Starter] = make_tasks() if tasks_from_start else None
        self._local_only = False

    def prepare(self, hosts: Sequence[HostSlots]) -> Dict[str, str]:
        if self._impl is None:
            self._local_only = all(is_local(h.hostname) for h in hosts)
            self._impl = self._make_local() if self._local_only else self._make_tasks()
            log.info(
                "job: %s",
                "every host is this machine: no SSH"
                if self._local_only
                else "workers start through a task per host",
            )
        if self._local_only:
            return {
                h.hostname: (
                    "it is not this machine, and this job runs its workers and rendezvous store "
                    "locally (every host of its first round was local); list a remote host in the "
                    "first round to let remote hosts join"
                )
                for h in hosts
                if not is_local(h.hostname)
            }
        return self._impl.prepare(hosts)

    @property
    def rendezvous_addr(self) -> str:
        return self._impl.rendezvous_addr

    def start(self, slots: Sequence[SlotInfo]) -> Dict[SlotId, str]:
        return self._impl.start(slots)

    def stop(self, ids: Sequence[SlotId]) -> None:
        if self._impl is not None:
            self._impl.stop(ids)

    def poll(self) -> List[Tuple[SlotId, int]]:
        return [] if self._impl is None else self._impl.poll()

    def stop_all(self) -> None:
        if self._impl is not None:
            self._impl.stop_all()

    def close(self) -> None:
        if self._impl is not None:
            self._impl.close()

    def suspended(self) -> List[SlotId]:
        return [] if self._impl is None else self._impl.suspended()

    def outside_stacks(self, ids: Sequence[SlotId], timeout_s: float) -> Dict[SlotId, OutsideStack]:
        impl = self._impl
        return {} if impl is None else impl.outside_stacks(ids, timeout_s)

    def cut_links(self, hosts: Sequence[str]) -> List[Tuple[str, str]]:
        return [] if self._impl is None else self._impl.cut_links(hosts)

    def describe_failure(self, sid: SlotId, code: int) -> Optional[str]:
        return None if self._impl is None else self._impl.describe_failure(sid, code)
