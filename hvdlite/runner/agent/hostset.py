"""The hosts and slots a job may use: the discovered ones minus the blacklisted ones.

Two grains of blacklist.  A *slot* (host, local slot) is kept out when its worker
fails while the host's other workers keep running: the host is alive, so the
survivors keep their processes and their state.  A *host* is kept out when it
cannot take workers (its task cannot start, its connection is lost), or when a
failure leaves it no worker that is still running.  Without
``--blacklist-cooldown-range`` either stays out for the rest of the job; with
``MIN MAX`` it is out for a cooldown drawn uniformly from [MIN, MAX] seconds,
then may be used again (its next failure blacklists it again, with a new draw).
Times are ``time.monotonic()`` seconds (a clock is injected in tests).

A partial partition: which hosts stay together when some pairs cannot reach each other.
A switch that drops the traffic between two hosts while both still reach the launcher
leaves every rank alive and every heartbeat answered, yet no collective can finish.
The starter probes between the hosts' task services (``Starter.cut_links``); given the
pairs that failed, :func:`keep_reachable` picks the largest set of hosts that all reach
each other -- counted in slots, ties to the set that holds rank 0 (the state the others
will receive) and then to the lower ranks -- and the hosts it leaves out.  One-way drops
count as cuts: a TCP exchange needs both directions.
"""

import dataclasses
import itertools
import logging
import random
import time
from typing import Callable, Dict, FrozenSet, List, Optional, Sequence, Set, Tuple, Union

from hvdlite.runner.hosts import HostSlots

log = logging.getLogger(__name__)

#: a host name, or a (host name, local slot) pair
Banned = Union[str, Tuple[str, int]]


@dataclasses.dataclass
class _Ban:
    until: Optional[float]  # None: for the rest of the job
    reason: str


def _label(what: Banned) -> str:
    return what if isinstance(what, str) else f"{what[0]}:{what[1]}"


class HostSet:
    """Blacklist bookkeeping on top of the hosts a source offers."""

    def __init__(
        self,
        cooldown_range: Optional[Tuple[float, float]] = None,
        clock: Optional[Callable[[], float]] = None,
        rng: Optional[random.Random] = None,
    ):
        self._clock = clock or time.monotonic
        self._cooldown = cooldown_range
        self._rng = rng or random.Random()
        self._banned: Dict[Banned, _Ban] = {}

    def blacklist(self, what: Banned, reason: str) -> Optional[float]:
        """Keep a host (a name) or one slot ((host, local slot)) out; returns its cooldown in
        seconds (None: for good)."""
        cooldown = None
        if self._cooldown is not None:
            cooldown = self._rng.uniform(*self._cooldown)
        until = None if cooldown is None else self._clock() + cooldown
        self._banned[what] = _Ban(until, reason)
        return cooldown

    def expire(self) -> List[str]:
        """Hosts and slots whose cooldown has passed: they leave the blacklist (returned in
        order, slots as ``host:slot``)."""
        now = self._clock()
        back = [h for h, b in self._banned.items() if b.until is not None and b.until <= now]
        for h in back:
            del self._banned[h]
        return [_label(h) for h in back]

    def is_blacklisted(self, hostname: str) -> bool:
        return hostname in self._banned

    def slot_blacklisted(self, slot: Tuple[str, int]) -> bool:
        """True when the slot or its whole host is kept out."""
        return slot in self._banned or slot[0] in self._banned

    @property
    def blacklisted(self) -> Dict[str, str]:
        """``{host or host:slot: why}`` for what is kept out now, in blacklisting order."""
        return {_label(h): b.reason for h, b in self._banned.items()}

    def usable(self, discovered: List[HostSlots]) -> List[HostSlots]:
        """``discovered`` without the blacklisted hosts (same order; slots are checked with
        :meth:`slot_blacklisted`)."""
        return [h for h in discovered if h.hostname not in self._banned]

    def seconds_to_next_return(self) -> Optional[float]:
        """Time until the next cooldown ends; None when nothing will come back."""
        times = [b.until for b in self._banned.values() if b.until is not None]
        if not times:
            return None
        return max(0.0, min(times) - self._clock())

    def may_return(self) -> bool:
        """True while something blacklisted has a cooldown (it will be usable again)."""
        return any(b.until is not None for b in self._banned.values())


#: above this many hosts the exact search (every subset) gives way to a greedy one
EXACT_HOSTS = 12


def keep_reachable(
    hosts: Sequence[str], slots: Dict[str, int], cut: Sequence[Tuple[str, str]]
) -> Tuple[List[str], List[str]]:
    """``(kept, left_out)``: the hosts (in ``hosts``' order, which is rank order) to keep,
    all reaching each other, and the rest."""
    broken: Set[FrozenSet[str]] = {frozenset(p) for p in cut if p[0] != p[1]}
    if not broken:
        return list(hosts), []
    order = {h: i for i, h in enumerate(hosts)}

    def clique(group) -> bool:
        return not any(frozenset(p) in broken for p in itertools.combinations(group, 2))

    def score(group) -> tuple:
        # most slots, then rank 0's host inside, then the lowest ranks
        return (sum(slots.get(h, 1) for h in group), hosts[0] in group, [-order[h] for h in group])

    if len(hosts) <= EXACT_HOSTS:
        groups = (
            g
            for n in range(len(hosts), 0, -1)
            for g in itertools.combinations(hosts, n)
            if clique(g)
        )
        best = max(groups, key=score)
    else:
        best = list(hosts)
        while not clique(best):
            # leave out the host with the most cuts (the latest in rank order on a tie)
            worst = max(
                best, key=lambda h: (sum(frozenset((h, o)) in broken for o in best), order[h])
            )
            best.remove(worst)
    kept = [h for h in hosts if h in best]
    return kept, [h for h in hosts if h not in best]


def describe_partition(cut: Sequence[Tuple[str, str]], left_out: Sequence[str]) -> str:
    """``tbh1 and tbh2 cannot reach each other; tbh2 left out``."""
    links = "; ".join(f"{a} and {b} cannot reach each other" for a, b in cut)
    return links + (f"; {', '.join(left_out)} left out" if left_out else "")
