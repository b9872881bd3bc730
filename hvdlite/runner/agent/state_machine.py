"""The agent's loop: one state machine that decides who trains in which round.

Every job runs through it -- a static job is the case "fixed hosts, no resets".
The agent keeps the set of usable hosts (its host source minus the blacklist),
turns it into rendezvous rounds, starts and stops workers through its starter,
and decides when the job has succeeded or failed.  Everything happens on one
thread, in :meth:`Agent._step`; between steps the agent sleeps on an
:class:`threading.Event` that a worker exit, a discovery change or a stop request
sets, so it reacts at once.

States and their transitions (every one is logged, with the round and hosts)::

    WAITING_FOR_SLOTS --enough slots---------------> STARTING_ROUND
                      --elastic timeout / no host can come back--> FAILED
    STARTING_ROUND    --round published, workers started--> RUNNING
                      --fewer than the needed slots--> WAITING_FOR_SLOTS
                      --a new worker could not start--> STARTING_ROUND (a reset)
                      --reset limit reached------> FAILED
    RUNNING           --a worker failed / the hosts changed the membership--> STARTING_ROUND
                      --reset limit reached------> FAILED
                      --a worker of the round exited 0--> FINISHING
    WAITING_FOR_SLOTS --a worker of the round exited 0--> FINISHING
    FINISHING         --every worker of the round exited 0--> SUCCEEDED
                      --a worker of the round failed, or none is left to finish--> FAILED
    any live state    --stop requested (SIGINT/SIGTERM)--> STOPPED

SUCCEEDED, FAILED and STOPPED are final: every worker on every host is ended.

Rounds and ranks.  The first round waits for ``-np`` slots; if ``--elastic-timeout``
passes with at least ``--min-np`` it starts with those, with fewer the job fails.
Later rounds need ``--min-np`` slots within ``--elastic-timeout`` (counted from the
moment the round was needed).  A round has at most ``--max-np`` slots.  Its ranks:
the surviving workers first, in their order in the previous round -- so rank 0 is a
survivor whenever there is one, and it holds the state new workers receive -- then
new slots, host by host in discovery order, lowest free local rank first.  A round is
published only when its membership differs from the running one: a discovered host
that would not get a slot (``--max-np`` reached) starts nothing.

Failures.  A worker that exits non-zero while its slot is in the newest round
failed.  In a static job that ends the job: the summary names the rank that failed
first and was not only reacting to a peer (``blame``).  In an elastic job its slot is
blacklisted while other workers of its host keep running (the host is alive: they
keep their processes and state), or else its whole host is (``hostset.HostSet``); the
next round is published without it (a reset).  Workers the agent
stopped, and workers whose slot is no longer in the newest round, may exit with any
code: that is no failure.  Every round after the first counts as a reset; when the
job needs one more than ``--reset-limit`` allows, it fails.

Growing without stopping.  Once an elastic job has survivors training, new slots
(a host back from its cooldown, a host discovery added) do not enter the next round at
once: their workers are started *ahead* of it, on standby, while the others train on.
The round that takes them is published only when every one of them waits to join
(``Publisher.ready``; a replacement's start-up takes seconds), so the survivors stop at
``commit()`` only for the reset itself.  A standby worker that fails before it joins
gets its host (or slot) blacklisted like a member's; one that does not wait to join
within ``--elastic-timeout`` is ended the same way.  Rounds forced by a failure, and
rounds that could not reach ``--min-np`` without them, take the new slots at once.

A reset nobody left.  When every member of the round asks the store for a new one and none
exited (a collective failed on all ranks, e.g. one rank raised), the agent opens a round
with the same members, counted as a reset like any other.

Workers.  Each worker has one record in ``self.workers`` (``registry.WorkerRegistry``)
with one state -- on standby, live, suspended, ending (its exit will count as a failure),
stopping, excused, finished or failed -- and the agent moves it only along
``registry.MOVES``; nothing else in the agent is kept per worker.

Success.  Once a worker of the newest round exits 0, training is over: the job
stops changing rounds (FINISHING) and succeeds when every worker of the round has
exited 0; a failure of one of them now fails the job, and so does a worker of the
round that had failed or was stopped before.
"""

import collections
import dataclasses
import enum
import logging
import signal
import threading
import time
from typing import Dict, List, Optional, Protocol, Sequence, Set, Tuple

from hvdlite.common.config import tunables
from hvdlite.common.exceptions import HvdliteLaunchError
from hvdlite.runner.agent import blame
from hvdlite.runner.agent.hostset import HostSet, describe_partition, keep_reachable
from hvdlite.runner.agent.poller import DiscoveryPoller
from hvdlite.runner.agent.registry import WorkerRecord, WorkerRegistry, WorkerState
from hvdlite.runner.agent.settings import JobSettings
from hvdlite.runner.agent.wedged import WedgeWatch
from hvdlite.runner.hosts import HostSlots, SlotInfo, place_slots
from hvdlite.runner.hosts.source import HostSource
from hvdlite.runner.processes.workers import describe_exit, exit_status
from hvdlite.runner.hosts import SlotId
from hvdlite.runner.starters.base import Starter

log = logging.getLogger("hvdlite.runner.agent")

#: the agent wakes at least this often even when nothing signals it (a safety net)
MAX_SLEEP_S = 0.5
#: elastic jobs: a member whose process has been stopped (SIGSTOP, a frozen host's
#: scheduler, a debugger) this long is ended, so that a new round goes on without it (its
#: peers would otherwise wait --op-timeout-seconds in their next collective); how often the
#: starter is asked which workers are stopped
FROZEN_S = 5.0
FROZEN_CHECK_S = 1.0
#: the exit status of a job the agent failed (reset limit, too few slots)
FAILED_EXIT = 1
#: the exit status after SIGINT/SIGTERM
STOPPED_EXIT = 130
#: while short of slots, say what the agent waits for this often
WAIT_LOG_INTERVAL_S = 5.0
#: this many rounds in a row replaced before they formed end an elastic job (a cascade)
UNFORMED_ROUNDS_LIMIT = 5


class JobState(enum.Enum):
    """The agent's states (see the module docstring for the transitions)."""

    WAITING_FOR_SLOTS = "waiting for slots"
    STARTING_ROUND = "starting a round"
    RUNNING = "running"
    FINISHING = "finishing"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"


FINAL = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.STOPPED})
#: the allowed transitions; :meth:`Agent._set_state` refuses any other
#: (every live state may also go to STOPPED)
TRANSITIONS: Dict[JobState, frozenset] = {
    JobState.WAITING_FOR_SLOTS: frozenset({JobState.STARTING_ROUND, JobState.FINISHING, JobState.FAILED,
                                        JobState.STOPPED}),
    JobState.STARTING_ROUND: frozenset({JobState.RUNNING, JobState.WAITING_FOR_SLOTS,
                                     JobState.STARTING_ROUND, JobState.FAILED, JobState.STOPPED}),
    JobState.RUNNING: frozenset({JobState.STARTING_ROUND, JobState.FINISHING, JobState.FAILED,
                              JobState.STOPPED}),
    JobState.FINISHING: frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.STOPPED}),
}


class Publisher(Protocol):
    """Opens rendezvous rounds (``hvdlite.runner.agent.rounds.Rounds``)."""

    def publish(self, slots: Sequence[SlotInfo], ids: Sequence[SlotId]) -> int:
        """Open the next round with ``slots``, the worker on ``ids[i]`` taking ``slots[i]``;
        returns its number."""

    def exit_reports(self) -> Dict[SlotId, dict]:
        """What ranks said about their own exit (see ``blame``), by slot."""

    def formed(self, round_: int) -> bool:
        """Did every rank of the newest round ``round_`` reach ``init()``?"""

    def standby(self, ids: Sequence[SlotId]) -> None:
        """These slots' new workers wait for a later round (replaces the previous set)."""

    def ready(self) -> Set[SlotId]:
        """The standby slots whose worker is waiting to join."""

    def new_process(self, ids: Sequence[SlotId]) -> None:
        """New processes start on these slots; their previous processes may not join."""

    def all_asking(self, round_: int) -> bool:
        """Does every member of ``round_`` wait for a round after it, none having left?"""

    def set_waker(self, waker) -> None:
        """Call ``waker()`` when :meth:`all_asking` becomes true."""

    def asking(self, round_: int) -> Set[SlotId]:
        """The members of ``round_`` that wait for a round after it."""

    def arrived(self, round_: int) -> Set[int]:
        """The ranks of ``round_`` that reached ``init()`` in it."""


def _name(sid: SlotId) -> str:
    return f"{sid[0]}:{sid[1]}"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _for(cooldown: Optional[float]) -> str:
    return "for the rest of the job" if cooldown is None else f"for {cooldown:.3g}s"


class Agent:
    """Runs the state machine above until the job succeeds, fails or is stopped.

    ``source`` (the host source) is polled on its own thread every
    ``discovery_interval_s``; ``starter`` starts and stops the processes (it must call
    :meth:`wake` when one exits); ``rounds`` opens the rendezvous rounds.
    ``op_timeout_s`` is the ranks' ``--op-timeout-seconds``, for failure summaries.
    """

    def __init__(self, settings: JobSettings, source: HostSource,
                 starter: Starter, rounds: Publisher,
                 discovery_interval_s: Optional[float] = None,
                 op_timeout_s: Optional[float] = None,
                 wedges: Optional[WedgeWatch] = None,
                 elastic_timeout_s: float = tunables.BY_FIELD["elastic_timeout_s"].default):
        self.settings = settings
        #: --elastic-timeout: the longest wait for --min-np slots, and for a worker's round
        self.elastic_timeout_s = elastic_timeout_s
        #: members alive but not progressing (None: no liveness, e.g. no store)
        self._wedges = wedges
        self._starter = starter
        self._rounds = rounds
        self._wake = threading.Event()
        rounds.set_waker(self.wake)
        self._stop_requested = threading.Event()
        self._poller = DiscoveryPoller(source, self.wake, discovery_interval_s)
        self._can_change = source.can_change
        self.hostset = HostSet(settings.cooldown_range)
        self.state = JobState.WAITING_FOR_SLOTS
        self.round = -1                       # the newest published round
        self.round_slots: List[SlotInfo] = []
        #: the worker (slot id) holding each place of the newest round, in rank order
        self.round_ids: List[SlotId] = []
        self._op_timeout_s = op_timeout_s
        self._exit_order: List[Tuple[SlotId, int]] = []     # members' exits, for summaries
        self._last_wait_log = time.monotonic()     # a wait is reported once it lasts
        self.resets = 0                       # rounds published after the first
        self.history: List[Tuple[JobState, JobState, str]] = []      # (from, to, why), for tests
        self.error: Optional[str] = None      # why the job failed
        #: a static job's failure: the whole line naming the rank that failed first
        self.summary: Optional[str] = None
        #: a static job that could not start: raised to the caller once workers are ended
        self.launch_error: Optional[HvdliteLaunchError] = None
        self.exit_code: Optional[int] = None
        #: every worker, one state each (``registry``)
        self.workers = WorkerRegistry()
        self._wait_since: Optional[float] = time.monotonic()
        self._prepared: Set[str] = set()
        self._frozen_checked = 0.0            # when the starter was last asked who is stopped
        self._unformed: List[int] = []        # rounds in a row replaced before they formed
        #: the round whose hosts were last probed for cut links (once per round)
        self._probed_round = -1

    # ---- the loop ------------------------------------------------------------------------

    def wake(self) -> None:
        """Have the loop take a step now (a worker exited, the hosts changed)."""
        self._wake.set()

    def finishing(self) -> bool:
        """Is training over: FINISHING or a final state?"""
        return self.state is JobState.FINISHING or self.state in FINAL

    def request_stop(self) -> None:
        """End the job: every worker is ended; :meth:`run` returns 130 (signal-safe)."""
        self._stop_requested.set()
        self._wake.set()

    def run(self) -> int:
        """Run until a final state; every worker is ended on return.  Returns the exit code."""
        self._poller.start()
        if not self.settings.static:
            log.info("elastic job: -np %d, --min-np %d, --max-np %s, --elastic-timeout %gs, "
                     "--reset-limit %s", self.settings.np, self.settings.min_np,
                     self.settings.max_np or "none", self.elastic_timeout_s,
                     "none" if self.settings.reset_limit is None else self.settings.reset_limit)
        try:
            while self.state not in FINAL:
                self._wake.clear()
                self._step()
                if self.state not in FINAL:
                    self._wake.wait(self._sleep_for())
        finally:
            self._poller.stop()
            self._starter.stop_all()
        return FAILED_EXIT if self.exit_code is None else self.exit_code

    def _step(self) -> None:
        """One decision: read exits and hosts, then act according to the state."""
        if self._stop_requested.is_set():
            self._set_state(JobState.STOPPED, "stop requested")
            self.exit_code = STOPPED_EXIT
            return
        for what in self.hostset.expire():
            log.warning("%s: blacklist cooldown over; it may rejoin (round %d)",
                        ("slot " if ":" in what else "host ") + what, self.round)
        failures = self._collect_exits()
        finished = self._finished()
        if finished and self.state in (JobState.RUNNING, JobState.WAITING_FOR_SLOTS):
            self._set_state(JobState.FINISHING,
                            f"worker {_name(finished[0])} of round {self.round} "
                            f"exited 0: training is over")
            self._excuse_newcomers()
            self._stop(self.workers.ids(WorkerState.STANDBY))
        if self.state is JobState.FINISHING or (failures and self.settings.static):
            self._step_finishing(failures)
            return
        for sid, code in failures:
            self._blacklist_for(sid, code)
        if self.state is JobState.RUNNING and not failures and self._leave_out_partitioned():
            pass                        # the next round is open, without the cut-off hosts
        elif self.state is JobState.RUNNING:
            self._end_frozen()
            self._end_wedged()
            self._check_standby()
            self._step_running(failures)
        elif self.state is JobState.WAITING_FOR_SLOTS:
            self._step_waiting()
        elif self.state is JobState.STARTING_ROUND:
            self._step_starting()

    def _sleep_for(self) -> float:
        waits = [MAX_SLEEP_S]
        back = self.hostset.seconds_to_next_return()
        if back is not None:
            waits.append(back)
        if self.state is JobState.WAITING_FOR_SLOTS and self._wait_since is not None:
            waits.append(self._wait_since + self.elastic_timeout_s - time.monotonic())
        return max(0.0, min(waits))

    def _set_state(self, new: JobState, why: str) -> None:
        old = self.state
        if new not in TRANSITIONS.get(old, frozenset()):
            raise AssertionError(f"agent: no transition {old.name} -> {new.name}")
        self.history.append((old, new, why))
        self.state = new
        if new is JobState.WAITING_FOR_SLOTS:
            self._last_wait_log = time.monotonic()
        log.info("%s: %s -> %s: %s", f"round {self.round}" if self.round >= 0
                 else "before the first round", old.name, new.name, why)

    # ---- exits ---------------------------------------------------------------------------

    def _collect_exits(self) -> List[Tuple[SlotId, int]]:
        """Record the exits since the last step; returns the failures among them."""
        members = set(self.round_ids)
        failures = []
        for sid, code in self._starter.poll():
            worker = self.workers.exited(sid)
            if worker is None:
                log.info("round %d: exit of unknown worker %s ignored", self.round, _name(sid))
                continue
            started = f"started as rank {worker.slot.rank} in round {worker.started_round}"
            if worker.state is WorkerState.STANDBY:
                self._standby_exited(sid, code)
                continue
            if worker.stopping:
                if worker.state is not WorkerState.EXCUSED:
                    self.workers.drop(sid)
                log.info("round %d: worker %s (%s) %s after it was stopped",
                         self.round, _name(sid), started, describe_exit(code))
                continue
            if sid not in members:
                self.workers.drop(sid)
                log.info("round %d: worker %s (%s) %s; its slot is not in the newest round: "
                         "no failure", self.round, _name(sid), started, describe_exit(code))
                continue
            if worker.state is WorkerState.ENDING:
                code = code or -signal.SIGTERM
            self._exit_order.append((sid, code))
            if code == 0:
                log.info("round %d: worker %s exited 0", self.round, _name(sid))
                self.workers.move(sid, WorkerState.FINISHED)
            else:
                self.workers.move(sid, WorkerState.FAILED)
                failures.append((sid, code))
                self._note_peer_failure(sid, worker)
        return failures

    def _finished(self) -> List[SlotId]:
        """Members of the newest round that exited 0 (in the order they started)."""
        return self.workers.ids(WorkerState.FINISHED)

    def _peer_error(self, sid: SlotId) -> Optional[str]:
        """A failed member's words when its rank only saw a peer fail (else None)."""
        rec = self.workers.get(sid)
        return None if rec is None or rec.state is not WorkerState.FAILED else rec.peer_error

    def _tell_standby(self, also: Sequence[SlotId] = ()) -> None:
        """Give the rendezvous the standby slots (and ``also``, about to start on standby)."""
        self._rounds.standby(self.workers.ids(WorkerState.STANDBY) + list(also))

    def _standby_exited(self, sid: SlotId, code: int) -> None:
        """A worker started ahead of its round exited before it joined one."""
        self.workers.drop(sid)
        self._tell_standby()
        if code == 0:
            log.info("round %d: standby worker %s %s before joining a round", self.round,
                     _name(sid), describe_exit(code))
            return
        self._standby_failed(sid, f"{describe_exit(code)} before it could join a round")

    def _standby_failed(self, sid: SlotId, why: str) -> None:
        """Keep out the slot of a standby worker that failed (the host, when none of its
        workers is running)."""
        others = [i for i in self.workers.active_ids() if i[0] == sid[0] and i != sid]
        what = _name(sid) if others else sid[0]
        cooldown = self.hostset.blacklist(sid if others else sid[0], f"worker {_name(sid)} {why}")
        log.warning("round %d: new worker %s %s; blacklisting %s %s %s", self.round,
                    _name(sid), why, "slot" if others else "host", what, _for(cooldown))

    def _check_standby(self) -> None:
        """End the standby workers that have not come to wait within --elastic-timeout."""
        standby = list(self.workers.items(WorkerState.STANDBY))
        if not standby:
            return
        ready = self._rounds.ready()
        now = time.monotonic()
        late = [sid for sid, w in standby if sid not in ready
                and now - w.since > self.elastic_timeout_s]
        for sid in late:
            self._standby_failed(sid, f"did not reach init() within --elastic-timeout "
                                      f"{self.elastic_timeout_s:g}s")
        self._stop(late)

    def _end_frozen(self) -> None:
        """Members whose process has been stopped for :data:`FROZEN_S`: an elastic job ends
        them (their exits then count as failures, so the next round goes on without them and
        the survivors' waits let go as soon as it is open); a static job, which cannot go on
        without them, says which rank and host every other rank is waiting for."""
        now = time.monotonic()
        if now - self._frozen_checked < FROZEN_CHECK_S:
            return
        self._frozen_checked = now
        members = set(self.round_ids)
        stopped = {sid for sid in self._starter.suspended() if sid in members
                   and self.workers.state(sid) in (WorkerState.LIVE, WorkerState.SUSPENDED)}
        for sid, w in self.workers.items(WorkerState.SUSPENDED):
            if sid not in stopped:
                if w.said:
                    log.warning("round %d: rank %d on host %s (worker %s) runs again",
                                self.round, self._rank_in_round(sid), sid[0], _name(sid))
                self.workers.move(sid, WorkerState.LIVE, now)
        for sid in stopped:
            self.workers.move(sid, WorkerState.SUSPENDED, now)
        frozen = [(sid, w) for sid, w in self.workers.items(WorkerState.SUSPENDED)
                  if now - w.since >= FROZEN_S]
        if not frozen:
            return
        if self.settings.static:
            for sid, w in frozen:
                if not w.said:
                    w.said = True
                    log.warning(
                        "round %d: rank %d on host %s (worker %s) has been stopped for %.0fs "
                        "(SIGSTOP, a debugger or a frozen host): every other rank waits for it "
                        "in its next collective; the job goes on when it runs again, or fails "
                        "after --op-timeout-seconds%s", self.round, self._rank_in_round(sid),
                        sid[0], _name(sid), now - w.since,
                        "" if self._op_timeout_s is None else f" ({self._op_timeout_s:g}s)")
            return
        log.warning("round %d: worker(s) %s stopped (SIGSTOP, a debugger or a frozen host) for "
                    "%.0fs; ending them so that the others go on without them", self.round,
                    ", ".join(_name(sid) for sid, _ in frozen), FROZEN_S)
        for sid, _ in frozen:
            self.workers.move(sid, WorkerState.ENDING)
        self._starter.stop([sid for sid, _ in frozen])

    def _round_hosts(self) -> List[str]:
        return list(dict.fromkeys(sid[0] for sid in self.round_ids))

    def _leave_out_partitioned(self) -> bool:
        """Elastic jobs: once members of a multi-host round ask for a new one and no member
        exited (that would explain it), probe the round's hosts for cut links (once per
        round); when some cannot reach each other,
        keep the largest set that can (``hostset.keep_reachable``), blacklist the rest and open the next
        round without them.  True when it did."""
        hosts = self._round_hosts()
        if self.settings.static or self._probed_round == self.round or len(hosts) < 2 \
                or not self._rounds.asking(self.round):
            return False
        self._probed_round = self.round
        cut = self._starter.cut_links(hosts)
        if not cut:
            return False
        slots = collections.Counter(sid[0] for sid in self.round_ids)
        _, out = keep_reachable(hosts, slots, cut)
        why = describe_partition(cut, out)
        log.warning("round %d: the round's hosts probed each other: %s", self.round, why)
        self._blacklist_hosts({h: "cannot reach " + ", ".join(
            sorted({b if a == h else a for a, b in cut if h in (a, b)})) for h in out},
            "is cut off from the others")
        self._need_round(why)
        return True

    def _end_wedged(self) -> None:
        """Members alive but not progressing (``wedged.WedgeWatch``): name them with their
        stacks; an elastic job ends those the others gave up on (their exits then count as
        failures, so the next round goes on without them)."""
        if self._wedges is None:
            return
        members = [sid for sid in self.round_ids
                   if self.workers.state(sid) in (WorkerState.LIVE, WorkerState.SUSPENDED)]
        self._wedges.report_silent(members, self._rank_in_round)
        if self.settings.static:
            return
        ending = self._wedges.to_end(members, self._rounds.asking(self.round),
                                     self._rank_in_round)
        for sid, why in ending:
            log.warning("round %d: %s: ending worker %s so that the others go on without it",
                        self.round, why, _name(sid))
            self.workers.move(sid, WorkerState.ENDING)
        if ending:
            self._starter.stop([sid for sid, _ in ending])

    def _note_peer_failure(self, sid: SlotId, worker: WorkerRecord) -> None:
        """Remember a failed worker whose own exit report (sent by this process, not an
        earlier one of the slot) says it only saw a peer fail: e.g. a new worker that timed
        out waiting for a round's rank that had died.  Its host is not to blame."""
        report = self._rounds.exit_reports().get(sid)
        if report and report.get("peer") and report.get("at", 0.0) >= worker.started_at:
            worker.peer_error = report.get("error", "")

    def _blacklist_for(self, sid: SlotId, code: int) -> None:
        """A member failed: keep its slot out while its host has other running workers of
        the round (they keep their state), else keep the whole host out."""
        host = sid[0]
        rank = self._rank_in_round(sid)
        why = f"worker {_name(sid)} {describe_exit(code)}"
        peer_error = self._peer_error(sid)
        if peer_error is not None:
            log.warning("round %d: worker %s (rank %d) %s after a peer's failure (%s); "
                        "its host %s is not blacklisted", self.round, _name(sid), rank,
                        describe_exit(code), peer_error, host)
            return
        members = set(self.round_ids)
        others = [i for i in self.workers.active_ids() if i[0] == host and i in members]
        if others:
            cooldown = self.hostset.blacklist(sid, why)
            log.warning("round %d: worker %s (rank %d) %s; blacklisting slot %s %s; the host's "
                        "other workers %s keep running", self.round, _name(sid), rank,
                        describe_exit(code), _name(sid), _for(cooldown),
                        ", ".join(map(_name, others)))
            return
        cooldown = self.hostset.blacklist(host, why)
        strays = [i for i in self.workers.active_ids() if i[0] == host]
        log.warning("round %d: worker %s (rank %d) %s; blacklisting host %s %s%s", self.round,
                    _name(sid), rank, describe_exit(code), host, _for(cooldown),
                    f" and stopping its workers {', '.join(map(_name, strays))}" if strays else "")
        self._stop(strays)

    def _rank_in_round(self, sid: SlotId) -> int:
        return self.round_ids.index(sid) if sid in self.round_ids else -1

    def _stop(self, ids: Sequence[SlotId]) -> None:
        ids = [i for i in ids if self.workers.active(i)]
        standby = [i for i in ids if self.workers.state(i) is WorkerState.STANDBY]
        for i in ids:
            self.workers.move(i, WorkerState.STOPPING)
        if standby:
            self._tell_standby()
        if ids:
            self._starter.stop(ids)

    # ---- states --------------------------------------------------------------------------

    def _excuse_newcomers(self) -> None:
        """Training ended before the newest round formed: its new workers (started for it)
        can never meet the finished ones, so they are stopped and need not finish."""
        if self.settings.static or self._rounds.formed(self.round):
            return
        started_now = {sid for sid, w in self.workers.items()
                       if w.running and w.started_round == self.round}
        new = [sid for sid in self.round_ids if sid in started_now]
        if new:
            log.info("round %d: training finished before new workers %s joined; stopping "
                     "them", self.round, ", ".join(map(_name, new)))
            self._stop(new)
            for sid in new:
                self.workers.move(sid, WorkerState.EXCUSED)

    def _step_finishing(self, failures: List[Tuple[SlotId, int]]) -> None:
        if failures:
            self._fail_with_summary(failures[0])
            return
        members = [m for m in self.round_ids if self.workers.state(m) is not WorkerState.EXCUSED]
        finished = set(self._finished())
        if all(m in finished for m in members):
            self._set_state(JobState.SUCCEEDED, f"all {_count(len(members), 'worker')} of round "
                                             f"{self.round} exited 0")
            self.exit_code = 0
            return
        running = [m for m in members if self.workers.active(m)]
        if not running:
            lost = [m for m in members if m not in finished]
            self._fail(f"training finished on {', '.join(map(_name, sorted(finished)))} "
                       f"but workers {', '.join(map(_name, lost))} of round {self.round} "
                       f"failed or were stopped before finishing", FAILED_EXIT)

    def _fail_with_summary(self, failure: Tuple[SlotId, int]) -> None:
        """A member failed where no new round can follow: name the right rank."""
        sid, code = failure
        line = self._starter.describe_failure(sid, code)
        if line is None and not self.settings.static:
            self._fail(f"worker {_name(sid)} (rank {self._rank_in_round(sid)}) of round "
                       f"{self.round} {describe_exit(code)} after training finished on "
                       f"{', '.join(map(_name, sorted(self._finished())))}", exit_status(code))
            return
        if line is None:
            line = blame.FailureSummary(
                ranks={i: (self._rank_in_round(i), i[0]) for i in self.round_ids},
                exits=list(self._exit_order), reports=self._rounds.exit_reports,
                stopped=self._starter.suspended, op_timeout_s=self._op_timeout_s,
                culprits=self._culprits, cut_links=self._cut_links).line(failure)
        self.summary = line
        self._fail(line.strip(), exit_status(code))

    def _cut_links(self) -> List[Tuple[str, str]]:
        """Pairs of the round's hosts that cannot reach each other (for the summary)."""
        hosts = self._round_hosts()
        return self._starter.cut_links(hosts) if len(hosts) > 1 else []

    def _culprits(self) -> List[Tuple[SlotId, str]]:
        """The members the others waited for, with why (for the failure summary)."""
        if self._wedges is None:
            return []
        arrived = None if self._rounds.formed(self.round) \
            else self._rounds.arrived(self.round)
        running = {sid for sid in self.round_ids if self.workers.running(sid)}
        return self._wedges.culprits(self.round_ids, self._rank_in_round, arrived, running)

    def _step_running(self, failures: List[Tuple[SlotId, int]]) -> None:
        if failures:
            self._need_round("worker " + ", ".join(
                f"{_name(s)} {describe_exit(c)}" for s, c in failures),
                peers_only=all(self._peer_error(s) is not None for s, _ in failures))
            return
        if not self.settings.static and self._rounds.all_asking(self.round):
            why = (f"every rank of round {self.round} left it and asks for a new one, and "
                   f"none exited (a collective failed on all of them): the same "
                   f"{_count(len(self.round_ids), 'worker')} again")
            log.warning("round %d: %s", self.round, why)
            self._need_round(why)
            return
        plan = self._plan()
        if plan is None:
            return
        plan, later = self._defer(plan)
        self._start_ahead(later)
        current = list(self.round_ids)
        if self.state is JobState.RUNNING and plan != current:
            added = [p for p in plan if p not in current]
            removed = [c for c in current if c not in plan]
            why = "hosts changed:" + (f" adds {', '.join(map(_name, added))}" if added else "") \
                + (f" removes {', '.join(map(_name, removed))}" if removed else "")
            self._need_round(why)

    def _need_round(self, why: str, peers_only: bool = False) -> None:
        """The membership must change: go publish a round, unless the reset limit is spent
        or rounds keep failing to form (``peers_only``: every failure behind this one was a
        rank giving up on a peer, see :meth:`_cascading`)."""
        limit = self.settings.reset_limit
        if limit is not None and self.resets >= limit:
            self._fail(f"{why}; that needs reset {self.resets + 1}, but --reset-limit is "
                       f"{limit}", FAILED_EXIT)
            return
        if self._cascading(why, peers_only):
            return
        self._wait_since = time.monotonic()
        self._set_state(JobState.STARTING_ROUND, why)
        self._step_starting()

    def _cascading(self, why: str, peers_only: bool) -> bool:
        """Stop a cascade: ranks of rounds that never form giving up on each other (each
        exit a peer failure, no host to blame), round after round.  Counts those rounds;
        a round that formed starts the count again; a crash or a kill neither counts nor
        resets it.  At ``UNFORMED_ROUNDS_LIMIT`` in a row the job fails (True) rather than
        start yet more workers into rounds that cannot form."""
        if self.round < 0 or self._rounds.formed(self.round):
            self._unformed = []
            return False
        if not peers_only:
            return False
        self._unformed.append(self.round)
        log.warning("round %d ends before all its workers reached init(), its ranks giving "
                    "up on each other (%d such rounds in a row; the job stops at %d): %s",
                    self.round, len(self._unformed), UNFORMED_ROUNDS_LIMIT, why)
        if len(self._unformed) < UNFORMED_ROUNDS_LIMIT:
            return False
        self._fail(f"rounds {self._unformed[0]} to {self._unformed[-1]} each ended before all "
                   f"their workers reached init(), their ranks timing out on each other; "
                   f"stopping rather than starting more workers (last: {why})", FAILED_EXIT)
        return True

    def _needed(self) -> int:
        """Slots the next round needs now (see the module docstring)."""
        if self.round < 0 and not self._timed_out():
            return self.settings.np
        return self.settings.min_np

    def _timed_out(self) -> bool:
        return (self._wait_since is not None
                and time.monotonic() - self._wait_since >= self.elastic_timeout_s)

    def _step_waiting(self) -> None:
        plan = self._plan()
        if plan is not None and len(plan) >= self._needed():
            self._set_state(JobState.STARTING_ROUND, f"{_count(len(plan), 'slot')} available")
            self._step_starting()
            return
        have = 0 if plan is None else len(plan)
        if self._timed_out():
            self._fail(f"{self._shortage(have)}, and no more became available within "
                       f"--elastic-timeout {self.elastic_timeout_s:g}s", FAILED_EXIT)
        elif self._poller.hosts is not None and not self._may_get_more():
            why = "a fixed host list" + ("" if self.settings.cooldown_range
                                         else " and no --blacklist-cooldown-range")
            self._fail(f"{self._shortage(have)}, and none can come back ({why})", FAILED_EXIT)
        else:
            self._say_what_we_wait_for(have)

    def _say_what_we_wait_for(self, have: int) -> None:
        """Never wait silently: once a wait has lasted ``WAIT_LOG_INTERVAL_S``, and as often
        again after that, one line on what is missing."""
        now = time.monotonic()
        if now - self._last_wait_log < WAIT_LOG_INTERVAL_S:
            return
        self._last_wait_log = now
        left = ("" if self._wait_since is None else
                f"; --elastic-timeout ends the job in "
                f"{max(0.0, self._wait_since + self.elastic_timeout_s - now):.0f}s")
        source = ("waiting for the host source's first answer" if self._poller.hosts is None
                  else self._shortage(have))
        log.warning("round %d: waiting for %s: %s%s", self.round,
                    _count(self._needed(), "slot"), source, left)

    def _may_get_more(self) -> bool:
        """Could the usable slots still grow without discovery changing?"""
        return (self._can_change or self.hostset.may_return()
                or any(w.stopping for _, w in self.workers.items() if w.running))

    def _shortage(self, have: int) -> str:
        hosts = self._poller.hosts
        listing = "none" if not hosts else ", ".join(f"{h.hostname}:{h.slots}" for h in hosts)
        black = self.hostset.blacklisted
        return (f"only {_count(have, 'slot')} usable, but --min-np is {self.settings.min_np}"
                + (f" (-np {self.settings.np} for the first round)" if self.round < 0 else "")
                + f"; hosts: {listing}"
                + (f"; blacklisted: {', '.join(f'{h} ({why})' for h, why in black.items())}"
                   if black else ""))

    def _step_starting(self) -> None:
        while True:
            plan = self._plan()
            if plan is None or len(plan) < self._needed():
                have = 0 if plan is None else len(plan)
                self._set_state(JobState.WAITING_FOR_SLOTS,
                                f"{_count(have, 'usable slot')}, {self._needed()} needed")
                self._step_waiting()
                return
            plan, later = self._defer(plan)
            refused = self._prepare_hosts(plan)
            if refused is None:
                return
            if not refused:
                break
            if not self._blacklist_hosts(refused, "cannot take workers"):
                return
        if self.round >= 0:
            self.resets += 1
        self._publish(plan)
        if self.state is JobState.RUNNING:
            self._start_ahead(later)

    def _defer(self, plan: List[SlotId]) -> Tuple[List[SlotId], List[SlotId]]:
        """Split ``plan`` into the round to publish now and the new slots whose workers
        should rather start ahead of a later round (see "Growing without stopping"): the
        new slots not yet waiting to join, when there are survivors and the round reaches
        the slots it needs without them."""
        if self.settings.static or self.round < 0 or not self._starter.needs_rendezvous:
            return plan, []
        members = set(self.round_ids)
        if not any(sid in members for sid in plan):
            return plan, []
        ready = self._rounds.ready()
        later = [sid for sid in plan if sid not in members
                 and not (self.workers.state(sid) is WorkerState.STANDBY and sid in ready)]
        now = [sid for sid in plan if sid not in later]
        if not later or len(now) < self._needed():
            return plan, []
        return now, later

    def _start_ahead(self, later: List[SlotId]) -> None:
        """Start the workers of ``later``'s slots that are not running yet, on standby: they
        wait to join while the round's members train."""
        fresh = [sid for sid in later if not self.workers.running(sid)]
        if not fresh:
            return
        refused = self._prepare_hosts(fresh)
        if refused is None:
            return
        if refused and not self._blacklist_hosts(refused, "cannot take workers"):
            return
        fresh = [sid for sid in fresh if sid[0] not in refused]
        slots = dict(zip(self.round_ids + fresh, place_slots(self.round_ids + fresh)))
        self._tell_standby(also=fresh)
        self._rounds.new_process(fresh)
        if self._wedges is not None:
            for sid in fresh:
                self._wedges.forget(sid)
        starting = [dataclasses.replace(slots[sid], local_rank=sid[1]) for sid in fresh]
        not_started = self._starter.start(starting) if starting else {}
        for sid, launched in zip(fresh, starting):
            if sid not in not_started:
                self.workers.start(sid, launched, self.round, WorkerState.STANDBY)
        if not_started:
            self._tell_standby()
        started = [sid for sid in fresh if sid not in not_started]
        if started:
            log.warning("round %d: starting %s ahead of the next round (%s); it opens once "
                        "they wait to join, training goes on meanwhile", self.round,
                        _count(len(started), "new worker"), ", ".join(map(_name, started)))
        if not_started:
            refused = {}
            for sid, why in not_started.items():
                refused.setdefault(sid[0], why)
            self._blacklist_hosts(refused, "cannot start workers")

    def _prepare_hosts(self, plan: List[SlotId]) -> Optional[Dict[str, str]]:
        """Have the starter ready the plan's new hosts; ``{host: why}`` for those it could
        not (None: the job failed)."""
        discovered = {h.hostname: h for h in self._poller.hosts or []}
        self._prepared &= {h.hostname for h in self.hostset.usable(list(discovered.values()))}
        todo = [discovered[h] for h in dict.fromkeys(p[0] for p in plan)
                if h not in self._prepared]
        try:
            refused = self._starter.prepare(todo) if todo else {}
        except HvdliteLaunchError as exc:
            self._fail(str(exc), FAILED_EXIT)
            return None
        self._prepared.update(h.hostname for h in todo if h.hostname not in refused)
        return refused

    def _publish(self, plan: List[SlotId]) -> None:
        slots = place_slots(plan)
        new = [(sid, s) for sid, s in zip(plan, slots) if not self.workers.running(sid)]
        joining = [sid for sid in plan if self.workers.state(sid) is WorkerState.STANDBY]
        self.round = self._rounds.publish(slots, plan)
        if self._wedges is not None:
            self._wedges.new_round(self.round)
            for sid, _ in new:
                self._wedges.forget(sid)
        for sid in joining:
            self.workers.move(sid, WorkerState.LIVE).started_round = self.round
        self.round_slots = slots
        self.round_ids = list(plan)
        self._wait_since = None
        (log.info if self.settings.static else log.warning)(
            "round %d: %s: %s", self.round, _count(len(slots), "worker"), ", ".join(
                f"rank {s.rank} {_name(sid)}{' (new)' if not self.workers.running(sid) else ''}"
                f"{' (was on standby)' if sid in joining else ''}"
                for sid, s in zip(plan, slots)))
        members = set(plan)
        self._stop([sid for sid in self.workers.running_ids() if sid not in members
                    and self.workers.state(sid) is not WorkerState.STANDBY])
        # a new worker is started under its slot id: that is how it joins every round
        starting = [dataclasses.replace(s, local_rank=sid[1]) for sid, s in new]
        if starting:
            self._rounds.new_process([sid for sid, _ in new])
        not_started = self._starter.start(starting) if starting else {}
        refused: Dict[str, str] = {}
        for (sid, s), launched in zip(new, starting):
            if sid in not_started:
                refused.setdefault(s.hostname, not_started[sid])
            else:
                self.workers.start(sid, launched, self.round, WorkerState.LIVE)
        if refused:
            self._refused_at_start(refused)
            return
        self._set_state(JobState.RUNNING, f"round {self.round} published with "
                                       f"{_count(len(slots), 'worker')}")

    def _cannot_start(self, refused: Dict[str, str]) -> None:
        """A static job whose hosts or workers could not start fails as a launch error."""
        why = "; ".join(dict.fromkeys(refused.values()))
        self.launch_error = HvdliteLaunchError(why)
        self._fail(why, FAILED_EXIT)

    def _refused_at_start(self, refused: Dict[str, str]) -> None:
        if self._blacklist_hosts(refused, "cannot start workers"):
            self._need_round(f"workers could not start on {', '.join(refused)}")

    def _blacklist_hosts(self, refused: Dict[str, str], what: str) -> bool:
        """Hosts that cannot take workers: an elastic job blacklists them and stops their
        workers (returns True: go on); a static job fails (returns False)."""
        if self.settings.static:
            self._cannot_start(refused)
            return False
        for host, why in refused.items():
            cooldown = self.hostset.blacklist(host, why)
            log.warning("round %d: host %s %s: %s; blacklisting it %s", self.round, host, what,
                        why, _for(cooldown))
            self._stop([sid for sid in self.workers.running_ids() if sid[0] == host])
        return True

    # ---- planning ------------------------------------------------------------------------

    def _plan(self) -> Optional[List[SlotId]]:
        """The next round's slots in rank order (None before discovery first answered)."""
        discovered = self._poller.hosts
        if discovered is None:
            return None
        usable: List[HostSlots] = self.hostset.usable(discovered)
        slots_of = {h.hostname: h.slots for h in usable}
        survivors = [sid for sid in self.round_ids
                     if self.workers.active(sid)
                     and sid[1] < slots_of.get(sid[0], 0)
                     and not self.hostset.slot_blacklisted(sid)]
        kept = set(survivors)
        plan = list(survivors)
        cap = self.settings.max_np
        for host in usable:
            for local in range(host.slots):
                if cap is not None and len(plan) >= cap:
                    break                   # never walk more slots than the round may use
                sid = (host.hostname, local)
                if sid in kept or self.hostset.slot_blacklisted(sid):
                    continue
                if self.workers.state(sid) is WorkerState.STANDBY:   # started ahead of it
                    plan.append(sid)
                    continue
                if self.workers.running(sid):   # its old process is still being stopped
                    break
                plan.append(sid)
        if self.settings.max_np is not None:
            plan = plan[:self.settings.max_np]
        return plan

    def _fail(self, why: str, code: int) -> None:
        self.error = why
        self.exit_code = code
        self._set_state(JobState.FAILED, why)
