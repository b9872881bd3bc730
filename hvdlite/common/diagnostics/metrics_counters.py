"""Rank-side counters for ``hvdlite-run --metrics-port``, and the thread that sends them.

Only when metrics are on (``HVDLITE_METRICS_PORT`` set, which the flag does) does the
runtime own a :class:`Counters`; its background thread adds to plain ints and lists at a
few points (one call per executed group, one per cycle with work), never per event of a
recorder, so a timeline or flight recorder composes with it untouched.  It counts per
executed group the op, its tensors and bytes, the collective's time and the fusion
buffer's fill; per ``_execute`` call whether the cache answered or a negotiation did; per
cycle with work the time to agreement; and on rank 0, about once a second, the tensors
stalled past the warning time.  Without metrics the runtime pays one ``is None`` test
per group.

A daemon thread (:class:`Reporter`, started by ``init()`` through
:func:`start_reporting`) sends a snapshot -- totals, not events -- to the launcher's store
every second (op ``metrics``); the launcher turns the snapshots of all ranks into
Prometheus metrics (``hvdlite.runner.store.metrics_server``).
"""

import bisect
import json
import logging
import threading
import time
from typing import Optional

from hvdlite.common.engine.message import OpType

log = logging.getLogger(__name__)

#: upper bounds (seconds) of the negotiation and collective time histograms
BUCKETS_S = (
    1e-4,
    2.5e-4,
    5e-4,
    1e-3,
    2.5e-3,
    5e-3,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
#: how often a rank sends its snapshot
REPORT_INTERVAL_S = 1.0
#: bound on one send (a launcher that does not answer costs the rank nothing else)
SEND_TIMEOUT_S = 2.0
#: how often rank 0 counts the stalled tensors
STALL_COUNT_INTERVAL_S = 1.0
_OPS = [op.name.lower() for op in OpType]


class Counters:
    """Totals since this runtime started; written by the background thread only."""

    def __init__(self, fusion_threshold_bytes: int):
        n = len(_OPS)
        self.ops = [0] * n
        self.bytes = [0] * n
        self.negotiation = [0] * (len(BUCKETS_S) + 1)  # per bucket, not cumulative
        self.negotiation_s = 0.0
        self.collective = [0] * (len(BUCKETS_S) + 1)
        self.collective_s = 0.0
        self.fused_groups = 0
        self.fill_sum = 0.0  # sum over fused groups of bytes / fusion threshold
        self.cache_hits = 0
        self.cache_misses = 0
        self.stalled = 0  # rank 0: tensors waiting past the stall warning time
        self.stall_counted_at = 0.0
        self.threshold = fusion_threshold_bytes
        self.stragglers = None  # rank 0's StragglerTracker, for per-rank lateness
        self._last_group = None  # the last fused group counted, and its bytes
        self._last_bytes = 0

    def negotiated(self, seconds: float) -> None:
        """A cycle with work of this rank reached agreement after ``seconds``."""
        self.negotiation[bisect.bisect_left(BUCKETS_S, seconds)] += 1
        self.negotiation_s += seconds

    def executed(self, group, seconds: float) -> None:
        """``group`` (responses of one collective) ran for ``seconds``."""
        self.collective[bisect.bisect_left(BUCKETS_S, seconds)] += 1
        self.collective_s += seconds
        op = int(group[0].op)
        if len(group) == 1:
            nbytes = group[0].nbytes
        elif self._last_group is group:  # a cached plan runs the same group objects
            nbytes = self._last_bytes
        else:
            nbytes = self._last_bytes = sum(r.nbytes for r in group)
            self._last_group = group
        self.ops[op] += len(group)
        self.bytes[op] += nbytes
        if len(group) > 1 and self.threshold > 0:
            self.fused_groups += 1
            self.fill_sum += nbytes / self.threshold

    def responses(self, count: int, cached: bool) -> None:
        """``count`` responses ran from the response cache (``cached``) or a negotiation."""
        if cached:
            self.cache_hits += count
        else:
            self.cache_misses += count

    def snapshot(self) -> dict:
        """The totals as plain data (what a rank sends; read from another thread: a
        snapshot may be a cycle out of step with itself, never wrong by more)."""
        snap = {
            "ops": dict(zip(_OPS, list(self.ops))),
            "bytes": dict(zip(_OPS, list(self.bytes))),
            "negotiation": list(self.negotiation),
            "negotiation_s": self.negotiation_s,
            "collective": list(self.collective),
            "collective_s": self.collective_s,
            "fused_groups": self.fused_groups,
            "fill_sum": self.fill_sum,
            "cache_hits": self.cache_hits,
            "cache_misses": self.cache_misses,
            "stalled": self.stalled,
        }
        tracker = self.stragglers
        if tracker is not None:
            snap["last_ready"] = dict(zip(map(str, tracker.ranks), list(tracker.last_total)))
            snap["lateness_s"] = dict(zip(map(str, tracker.ranks), list(tracker.late_total_s)))
            snap["completing_cycles"] = tracker.cycles_total
        return snap


class Reporter:
    """Sends ``runtime.metrics``'s snapshot to the store every second while the runtime
    runs, and once more when it has stopped (so the totals are complete)."""

    def __init__(self, runtime, config):
        self._runtime = runtime
        self._addr = (config.rendezvous_addr, int(config.rendezvous_port))
        self._key = config.secret_key
        self._header = {
            "op": "metrics",
            "hostname": config.hostname,
            "local_rank": config.local_rank,
            "rank": runtime.rank,
        }
        self._thread = threading.Thread(target=self._main, name="hvdlite-metrics", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _main(self) -> None:
        while True:
            running = self._runtime.running()
            self._send(json.dumps(self._runtime.metrics.snapshot()).encode())
            if not running:
                return
            time.sleep(REPORT_INTERVAL_S)

    def _send(self, blob: bytes) -> None:
        """One snapshot on a connection of its own: the store caps connections per job, and
        a connection held by every rank for the whole job would halve what is left."""
        from hvdlite.common.net.service import Client

        client = Client(self._addr, self._key, SEND_TIMEOUT_S, name="rendezvous store")
        try:
            client.request(dict(self._header), blob, timeout_s=SEND_TIMEOUT_S)
        except Exception as err:  # noqa: BLE001 -- metrics never end a rank
            log.debug("metrics snapshot not delivered: %s", err)
        finally:
            client.close()


def start_reporting(runtime, config) -> Optional[Reporter]:
    """Start sending ``runtime``'s counters to the launcher, if it counts and there is a
    store to send them to (a Gloo job's launcher); returns the reporter or None."""
    if (
        getattr(runtime, "metrics", None) is None
        or config.rendezvous_addr is None
        or config.rendezvous_port is None
        or config.secret_key is None
    ):
        return None
    reporter = Reporter(runtime, config)
    reporter.start()
    return reporter
