"""Each rank's last N operations, kept in memory and written to a file when the job fails.

Why: when a job hangs or dies, the stall warning says which tensor waited, but not
what every rank did just before.  A per-rank ring of the operations it took part
in (name, op, dtype, shape, process set, submit time, cycle, state, duration)
answers that after the fact; ``hvdlite-doctor`` (:mod:`hvdlite.timeline.doctor`)
reads the files of all ranks and names the first op where they diverge.

It is on by default, so the background thread pays only for what it already has
at hand: one small list per operation appended to a ``deque(maxlen=N)`` when the
op is drained, a few item stores when it is executed and completed, one clock read
per executed group.  No strings are formatted until a dump.  The ring is one per
process, shared by the runtimes of all process sets (``deque.append`` is atomic).

Dumps go to ``<dir>/flight-rank<R>.json`` (written whole, then renamed, so a
reader never sees half a file) when the background thread fails, when a stall
passes the shutdown time, when the process dies of an uncaught exception, and
whenever :func:`dump` is called (the on-demand stack report calls it).
"""

import collections
import json
import logging
import os
import sys
import tempfile
import threading
import time
from typing import Any, Dict, List, Optional

from hvdlite.common.message import OpType

log = logging.getLogger(__name__)

#: states of one operation, in order
QUEUED, NEGOTIATED, IN_COLLECTIVE, DONE, FAILED = range(5)
STATE_NAMES = ("queued", "negotiated", "in collective", "done", "failed")

# slots of one record (a list, so the background thread updates it in place); the request
# is held, not copied (it names the tensor, op, dtype and shape, and holds no tensor)
REQUEST, SET, SUBMITTED, CYCLE, STATE, END, WAITED, ERROR = range(8)

#: the file format's version (the doctor refuses others)
FORMAT_VERSION = 1
#: dump file name of a rank
FILE_PATTERN = "flight-rank{rank}.json"


def default_directory(job_id: str) -> str:
    """Where dumps go when the directory tunable is empty."""
    return os.path.join(tempfile.gettempdir(), f"hvdlite-flight-{job_id}")


class FlightRecorder:
    """The ring of one process; :func:`configure` makes it, the runtimes feed it."""

    def __init__(self, capacity: int, directory: str, rank: int = 0, size: int = 1,
                 hostname: str = "", job_id: str = "job"):
        self.ring: collections.deque = collections.deque(maxlen=capacity)
        self.capacity = capacity
        self.directory = directory
        self.rank, self.size, self.hostname, self.job_id = rank, size, hostname, job_id
        #: process set key -> the response group its background thread is executing
        self.running: Dict[str, Any] = {}
        #: every record ever appended (to tell a wrapped ring from a short history)
        self.appended = 0
        self._lock = threading.Lock()

    # -- background thread ---------------------------------------------------------------
    def queued(self, entries, set_key: str) -> None:
        """Start a record for each drained entry (the entry keeps it as ``entry.flight``)."""
        append = self.ring.append
        queued = QUEUED
        for entry in entries:
            rec = [entry.request, set_key, entry.enqueued_at, -1, queued, 0.0, (), None]
            entry.flight = rec
            append(rec)
        self.appended += len(entries)

    @staticmethod
    def failed(entries, err: BaseException) -> None:
        """The runtime failed these entries without executing them."""
        end = time.monotonic()
        for entry in entries:
            rec = entry.flight
            if rec is not None and rec[STATE] < DONE:
                rec[STATE], rec[END], rec[ERROR] = FAILED, end, err

    # -- any thread ----------------------------------------------------------------------
    def snapshot(self, reason: str) -> dict:
        """The ring as a JSON-ready dict (times as wall-clock seconds)."""
        for _ in range(3):
            try:
                records = list(self.ring)
                break
            except RuntimeError:       # appended to while copied: try again
                continue
        else:
            records = []
        now_mono, now_wall = time.monotonic(), time.time()
        shift = now_wall - now_mono
        running = {}
        for key, group in list(self.running.items()):
            if group is not None:
                running[key] = {r.name for r in group}
        ops = []
        for rec in records:
            rec = list(rec)
            state = rec[STATE]
            req = rec[REQUEST]
            if state == NEGOTIATED and req.name in running.get(rec[SET], ()):
                state = IN_COLLECTIVE
            end = rec[END] if state >= DONE else now_mono
            ops.append({
                "name": req.name, "op": OpType(req.op).name.lower(),
                "dtype": req.dtype, "shape": [int(d) for d in req.shape], "process_set": rec[SET],
                "submitted": round(rec[SUBMITTED] + shift, 6), "cycle": rec[CYCLE],
                "state": STATE_NAMES[state],
                "duration_s": round(max(0.0, end - rec[SUBMITTED]), 6),
                "waited_for": [int(r) for r in rec[WAITED]],
                "error": None if rec[ERROR] is None else str(rec[ERROR]),
            })
        return {"format": "hvdlite-flight-recorder", "version": FORMAT_VERSION,
                "rank": self.rank, "size": self.size, "hostname": self.hostname,
                "pid": os.getpid(), "job_id": self.job_id, "reason": reason,
                "dumped_at": now_wall, "capacity": self.capacity,
                "appended": self.appended, "ops": ops}

    def path(self) -> str:
        return os.path.join(self.directory, FILE_PATTERN.format(rank=self.rank))

    def dump(self, reason: str) -> str:
        """Write the ring to this rank's file (replacing an earlier dump); returns the path.

        Raises:
            OSError: the directory cannot be created or written (the message names it).
        """
        data = self.snapshot(reason)
        path = self.path()
        with self._lock:
            _private_directory(self.directory)
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(data, f)
            os.replace(tmp, path)
        return path


def _private_directory(path: str) -> None:
    """Make ``path`` readable by this user only; refuse one that another user owns (a
    shared temporary directory's name could be taken first).

    Raises:
        OSError: it cannot be made, or another user owns it (names it).
    """
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.lstat(path)
    if not os.path.isdir(path) or os.path.islink(path) or st.st_uid != os.getuid():
        raise OSError(f"{path} is not a directory of this user")


_CURRENT: Optional[FlightRecorder] = None
_HOOK_INSTALLED = False


def configure(config) -> Optional[FlightRecorder]:
    """Make (or update) this process's recorder from ``config``; None when its size is 0.

    A re-init keeps the ring (the history before an elastic reset is worth keeping)
    unless the size changed.
    """
    global _CURRENT
    size = config.flight_recorder_size
    if size <= 0:
        _CURRENT = None
        return None
    directory = config.flight_recorder_dir or default_directory(config.job_id)
    fr = _CURRENT
    if fr is None or fr.capacity != size:
        fr = FlightRecorder(size, directory)
    fr.directory = directory
    fr.rank, fr.size, fr.hostname, fr.job_id = (config.rank, config.size, config.hostname,
                                                config.job_id)
    _CURRENT = fr
    _install_excepthook()
    return fr


def current() -> Optional[FlightRecorder]:
    """This process's recorder, or None (off, or ``init()`` not called yet)."""
    return _CURRENT


def dump(reason: str) -> Optional[str]:
    """Write this rank's ring now; returns the file's path, or None when the recorder is
    off or the file could not be written (logged, never raised: callers are failing
    already)."""
    fr = _CURRENT
    if fr is None:
        return None
    try:
        path = fr.dump(reason)
    except OSError as exc:
        log.warning("rank %d: flight recorder: cannot write %s (%s); set "
                    "--flight-recorder-dir to a writable directory", fr.rank, fr.path(), exc)
        return None
    log.info("rank %d: flight recorder written to %s (%s)", fr.rank, path, reason)
    return path


def _install_excepthook() -> None:
    """Dump at an uncaught exception; chains to whatever hook was there (the exit report's
    too), so both run."""
    global _HOOK_INSTALLED
    if _HOOK_INSTALLED:
        return
    _HOOK_INSTALLED = True
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        try:
            if not issubclass(exc_type, (KeyboardInterrupt, SystemExit)):
                dump(f"uncaught {exc_type.__name__}: {exc}")
        finally:
            previous(exc_type, exc, tb)

    sys.excepthook = hook


def launcher_note(job_id: str, directory: str = "") -> str:
    """The line the launcher prints when a job failed: where the ranks' dumps are."""
    where = directory or default_directory(job_id)
    return (f"hvdlite-run: flight recorder dumps (one file per rank, on each rank's host): "
            f"{where}; diagnose with: hvdlite-doctor {where}\n")


def load(path: str) -> dict:
    """One rank's dump.

    Raises:
        ValueError: not a flight-recorder file of this version (names the file).
    """
    with open(path, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except ValueError as exc:
            raise ValueError(f"{path}: not JSON ({exc})") from None
    if not isinstance(data, dict) or data.get("format") != "hvdlite-flight-recorder":
        raise ValueError(f"{path}: not an hvdlite flight-recorder dump")
    if data.get("version") != FORMAT_VERSION:
        raise ValueError(f"{path}: format version {data.get('version')} (this reader knows "
                         f"{FORMAT_VERSION})")
    return data


def dump_files(paths: List[str]) -> List[str]:
    """The dump files named by ``paths`` (files, or directories holding them)."""
    out = []
    for p in paths:
        if os.path.isdir(p):
            out += sorted(os.path.join(p, n) for n in os.listdir(p)
                          if n.startswith("flight-rank") and n.endswith(".json"))
        else:
            out.append(p)
    return out
