"""Stalls seen from the background thread: warnings, rank 0's verdict, and stack requests.

A tensor some ranks submitted and others did not is a stall (``Controller.stalled``).
Rank 0 warns about each once per ``--stall-check-warning-time-seconds`` (as Horovod
does), puts its verdict in every control vector (how many cycles ago the oldest cycle
whose tensors waited past the shutdown time was, so that every rank fails them in the
same cycle), and asks the stall's missing ranks for their stacks once per stall
(``diagnostics.stack_capture``): a summary to the launcher at once, the request to the
ranks in the next control vector, which each rank answers in the cycle it arrives.  A
user's request for every rank's stacks takes the same way.  :class:`StallWatch` holds
that state for one :class:`~hvdlite.common.engine.runtime.Runtime`, which calls it from
its cycle.
"""

import logging
import random
import threading
import time
from typing import Callable, Dict, List, Optional, Set, Tuple

import numpy as np

from hvdlite.common import config as cfg
from hvdlite.common.config import Config
from hvdlite.common.diagnostics import stack_capture as stack_report
from hvdlite.common.diagnostics.stall_words import SHUTDOWN_FLAG, stall_outcome
from hvdlite.common.engine import control_vector as cv
from hvdlite.common.engine.controller import Controller

log = logging.getLogger(__name__)

_INT_MAX = cv.INT_MAX
#: how many stalled tensors one stack report names (it counts the rest)
_MAX_TENSORS_REPORTED = 10
#: how a user turns a stall into an error
SHUTDOWN_HINT = " or ".join((SHUTDOWN_FLAG,) + cfg.horovod_twins(cfg.STALL_CHECK_SHUTDOWN_TIME))
#: how often rank 0 looks for stalls
_CHECK_EVERY_S = 1.0


class StallWatch:
    """One runtime's stall warnings, verdicts and stack requests.

    ``ranks``: the job ranks of the runtime's members by set rank; ``rank``: this
    process's set rank; ``hurry``: wakes the runtime's loop (a user's request for stacks
    goes out in the next cycle)."""

    def __init__(
        self,
        config: Config,
        controller: Controller,
        rank: int,
        ranks: List[int],
        hurry: Callable[[], None],
    ):
        self.config = config
        self.controller = controller
        self.rank, self.ranks = rank, ranks
        self._hurry = hurry
        self._warned: Dict[str, float] = {}  # name -> when last reported
        self._last_check = time.monotonic()
        # job ranks whose stacks this stall already asked for, and the request the next
        # control vector carries: (id, cutoff cycle or None for all ranks)
        self._asked: Set[int] = set()
        self._wanted: Optional[Tuple[int, Optional[int]]] = None
        self._lock = threading.Lock()
        #: where stacks go (None: nowhere, e.g. no launcher)
        self.target = stack_report.Target.from_config(config)

    def poller(self, status: Callable[[], dict]) -> Optional[stack_report.Poller]:
        """The thread that asks the launcher for users' stack requests (None: no target)."""
        if self.target is None:
            return None
        return stack_report.Poller(
            self.target, self.rank, self._ask_all if self.rank == 0 else None, status=status
        )

    # -- rank 0 -----------------------------------------------------------------------------
    def check(self, now: float) -> None:
        """Rank 0, about once a second: warn about each stalled tensor once per warning
        period, and ask the missing ranks for their stacks once per stall."""
        if (
            self.rank != 0
            or not self.config.stall_check
            or now - self._last_check <= _CHECK_EVERY_S
        ):
            return
        self._last_check = now
        every = self.config.stall_check_warning_time_s
        stalled = self.controller.stalled(every)
        for name in set(self._warned) - {s[0] for s in stalled}:
            del self._warned[name]
        if not stalled:
            self._asked.clear()  # the stall is over: the next one is reported
            return
        job = self.ranks
        for name, have, missing, waited in stalled:
            if now - self._warned.get(name, -every) < every:
                continue  # reported recently: repeat once per period
            self._warned[name] = now
            have, missing = [job[r] for r in have], [job[r] for r in missing]
            log.warning(
                "stall: tensor %r was submitted by ranks %s but not yet by ranks %s "
                "(waiting %.0fs); one rank may be skipping a collective or running "
                "different code (%s)",
                name,
                have,
                missing,
                waited,
                stall_outcome(self.config.stall_check_shutdown_time_s, SHUTDOWN_HINT),
            )
        self._ask_for_stacks(stalled)

    def _ask_for_stacks(self, stalled: List[Tuple[str, List[int], List[int], float]]) -> None:
        """Ask the stall's missing ranks not asked yet for their stacks: a summary to the
        launcher now, the request to the ranks in the next control vector."""
        job = self.ranks
        missing = {job[r] for _, _, miss, _ in stalled for r in miss}
        if self.target is None or not missing - self._asked:
            return
        self._asked |= missing
        cutoff = max(self.controller.table[name].first_cycle for name, _, _, _ in stalled)
        request_id = random.randrange(1, _INT_MAX)
        tensors = [
            [name, [job[r] for r in have], [job[r] for r in miss], round(waited, 1)]
            for name, have, miss, waited in stalled[:_MAX_TENSORS_REPORTED]
        ]
        stack_report.send_async(
            self.target,
            stack_report.STALL,
            request_id,
            job[self.rank],
            {
                "expected": sorted(missing),
                "tensors": tensors,
                "stalled": len(stalled),
                "hint": SHUTDOWN_HINT,
                "shutdown_s": self.config.stall_check_shutdown_time_s,
            },
            with_stacks=False,
        )
        with self._lock:
            self._wanted = (request_id, cutoff)

    def _ask_all(self, request_id: int) -> None:
        """The poller's thread: a user asked for every rank's stacks.  Rank 0's own go at
        once, from this thread; the others are asked in the next cycle."""
        assert self.target is not None
        stack_report.send_async(
            self.target,
            stack_report.ALL,
            request_id,
            self.ranks[self.rank],
            {"expected": list(self.ranks)},
        )
        with self._lock:
            self._wanted = (request_id, None)
        self._hurry()

    def put_in(self, vec: np.ndarray, cycle: int) -> None:
        """Rank 0: its verdict and any stack request into this cycle's control vector."""
        vec[cv.STALL] = self._cutoff(cycle)
        vec[cv.DUMP] = vec[cv.DUMP_AGE] = _INT_MAX
        if self._wanted is None:
            return
        with self._lock:
            wanted, self._wanted = self._wanted, None
        if wanted is not None:
            request_id, cutoff = wanted
            vec[cv.DUMP] = request_id
            # an age in cycles, as for the verdict; -1: every rank
            vec[cv.DUMP_AGE] = -1 if cutoff is None else min(cycle - cutoff, _INT_MAX - 1)

    def _cutoff(self, cycle: int) -> int:
        """How many cycles ago the last cycle whose tensors have waited too long was, or
        INT_MAX."""
        limit = self.config.stall_check_shutdown_time_s
        if not self.config.stall_check or limit <= 0 or not self.controller.table:
            return _INT_MAX
        horizon = time.monotonic() - limit
        expired = [e.first_cycle for e in self.controller.table.values() if e.first_time <= horizon]
        return min(cycle - max(expired), _INT_MAX - 1) if expired else _INT_MAX

    # -- every rank ---------------------------------------------------------------------------
    def answer(self, agreed: np.ndarray, cycle: int) -> None:
        """In the cycle rank 0's stack request arrives: send this rank's stacks if it is
        asked (every rank, or a rank missing from a tensor as old as the cutoff)."""
        if agreed[cv.DUMP] == _INT_MAX or self.target is None:
            return
        request_id, age = int(agreed[cv.DUMP]), int(agreed[cv.DUMP_AGE])
        if age < 0:
            if self.rank != 0:  # rank 0 sent its own with the summary
                stack_report.send_async(
                    self.target, stack_report.ALL, request_id, self.ranks[self.rank]
                )
        elif self.rank in self.controller.missing_since(cycle - age):
            stack_report.send_async(
                self.target, stack_report.STALL, request_id, self.ranks[self.rank]
            )
