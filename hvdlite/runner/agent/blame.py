"""Whom a failed job's summary names: the rank whose failure came first and was its own.

When one rank raises, its peers fail too -- their collectives end with
``HvdliteInternalError`` because it left -- and whichever exit the launcher sees
first is often a peer's.  So ranks say why they exit: at an uncaught exception a
rank sends the store an *exit report* (``hvdlite.common.exit_report``: its
exception's last line, and whether it was a peer's failure seen from here).  The
summary names the first report that was not a peer's; without one it falls back
to what the launcher can see itself: a rank that exited 0 before its peers
finished, or one whose process is stopped (SIGSTOP, a debugger), else the rank
whose exit came first.
"""

import dataclasses
import threading
import time
from typing import Callable, Dict, List, Optional, Tuple

from hvdlite.common.net.service import ServiceError, is_int
from hvdlite.runner.procs import describe_exit, failure_message
from hvdlite.runner.starters.base import SlotId

#: how long to wait for the cause's report when the failing rank only reacted to a peer
REPORT_GRACE_S = 1.0
#: how much of a rank's exception line an exit report keeps
ERROR_CHARS = 500
#: how many reports a store keeps (one per slot; a bound against a flood)
MAX_REPORTS = 65536


def parse_exit_report(header: dict) -> Tuple[SlotId, dict]:
    """The slot and the report an ``exit_report`` request carries (sent by
    ``hvdlite.common.exit_report``): ``{"peer", "error", "rank" (or None), "slot", "at"}``.

    Raises:
        ServiceError: a field is missing or malformed (the sender is told).
    """
    host, slot = header.get("hostname"), header.get("local_rank")
    peer, error, rank = header.get("peer"), header.get("error"), header.get("rank")
    if not (isinstance(host, str) and len(host) <= 255 and is_int(slot)
            and isinstance(peer, bool) and isinstance(error, str)
            and (rank is None or is_int(rank))):
        raise ServiceError("exit_report: hostname, local_rank, peer and error are required")
    return (host, slot), {"peer": peer, "error": error[:ERROR_CHARS], "rank": rank,
                          "slot": (host, slot), "at": time.monotonic()}


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


def first_own_report(reports: Callable[[], List[Tuple[SlotId, dict]]],
                     grace_s: float = REPORT_GRACE_S) -> Optional[Tuple[SlotId, dict]]:
    """The earliest of ``reports()`` that was not a peer's failure, asked again for up to
    ``grace_s``: a rank reports before it exits, but its report may still be on the wire."""
    deadline = time.monotonic() + grace_s
    while True:
        own = [(sid, r) for sid, r in reports() if not r["peer"]]
        if own or time.monotonic() >= deadline:
            return min(own, key=lambda item: item[1]["at"]) if own else None
        time.sleep(0.05)


@dataclasses.dataclass
class Summary:
    """The facts one failure summary is made of (see the module docstring)."""

    #: every member of the round: slot id -> (rank, host)
    ranks: Dict[SlotId, Tuple[int, str]]
    #: the members' exits, in the order the launcher saw them
    exits: List[Tuple[SlotId, int]]
    #: the exit reports so far: slot id -> {"peer": bool, "error": str, "at": seconds}
    reports: Callable[[], Dict[SlotId, dict]]
    #: members whose process is stopped
    stopped: Callable[[], List[SlotId]]
    op_timeout_s: Optional[float] = None

    def line(self, failure: Tuple[SlotId, int]) -> str:
        """The summary line (newline-terminated) for the job's first failure ``failure``."""
        sid, code = failure
        rank, host = self.ranks.get(sid, (-1, sid[0]))
        cause = self._cause()
        if cause is not None:
            csid, report = cause
            crank, chost = self.ranks[csid]
            if csid == sid:
                return (f"hvdlite-run: rank {rank} on host {host} {describe_exit(code)}: "
                        f"{report['error']}; the other ranks were terminated.\n")
            return (f"hvdlite-run: rank {crank} on host {chost} failed first: "
                    f"{report['error']}; rank {rank} on host {host} then failed "
                    f"({describe_exit(code)}); the other ranks were terminated.\n")
        early = self._left_early(sid)
        silent = next(iter(self.stopped()), None) if early is None else None
        return failure_message(
            rank, host, code,
            left_early=self.ranks[early] if early else None,
            stopped=self.ranks[silent] if silent else None,
            op_timeout_s=self.op_timeout_s)

    def _cause(self) -> Optional[Tuple[SlotId, dict]]:
        """The first member's report that was not a peer's failure."""
        return first_own_report(lambda: [(sid, r) for sid, r in self.reports().items()
                                         if sid in self.ranks])

    def _left_early(self, failed: SlotId) -> Optional[SlotId]:
        """A member that exited 0 before the failure (its peers then lost it)."""
        for sid, code in self.exits:
            if sid == failed:
                return None
            if code == 0:
                return sid
        return None
