"""The launcher's side of stack reports: gather the ranks' stacks, print one report.

Ranks send their stacks with ``hvdlite.common.diagnostics.stack_capture`` (op ``stack_report`` on
the launcher's store).  One request -- a stall rank 0 found, or a user's
``--dump-stacks`` / SIGUSR1 -- has one id; rank 0's part names the ranks expected,
and the report is printed, once, when they have all answered or
:data:`ANSWER_WAIT_S` after rank 0's part, naming the ranks that did not answer.

Under ``--mpi`` there is no rendezvous store; :class:`ReportStore` is a store that
takes only these ops, with the job's key, so the same path works there.

Ranks that cannot answer -- a program that never calls ``hvd.init()`` (a plain
torch.distributed one), a rank whose interpreter lock a C call holds -- are shown with
stacks taken from outside their processes by py-spy, when the job's code gives the
reports a way to take them (:meth:`StackReports.use_outside`; the store does not know the
starters): an on-demand request no rank polled for within :data:`UNPOLLED_S` gets every
live worker's, and a report gets those of the expected ranks that did not answer.  py-spy
runs on the writer thread, never under its lock.
"""

import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
from typing import Callable, Dict, List, Optional, Tuple

import psutil

from hvdlite.common.exceptions import HvdliteConfigError
from hvdlite.common.net.service import Service, ServiceError, is_int
from hvdlite.common.diagnostics.stack_capture import ALL, STALL
from hvdlite.common.diagnostics.stall_words import SHUTDOWN_FLAG, stall_outcome
from hvdlite.runner.hosts import SlotId
from hvdlite.runner.processes.py_spy import OutsideStack

log = logging.getLogger(__name__)

#: how long the answers of the ranks expected are awaited after rank 0's part
ANSWER_WAIT_S = 5.0
#: after this long without a rank's answer, its stack poller is asked instead (the
#: background thread that should have answered may be blocked)
POLLER_AFTER_S = 1.0
#: a request whose rank 0 part never came is printed (or dropped) after this long
ORPHAN_S = 15.0
#: an on-demand request no rank polled for this long is said to be unanswerable (the
#: ranks run no hvdlite runtime: a plain torch.distributed program, or before init())
UNPOLLED_S = 5.0
#: bounds on what the launcher keeps
MAX_PENDING = 64
MAX_USER_FRAMES = 8

#: how long py-spy may take for the stacks of one report (all its workers at once)
OUTSIDE_TIMEOUT_S = 10.0

Handler = Callable[[dict, bytes], Tuple[dict, bytes]]
#: a worker's stack taken from outside its process: its slot, its rank (None: not known)
#: and what py-spy took
Outside = Tuple[SlotId, Optional[int], OutsideStack]
#: ``every()``: the stacks of every live worker of the newest round, from outside
OutsideEvery = Callable[[], List[Outside]]
#: ``for_ranks(ranks)``: the stacks of these ranks of the newest round, from outside
OutsideForRanks = Callable[[List[int]], List[Outside]]


class _Pending:
    def __init__(self) -> None:
        self.first = time.monotonic()
        self.summary: Optional[dict] = None
        self.summary_at = 0.0
        #: rank -> (host, pid, threads, whether its stack poller sent them)
        self.stacks: Dict[int, Tuple[str, int, list, bool]] = {}
        #: rank -> the error its user code last got from the op layer (its ``raised``)
        self.raised: Dict[int, dict] = {}


class StackReports:
    """Collects the parts of each request and writes each report once (to stderr by
    default: the launcher's own output, beside the ranks')."""

    def __init__(
        self,
        write: Optional[Callable[[str], None]] = None,
        outside: Optional[OutsideEvery] = None,
        outside_for_ranks: Optional[OutsideForRanks] = None,
    ):
        """``outside``, ``outside_for_ranks``: see :meth:`use_outside`."""
        self._write = write or to_stderr
        self._outside = outside
        self._outside_for_ranks = outside_for_ranks
        self._cond = threading.Condition()
        self._pending: Dict[Tuple[str, int], _Pending] = {}
        self._serial = 0
        #: the newest on-demand request no rank 0 has answered yet (0: none)
        self._wanted = 0
        self._announced = 0
        self._thread: Optional[threading.Thread] = None
        self._closed = False
        #: how many reports were written (for tests)
        self.written = 0
        #: when a rank last polled for on-demand requests, and when the newest was announced
        self._polled_at = 0.0
        self._announced_at = 0.0
        self._unpolled_said = 0

    def use_outside(
        self,
        outside: Optional[OutsideEvery] = None,
        outside_for_ranks: Optional[OutsideForRanks] = None,
    ) -> None:
        """How to take stacks from outside the ranks' processes (py-spy, through the job's
        starter), once it is known: ``outside()`` -- every live worker's, for an on-demand
        request no rank polled for -- and ``outside_for_ranks(ranks)`` -- for the expected
        ranks of a report that did not answer.  Both are called on the writer thread,
        never under its lock, and should return within about :data:`OUTSIDE_TIMEOUT_S`."""
        self._outside = outside
        self._outside_for_ranks = outside_for_ranks

    def ops(self) -> Dict[str, Handler]:
        """The store ops this serves: ``stack_report`` (a part) and ``stacks_wanted``
        (rank 0's poll for an on-demand request)."""
        return {"stack_report": self._take, "stacks_wanted": self._wanted_op}

    def request_all(self) -> int:
        """Ask for every rank's stacks (SIGUSR1).  No lock and no output here: this runs
        in a signal handler, which must not wait for a lock another thread holds nor
        write to a stream the interrupted code may be writing to (the writer thread
        announces the request)."""
        self._serial += 1
        self._wanted = self._serial
        return self._serial

    def start(self) -> None:
        """Start the writer thread now (before a signal handler may need it)."""
        with self._cond:
            self._start_locked()

    def _wanted_op(self, header: dict, blob: bytes) -> Tuple[dict, bytes]:
        """A rank's poll: the newest on-demand request (for rank 0), and a request that
        rank has not answered :data:`POLLER_AFTER_S` after it was made (``ask``)."""
        reply = {"wanted": self._wanted}
        self._polled_at = time.monotonic()
        rank = header.get("rank")
        if is_int(rank):
            with self._cond:
                ask = self._unanswered_locked(rank, time.monotonic())
            if ask is not None:
                reply["ask"] = list(ask)
        return reply, b""

    def _unanswered_locked(self, rank: int, now: float) -> Optional[Tuple[str, int]]:
        for key, entry in self._pending.items():
            if (
                entry.summary is not None
                and rank in entry.summary["expected"]
                and rank not in entry.stacks
                and now - entry.summary_at > POLLER_AFTER_S
            ):
                return key
        return None

    def _take(self, header: dict, blob: bytes) -> Tuple[dict, bytes]:
        kind, req, rank = header.get("kind"), header.get("id"), header.get("rank")
        host, pid = header.get("host"), header.get("pid")
        if not (
            kind in (STALL, ALL)
            and is_int(req)
            and is_int(rank)
            and rank >= 0
            and isinstance(host, str)
            and len(host) <= 255
            and is_int(pid)
        ):
            raise ServiceError("stack_report: kind, id, rank, host and pid are required")
        expected = header.get("expected")
        if expected is not None and not (
            isinstance(expected, list)
            and len(expected) <= 1 << 20
            and all(is_int(r) for r in expected)
        ):
            raise ServiceError("stack_report: expected must be a list of ranks")
        try:
            threads = json.loads(blob) if blob else None
        except ValueError as exc:
            raise ServiceError(
                f"stack_report from rank {rank}: stacks are not JSON: {exc}"
            ) from None
        if threads is not None and not isinstance(threads, list):
            raise ServiceError(f"stack_report from rank {rank}: stacks must be a list")
        with self._cond:
            entry = self._pending.get((kind, req))
            if entry is None:
                if len(self._pending) >= MAX_PENDING:
                    raise ServiceError("stack_report: too many reports in progress")
                entry = self._pending[(kind, req)] = _Pending()
            if expected is not None:
                entry.summary, entry.summary_at = header, time.monotonic()
                if kind == ALL and req == self._wanted:
                    self._wanted = 0
            if threads is not None and rank not in entry.stacks:  # the first answer
                entry.stacks[rank] = (host, pid, threads, header.get("via") == "poller")
                left = _raised_of(header.get("raised"))
                if left is not None:
                    entry.raised[rank] = left
            self._cond.notify_all()
            self._start_locked()
        return {}, b""

    def _start_locked(self) -> None:
        if self._thread is None and not self._closed:
            self._thread = threading.Thread(
                target=self._run, name="hvdlite-stack-reports", daemon=True
            )
            self._thread.start()

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
                self._cond.wait(0.25)
                done = self._take_ready_locked(time.monotonic())
            if self._serial > self._announced:
                self._announced = self._serial
                self._announced_at = time.monotonic()
                self._write(
                    f"hvdlite-run: stacks of every rank requested (request "
                    f"{self._serial}); rank 0 checks for it once a second and the "
                    f"report follows here\n"
                )
            self._say_if_unpolled(time.monotonic())
            for (kind, _), entry in done:
                if entry.summary is not None:
                    outside = self._outside_missing(entry)
                    text = format_report(kind, entry.summary, entry.stacks, outside, entry.raised)
                    if outside is None:
                        self._write(text)
                        self.written += 1
                    else:
                        self._write_unless_closed(text)

    def _write_unless_closed(self, text: str) -> None:
        """A report the writer thread made off the lock (py-spy may have taken seconds):
        dropped once the job has ended, whose summary must stay the last line."""
        with self._cond:
            if self._closed:
                return
        self._write(text)
        self.written += 1

    def _outside_missing(self, entry: _Pending) -> Optional[Dict[int, Outside]]:
        """The stacks, from outside, of the expected ranks that did not answer; None when
        none were asked for (every rank answered, or no ``outside_for_ranks``)."""
        expected = [r for r in entry.summary.get("expected", []) if is_int(r)]
        missing = sorted(set(expected) - set(entry.stacks))
        if not missing or self._outside_for_ranks is None:
            return None
        try:
            taken = self._outside_for_ranks(missing)
        except Exception as exc:  # noqa: BLE001 -- a diagnosis never fails the job
            log.info("stacks from outside ranks %s failed: %s", missing, exc)
            return {}
        return {
            rank: (sid, rank, stack)
            for sid, rank, stack in taken
            if rank is not None and rank in missing
        }

    def _say_if_unpolled(self, now: float) -> None:
        """Once per request: no rank polled since it was announced, so none will answer;
        every live worker's stack is taken from outside instead (when ``outside`` is
        given and finds any)."""
        if (
            self._announced > self._unpolled_said
            and self._polled_at < self._announced_at
            and now - self._announced_at > UNPOLLED_S
        ):
            self._unpolled_said = self._announced
            taken: List[Outside] = []
            if self._outside is not None:
                try:
                    taken = self._outside()
                except Exception as exc:  # noqa: BLE001 -- a diagnosis never fails the job
                    log.info("stacks from outside the ranks failed: %s", exc)
            if taken:
                self._write_unless_closed(format_outside(self._announced, taken))
                return
            self._write(
                f"hvdlite-run: no rank asked for request {self._announced} within "
                f"{UNPOLLED_S:.0f}s: stacks come from hvdlite's runtime in each rank, "
                f"which these ranks do not run (hvd.init() was not called: a plain "
                f"torch.distributed program, or a rank still starting) or which is "
                f"stuck; 'py-spy dump --pid PID' shows such a rank's stack\n"
            )

    def _take_ready_locked(self, now: float) -> List[Tuple[Tuple[str, int], _Pending]]:
        done = []
        for key, entry in list(self._pending.items()):
            if entry.summary is not None:
                expected = set(entry.summary["expected"])
                if not expected - set(entry.stacks) or now - entry.summary_at > ANSWER_WAIT_S:
                    done.append((key, self._pending.pop(key)))
            elif now - entry.first > ORPHAN_S:
                self._pending.pop(key)  # rank 0's part never came: nothing to say
        return done

    def close(self) -> None:
        """Write what is complete enough, then stop the writer thread."""
        with self._cond:
            self._closed = True
            done = self._take_ready_locked(float("inf"))
            self._cond.notify_all()
        for (kind, _), entry in done:
            if entry.summary is not None:
                self._write(format_report(kind, entry.summary, entry.stacks, raised=entry.raised))
                self.written += 1


@contextlib.contextmanager
def on_sigusr1(reports: StackReports):
    """While the job runs, SIGUSR1 to the launcher asks for every rank's stacks (only
    where a handler can be installed: the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    reports.start()
    previous = signal.signal(signal.SIGUSR1, lambda *_: reports.request_all())
    try:
        yield
    finally:
        signal.signal(signal.SIGUSR1, previous)


#: the modules ``python -m`` runs a launcher from (else the console script hvdlite-run)
_LAUNCHER_MODULES = ("hvdlite.runner", "hvdlite.runner.cli.launch")


def signal_launcher(pid: int) -> str:
    """``--dump-stacks PID``: SIGUSR1 to that launcher, after checking it is one of this
    user's hvdlite launchers; returns what to tell the user.

    Raises:
        HvdliteConfigError: no such process, not this user's, or not an hvdlite launcher.
    """
    try:
        proc = psutil.Process(pid)
        uid, cmdline = proc.uids().real, proc.cmdline()
    except psutil.NoSuchProcess:
        raise HvdliteConfigError(f"--dump-stacks {pid}: no such process") from None
    except psutil.AccessDenied:
        raise HvdliteConfigError(f"--dump-stacks {pid}: not your process") from None
    if uid != os.getuid():
        raise HvdliteConfigError(f"--dump-stacks {pid}: not your process")
    if not any(
        os.path.basename(part) == "hvdlite-run" or part in _LAUNCHER_MODULES for part in cmdline[:3]
    ):
        raise HvdliteConfigError(
            f"--dump-stacks {pid}: not an hvdlite launcher "
            f"({' '.join(cmdline)[:120]!r}); give hvdlite-run's pid"
        )
    os.kill(pid, signal.SIGUSR1)
    return (
        f"hvdlite-run: asked launcher {pid} for every rank's stacks; the report appears "
        f"in that launcher's output (its stderr) within a few seconds"
    )


class ReportStore(Service):
    """A store that takes only reports (``--mpi``, where no rendezvous store runs): the
    ``ops`` it is given, which the mpiexec starter makes ``stack_report``,
    ``stacks_wanted``, ``metrics``, ``straggler`` and ``exit_report``.  It listens on
    ``bind_addr``: 127.0.0.1 for a local job, else this host's address towards the first
    remote host."""

    def __init__(
        self,
        key: bytes,
        ops: Dict[str, Handler],
        bind_addr: str = "127.0.0.1",
        expected_peers: int = 0,
    ):
        self._ops = dict(ops)
        super().__init__("report store", key, bind_addr, 0, expected_peers=expected_peers)

    def handle(self, header, blob, client):
        handler = self._ops.get(header.get("op"))
        if handler is None:
            raise ServiceError(
                f"the report store takes only {sorted(self._ops)}, not {header.get('op')!r}"
            )
        return handler(header, blob)


def format_report(
    kind: str,
    summary: dict,
    stacks: Dict[int, Tuple[str, int, list, bool]],
    outside: Optional[Dict[int, Outside]] = None,
    raised: Optional[Dict[int, dict]] = None,
) -> str:
    """The report's text: what stalled (for a stall), then per rank its host, pid and
    threads, innermost frames first, user code first and runtime frames folded.
    ``outside``: stacks py-spy took of expected ranks that did not answer; ``raised``: per
    rank, the error its user code last got from the op layer."""
    outside = outside or {}
    raised = raised or {}
    expected = [r for r in summary.get("expected", []) if is_int(r)]
    if kind == STALL:
        lines = _stall_lines(summary, expected)
    else:
        lines = [
            "hvdlite-run: stacks of every rank, on request (innermost frame first; "
            "runtime frames folded):"
        ]
    for rank in sorted(set(expected) | set(stacks)):
        if rank not in stacks and rank in outside:
            sid, _, stack = outside[rank]
            lines += _outside_lines(
                f"rank {rank}",
                sid[0],
                stack,
                f"neither its background thread nor its stack poller "
                f"answered within {ANSWER_WAIT_S:.0f}s",
            )
            continue
        if rank not in stacks:
            lines.append(
                f"  rank {rank}: no stacks within {ANSWER_WAIT_S:.0f}s: neither its "
                f"background thread nor its stack poller answered (the process may "
                f"have ended, or a C call holds its interpreter lock)"
            )
            continue
        host, pid, threads, by_poller = stacks[rank]
        how = (
            "; its background thread did not answer, its stack poller thread took these"
            if by_poller
            else ""
        )
        lines.append(f"  rank {rank} (host {host}, pid {pid}{how}):")
        if rank in raised:
            lines.append(_raised_line(rank, raised[rank], kind == STALL))
        lines += _threads_lines(threads, "    ")
    if kind == STALL:
        lines.append(
            "  " + stall_outcome(summary.get("shutdown_s"), summary.get("hint", SHUTDOWN_FLAG))
        )
    return "\n".join(lines) + "\n"


def format_outside(request: int, taken: List[Outside]) -> str:
    """The report of an on-demand request no rank polled for: every worker's stacks as
    py-spy took them from outside, by rank (a worker of no known rank by its slot)."""
    lines = [
        f"hvdlite-run: stacks of every rank, on request {request}: no rank asked for it "
        f"within {UNPOLLED_S:.0f}s (hvdlite's runtime does not run in them: a plain "
        f"torch.distributed program, a rank still starting, or one whose interpreter "
        f"lock a C call holds), so py-spy took them from outside each process "
        f"(innermost frame first; runtime frames folded):"
    ]
    order = sorted(
        taken, key=lambda t: (t[1] is None, t[1] if t[1] is not None else 0, str(t[0][0]), t[0][1])
    )
    for sid, rank, stack in order:
        who = f"rank {rank}" if rank is not None else f"slot {sid[0]}:{sid[1]}"
        lines += _outside_lines(who, sid[0], stack)
    return "\n".join(lines) + "\n"


def _outside_lines(who: str, host: str, stack: OutsideStack, why: str = "") -> List[str]:
    """One worker's part of a report, its stacks taken by py-spy (or why there are none)."""
    pid = f", pid {stack.pid}" if stack.pid else ""
    why = f"; {why}" if why else ""
    if stack.threads is None:
        return [
            f"  {who} (host {host}{pid}{why}): no stacks from outside either: "
            f"{stack.note or 'py-spy gave none'}"
        ]
    return [
        f"  {who} (host {host}{pid}{why}; taken from outside the process by py-spy):"
    ] + _threads_lines(stack.threads, "    ")


def _raised_of(field) -> Optional[dict]:
    """A report's ``raised`` field if it has the shape ranks send, else None (a diagnosis
    drops what it cannot print rather than fail the report)."""
    if not isinstance(field, dict):
        return None
    kind, message, ago, where = (
        field.get("type"),
        field.get("message"),
        field.get("ago_s"),
        field.get("where"),
    )
    if not (
        isinstance(kind, str)
        and isinstance(message, str)
        and len(kind) <= 200
        and len(message) <= 2000
        and isinstance(ago, (int, float))
        and not isinstance(ago, bool)
    ):
        return None
    if not (
        isinstance(where, list)
        and len(where) == 3
        and isinstance(where[0], str)
        and len(where[0]) <= 4096
        and is_int(where[1])
        and isinstance(where[2], str)
        and len(where[2]) <= 200
    ):
        where = None
    return {"type": kind, "message": message, "ago_s": float(ago), "where": where}


def _raised_line(rank: int, left: dict, stall: bool) -> str:
    """``rank left the collective by raising ValueError: ... (at train.py:12 in main, 3s
    before these stacks)``: why a rank its peers wait for is elsewhere."""
    what = "left the collective" if stall else "last got an error from hvdlite"
    where = left["where"]
    at = f"at {_short(where[0])}:{where[1]} in {where[2]}, " if where else ""
    return (
        f"    rank {rank} {what} by raising {left['type']}: {left['message']} "
        f"({at}{left['ago_s']:g}s before these stacks)"
    )


def _stall_lines(summary: dict, expected: List[int]) -> List[str]:
    tensors = [t for t in summary.get("tensors", []) if isinstance(t, list) and len(t) == 4]
    waiting = sorted({r for t in tensors if isinstance(t[1], list) for r in t[1] if is_int(r)})
    lines = [
        f"hvdlite-run: stall: ranks {waiting} wait for ranks {expected}, which have not "
        f"submitted these tensors:"
    ]
    for name, have, missing, waited in tensors:
        lines.append(
            f"  tensor {str(name)!r}: submitted by ranks {have}, not by ranks "
            f"{missing} (waiting {waited}s)"
        )
    more = summary.get("stalled", len(tensors))
    if is_int(more) and more > len(tensors):
        lines.append(f"  ... and {more - len(tensors)} more tensors")
    lines.append("stacks of the missing ranks (innermost frame first; runtime frames folded):")
    return lines


def _threads_lines(threads: list, indent: str) -> List[str]:
    """User threads with their frames; threads running only runtime code on one line."""
    lines, runtime_only = [], []
    for thread in threads:
        if not isinstance(thread, dict):
            continue
        frames = [f for f in thread.get("frames", []) if isinstance(f, list) and len(f) == 4]
        name = str(thread.get("name", "?"))
        if all(f[3] for f in frames):
            runtime_only.append(f"{name} in {frames[-1][2]}" if frames else name)
            continue
        marks = [
            m
            for m, on in (
                ("main", thread.get("main")),
                ("holds the interpreter lock", thread.get("gil")),
            )
            if on
        ]
        lines.append(f"{indent}thread {name}{' (' + ', '.join(marks) + ')' if marks else ''}:")
        lines += _frame_lines(list(reversed(frames)), indent + "  ")
    if runtime_only:
        lines.append(f"{indent}+ {len(runtime_only)} runtime threads: {', '.join(runtime_only)}")
    return lines


def _frame_lines(inner_first: list, indent: str) -> List[str]:
    lines, folded, shown = [], [], 0
    for path, line, func, runtime in inner_first:
        if runtime:
            folded.append((path, line, func))
            continue
        if folded:
            lines.append(f"{indent}[runtime: {_fold(folded)}]")
            folded = []
        if shown == MAX_USER_FRAMES:
            lines.append(f"{indent}...")
            return lines
        lines.append(f"{indent}{func} ({path}:{line})")
        shown += 1
    if folded:
        lines.append(f"{indent}[runtime: {_fold(folded)}]")
    return lines


def _fold(frames: list) -> str:
    named = [f"{func} ({_short(path)}:{line})" for path, line, func in frames[:2]]
    if len(frames) > 2:
        named.append(f"{len(frames) - 2} more")
    return " < ".join(named)


def _short(path: str) -> str:
    parts = str(path).split(os.sep)
    return os.sep.join(parts[-2:]) if "hvdlite" in parts or "torch" in parts else parts[-1]


def to_stderr(text: str) -> None:
    """Write a report on the launcher's stderr, beside the ranks' output."""
    sys.stderr.write(text)
    sys.stderr.flush()


def outside_stack_lines(stack: OutsideStack) -> List[str]:
    """The lines of a stack py-spy took from outside a rank, or why there is none."""
    if stack.threads:
        return _threads_lines(stack.threads, "    ")
    return [f"    (no stack: {stack.note or 'py-spy gave none'})"]
