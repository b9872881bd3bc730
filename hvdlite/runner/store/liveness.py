"""Which ranks make progress, as the launcher sees it from outside them.

"The process exists" is not "the rank is alive": a rank whose C call holds the
interpreter lock, or that spins in native code, runs no Python thread at all and
answers nothing, yet its process stays and its task service keeps answering.  So
every rank's stack poller (``hvdlite.common.diagnostics.stack_capture.Poller``) tells
the store once a second who it is (slot, pid, round) and how far its background thread
got (its cycle count), and says when it stops polling (a shutdown or a reset).
:class:`Liveness` keeps the newest of these per slot:

* a slot that polled and then went silent, without saying it leaves, for
  :data:`SILENT_S` is *silent*: no thread of that process runs;
* rank 0's stall summaries (``stack_report`` of kind ``stall``) name the ranks the
  others wait for: those slots are *missing* from the round (a deadlock in the user's
  code leaves the process polling, but it never submits).

The agent confirms and acts on these (``hvdlite.runner.agent.wedged``); the failure
summary names these ranks rather than the ones that only waited for them.  A process
that never reached ``init()`` never polled and is never called silent here.
"""

import dataclasses
import threading
import time
from typing import Callable, Dict, List, Optional, Tuple

from hvdlite.common.net.service import is_int
from hvdlite.runner.hosts import SlotId

#: a slot that polled, then has not for this long (and did not say it leaves), is silent
SILENT_S = 5.0
#: at most this many slots are tracked (a bound against a flood of made-up slots)
MAX_SLOTS = 65536

Handler = Callable[[dict, bytes], Tuple[dict, bytes]]


@dataclasses.dataclass
class Beat:
    """The newest poll of one slot's process."""

    rank: int
    round: int
    pid: int
    seen: float  # when it last polled (monotonic)
    progress: int = -1  # its background thread's cycle count
    leaving: bool = False  # its poller said it stops


@dataclasses.dataclass
class Missing:
    """A stall's verdict on one slot: the others wait for it."""

    rank: int
    since: float  # when rank 0 reported it
    tensors: List[str]
    waited_s: float


class Liveness:
    """The ranks' beats and rank 0's stall verdicts, by slot (thread-safe)."""

    def __init__(self, silent_s: float = SILENT_S):
        self.silent_s = silent_s
        self._lock = threading.Lock()
        self._beats: Dict[SlotId, Beat] = {}
        self._missing: Dict[SlotId, Missing] = {}
        #: whether any rank ever polled: ran hvdlite's runtime (kept when beats are forgotten)
        self._heard_any = False

    # ---- the store's side -----------------------------------------------------------------

    def wrap(self, ops: Dict[str, Handler]) -> Dict[str, Handler]:
        """``ops`` with ``stacks_wanted`` (the pollers' beat) and ``stack_report`` (rank 0's
        stall summary) observed before they are handled."""
        out = dict(ops)
        for name, take in (("stacks_wanted", self.take_poll), ("stack_report", self.take_stall)):
            if name in ops:
                out[name] = _observed(take, ops[name])
        return out

    def take_poll(self, header: dict) -> None:
        slot, rank, pid = header.get("slot"), header.get("rank"), header.get("pid")
        if not (
            isinstance(slot, list)
            and len(slot) == 2
            and isinstance(slot[0], str)
            and len(slot[0]) <= 255
            and is_int(slot[1])
            and is_int(rank)
            and is_int(pid)
        ):
            return  # an old or foreign poller: no liveness
        sid = (slot[0], slot[1])
        round_ = header.get("round")
        progress = header.get("progress")
        now = time.monotonic()
        with self._lock:
            self._heard_any = True
            beat = self._beats.get(sid)
            if beat is None or beat.pid != pid:
                if beat is None and len(self._beats) >= MAX_SLOTS:
                    return
                beat = self._beats[sid] = Beat(rank, -1, pid, now)
            beat.rank, beat.seen = rank, now
            beat.round = round_ if is_int(round_) else beat.round
            if is_int(progress):
                beat.progress = progress
            beat.leaving = header.get("leaving") is True

    def take_stall(self, header: dict) -> None:
        """Rank 0's summary of a stall: the ranks it names as missing."""
        expected, tensors = header.get("expected"), header.get("tensors")
        if (
            header.get("kind") != "stall"
            or not isinstance(expected, list)
            or not isinstance(tensors, list)
        ):
            return
        names = [str(t[0]) for t in tensors if isinstance(t, list) and t][:5]
        waited = max(
            (
                t[3]
                for t in tensors
                if isinstance(t, list) and len(t) == 4 and isinstance(t[3], (int, float))
            ),
            default=0.0,
        )
        now = time.monotonic()
        with self._lock:
            by_rank = self._slots_by_rank_locked()
            for rank in expected:
                sid = by_rank.get(rank) if is_int(rank) else None
                if sid is not None:
                    self._missing[sid] = Missing(rank, now, names, float(waited))

    def _slots_by_rank_locked(self) -> Dict[int, SlotId]:
        """Each rank's slot in the newest round the beats know of."""
        newest = max((b.round for b in self._beats.values()), default=-1)
        return {b.rank: sid for sid, b in self._beats.items() if b.round == newest}

    # ---- the agent's side -----------------------------------------------------------------

    def forget(self, sid: SlotId) -> None:
        """A new process takes the slot (or its process ended): start over."""
        with self._lock:
            self._beats.pop(sid, None)
            self._missing.pop(sid, None)

    def beat(self, sid: SlotId) -> Optional[Beat]:
        with self._lock:
            beat = self._beats.get(sid)
            return None if beat is None else dataclasses.replace(beat)

    def silent_for(self, sid: SlotId, now: Optional[float] = None) -> Optional[float]:
        """Seconds since the slot's process last polled, when that is at least
        :attr:`silent_s` and it did not say it stops polling; else None."""
        now = time.monotonic() if now is None else now
        with self._lock:
            beat = self._beats.get(sid)
            if beat is None or beat.leaving or now - beat.seen < self.silent_s:
                return None
            return now - beat.seen

    def missing(self, sid: SlotId, since: float = 0.0) -> Optional[Missing]:
        """The stall verdict naming the slot, if one came after ``since`` (monotonic)."""
        with self._lock:
            verdict = self._missing.get(sid)
            return verdict if verdict is not None and verdict.since >= since else None

    def heard_any(self) -> bool:
        """Did any rank of the job ever poll (start hvdlite's runtime)?  A job whose ranks
        never did (a plain torch.distributed program, an import error) has no flight
        recorder to point at."""
        with self._lock:
            return self._heard_any

    def heard_from_host(self, host: str, within_s: float) -> bool:
        """Did a rank on ``host`` poll within the last ``within_s`` seconds?"""
        now = time.monotonic()
        with self._lock:
            return any(sid[0] == host and now - b.seen < within_s for sid, b in self._beats.items())


def _observed(observe: Callable[[dict], None], handler: Handler) -> Handler:
    def handle(header: dict, blob: bytes) -> Tuple[dict, bytes]:
        observe(header)
        return handler(header, blob)

    return handle
