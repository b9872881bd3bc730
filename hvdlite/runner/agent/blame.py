"""Whom a failed job's summary names: the rank whose failure came first and was its own.

When one rank raises, its peers fail too -- their collectives end with
``HvdliteInternalError`` because it left -- and whichever exit the launcher sees
first is often a peer's.  So ranks say why they exit: at an uncaught exception a
rank sends the store an *exit report* (``hvdlite.common.diagnostics.exit_report``: its
exception's last line, and whether it was a peer's failure seen from here).  The
summary names the first report that was not a peer's; without one it falls back
to what the launcher can see itself: a rank that exited 0 before its peers
finished, or one whose process is stopped (SIGSTOP, a debugger), else the rank
whose exit came first.
"""

import dataclasses
from typing import Callable, Dict, List, Optional, Tuple

from hvdlite.runner.hosts import SlotId
from hvdlite.runner.processes.workers import describe_exit, failure_message
from hvdlite.runner.store.exit_reports import first_own_report

@dataclasses.dataclass
class FailureSummary:
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
