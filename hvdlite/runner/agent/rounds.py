"""The job's rendezvous rounds, as the agent sees them: a store made on first use.

The store (``hvdlite.runner.store.rendezvous.RendezvousService``) is made when the first
round is published, because its address is known only once the starter has
prepared the first round's hosts (a multi-host job binds it to the interface
chosen between them).  A static job's store repeats its one round for every
``shutdown()`` then ``init()``; an elastic job's opens only what the agent
publishes.  A starter whose workers need no store (mpiexec) gets none.
"""

from typing import Callable, Dict, Optional, Sequence, Set, Tuple

from hvdlite.runner.hosts import SlotInfo
from hvdlite.runner.store.rendezvous import RendezvousService
from hvdlite.runner.hosts import SlotId


class Rounds:
    """Opens rounds on the job's store, made on the first :meth:`publish`."""

    def __init__(
        self,
        key: bytes,
        bind_addr: Callable[[], str],
        repeat_last: bool,
        needed: bool = True,
        job_id: str = "",
        extra_ops: Optional[Dict[str, Callable]] = None,
        extra_reports: Callable[[], Dict[SlotId, dict]] = dict,
        port: int = 0,
    ):
        """``extra_ops``: more store ops (see ``RendezvousService``); ``extra_reports()``:
        exit reports that did not come through the store (a platform's starter saw the
        failure itself), overridden by the ranks' own; ``port``: the store's (0: any)."""
        self._port = port
        self._extra_reports = extra_reports
        self._key = key
        self._job_id = job_id
        self._extra_ops = extra_ops
        self._bind_addr = bind_addr
        self._repeat_last = repeat_last
        self._needed = needed
        self._count = -1
        self._waker: Optional[Callable[[], None]] = None
        self.service: Optional[RendezvousService] = None

    def publish(self, slots: Sequence[SlotInfo], ids: Sequence[SlotId]) -> int:
        """Open the next round; returns its number."""
        if not self._needed:
            self._count += 1
            return self._count
        if self.service is None:
            self.service = RendezvousService(
                self._key,
                repeat_last=self._repeat_last,
                bind_addr=self._bind_addr(),
                port=self._port,
                job_id=self._job_id,
                extra_ops=self._extra_ops,
            )
            if self._waker is not None:
                self.service.set_waker(self._waker)
        return self.service.publish(slots, ids)

    def formed(self, round_: int) -> bool:
        """Did every rank of the newest round reach ``init()``?  (True without a store:
        mpiexec's ranks meet on their own.)"""
        return True if self.service is None else self.service.formed(round_)

    def standby(self, ids: Sequence[SlotId]) -> None:
        """Slots started ahead of the round that will take them (see ``RendezvousService``)."""
        if self.service is not None:
            self.service.standby(ids)

    def new_process(self, ids: Sequence[SlotId]) -> None:
        """New processes start on these slots (their previous ones may not join again)."""
        if self.service is not None:
            self.service.new_process(ids)

    def all_asking(self, round_: int) -> bool:
        """Does every member of ``round_`` wait for a round after it (none left)?"""
        return self.service is not None and self.service.all_asking(round_)

    def asking(self, round_: int) -> Set[SlotId]:
        """The members of ``round_`` that wait for a round after it."""
        return set() if self.service is None else self.service.asking(round_)

    def arrived(self, round_: int) -> Set[int]:
        """The ranks of ``round_`` that reached ``init()`` (every one without a store)."""
        return set() if self.service is None else self.service.arrived(round_)

    def set_waker(self, waker: Callable[[], None]) -> None:
        """Call ``waker()`` when every member of the newest round asks for a new one."""
        self._waker = waker
        if self.service is not None:
            self.service.set_waker(waker)

    def ready(self) -> Set[SlotId]:
        """The standby slots whose process waits to join (every one without a store)."""
        return set() if self.service is None else self.service.ready()

    def exit_reports(self) -> Dict[SlotId, dict]:
        reports = dict(self._extra_reports())
        if self.service is not None:
            reports.update(self.service.exit_reports())
        return reports

    @property
    def address(self) -> Tuple[str, int]:
        """The store's (address, port); valid after the first :meth:`publish`."""
        return self.service.address

    def shutdown(self) -> None:
        if self.service is not None:
            self.service.shutdown()
