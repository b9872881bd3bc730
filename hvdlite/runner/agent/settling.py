"""Damps hosts that flap in discovery: a host that appears is used once it stays listed.

A host whose discovery entry comes and goes (a flaky health check, a node that
reboots in a loop) would otherwise cost a reset each time it comes back: a new round,
a new worker, survivors stopped at ``commit()``.  :class:`SettlingHosts` wraps a host
source and hides such a host until it has been listed *steadily* for
``--discovery-settle-seconds``; the poller (:mod:`.poller`) and the agent then see
only the settled answer, so the state machine needs to know nothing about it.

The rules, answer by answer:

* The first answer is taken as is: a job starts with the hosts it finds, at once.
* A host that disappears is removed at once, with its slots: a dropped host must not
  keep ranks.  A host that was still settling forgets its wait.
* A host that appears -- new, or back after it was dropped -- is offered only once
  every answer for ``settle_s`` seconds has listed it (counted from the first of them;
  the poller asks about once a second, so it comes at the first answer after that).
  Dropped again meanwhile, it starts its wait anew when it is next listed.
* Slots: a host whose slot count shrinks gets the smaller count at once (like a
  drop).  One whose count grows keeps its old count until it has listed more than
  that for ``settle_s`` seconds in a row; it then gets the count of that answer.
* An answer that fails (:class:`~hvdlite.runner.hosts.source.HostDiscoveryError`)
  changes nothing here either: the error reaches the poller, and waits go on.

Hosts are offered in the order of the answer, settled ones only.  ``run_job`` wraps a
``--host-discovery-script``'s source in it when the setting is above 0; fixed hosts
never change, and Ray's and Spark's sources (nodes, registered tasks) are used as they
answer.
"""

import dataclasses
import logging
import time
from typing import Callable, Dict, List, Optional, Set

from hvdlite.runner.hosts import HostSlots
from hvdlite.runner.hosts.source import HostSource

log = logging.getLogger(__name__)

#: the flag that sets ``settle_s``, for log lines
SETTLE_FLAG = "--discovery-settle-seconds"


class SettlingHosts(HostSource):
    """``source``'s answers, with hosts that appear or grow held back for ``settle_s``
    seconds (see the module docstring).  :meth:`find` runs on the poller's thread only;
    ``clock`` (monotonic seconds) is for tests."""

    def __init__(
        self, source: HostSource, settle_s: float, clock: Callable[[], float] = time.monotonic
    ):
        self._source = source
        self._settle_s = float(settle_s)
        self._clock = clock
        self.can_change = source.can_change
        #: the slots offered per host (settled); None before the first answer
        self._offered: Optional[Dict[str, int]] = None
        #: hosts listed with more slots than offered: since when, in an unbroken run
        self._since: Dict[str, float] = {}
        #: every host any answer listed (to tell a returning host from a new one)
        self._seen: Set[str] = set()

    def find(self) -> List[HostSlots]:
        """The source's answer, less what has not settled yet.

        Raises:
            HostDiscoveryError: the source's (nothing changes here).
        """
        answer = self._source.find()
        now = self._clock()
        if self._offered is None:
            self._offered = {h.hostname: h.slots for h in answer}
            self._seen.update(self._offered)
            return list(answer)
        listed = {h.hostname: h.slots for h in answer}
        for host in [h for h in self._offered if h not in listed]:
            del self._offered[host]
        for host in [h for h in self._since if h not in listed]:
            del self._since[host]
            log.info(
                "host %s dropped again before it settled; its wait starts anew when it "
                "is next listed",
                host,
            )
        for host, slots in listed.items():
            self._settle(host, slots, now)
        self._seen.update(listed)
        return [
            h
            if h.slots == self._offered[h.hostname]
            else dataclasses.replace(h, slots=self._offered[h.hostname])
            for h in answer
            if self._offered.get(h.hostname, 0) > 0
        ]

    def _settle(self, host: str, slots: int, now: float) -> None:
        """One listed host: shrink at once, grow once listed so for ``settle_s``."""
        offered = self._offered.get(host, 0)
        if slots <= offered:
            self._offered[host] = slots
            self._since.pop(host, None)
            return
        first = host not in self._since
        since = self._since.setdefault(host, now)
        if now - since >= self._settle_s:
            del self._since[host]
            self._offered[host] = slots
            if offered:
                log.warning(
                    "host %s: its %s are used (listed for %.3gs)", host, _slots(slots), now - since
                )
            else:
                log.warning(
                    "host %s listed for %.3gs: it is added (%s)", host, now - since, _slots(slots)
                )
            return
        if not first:
            return  # still settling, said already
        if offered:
            log.warning(
                "host %s lists %d slots, up from %d; the %d more are added once "
                "listed for %gs (%s)",
                host,
                slots,
                offered,
                slots - offered,
                self._settle_s,
                SETTLE_FLAG,
            )
        else:
            again = " again" if host in self._seen else ""
            log.warning(
                "host %s listed%s; it is added once listed for %gs (%s)",
                host,
                again,
                self._settle_s,
                SETTLE_FLAG,
            )

    def close(self) -> None:
        self._source.close()


def _slots(n: int) -> str:
    return f"{n} slot" + ("" if n == 1 else "s")


def settled(source: HostSource, settle_s: float) -> HostSource:
    """``source`` damped by ``settle_s`` seconds, or itself when that is 0 or the source
    never changes."""
    if settle_s <= 0 or not source.can_change:
        return source
    return SettlingHosts(source, settle_s)
