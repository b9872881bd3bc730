"""Chrome-trace JSON of every tensor's phases, written by rank 0 while the job runs.

Why a recorder plus its own writer thread: the background loop only appends a
tuple to a deque per event (no formatting, no I/O), and the ``hvdlite-timeline``
thread turns them into one JSON object per line every ``flush_interval_s``.
The file is a JSON array whose closing ``]`` is written at :meth:`Timeline.close`;
a job killed before then leaves every line flushed so far, which chrome://tracing
and Perfetto load as they are, and :func:`load_events` reads too.

Rows (Chrome "threads" of process 0): row 0 is the runtime (cycle marks,
parameter changes, one async slice per fused response and phase over all its
tensors, listed in its args); each
tensor name gets its own row with ``QUEUED``, ``NEGOTIATE_<OP>`` (args: the
ranks waited for), and ``<OP>`` holding ``MEMCPY_IN_FUSION_BUFFER``, the
collective (``<BACKEND>_<OP>``) and ``MEMCPY_OUT_FUSION_BUFFER``, one slice per
pipelined chunk.

With a size bound (``--timeline-max-mb``) the file is rotated: once it holds about a
quarter of the bound it is finished (a complete trace), renamed ``FILE.1`` (``FILE.1``
becomes ``FILE.2``, ..., ``FILE.3`` is dropped), and a new ``FILE`` starts with the
row names it needs again, so each file loads on its own and a day-long job keeps
only its last few hours.  Times count from the same origin in every file.
"""

import collections
import dataclasses
import json
import logging
import os
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence

from hvdlite.common.config import TIMELINE
from hvdlite.common.exceptions import HvdliteConfigError
from hvdlite.common.diagnostics.recorder import COLLECTIVE, COPY_IN, COPY_OUT, Recorder

log = logging.getLogger(__name__)

#: the phase names in the trace (Horovod's spelling where it has one)
QUEUED_NAME = "QUEUED"
NEGOTIATE_PREFIX = "NEGOTIATE_"
COPY_IN_NAME = "MEMCPY_IN_FUSION_BUFFER"
COPY_OUT_NAME = "MEMCPY_OUT_FUSION_BUFFER"
CYCLE_NAME = "CYCLE_START"
PARAMETERS_NAME = "PARAMETERS"
#: an instant event: the rank the others waited for in a completing cycle (stragglers.py)
LATE_NAME = "LATE"
#: row 0: the runtime's own events and the fused responses
RUNTIME_ROW = "(runtime: cycles, parameters, fused responses)"
#: how many tensor names a fused slice lists in its args
_NAMES_SHOWN = 64

#: events the writer formats before it lets other threads run
_YIELD_EVERY = 64

# event kinds in the deque
_Q, _N, _S, _D, _C, _P, _L = range(7)

#: rotated files kept beside the live one (FILE.1 .. FILE.<ROTATED_FILES>)
ROTATED_FILES = 3
#: the smallest file a size bound rotates at (smaller bounds are raised to it)
_MIN_FILE_BYTES = 16 * 1024


def rotated_paths(path: str) -> List[str]:
    """The files of a rotated timeline, oldest first, ``path`` last (those that exist)."""
    older = [f"{path}.{i}" for i in range(ROTATED_FILES, 0, -1)]
    return [p for p in older if os.path.exists(p)] + ([path] if os.path.exists(path) else [])


class Timeline(Recorder):
    """A recorder that writes a Chrome trace to ``path`` (call :meth:`close` to finish it).

    Raises:
        HvdliteConfigError: ``path`` cannot be opened for writing (names it).
    """

    active = True

    def __init__(self, path: str, mark_cycles: bool = False, backend_name: str = "",
                 flush_interval_s: float = 0.1, max_bytes: int = 0):
        """``max_bytes``: rotate so the files hold about this much in all (0: no bound)."""
        self.path = path
        self._file_limit = max(_MIN_FILE_BYTES, max_bytes // (ROTATED_FILES + 1)) \
            if max_bytes > 0 else 0
        self._size = 0                          # characters in the live file
        self.mark_cycles = mark_cycles
        self._collective_prefix = (backend_name.upper() + "_") if backend_name else ""
        try:
            self._file = open(path, "w", encoding="utf-8")
        except OSError as exc:
            raise HvdliteConfigError(
                f"timeline: cannot write {path!r} ({exc.strerror}); check --timeline-filename "
                f"/ {TIMELINE}") from None
        self._t0 = time.monotonic()
        self._events: collections.deque = collections.deque()
        # writer-thread state
        self._rows: Dict[str, int] = {}         # name -> row, for the whole run
        self._file_rows: Dict[str, int] = {}    # the rows named in the live file
        self._ops: Dict[str, str] = {}          # name -> op, from queued
        self._drained: Dict[str, float] = {}    # name -> when taken from the queue
        self._started: Dict[str, float] = {}    # name -> negotiation end (its op begins)
        self._cycle_start = self._t0
        self._fused = 0                         # id of the last fused (async) slice
        self._interval = flush_interval_s
        self._stop = threading.Event()
        self._closed = False
        #: a write failed (a full disk): the timeline stopped, the job goes on
        self._broken = False
        for old in rotated_paths(path)[:-1]:    # a previous run's: not part of this trace
            os.remove(old)
        self._guarded(self._start_file)
        self._thread = threading.Thread(target=self._run, name="hvdlite-timeline", daemon=True)
        self._thread.start()

    # -- recorder side: the background thread; append only ---------------------------------
    def cycle(self, cycle, start):
        self._cycle_start = start
        if self.mark_cycles:
            self._events.append((_C, cycle, start))

    def queued(self, name, op, submitted, nbytes=0):
        self._events.append((_Q, name, op, submitted, self._cycle_start, nbytes))

    def negotiated(self, name, end, waited_for):
        self._events.append((_N, name, end, waited_for))

    def span(self, phase, names, start, end, chunk=0):
        self._events.append((_S, phase, names, start, end, chunk))

    def done(self, name, end, error):
        self._events.append((_D, name, end, error))

    def parameters(self, cycle, params):
        self._events.append((_P, cycle, time.monotonic(), params))

    def late(self, end, rank, seconds):
        self._events.append((_L, rank, end, seconds))

    # -- writer thread ------------------------------------------------------------------------
    def close(self, timeout_s: float = 5.0) -> None:
        """Write what is left and the closing bracket; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._thread.join(timeout_s)
        if not self._broken:
            self._guarded(self._flush)
        if not self._broken:
            self._guarded(self._end_file)

    def _guarded(self, write: Callable[[], None]) -> None:
        """Run ``write``; a failure to write (a full disk, an I/O error) stops the
        timeline, logged once, and never reaches the job: a finished training must
        not exit 1 because its trace could not be completed."""
        try:
            write()
        except OSError as exc:
            self._broken = True
            # keep nothing from now on: a deque of length 0 drops every append, so the
            # recorder's per-op methods need no check of their own
            self._events = collections.deque(maxlen=0)
            log.warning("timeline %s: writing failed (%s); the timeline stops here and the "
                        "job goes on", self.path, exc.strerror or exc)
            self._close_quietly()

    def _close_quietly(self) -> None:
        """Close the file after a failed write; closing flushes, which may fail again."""
        try:
            self._file.close()
        except OSError:
            pass                                 # the data is lost either way; said above

    def _start_file(self) -> None:
        self._write("[\n")
        self._emit_meta(0, RUNTIME_ROW)
        self._write(json.dumps({"name": "process_name", "ph": "M", "pid": 0,
                                "args": {"name": "hvdlite rank 0"}}) + ",\n")
        self._file.flush()

    def _write(self, text: str) -> None:
        self._file.write(text)
        self._size += len(text)

    def _end_file(self) -> None:
        self._file.write(json.dumps({"name": "timeline_end", "ph": "i", "s": "g", "pid": 0,
                                     "tid": 0, "ts": self._us(time.monotonic())}) + "\n]\n")
        self._file.close()

    def _rotate(self) -> None:
        """Finish the live file, shift FILE.i to FILE.i+1 (the oldest goes), start anew."""
        self._end_file()
        for i in range(ROTATED_FILES - 1, 0, -1):
            if os.path.exists(f"{self.path}.{i}"):
                os.replace(f"{self.path}.{i}", f"{self.path}.{i + 1}")
        os.replace(self.path, f"{self.path}.1")
        self._file = open(self.path, "w", encoding="utf-8")
        self._size = 0
        self._file_rows = {}
        self._start_file()

    def _run(self) -> None:
        while not self._stop.wait(self._interval) and not self._broken:
            try:
                self._guarded(self._flush)
            except Exception:  # noqa: BLE001 -- a broken writer must not end the job; say so
                self._broken = True
                log.exception("timeline %s: writing failed; the timeline stops here", self.path)
                self._close_quietly()
                return

    def _us(self, t: float) -> float:
        return round(max(0.0, t - self._t0) * 1e6, 1)

    def _emit_meta(self, tid: int, label: str) -> None:
        self._write(json.dumps({"name": "thread_name", "ph": "M", "pid": 0, "tid": tid,
                                "args": {"name": label}}) + ",\n")
        self._write(json.dumps({"name": "thread_sort_index", "ph": "M", "pid": 0,
                                "tid": tid, "args": {"sort_index": tid}}) + ",\n")

    def _row(self, name: str) -> int:
        tid = self._file_rows.get(name)
        if tid is None:
            tid = self._rows.get(name)
            if tid is None:
                tid = self._rows[name] = len(self._rows) + 1
            self._file_rows[name] = tid
            self._emit_meta(tid, name)
        return tid

    def _slice(self, out: List[str], tid: int, label: str, start: float, end: float,
               args: Optional[str] = None) -> None:
        # %-formatting, not json.dumps: labels are our own constants (no escaping needed)
        # and this runs ~1000 times per training step of a ResNet-50
        t0 = self._t0
        ts = (start - t0) * 1e6 if start > t0 else 0.0
        dur = (end - start) * 1e6 if end > start else 0.0
        if args is None:
            out.append('{"name": "%s", "ph": "X", "pid": 0, "tid": %d, "ts": %.1f, "dur": %.1f}'
                       % (label, tid, ts, dur))
        else:
            out.append('{"name": "%s", "ph": "X", "pid": 0, "tid": %d, "ts": %.1f, "dur": %.1f, '
                       '"args": %s}' % (label, tid, ts, dur, args))

    def _flush(self) -> None:
        events = self._events
        out: List[str] = []
        budget = _YIELD_EVERY
        while events:
            budget -= 1
            if not budget:
                # give the GIL away now and then: otherwise the background loop, back from
                # a collective, may wait a whole switch interval (5 ms) for this thread
                budget = _YIELD_EVERY
                time.sleep(0)
                if self._file_limit:
                    self._write_out(out)        # so a big batch rotates in time
            ev = events.popleft()
            kind = ev[0]
            if kind == _S:
                self._write_span(out, *ev[1:])
            elif kind == _Q:
                _, name, op, submitted, drained, nbytes = ev
                op = op.upper()
                self._ops[name] = op
                self._drained[name] = drained
                self._slice(out, self._row(name), QUEUED_NAME, min(submitted, drained), drained,
                            '{"bytes": %d}' % nbytes if nbytes else None)
            elif kind == _N:
                _, name, end, waited_for = ev
                op = self._ops.get(name, "OP")
                start = self._drained.pop(name, end)
                self._started[name] = end
                self._slice(out, self._row(name), NEGOTIATE_PREFIX + op, start, end,
                            '{"waited_for": [%s]}' % ", ".join(str(int(r)) for r in waited_for))
            elif kind == _D:
                _, name, end, error = ev
                start = self._started.pop(name, None)
                op = self._ops.pop(name, "OP")
                if start is not None:
                    self._slice(out, self._row(name), op, start, end,
                                json.dumps({"error": str(error)}) if error is not None else None)
            elif kind == _L:
                out.append(json.dumps({"name": LATE_NAME, "ph": "i", "s": "p", "pid": 0,
                                       "tid": 0, "ts": self._us(ev[2]),
                                       "args": {"rank": ev[1], "ms": round(ev[3] * 1e3, 3)}}))
            elif kind == _C:
                out.append(json.dumps({"name": CYCLE_NAME, "ph": "i", "s": "g", "pid": 0,
                                       "tid": 0, "ts": self._us(ev[2]),
                                       "args": {"cycle": ev[1]}}))
            elif kind == _P:
                _, cycle, t, params = ev
                out.append(json.dumps({"name": PARAMETERS_NAME, "ph": "i", "s": "p", "pid": 0,
                                       "tid": 0, "ts": self._us(t),
                                       "args": {"cycle": cycle, **_params_dict(params)}}))
        self._write_out(out)

    def _write_out(self, out: List[str]) -> None:
        """Write the formatted events (and empty ``out``); rotate past the file bound."""
        if out:
            self._write(",\n".join(out) + ",\n")
            out.clear()
            self._file.flush()
            if self._file_limit and self._size >= self._file_limit:
                self._rotate()

    def _write_span(self, out: List[str], phase: str, names: Sequence[str], start: float,
                    end: float, chunk: int) -> None:
        op = self._ops.get(names[0], "OP") if names else "OP"
        if phase == COPY_IN:
            label = COPY_IN_NAME
        elif phase == COPY_OUT:
            label = COPY_OUT_NAME
        elif phase == COLLECTIVE:
            label = self._collective_prefix + op
        else:
            label = phase.upper()
        if len(names) > 1:
            # one slice over the whole fused response; an async slice, since the chunks of
            # a pipelined buffer overlap (chunk k on the wire while k+1 is packed)
            self._fused += 1
            head = {"name": f"{label} ({len(names)} tensors)", "cat": "fused", "id": self._fused,
                    "pid": 0, "tid": 0}
            out.append(json.dumps({**head, "ph": "b", "ts": self._us(start),
                                   "args": {"chunk": chunk, "tensors": list(names[:_NAMES_SHOWN]),
                                            "more": max(0, len(names) - _NAMES_SHOWN)}}))
            out.append(json.dumps({**head, "ph": "e", "ts": self._us(end)}))
        rest = ('", "ph": "X", "pid": 0, "tid": %%d, "ts": %.1f, "dur": %.1f, "args": '
                '{"chunk": %d, "fused": %d}}' % (self._us(start), max(0.0, end - start) * 1e6,
                                                 chunk, len(names)))
        head = '{"name": "' + label
        row = self._row
        for name in names:
            out.append(head + rest % row(name))


def _params_dict(params) -> dict:
    try:
        return dataclasses.asdict(params)
    except TypeError:
        return {"value": str(params)}


def load_events(path: str) -> List[dict]:
    """Every event of a timeline file, complete or cut short (the job was killed).

    A file without its closing ``]`` is read line by line and a last line cut in
    the middle is dropped, as chrome://tracing does.

    Raises:
        ValueError: not a timeline (names the file and the line that does not parse).
    """
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        data = json.loads(text)
        return data["traceEvents"] if isinstance(data, dict) else list(data)
    except ValueError:
        pass
    lines = text.splitlines()
    if not lines or lines[0].strip() != "[":
        raise ValueError(f"{path}: not a Chrome-trace JSON array (first line "
                         f"{lines[0][:40] if lines else ''!r})")
    events = []
    last = len(lines) - 1
    for i, line in enumerate(lines[1:], start=1):
        line = line.strip().rstrip(",")
        if not line or line == "]":
            continue
        try:
            events.append(json.loads(line))
        except ValueError:
            if i == last:
                break               # cut in the middle of its last write
            raise ValueError(f"{path}:{i + 1}: not a trace event: {line[:80]!r}") from None
    return events
