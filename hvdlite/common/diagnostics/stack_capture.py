"""A rank's Python stacks, sent to the launcher when a stall or a user asks for them.

The stall check names the ranks that have not submitted a tensor; this says what
those ranks are doing instead.  How a request travels, and why:

* **A stall.**  Rank 0 checks once a second for tensors some ranks submitted and
  others have not (``Controller.stalled``).  It asks once per stall -- again only if a
  rank not asked yet goes missing; a stall ends when no tensor is stalled -- and first
  sends the launcher the request's summary (a random id, the stalled tensors, the
  waiting and the missing ranks) on a short-lived daemon thread.  Then it asks through
  the per-cycle control vector that every rank already agrees on (two int32 slots: a
  request id and a cycle age), so every rank's background thread sees it in the same
  cycle at no extra message, and no network round trip is ever added to a cycle.  The
  missing rank's main thread may be stuck in user code, but its background thread
  still cycles.  The ranks asked capture ``sys._current_frames()`` on a short-lived
  daemon thread and send the stacks to the launcher's store (op ``stack_report``) over
  the job's authenticated channel; the launcher prints one report.
* **On demand** (``hvdlite-run --dump-stacks PID``, or SIGUSR1 to the launcher).  The
  launcher marks a request in its store.  Rank 0 finds it when it polls
  (:class:`Poller`: one small request a second on a daemon thread), sends its own
  stacks at once (so even a rank 0 whose background thread is blocked is seen) and
  asks every other rank through the control vector.  Signals to the ranks were not
  used: the launcher does not own the processes under SSH tasks or mpiexec, and a
  Python signal handler runs only when the main thread returns to the interpreter.
* **Liveness.**  Each poll also tells the launcher who polls (slot, pid, round) and how
  far the background thread got (its cycle count), and a poller that stops says so in
  one last poll.  So the launcher sees, without the rank's cooperation, a process that
  runs but whose threads all stopped (a C call holding the interpreter lock): its polls
  stop while its process stays (``hvdlite.runner.store.liveness``).
* **When the background thread does not answer.**  A rank whose background thread is
  blocked (in a collective of a process set, in a lock, behind a stuck transport) never
  sees the control vector's request, and that rank is exactly the one a stall report
  needs.  So every rank runs a :class:`Poller`, and the launcher's reply to a rank's
  poll names any request that rank has not answered a second after it was made; the
  poller's own thread then captures and sends the stacks, marked ``via: poller``, and
  the report says so.  Only a process whose interpreter lock is held by a blocked C
  call (no Python thread runs at all) stays silent, and the report says that too.

Frames are marked ``runtime`` when their file belongs to hvdlite, the standard
library or an installed package (torch's internals), so the launcher can show user
code first and fold the rest: the report shows each thread innermost frame first,
runtime frames folded onto one line, and the threads that run only runtime code on one
line per rank (:mod:`hvdlite.runner.store.stack_collection`).
"""

import json
import logging
import os
import sys
import sysconfig
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from hvdlite.common.diagnostics import exit_report, flight_recorder, raised
from hvdlite.common.net.service import Client, ServiceError

log = logging.getLogger(__name__)

#: kinds of request: the missing ranks of a stall, or every rank
STALL, ALL = "stall", "all"
#: bounds on what one report carries
MAX_THREADS = 64
MAX_FRAMES = 40
#: how long sending one report may take (it runs on its own daemon thread)
SEND_TIMEOUT_S = 5.0
#: how often each rank asks the launcher whether a user wants stacks (its liveness beat)
POLL_PERIOD_S = 1.0
#: bound on the last poll of a poller that stops
LEAVING_TIMEOUT_S = 1.0

#: the hvdlite package (this file is hvdlite/common/diagnostics/stack_capture.py)
_HVDLITE_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_RUNTIME_DIRS = tuple(
    sorted(
        {
            os.path.join(p, "")
            for p in (
                _HVDLITE_DIR,
                sysconfig.get_paths().get("stdlib", ""),
                sysconfig.get_paths().get("platstdlib", ""),
                sysconfig.get_paths().get("purelib", ""),
                sysconfig.get_paths().get("platlib", ""),
            )
            if p
        }
    )
)


def is_runtime_file(path: str) -> bool:
    """Whether a frame in ``path`` is hvdlite's, the standard library's or an installed
    package's (not the user's code)."""
    if path.startswith("<"):  # <frozen ...>, <string>
        return True
    full = os.path.abspath(path)
    return full.startswith(_RUNTIME_DIRS) or "site-packages" in full or "dist-packages" in full


def capture(skip: Sequence[int] = ()) -> List[dict]:
    """Every thread's stack but those in ``skip`` (thread idents): ``[{"name", "main",
    "frames": [[file, line, function, runtime], ...]}]``, frames outermost first (the
    innermost :data:`MAX_FRAMES` kept), the main thread first."""
    names = {t.ident: t.name for t in threading.enumerate()}
    main = threading.main_thread().ident
    threads = []
    for ident, frame in sys._current_frames().items():
        if ident in skip:
            continue
        frames = []
        while frame is not None and len(frames) < MAX_FRAMES:
            code = frame.f_code
            frames.append(
                [code.co_filename, frame.f_lineno, code.co_name, is_runtime_file(code.co_filename)]
            )
            frame = frame.f_back
        frames.reverse()
        threads.append(
            {"name": names.get(ident, f"thread {ident}"), "main": ident == main, "frames": frames}
        )
    threads.sort(key=lambda t: not t["main"])
    return threads[:MAX_THREADS]


def _raised_field() -> Optional[dict]:
    """The error this rank's user code last got from the op layer, for a report: type,
    message, ``ago_s`` and ``where`` (the innermost user frame that called: file, line,
    function; None when only runtime frames did)."""
    entry = raised.last()
    if entry is None:
        return None
    callers = entry.pop("callers")
    entry["where"] = next((c for c in callers if not is_runtime_file(c[0])), None)
    return entry


class Target:
    """Where this process sends its stacks: the launcher's store and who we are."""

    def __init__(self, addr: Tuple[str, int], key: bytes, hostname: str):
        self.addr, self.key, self.hostname = addr, key, hostname

    @classmethod
    def from_config(cls, config) -> Optional["Target"]:
        """The launcher's store from ``config``, or None (no launcher: nobody to tell)."""
        if (
            config.rendezvous_addr is None
            or config.rendezvous_port is None
            or not config.secret_key
        ):
            return None
        return cls(
            (config.rendezvous_addr, int(config.rendezvous_port)),
            config.secret_key,
            config.hostname or "",
        )

    def client(self) -> Client:
        return Client(self.addr, self.key, SEND_TIMEOUT_S, name="launcher's store")


def send_async(
    target: Target,
    kind: str,
    request_id: int,
    rank: int,
    extra: Optional[dict] = None,
    with_stacks: bool = True,
) -> threading.Thread:
    """Capture this process's stacks and send them, on a daemon thread (never blocks the
    caller, which is usually the background thread).  ``extra``: the coordinator's
    fields (``expected`` ranks, stalled ``tensors``)."""

    def run() -> None:
        header = {
            "op": "stack_report",
            "kind": kind,
            "id": int(request_id),
            "rank": int(rank),
            "host": target.hostname,
            "pid": os.getpid(),
        }
        header.update(extra or {})
        left = _raised_field()
        if left is not None:
            header["raised"] = left
        if kind == ALL:  # on demand, this rank's flight recorder too (off the loop)
            flight_recorder.dump("stacks requested")
        blob = b""
        if with_stacks:
            blob = json.dumps(capture(skip=(threading.get_ident(),))).encode()
        client = target.client()
        try:
            client.request(header, blob, timeout_s=SEND_TIMEOUT_S)
        except Exception as err:  # noqa: BLE001 -- a diagnosis must never fail the job
            log.warning("rank %d: could not send its stacks to the launcher: %s", rank, err)
        finally:
            client.close()

    thread = threading.Thread(target=run, name="hvdlite-stack-sender", daemon=True)
    thread.start()
    return thread


class Poller:
    """Every rank of the job, one daemon thread: asks the launcher once a second
    (op ``stacks_wanted``) whether anyone wants stacks.  Rank 0 hands a new on-demand
    request's id to ``on_request``; any rank that the launcher names in ``ask`` (a request
    its background thread did not answer) captures and sends its stacks from this
    thread, which does not depend on the background thread."""

    def __init__(
        self,
        target: Target,
        rank: int,
        on_request: Optional[Callable[[int], None]] = None,
        period_s: float = POLL_PERIOD_S,
        status: Optional[Callable[[], dict]] = None,
    ):
        """``status()``: this rank's progress for the launcher's liveness view (its
        ``round`` and ``progress``, the background thread's cycle count)."""
        self._target = target
        self._rank = rank
        self._on_request = on_request
        self._period_s = period_s
        self._status = status
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hvdlite-stack-poller", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        client = self._target.client()
        seen: Dict[int, float] = {}
        answered: Dict[Tuple[str, int], float] = {}
        try:
            first = True  # the first poll at once: the launcher knows the rank
            while first or not self._stop.wait(self._period_s):
                first = False
                try:
                    reply, _ = client.request(self._poll(), timeout_s=SEND_TIMEOUT_S)
                except ServiceError as err:  # a store without the op: nobody will ask
                    log.debug("stack polling off: %s", err)
                    return
                except Exception as err:  # noqa: BLE001 -- the launcher may be ending
                    log.debug("stack poll failed: %s", err)
                    continue
                self._handle(reply, seen, answered)
            self._say_leaving(client)
        finally:
            client.close()

    def _poll(self, leaving: bool = False) -> dict:
        """A poll: the request, and this rank's liveness (see the module docstring)."""
        header = {"op": "stacks_wanted", "rank": self._rank, "pid": os.getpid()}
        where = exit_report.slot()
        if where is not None:
            header["slot"] = [where[0], where[1]]
        if self._status is not None:
            header.update(self._status())
        if leaving:
            header["leaving"] = True
        return header

    def _say_leaving(self, client: Client) -> None:
        """This runtime stops polling (shutdown, a failed loop, a reset): the launcher must
        not take the silence that follows for a stuck rank."""
        try:
            client.request(self._poll(leaving=True), timeout_s=LEAVING_TIMEOUT_S)
        except Exception as err:  # noqa: BLE001 -- the launcher may be ending
            log.debug("leaving poll failed: %s", err)

    def _handle(
        self, reply: dict, seen: Dict[int, float], answered: Dict[Tuple[str, int], float]
    ) -> None:
        wanted = reply.get("wanted")
        if (
            self._on_request is not None
            and isinstance(wanted, int)
            and wanted > 0
            and wanted not in seen
        ):
            seen[wanted] = time.monotonic()
            self._on_request(wanted)
        ask = reply.get("ask")
        if (
            isinstance(ask, list)
            and len(ask) == 2
            and ask[0] in (STALL, ALL)
            and isinstance(ask[1], int)
            and (ask[0], ask[1]) not in answered
        ):
            answered[(ask[0], ask[1])] = time.monotonic()
            send_async(self._target, ask[0], ask[1], self._rank, {"via": "poller"})
