"""Exit reports: why each rank exited, as it told the launcher before it did.

At an uncaught exception a rank sends an ``exit_report`` request
(``hvdlite.common.diagnostics.exit_report``): its exception's last line and whether
it was only a peer's failure seen from here.  The rendezvous store keeps them for
an agent's job; :class:`ExitReports` keeps them for an ``--mpi`` job, which has no
store.  ``hvdlite.runner.agent.blame`` reads them to name the rank that failed first.
"""

import threading
import time
from typing import Callable, Dict, List, Optional, Tuple

from hvdlite.common import exceptions
from hvdlite.common.net.service import ServiceError, is_int
from hvdlite.runner.hosts import SlotId
from hvdlite.runner.processes.rank_output import EXCEPTION_LINE

#: how long to wait for the cause's report when the failing rank only reacted to a peer
REPORT_GRACE_S = 1.0
#: how much of a rank's exception line an exit report keeps
ERROR_CHARS = 500
#: how many reports a store keeps (one per slot; a bound against a flood)
MAX_REPORTS = 65536


def parse_exit_report(header: dict) -> Tuple[SlotId, dict]:
    """The slot and the report an ``exit_report`` request carries (sent by
    ``hvdlite.common.diagnostics.exit_report``): ``{"peer", "error", "rank" (or None), "slot", "at"}``.

    Raises:
        ServiceError: a field is missing or malformed (the sender is told).
    """
    host, slot = header.get("hostname"), header.get("local_rank")
    peer, error, rank = header.get("peer"), header.get("error"), header.get("rank")
    if not (
        isinstance(host, str)
        and len(host) <= 255
        and is_int(slot)
        and isinstance(peer, bool)
        and isinstance(error, str)
        and (rank is None or is_int(rank))
    ):
        raise ServiceError("exit_report: hostname, local_rank, peer and error are required")
    return (host, slot), {
        "peer": peer,
        "error": error[:ERROR_CHARS],
        "rank": rank,
        "slot": (host, slot),
        "at": time.monotonic(),
    }


class ExitReports:
    """The exit reports of a job whose launcher has no rendezvous store (``--mpi``): the
    report store takes them with :meth:`ops`, and :meth:`cause` names the first rank
    whose failure was its own."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: by rank (or by slot, from a rank that failed before MPI numbered it)
        self._reports: Dict[object, dict] = {}

    def ops(self) -> dict:
        return {"exit_report": self._take}

    def _take(self, header: dict, _blob: bytes):
        slot, report = parse_exit_report(header)
        with self._lock:
            if len(self._reports) < MAX_REPORTS:
                # under mpiexec a rank knows its slot only once MPI numbered it: every rank
                # may have reported local slot 0, so the rank tells them apart
                self._reports[slot if report["rank"] is None else report["rank"]] = report
        return {}, b""

    def cause(self) -> Optional[Tuple[SlotId, dict]]:
        """The earliest report that was not a peer's failure, with the slot it came from."""

        def reports():
            with self._lock:
                return [(r["slot"], r) for r in self._reports.values()]

        return first_own_report(reports)


def first_own_report(
    reports: Callable[[], List[Tuple[SlotId, dict]]], grace_s: Optional[float] = None
) -> Optional[Tuple[SlotId, dict]]:
    """The earliest of ``reports()`` that was not a peer's failure, asked again for up to
    ``grace_s``: a rank reports before it exits, but its report may still be on the wire."""
    deadline = time.monotonic() + (REPORT_GRACE_S if grace_s is None else grace_s)
    while True:
        own = [(sid, r) for sid, r in reports() if not r["peer"]]
        if own or time.monotonic() >= deadline:
            return min(own, key=lambda item: item[1]["at"]) if own else None
        time.sleep(0.05)


def report_from_failure(slot: SlotId, text: str, order: float) -> dict:
    """The exit report of a worker whose failure its starter saw itself (a Ray call's or a
    Spark task's traceback), as a rank would have sent it: its exception's line, and
    whether that exception is hvdlite's way of saying a peer failed.  ``order`` sorts
    such reports among themselves (the order the starter saw the failures)."""
    lines = [x.strip() for x in text.strip().splitlines() if x.strip()]
    named = [x for x in lines if EXCEPTION_LINE.match(x)]
    line = named[-1] if named else (lines[0] if lines else "failed")
    kind = EXCEPTION_LINE.match(line)
    peer = bool(kind) and _is_peer_error(kind.group(1).rsplit(".", 1)[-1])
    return {
        "peer": peer,
        "error": line[:ERROR_CHARS],
        "rank": None,
        "slot": slot,
        "at": float(order),
    }


def _is_peer_error(name: str) -> bool:
    """Is ``name`` hvdlite's exception for a collective that failed because of a peer?"""
    found = getattr(exceptions, name, None)
    return isinstance(found, type) and issubclass(found, exceptions.HvdliteInternalError)
