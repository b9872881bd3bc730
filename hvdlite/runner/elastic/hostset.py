"""The hosts an elastic job may use: the discovered ones minus the blacklisted ones.

A host is blacklisted when one of its workers fails.  Without
``--blacklist-cooldown-range`` it stays out for the rest of the job; with
``MIN MAX`` it is out for a cooldown drawn uniformly from [MIN, MAX] seconds,
then discovery may offer it again (its next failure blacklists it again, with a
new draw).  Times are ``time.monotonic()`` seconds (a clock is injected in tests).
"""

import dataclasses
import logging
import random
import time
from typing import Callable, Dict, List, Optional, Tuple

from hvdlite.runner.hosts import HostSlots

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _Ban:
    until: Optional[float]          # None: for the rest of the job
    reason: str


class HostSet:
    """Blacklist bookkeeping on top of the hosts discovery offers."""

    def __init__(self, cooldown_range: Optional[Tuple[float, float]] = None,
                 clock: Optional[Callable[[], float]] = None, rng: Optional[random.Random] = None):
        self._clock = clock or time.monotonic
        self._cooldown = cooldown_range
        self._rng = rng or random.Random()
        self._banned: Dict[str, _Ban] = {}

    def blacklist(self, hostname: str, reason: str) -> Optional[float]:
        """Keep ``hostname`` out; returns its cooldown in seconds (None: for good)."""
        cooldown = None
        if self._cooldown is not None:
            cooldown = self._rng.uniform(*self._cooldown)
        until = None if cooldown is None else self._clock() + cooldown
        self._banned[hostname] = _Ban(until, reason)
        return cooldown

    def expire(self) -> List[str]:
        """Hosts whose cooldown has passed: they leave the blacklist (returned in order)."""
        now = self._clock()
        back = [h for h, b in self._banned.items() if b.until is not None and b.until <= now]
        for h in back:
            del self._banned[h]
        return back

    def is_blacklisted(self, hostname: str) -> bool:
        return hostname in self._banned

    @property
    def blacklisted(self) -> Dict[str, str]:
        """``{host: why}`` for the hosts kept out now, in the order they were blacklisted."""
        return {h: b.reason for h, b in self._banned.items()}

    def usable(self, discovered: List[HostSlots]) -> List[HostSlots]:
        """``discovered`` without the blacklisted hosts (same order)."""
        return [h for h in discovered if h.hostname not in self._banned]

    def seconds_to_next_return(self) -> Optional[float]:
        """Time until the next cooldown ends; None when no host will come back."""
        times = [b.until for b in self._banned.values() if b.until is not None]
        if not times:
            return None
        return max(0.0, min(times) - self._clock())

    def may_return(self) -> bool:
        """True while some blacklisted host has a cooldown (it will be usable again)."""
        return any(b.until is not None for b in self._banned.values())
