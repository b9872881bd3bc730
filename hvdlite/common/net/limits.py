"""What a listener grants a peer that has not proved the job key, and how it reports them.

Every control-plane listener (driver, task service, rendezvous store, the
``hvdlite.run`` function service) may be reachable by strangers: the driver and
task services listen on all addresses.  The limits here keep what a stranger
can make us spend small and bounded:

* time: the hello must arrive within :data:`PREAUTH_TIMEOUT_S` (5 s);
* memory: the hello is at most ``framing.HELLO_MAX_BYTES`` (1 KiB);
* the kernel's queue: a listen backlog of at least :data:`MIN_BACKLOG` (2,048, capped by
  ``somaxconn``), so a flood of strangers does not make our clients' SYNs drop;
* the accept loop: when accept fails for want of descriptors or memory (EMFILE and
  kin), it sleeps :data:`ACCEPT_BACKOFF_S` (50 ms, doubling up to 1 s) instead of
  spinning;
* threads and descriptors: connections waiting for their hello cost no thread (the
  accept thread reads their hellos); at most :data:`MAX_UNAUTHENTICATED` of them per
  listener (fewer when descriptors are scarce), half of those per source address, and at
  most ``max_connections`` connections in all;
* places: when the table of waiting connections is full, the oldest one of the busiest
  source that has waited :data:`EVICT_MIN_AGE_S` is closed to make room for the newcomer
  (see :mod:`hvdlite.common.net.preauth`), so that idle strangers cannot keep a job's own
  clients out; authenticated connections are never closed for a newcomer;
* log volume: rejections are logged five per 10 s, then summarised
  (:class:`RejectLog`), so 40,000 forged frames make a handful of lines.

A :class:`hvdlite.common.net.service.Client` that a full listener drops before its
nonce connects again with a growing pause (``Client.RETRY_PAUSE_S``) until its timeout.
"""

import logging
import resource
import socket
import threading
import time
from typing import Dict, Optional

#: how long a new connection may take to prove the key (its whole hello frame); a client
#: sends its hello as soon as the nonce arrives, one round trip after connecting
PREAUTH_TIMEOUT_S = 5.0
#: connections per listener that may wait for their hello at once
MAX_UNAUTHENTICATED = 512
#: how long every accepted connection may wait for its hello before a newcomer may take
#: its place; a peer with the key answers the nonce at once (one round trip), and one on
#: another address than the flood's is not in the flood's part of the table at all
EVICT_MIN_AGE_S = 0.05
#: connections accepted per turn of the accept loop before it reads waiting hellos again
ACCEPTS_PER_TURN = 32
#: connections per listener, authenticated or not (a job needs about one per rank)
MIN_MAX_CONNECTIONS = 512
#: pending connections the kernel queues before accept (the real bound is also capped by
#: net.core.somaxconn); a job of N ranks may connect N at once, and a flood of strangers
#: must not fill the queue so that our clients' SYNs are dropped (retried after 1 s, 3 s...)
MIN_BACKLOG = 2048
#: how long the accept loop sleeps (doubling up to the cap) when accept fails for want of
#: descriptors or memory, instead of spinning
ACCEPT_BACKOFF_S = (0.05, 1.0)


def backlog_for(expected_peers: int) -> int:
    """A listen backlog for a listener that ``expected_peers`` processes connect to at once."""
    return min(socket.SOMAXCONN, max(MIN_BACKLOG, 2 * int(expected_peers)))


def max_unauthenticated_default() -> int:
    """:data:`MAX_UNAUTHENTICATED`, or a quarter of this process's descriptor limit when
    that is smaller (waiting strangers must not take the descriptors our peers need)."""
    try:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (OSError, ValueError):
        return MAX_UNAUTHENTICATED
    if soft == resource.RLIM_INFINITY:
        return MAX_UNAUTHENTICATED
    return max(16, min(MAX_UNAUTHENTICATED, soft // 4))


def max_connections_for(expected_peers: int) -> int:
    """A connection cap that leaves every expected peer room for a few connections."""
    return max(MIN_MAX_CONNECTIONS, 4 * int(expected_peers))


class RejectLog:
    """Rate-limited warnings about refused peers.

    The first ``burst`` events of each ``window_s`` are logged one by one; the rest are
    counted, and a summary (how many, from which addresses) is logged when the window
    ends (at the next event or at :meth:`flush`, which a listener calls when it shuts
    down).
    """

    def __init__(
        self,
        logger: logging.Logger,
        name: str,
        burst: int = 5,
        window_s: float = 10.0,
        max_peers: int = 8,
    ):
        self._log = logger
        self._name = name
        self._burst = burst
        self._window_s = window_s
        self._max_peers = max_peers
        self._lock = threading.Lock()
        self._window_start = time.monotonic()
        self._logged = 0
        self._suppressed = 0
        self._peers: Dict[str, int] = {}
        #: every event ever noted (for tests and the final summary)
        self.total = 0

    def note(self, peer: str, what: str) -> None:
        """One refused frame or connection from ``peer`` (``host:port``; the summary counts
        by host), ``what`` saying why."""
        with self._lock:
            self.total += 1
            now = time.monotonic()
            if now - self._window_start >= self._window_s:
                self._summary_locked()
                self._window_start = now
            if self._logged < self._burst:
                self._logged += 1
                self._log.warning("%s: %s from %s", self._name, what, peer)
                if self._logged == self._burst:
                    self._log.warning(
                        "%s: further rejections are summarised every %.0fs",
                        self._name,
                        self._window_s,
                    )
                return
            self._suppressed += 1
            host = peer.rsplit(":", 1)[0] if ":" in peer else peer  # by address, not port
            self._peers[host] = self._peers.get(host, 0) + 1

    def flush(self) -> Optional[str]:
        """Log (and return) the summary of what was not logged yet, if anything."""
        with self._lock:
            return self._summary_locked()

    def _summary_locked(self) -> Optional[str]:
        if not self._suppressed:
            self._logged = 0
            return None
        top = sorted(self._peers.items(), key=lambda kv: -kv[1])[: self._max_peers]
        more = len(self._peers) - len(top)
        peers = ", ".join(f"{p} ({n})" for p, n in top) + (f" and {more} more" if more else "")
        text = (
            f"{self._name}: {self._suppressed} more rejected frames or connections not "
            f"logged one by one, from {peers}"
        )
        self._log.warning("%s", text)
        self._suppressed = 0
        self._peers = {}
        self._logged = 0
        return text
