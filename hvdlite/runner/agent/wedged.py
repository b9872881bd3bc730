"""Members that are alive but not progressing: named, confirmed from outside, ended.

A grey failure is a rank whose process runs but whose training does not: a C call that
holds the interpreter lock, a deadlock in the user's code, a rank that never reaches
``init()``.  Its peers only wait for it, and whichever of them fails first used to be
blamed.  :class:`WedgeWatch` turns what the store saw (``hvdlite.runner.store.liveness``:
each rank's beats and rank 0's stall verdicts) into verdicts on members:

* **Named, from outside.**  A member silent for ``SILENT_S`` (no thread of it ran) is
  reported once, with its host, pid and the stack py-spy takes of it from outside the
  process (the starter's ``outside_stacks``), on a thread of its own so that the agent
  never waits for py-spy.
* **Ended (elastic jobs).**  When other members of the round have given up on it and
  ask for a new round (their collectives timed out, or the stall shutdown ended them),
  a member that does not ask is ended, so that the next round goes on without it, when
  it is confirmed as not progressing: silent, or named missing by a stall of this
  round -- or, failing both, when it has not asked within twice ``--op-timeout-seconds``
  + :data:`ASK_GRACE_S` after the first that did (its own collective would have failed
  long before; twice, so that a rank busy with work of its own -- an evaluation on rank 0
  while the others wait -- is not ended for being slow once).
* **Blamed.**  :meth:`culprits` says, for the failure summary, which members the others
  waited for and why: silent, missing from a stall, or never reached ``init()``.
"""

import logging
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

from hvdlite.runner.hosts import SlotId
from hvdlite.runner.processes.py_spy import OutsideStack
from hvdlite.runner.store.liveness import Liveness

log = logging.getLogger("hvdlite.runner.agent")

#: a member that does not ask for the new round this long after twice the op timeout (from
#: the first that asked) is ended
ASK_GRACE_S = 10.0
#: bound on taking one member's stack with py-spy
OUTSIDE_STACK_S = 10.0

#: ``outside(ids, timeout_s)``: stacks taken by py-spy, by slot (see ``Starter``)
Outside = Callable[[Sequence[SlotId], float], Dict[SlotId, OutsideStack]]
#: ``lines(stack)``: the report's lines for one py-spy stack (indented)
StackLines = Callable[[OutsideStack], List[str]]


class WedgeWatch:
    """Verdicts on the members of the newest round (called from the agent's thread)."""

    def __init__(
        self,
        liveness: Liveness,
        outside: Optional[Outside] = None,
        stack_lines: Optional[StackLines] = None,
        op_timeout_s: Optional[float] = None,
        write: Callable[[str], None] = lambda text: log.warning("%s", text.rstrip()),
    ):
        self.liveness = liveness
        self._outside = outside
        self._stack_lines = stack_lines
        self._op_timeout_s = op_timeout_s
        self._write = write
        #: members reported silent (until they poll again), and when each asker first asked
        self._said: Set[SlotId] = set()
        self._asking_since: Dict[SlotId, float] = {}
        self._round = -1
        self._round_since = time.monotonic()

    def new_round(self, round_: int) -> None:
        self._round, self._round_since = round_, time.monotonic()
        self._asking_since.clear()

    def forget(self, sid: SlotId) -> None:
        """A new process takes the slot."""
        self.liveness.forget(sid)
        self._said.discard(sid)

    # ---- naming ---------------------------------------------------------------------------

    def report_silent(self, members: Sequence[SlotId], rank_of: Callable[[SlotId], int]) -> None:
        """Say once per silence which members stopped answering, with their stacks."""
        now = time.monotonic()
        silent = {sid: self.liveness.silent_for(sid, now) for sid in members}
        self._said &= {sid for sid, s in silent.items() if s is not None}
        new = [sid for sid, s in silent.items() if s is not None and sid not in self._said]
        if not new:
            return
        self._said.update(new)
        facts = [(sid, rank_of(sid), self.liveness.beat(sid), silent[sid]) for sid in new]
        threading.Thread(
            target=self._say_silent, args=(facts,), daemon=True, name="hvdlite-wedge-report"
        ).start()

    def _say_silent(self, facts) -> None:
        stacks = {}
        if self._outside is not None:
            try:
                stacks = self._outside([sid for sid, _, _, _ in facts], OUTSIDE_STACK_S)
            except Exception as exc:  # noqa: BLE001 -- a diagnosis never fails the job
                log.info("outside stacks failed: %s", exc)
        lines = []
        for sid, rank, beat, seconds in facts:
            pid = beat.pid if beat is not None else "?"
            lines.append(
                f"hvdlite-run: rank {rank} on host {sid[0]} (pid {pid}) has not answered for "
                f"{seconds:.0f}s while its process runs: no thread of it gets to run (a C "
                f"call holding the interpreter lock, or a loop in native code); the other "
                f"ranks wait for it in their next collective"
            )
            stack = stacks.get(sid)
            if stack is not None and self._stack_lines is not None:
                lines.append(
                    "  its stack, taken from outside the process by py-spy (innermost frame first):"
                )
                lines += self._stack_lines(stack)
            else:
                lines.append("  (no stack: this starter cannot take one from outside)")
        self._write("\n".join(lines) + "\n")

    # ---- ending (elastic) -----------------------------------------------------------------

    def to_end(
        self, members: Sequence[SlotId], asking: Set[SlotId], rank_of: Callable[[SlotId], int]
    ) -> List[Tuple[SlotId, str]]:
        """Members to end now, with why: the others ask for a new round and these are
        confirmed as not progressing (see the module docstring)."""
        now = time.monotonic()
        for sid in asking:
            self._asking_since.setdefault(sid, now)
        askers = [sid for sid in members if sid in asking]
        if not askers:
            return []
        first = min(self._asking_since[sid] for sid in askers)
        out = []
        for sid in members:
            if sid in asking:
                continue
            why = self._why_stuck(sid, now, first)
            if why is not None:
                out.append(
                    (
                        sid,
                        f"rank {rank_of(sid)} on host {sid[0]} {why}; ranks "
                        f"{sorted(rank_of(a) for a in askers)} gave up waiting for "
                        f"it and ask for a new round",
                    )
                )
        return out

    def _why_stuck(self, sid: SlotId, now: float, first_ask: float) -> Optional[str]:
        silent = self.liveness.silent_for(sid, now)
        if silent is not None:
            return (
                f"has not answered for {silent:.0f}s while its process runs (a C call "
                f"holding the interpreter lock, or a loop in native code)"
            )
        missing = self.liveness.missing(sid, since=self._round_since)
        if missing is not None:
            return (
                f"never submitted {_tensors(missing.tensors)} that the others waited "
                f"for (a deadlock or other code on that rank)"
            )
        if (
            self._op_timeout_s is not None
            and now - first_ask >= 2 * self._op_timeout_s + ASK_GRACE_S
        ):
            return (
                f"did not leave the failed round within {now - first_ask:.0f}s "
                f"(twice --op-timeout-seconds {self._op_timeout_s:g}, + {ASK_GRACE_S:g}s)"
            )
        return None

    # ---- blame ----------------------------------------------------------------------------

    def culprits(
        self,
        members: Sequence[SlotId],
        rank_of: Callable[[SlotId], int],
        arrived: Optional[Set[int]] = None,
        running: Optional[Set[SlotId]] = None,
    ) -> List[Tuple[SlotId, str]]:
        """The members the others waited for, each with why, for the failure summary:
        silent ones, those a stall of this round named, and -- when the round never formed
        -- those that never reached ``init()`` while others did (``arrived``: the ranks that
        did).  Silent and never-arrived members count only while their process runs
        (``running``; None: all): one that exited is named by its exit instead (a rank
        killed before ``init()``, or one that exits without its last "leaving" poll)."""
        now = time.monotonic()
        out = []
        for sid in members:
            beat = self.liveness.beat(sid)
            pid = f" (pid {beat.pid})" if beat is not None else ""
            silent = (
                self.liveness.silent_for(sid, now) if running is None or sid in running else None
            )
            if silent is not None:
                out.append(
                    (
                        sid,
                        f"stopped answering{pid}: no thread of it ran for "
                        f"{silent:.0f}s while its process stayed up (a C call "
                        f"holding the interpreter lock, or a loop in native code)",
                    )
                )
                continue
            missing = self.liveness.missing(sid, since=self._round_since)
            if missing is not None:
                waited = missing.waited_s + now - missing.since
                out.append(
                    (
                        sid,
                        f"never submitted {_tensors(missing.tensors)}{pid}, which "
                        f"the others waited for {waited:.0f}s",
                    )
                )
        if not out and arrived:
            out = [
                (sid, "never reached hvd.init()")
                for sid in members
                if rank_of(sid) not in arrived and (running is None or sid in running)
            ]
        return out


def _tensors(names: List[str]) -> str:
    if not names:
        return "the tensors"
    return ("tensor " if len(names) == 1 else "tensors ") + ", ".join(repr(n) for n in names)
