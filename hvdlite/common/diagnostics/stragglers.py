"""Which rank the others keep waiting for: the straggler report.

Every cycle each rank puts one number of its own into the control vector: how long its
oldest pending submission had waited when the previous cycle's agreement ended (the
agreement ends at about the same moment everywhere, so these ages compare across hosts
without comparing clocks).  After a cycle that completed operations, the rank with the
smallest age is the one that became ready last, and the spread between the largest and
the smallest age is what it cost the others.  Rank 0 keeps, per rank, how often and by
how much it was last (:class:`StragglerTracker`) and, once per window, warns about a rank
that was last in more than half of the completing cycles and cost more than a tenth of
the window.  The control vector carries three numbers for it whatever the job's size (the
smallest age, the largest, and the rank with the smallest; control_vector.py), and a
completing cycle costs rank 0 a few operations, so it is always on.

Ages are taken at the *end* of an agreement, not when each rank builds its vector: an
idle rank sleeps up to 50 ms between cycles while the others block in the control
allreduce, so ages taken earlier would be off by that much.  They travel in microseconds
(the rank-naming field in units of ``control_vector.AGE_UNIT_US``).  A wait is counted at
most for the time since the previous completing cycle, so several completions inside one
wait do not count it twice; spreads under :data:`MIN_SPREAD_S` count for nobody, and a
rank is named at most once per :data:`REPEAT_AFTER_WINDOWS` windows.  The warning goes to
the launcher's store as op ``straggler`` from a short-lived thread (never the loop), and
the launcher prints it with the rank's host; without a store rank 0 logs it.
"""

import logging
import threading
from typing import Callable, List, Optional, Tuple

import numpy as np

log = logging.getLogger(__name__)

#: a spread below this is noise (scheduling, one cycle time): nobody counts as last
MIN_SPREAD_S = 0.001
#: a rank counts as the straggler of a window when it was last in more than this share of
#: its completing cycles ...
LAST_SHARE = 0.5
#: ... and the others waited for it more than this share of the window
COST_SHARE = 0.10
#: the same rank is named again only after this many windows
REPEAT_AFTER_WINDOWS = 10
#: bound on handing a warning to the launcher (a daemon thread does it, never the loop)
SEND_TIMEOUT_S = 2.0


class StragglerTracker:
    """Rank 0's tally of who was last to be ready; fed by the background thread only.

    ``ranks`` are the job ranks of the runtime's members (messages name those);
    ``announce(rank, text)`` delivers a warning (see :func:`announcer`).
    """

    def __init__(
        self,
        ranks: List[int],
        window_s: float,
        announce: Callable[[int, str], None],
        label: str = "",
    ):
        size = len(ranks)
        self.ranks = list(ranks)
        self.window_s = window_s
        self._announce = announce
        self._label = label
        #: since the start: completing cycles each rank was last in, and seconds it cost
        self.last_total = [0] * size
        self.late_total_s = [0.0] * size
        self.cycles_total = 0
        self._last = [0] * size  # this window's
        self._late_s = [0.0] * size
        self._cycles = 0
        self._window_start: Optional[float] = None
        self._previous: Optional[float] = None
        self._warned_at = [-float("inf")] * size

    def observe(self, ages_us: np.ndarray, now: float) -> Optional[Tuple[int, float]]:
        """One completing cycle: ``ages_us[r]`` is how long rank r's oldest pending
        submission had waited when that cycle's agreement ended (microseconds).  Returns
        (member, seconds the others waited for it) when one member was clearly last."""
        newest = int(ages_us.argmin())
        return self.observe_summary(newest, int(ages_us[newest]), int(ages_us.max()), now)

    def observe_summary(
        self, newest: int, youngest_us: int, oldest_us: int, now: float
    ) -> Optional[Tuple[int, float]]:
        """:meth:`observe` from what the control vector carries instead of every age: the
        member that became ready last, and the smallest and largest age (microseconds)."""
        if self._window_start is None:
            self._window_start = now
        spread = (oldest_us - youngest_us) / 1e6
        self._cycles += 1
        self.cycles_total += 1
        late = None
        if spread >= MIN_SPREAD_S:
            # several completions inside one wait must not count that wait twice
            cost = spread if self._previous is None else min(spread, now - self._previous)
            self._last[newest] += 1
            self._late_s[newest] += cost
            self.last_total[newest] += 1
            self.late_total_s[newest] += cost
            late = (newest, cost)
        self._previous = now
        if now - self._window_start >= self.window_s:
            self._close_window(now)
        return late

    def _close_window(self, now: float) -> None:
        elapsed = now - self._window_start
        for r, count in enumerate(self._last):
            if count <= LAST_SHARE * self._cycles or self._late_s[r] <= COST_SHARE * elapsed:
                continue
            if now - self._warned_at[r] < REPEAT_AFTER_WINDOWS * self.window_s:
                continue
            self._warned_at[r] = now
            self._announce(self.ranks[r], self.describe(r, elapsed))
        self._last = [0] * len(self._last)
        self._late_s = [0.0] * len(self._late_s)
        self._cycles = 0
        self._window_start = now

    def describe(self, r: int, elapsed: float) -> str:
        """The one-line warning about member ``r`` for the window now closing."""
        where = f" ({self._label})" if self._label else ""
        return (
            f"straggler{where}: rank {self.ranks[r]} was the last to be ready in "
            f"{self._last[r]} of {self._cycles} completing cycles over the last "
            f"{elapsed:.0f}s and kept the others waiting {self._late_s[r]:.2f}s "
            f"({100.0 * min(1.0, self._late_s[r] / elapsed):.0f}% of the time); look for "
            f"extra work, a slower host or data loading on that rank"
        )


def announcer(config) -> Callable[[int, str], None]:
    """How rank 0 delivers a straggler warning: to the launcher's store, which prints it
    with the rank's host (a daemon thread sends it, so the loop never blocks); without a
    store (MPI, one process) to this rank's log."""
    if (
        config.rendezvous_addr is None
        or config.rendezvous_port is None
        or config.secret_key is None
    ):
        return _log_warning

    def send(rank: int, text: str) -> None:
        threading.Thread(
            target=_send,
            name="hvdlite-straggler-report",
            daemon=True,
            args=(
                (config.rendezvous_addr, int(config.rendezvous_port)),
                config.secret_key,
                rank,
                text,
            ),
        ).start()

    return send


def _log_warning(rank: int, text: str) -> None:
    log.warning("%s", text)


def _send(addr, key: bytes, rank: int, text: str) -> None:
    from hvdlite.common.net.service import Client

    client = Client(addr, key, SEND_TIMEOUT_S, name="rendezvous store")
    try:
        client.request({"op": "straggler", "rank": rank, "text": text}, timeout_s=SEND_TIMEOUT_S)
    except Exception as err:  # noqa: BLE001 -- the warning must not end the rank
        log.warning("%s (the launcher could not be told: %s)", text, err)
    finally:
        client.close()


#: a rank's entry when nothing of its own was pending (the MIN-allreduce's neutral value)
NOT_PENDING = 2**31 - 1


def ready_age_us(oldest: Optional[float], agreed_at: float) -> int:
    """This rank's entry for the next control vector: microseconds its oldest pending
    submission had waited at ``agreed_at``, or :data:`NOT_PENDING`."""
    if oldest is None:
        return NOT_PENDING
    return max(0, min(int((agreed_at - oldest) * 1e6), NOT_PENDING - 1))
