"""What ranks report to the launcher's store while they run: counters and straggler lines.

The store (``hvdlite.runner.store.rendezvous.RendezvousService``, or under ``--mpi`` the report
store, through :meth:`MetricsInbox.ops`) hands two ops here:
``metrics`` (a rank's snapshot of ``hvdlite.common.diagnostics.metrics_counters.Counters``, JSON in
the blob, about once a second) and ``straggler`` (rank 0's one-line warning, printed here
with the named rank's host).  Both come over the store's authenticated channel; what
they carry is bounded and checked, and only the newest snapshot per slot is kept.
"""

import json
import logging
import threading
import time
from typing import Callable, Dict, Optional, Tuple

from hvdlite.common.net.service import ServiceError, is_int

log = logging.getLogger("hvdlite.runner")

#: bound on one snapshot's JSON
MAX_SNAPSHOT_BYTES = 64 * 1024
#: bound on the slots whose snapshots are kept (one per worker process of a round)
MAX_SLOTS = 65536
#: bound on a straggler line
MAX_LINE_CHARS = 500

SlotKey = Tuple[str, int]


class MetricsInbox:
    """The newest snapshot of every rank, and the straggler lines, as the store gets them.

    ``host_of(rank)`` names a rank's host in the newest round (None: unknown).
    """

    def __init__(self, host_of: Callable[[int], Optional[str]]):
        self._host_of = host_of
        self._lock = threading.Lock()
        self._snapshots: Dict[SlotKey, dict] = {}

    def take_metrics(self, header: dict, blob: bytes) -> None:
        """Op ``metrics``: keep the snapshot of the slot in ``header``.

        Raises:
            ServiceError: a missing field, or a snapshot that is too big or not an object.
        """
        host, slot, rank = header.get("hostname"), header.get("local_rank"), header.get("rank")
        if not (isinstance(host, str) and len(host) <= 255 and is_int(slot) and is_int(rank)):
            raise ServiceError("metrics: hostname, local_rank and rank are required")
        if len(blob) > MAX_SNAPSHOT_BYTES:
            raise ServiceError(
                f"metrics: a snapshot of {len(blob)} bytes is over {MAX_SNAPSHOT_BYTES}"
            )
        try:
            snap = json.loads(blob)
        except ValueError:
            raise ServiceError("metrics: the snapshot is not JSON") from None
        if not isinstance(snap, dict):
            raise ServiceError("metrics: the snapshot is not a JSON object")
        with self._lock:
            if (host, slot) in self._snapshots or len(self._snapshots) < MAX_SLOTS:
                self._snapshots[(host, slot)] = {"rank": rank, "at": time.monotonic(), "data": snap}

    def take_straggler(self, header: dict) -> None:
        """Op ``straggler``: print rank 0's warning, naming the straggler's host.

        Raises:
            ServiceError: the rank or the line is missing.
        """
        rank, text = header.get("rank"), header.get("text")
        if not (is_int(rank) and isinstance(text, str)):
            raise ServiceError("straggler: rank and text are required")
        host = self._host_of(rank) or self._host_in_snapshots(rank)
        where = f" on host {host}" if host else ""
        log.warning("%s [rank %d%s]", text[:MAX_LINE_CHARS], rank, where)

    def _host_in_snapshots(self, rank: int) -> Optional[str]:
        with self._lock:
            return next(
                (host for (host, _), s in self._snapshots.items() if s["rank"] == rank), None
            )

    def ops(self) -> Dict[str, Callable[[dict, bytes], Tuple[dict, bytes]]]:
        """The store ops this serves, for a store other than the rendezvous store (the
        report store of an ``--mpi`` job)."""

        def metrics(header, blob):
            self.take_metrics(header, blob)
            return {}, b""

        def straggler(header, _blob):
            self.take_straggler(header)
            return {}, b""

        return {"metrics": metrics, "straggler": straggler}

    def snapshots(self) -> Dict[SlotKey, dict]:
        """(host, local slot) -> ``{"rank", "at" (monotonic arrival), "data"}``."""
        with self._lock:
            return dict(self._snapshots)
