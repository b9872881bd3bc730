"""Each rank's last N operations, kept in memory and written to a file when the job fails.

Why: when a job hangs or dies, the stall warning says which tensor waited, but not
what every rank did just before.  A per-rank ring of the operations it took part
in (name, op, dtype, shape, process set, submit time, cycle, state, duration)
answers that after the fact; ``hvdlite-doctor`` (:mod:`hvdlite.timeline.doctor`)
reads the files of all ranks and names the first op where they diverge.

It is on by default, so the background thread pays only for what it already has
at hand, and only after it has completed a group's handles (off the path of the
user waiting for them): one clock read, three list comprehensions over the group
and one ``deque.append`` per executed group.  Nothing is recorded when an op is
submitted or negotiated: a dump asks the live runtimes for what is still pending.
No strings are formatted until a dump.  The ring is one per process, shared by
the runtimes of all process sets (``deque.append`` is atomic): ``init()`` makes
it (:func:`configure`), and each runtime takes it (:func:`current`) when it is
built and registers itself (:meth:`FlightRecorder.watch`).

Dumps go to ``<dir>/flight-rank<R>.json`` (written whole, then renamed, so a
reader never sees half a file; times in wall-clock seconds) when the background
thread fails or a peer leaves while operations were pending
(``Runtime._fail_all``), when a stall passes the shutdown time
(``Runtime._stall_failures``), when the process dies of an uncaught exception
(a ``sys.excepthook`` chained to the one before it, the exit report's too), and
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
import weakref
from typing import List, Optional

from hvdlite.common.engine.message import OpType

log = logging.getLogger(__name__)

#: the states an operation is reported in
STATE_NAMES = ("queued", "negotiated", "in collective", "done", "failed")

#: the file format's version (the doctor refuses others)
FORMAT_VERSION = 1
#: dump file name of a rank
FILE_PATTERN = "flight-rank{rank}.json"


def default_directory(job_id: str) -> str:
    """Where dumps go when the directory tunable is empty."""
    return os.path.join(tempfile.gettempdir(), f"hvdlite-flight-{job_id}")


class FlightRecorder:
    """The ring of one process; :func:`configure` makes it, the runtimes feed it.

    The ring holds executed groups, newest last, each as ``(process set, cycle, end,
    requests, submit times, errors, responses)``: lists the background thread builds in
    one pass over a group it has just completed (the requests and responses exist
    already and hold no tensor).  Oldest groups are dropped while the rest still hold
    ``capacity`` operations.  Operations not yet completed are not in the ring: a dump
    asks each live runtime for them (:meth:`Runtime.flight_pending`).
    """

    def __init__(
        self,
        capacity: int,
        directory: str,
        rank: int = 0,
        size: int = 1,
        hostname: str = "",
        job_id: str = "job",
    ):
        self.groups: collections.deque = collections.deque()
        self.capacity = capacity
        self.directory = directory
        self.rank, self.size, self.hostname, self.job_id = rank, size, hostname, job_id
        #: operations in ``groups``, and every operation ever recorded
        self.count = 0
        self.appended = 0
        self._runtimes: "weakref.WeakSet" = weakref.WeakSet()
        self._lock = threading.Lock()

    def watch(self, runtime) -> None:
        """Ask ``runtime`` (while it lives) for its pending operations at each dump."""
        self._runtimes.add(runtime)

    # -- background thread ---------------------------------------------------------------
    def completed(self, set_key: str, cycle: int, group, done) -> None:
        """``done`` (``(entry, result, error)`` of ``group``'s responses on this rank)
        has just completed in ``cycle``."""
        n = len(done)
        if not n:
            return
        groups = self.groups
        groups.append(
            (
                set_key,
                cycle,
                time.monotonic(),
                [e.request for e, _, _ in done],
                [e.enqueued_at for e, _, _ in done],
                [err for _, _, err in done],
                group,
            )
        )
        self.count += n
        self.appended += n
        while self.count - len(groups[0][3]) >= self.capacity:
            self.count -= len(groups.popleft()[3])

    def failed(self, set_key: str, entries, err: BaseException) -> None:
        """The runtime failed these entries without executing them."""
        if entries:
            self.completed(set_key, -1, (), [(e, None, err) for e in entries])

    # -- any thread ----------------------------------------------------------------------
    def snapshot(self, reason: str) -> dict:
        """The ring and the pending operations as a JSON-ready dict (times as wall-clock
        seconds; durations from submission to completion, or to now when pending)."""
        groups = list(self.groups)  # one C-level copy: consistent
        now_mono, now_wall = time.monotonic(), time.time()
        shift = now_wall - now_mono
        ops = []
        for set_key, cycle, end, requests, submitted, errors, responses in groups:
            waited = {r.name: r.waited_for for r in responses}
            for req, sub, err in zip(requests, submitted, errors):
                ops.append(
                    _op_dict(
                        req,
                        set_key,
                        sub + shift,
                        cycle,
                        "done" if err is None else "failed",
                        end - sub,
                        waited.get(req.name, ()),
                        err,
                    )
                )
        ops = ops[-self.capacity :]
        pending = []
        for runtime in list(self._runtimes):
            for state, entry, cycle in runtime.flight_pending():
                pending.append(
                    _op_dict(
                        entry.request,
                        runtime.flight_key,
                        entry.enqueued_at + shift,
                        cycle,
                        state,
                        now_mono - entry.enqueued_at,
                        (),
                        None,
                    )
                )
        ops += sorted(pending, key=lambda o: o["submitted"])
        return {
            "format": "hvdlite-flight-recorder",
            "version": FORMAT_VERSION,
            "rank": self.rank,
            "size": self.size,
            "hostname": self.hostname,
            "pid": os.getpid(),
            "job_id": self.job_id,
            "reason": reason,
            "dumped_at": now_wall,
            "capacity": self.capacity,
            "appended": self.appended,
            "ops": ops,
        }

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
            try:
                _write_private(tmp, data)
                os.replace(tmp, path)
            except OSError:
                _remove_quietly(tmp)  # a full disk must not leave a half file
                raise
        return path


def _op_dict(
    req, set_key: str, submitted: float, cycle: int, state: str, duration: float, waited, err
) -> dict:
    return {
        "name": req.name,
        "op": OpType(req.op).name.lower(),
        "dtype": req.dtype,
        "shape": [int(d) for d in req.shape],
        "process_set": set_key,
        "submitted": round(submitted, 6),
        "cycle": cycle,
        "state": state,
        "duration_s": round(max(0.0, duration), 6),
        "waited_for": [int(r) for r in waited],
        "error": None if err is None else str(err),
    }


def _write_private(path: str, data: dict) -> None:
    """``data`` as JSON in a new file readable by this user only (0600), whatever the
    directory's mode or the umask: the dumps name tensors and hosts (SECURITY.md)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        os.fchmod(fd, 0o600)  # an older file of that name kept its mode
    except OSError:
        os.close(fd)
        raise
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(data, f)


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("flight recorder: cannot remove %s (%s)", path, exc.strerror)


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
    fr.rank, fr.size, fr.hostname, fr.job_id = (
        config.rank,
        config.size,
        config.hostname,
        config.job_id,
    )
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
        log.warning(
            "rank %d: flight recorder: cannot write %s (%s); set "
            "--flight-recorder-dir to a writable directory",
            fr.rank,
            fr.path(),
            exc,
        )
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


def launcher_note(job_id: str, directory: str = "", local_only: bool = False) -> str:
    """The line the launcher prints when a job failed: where the ranks' dumps are.

    ``local_only``: every rank ran on this host, so the launcher can see whether any
    dump was written and never points at files that are not there (a full disk, an
    unwritable directory: the ranks logged why).
    """
    where = directory or default_directory(job_id)
    if local_only:
        found = dump_files([where]) if os.path.isdir(where) else []
        if not found:
            return (
                f"hvdlite-run: no flight recorder dump was written in {where} (a rank "
                f"writes one when it fails after hvd.init(); a rank that tried and could "
                f"not says why above)\n"
            )
        return (
            f"hvdlite-run: flight recorder dumps (one file per rank, on each rank's "
            f"host): {where} ({len(found)} here); diagnose with: hvdlite-doctor {where}\n"
        )
    return (
        f"hvdlite-run: flight recorder dumps (one file per rank, on each rank's host): "
        f"{where}; diagnose with: hvdlite-doctor {where}\n"
    )


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
        raise ValueError(
            f"{path}: format version {data.get('version')} (this reader knows {FORMAT_VERSION})"
        )
    return data


def dump_files(paths: List[str]) -> List[str]:
    """The dump files named by ``paths`` (files, or directories holding them)."""
    out = []
    for p in paths:
        if os.path.isdir(p):
            out += sorted(
                os.path.join(p, n)
                for n in os.listdir(p)
                if n.startswith("flight-rank") and n.endswith(".json")
            )
        else:
            out.append(p)
    return out
