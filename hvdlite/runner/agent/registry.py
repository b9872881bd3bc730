"""The agent's record of every worker: one state per slot, and the moves between states.

The agent asks one question of a worker again and again -- is it training, waiting
to join, being ended, done? -- so each worker has one record with one
:class:`WorkerState`, and :meth:`WorkerRegistry.move` refuses a move the agent does
not make (:data:`MOVES`).  A record lives from the worker's start to the end of the
job, or until its slot gets a new process or its exit means nothing (a stopped
worker, a worker of an older round): then it is dropped.
"""

import dataclasses
import enum
import time
from typing import Dict, Iterator, List, Optional, Tuple

from hvdlite.runner.hosts import SlotId, SlotInfo


class WorkerState(enum.Enum):
    """What the agent makes of one worker."""

    STANDBY = "on standby"  # started ahead of the round that will take it
    LIVE = "live"  # started into a round, running
    SUSPENDED = "suspended"  # a member whose process is stopped (SIGSTOP, a debugger)
    ENDING = "ending"  # a member ended for being stopped or stuck: its exit fails
    STOPPING = "stopping"  # ended by the agent: its exit is no failure
    EXCUSED = "excused"  # a newcomer stopped when training finished: not waited for
    FINISHED = "finished"  # a member that exited 0
    FAILED = "failed"  # a member that exited non-zero


S = WorkerState
#: the states whose process is (still) running
RUNNING = frozenset({S.STANDBY, S.LIVE, S.SUSPENDED, S.ENDING, S.STOPPING, S.EXCUSED})
#: the moves the agent makes; :meth:`WorkerRegistry.move` refuses any other
MOVES: Dict[WorkerState, frozenset] = {
    S.STANDBY: frozenset({S.LIVE, S.STOPPING}),
    S.LIVE: frozenset({S.SUSPENDED, S.ENDING, S.STOPPING, S.EXCUSED, S.FINISHED, S.FAILED}),
    S.SUSPENDED: frozenset({S.LIVE, S.ENDING, S.STOPPING, S.EXCUSED, S.FINISHED, S.FAILED}),
    S.ENDING: frozenset({S.STOPPING, S.EXCUSED, S.FAILED}),
    S.STOPPING: frozenset({S.EXCUSED}),
    S.EXCUSED: frozenset(),
    S.FINISHED: frozenset(),
    S.FAILED: frozenset(),
}


@dataclasses.dataclass
class WorkerRecord:
    """One worker: where it was started, its state, since when."""

    slot: SlotInfo  # its place in the round it was started in (env, output prefix)
    started_round: int
    state: WorkerState
    started_at: float = dataclasses.field(default_factory=time.monotonic)
    since: float = dataclasses.field(default_factory=time.monotonic)  # in this state
    running: bool = True  # its process has not exited (an excused one may have)
    said: bool = False  # SUSPENDED: the static job's warning was logged
    peer_error: Optional[str] = None  # FAILED: its rank only saw a peer fail (its words)

    @property
    def stopping(self) -> bool:
        """Is the agent ending it, so that its exit is no failure?"""
        return self.state in (S.STOPPING, S.EXCUSED)


class WorkerRegistry:
    """The records by slot, in the order the workers started."""

    def __init__(self):
        self._records: Dict[SlotId, WorkerRecord] = {}

    def start(self, sid: SlotId, slot: SlotInfo, round_: int, state: WorkerState) -> None:
        """A new process runs on ``sid`` (its slot's earlier record, if any, is replaced)."""
        if state not in (S.LIVE, S.STANDBY):
            raise AssertionError(f"agent: worker {sid} cannot start {state.value}")
        old = self._records.pop(sid, None)
        if old is not None and old.running:
            raise AssertionError(f"agent: worker {sid} started while its process runs")
        self._records[sid] = WorkerRecord(slot, round_, state)

    def move(self, sid: SlotId, state: WorkerState, now: Optional[float] = None) -> WorkerRecord:
        """Put ``sid``'s worker in ``state`` (a refused move is the agent's bug)."""
        rec = self._records[sid]
        if state is not rec.state:
            if state not in MOVES[rec.state]:
                raise AssertionError(
                    f"agent: worker {sid}: no move {rec.state.name} -> {state.name}"
                )
            rec.state = state
            rec.since = time.monotonic() if now is None else now
            rec.said = False
        return rec

    def exited(self, sid: SlotId) -> Optional[WorkerRecord]:
        """``sid``'s process exited: its record (None when none was running), marked so."""
        rec = self._records.get(sid)
        if rec is None or not rec.running:
            return None
        rec.running = False
        return rec

    def drop(self, sid: SlotId) -> None:
        """Forget ``sid``'s worker (its exit means nothing for the job)."""
        self._records.pop(sid, None)

    def get(self, sid: SlotId) -> Optional[WorkerRecord]:
        return self._records.get(sid)

    def state(self, sid: SlotId) -> Optional[WorkerState]:
        rec = self._records.get(sid)
        return None if rec is None else rec.state

    def running(self, sid: SlotId) -> bool:
        """Does a process run on ``sid``?"""
        rec = self._records.get(sid)
        return rec is not None and rec.running

    def active(self, sid: SlotId) -> bool:
        """Does a process run on ``sid`` that the agent is not ending as no failure?"""
        rec = self._records.get(sid)
        return rec is not None and rec.running and not rec.stopping

    def items(self, *states: WorkerState) -> Iterator[Tuple[SlotId, WorkerRecord]]:
        """The records (in these states; default all), in start order."""
        for sid, rec in list(self._records.items()):
            if not states or rec.state in states:
                yield sid, rec

    def ids(self, *states: WorkerState) -> List[SlotId]:
        return [sid for sid, _ in self.items(*states)]

    def running_ids(self) -> List[SlotId]:
        return [sid for sid, rec in self.items() if rec.running]

    def active_ids(self) -> List[SlotId]:
        return [sid for sid, rec in self.items() if rec.running and not rec.stopping]
