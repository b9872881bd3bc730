"""Whom a failed job's summary names: the rank whose failure came first and was its own.

When one rank raises, its peers fail too -- their collectives end with
``HvdliteInternalError`` because it left -- and whichever exit the launcher sees
first is often a peer's.  So ranks say why they exit: at an uncaught exception a
rank sends the store an *exit report* (``hvdlite.common.diagnostics.exit_report``: its
exception's last line, and whether it was a peer's failure seen from here).  The
summary names the first report that was not a peer's.  Without one, it names the
ranks the others waited for, as the agent confirmed them (``agent.wedged``): a rank
none of whose threads ran (a C call holding the interpreter lock), one a stall named
missing, one that never reached ``init()`` -- and says which ranks only waited.  Else
it falls back to what the launcher can see itself: a rank that exited 0 before its
peers finished, or one whose process is stopped (SIGSTOP, a debugger), else the rank
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
    #: the members the others waited for, each with why (``WedgeWatch.culprits``)
    culprits: Callable[[], List[Tuple[SlotId, str]]] = list
    #: pairs of the round's hosts that cannot reach each other (``Starter.cut_links``)
    cut_links: Callable[[], List[Tuple[str, str]]] = list

    def line(self, failure: Tuple[SlotId, int]) -> str:
        """The summary line (newline-terminated) for the job's first failure ``failure``."""
        sid, code = failure
        rank, host = self.ranks.get(sid, (-1, sid[0]))
        partitioned = self._partitioned(sid, code)
        if partitioned is not None:
            return partitioned
        cause = self._cause()
        if cause is not None:
            csid, report = cause
            crank, chost = self.ranks[csid]
            if csid == sid:
                return (
                    f"hvdlite-run: rank {rank} on host {host} {describe_exit(code)}: "
                    f"{report['error']}; the other ranks were terminated.\n"
                )
            return (
                f"hvdlite-run: rank {crank} on host {chost} failed first: "
                f"{report['error']}; rank {rank} on host {host} then failed "
                f"({describe_exit(code)}); the other ranks were terminated.\n"
            )
        waited_for = self._waited_for(sid, code)
        if waited_for is not None:
            return waited_for
        early = self._left_early(sid)
        silent = next(iter(self.stopped()), None) if early is None else None
        return failure_message(
            rank,
            host,
            code,
            left_early=self.ranks[early] if early else None,
            stopped=self.ranks[silent] if silent else None,
            op_timeout_s=self.op_timeout_s,
        )

    def _partitioned(self, failed: SlotId, code: int) -> Optional[str]:
        """The line naming the links that are cut between the round's hosts, if any."""
        cut = self.cut_links()
        if not cut:
            return None

        def ranks_on(host: str) -> str:
            ranks = sorted(r for r, h in self.ranks.values() if h == host)
            return f"rank{'s' if len(ranks) != 1 else ''} {', '.join(map(str, ranks))}"

        links = "; ".join(
            f"hosts {a} and {b} cannot reach each other ({ranks_on(a)} and "
            f"{ranks_on(b)} could not exchange)"
            for a, b in cut
        )
        rank, host = self.ranks.get(failed, (-1, failed[0]))
        return (
            f"hvdlite-run: {links}, while both reach the launcher (a partial network "
            f"partition); rank {rank} on host {host} then failed "
            f"({describe_exit(code)}); the other ranks were terminated.\n"
        )

    def _waited_for(self, failed: SlotId, code: int) -> Optional[str]:
        """The line naming the members the others waited for, if any."""
        culprits = dict((sid, why) for sid, why in self.culprits() if sid in self.ranks)
        if not culprits:
            return None
        named = "; ".join(
            f"rank {self.ranks[sid][0]} on host {self.ranks[sid][1]} {why}"
            for sid, why in culprits.items()
        )
        waiting = sorted(r for sid, (r, _) in self.ranks.items() if sid not in culprits)
        then = ""
        if failed not in culprits:
            rank, host = self.ranks.get(failed, (-1, failed[0]))
            report = self.reports().get(failed)
            said = f": {report['error']}" if report and report.get("error") else ""
            then = f" (rank {rank} then {describe_exit(code)}{said})"
        only = (
            f"; rank{'s' if len(waiting) != 1 else ''} {', '.join(map(str, waiting))} "
            f"only waited for {'it' if len(culprits) == 1 else 'them'}{then}"
            if waiting
            else ""
        )
        return f"hvdlite-run: {named}{only}; the other ranks were terminated.\n"

    def _cause(self) -> Optional[Tuple[SlotId, dict]]:
        """The first member's report that was not a peer's failure."""
        return first_own_report(
            lambda: [(sid, r) for sid, r in self.reports().items() if sid in self.ranks]
        )

    def _left_early(self, failed: SlotId) -> Optional[SlotId]:
        """A member that exited 0 before the failure (its peers then lost it)."""
        for sid, code in self.exits:
            if sid == failed:
                return None
            if code == 0:
                return sid
        return None
