"""Pending operations handed from user threads to the background thread.

User threads call :meth:`TensorQueue.push`; only the background thread calls
:meth:`TensorQueue.drain` and :meth:`TensorQueue.finish`.  A name may be in
flight once: pushing it again before it completes is refused at once.

The requests a rank has in flight may take at most
:data:`MAX_IN_FLIGHT_WIRE_BYTES` (256 MiB) by their wire bound, so a
negotiation's payload length always fits the int32 control vector; a push past
it raises ``ValueError`` at once (names are bounded too, at
:data:`hvdlite.common.ops.MAX_NAME_CHARS` characters, checked by the op layer).
One entry, the common case, takes the fast path
:meth:`TensorQueue.push_one` (``Runtime.enqueue_one``), which builds no lists.
"""

import threading
from typing import Any, Callable, Dict, List, Optional

from hvdlite.common.exceptions import HvdliteDuplicateNameError
from hvdlite.common.engine.message import Request


class Handle:
    """The user's side of one (possibly grouped) asynchronous operation."""

    __slots__ = ("_done", "_remaining", "_error", "_finish", "_hurry", "results", "names")

    def __init__(
        self,
        count: int,
        finish: Optional[Callable[[list], Any]] = None,
        hurry: Optional[Callable[[], None]] = None,
    ):
        """``hurry`` (the runtime's) is called when somebody starts waiting: the background
        thread then stops gathering submissions and runs its next cycle."""
        # A lock held until completion is far cheaper to create and signal than an Event,
        # which matters with thousands of small tensors per step.
        self._done = threading.Lock()
        self._done.acquire()
        self._remaining = count
        self._error: Optional[BaseException] = None
        self._finish = finish
        self._hurry = hurry
        self.results: List[Any] = [None] * count
        self.names: List[str] = []

    def complete_one(self, index: int, result: Any) -> None:
        """Record the result of the operation's ``index``-th tensor; the last one wakes the
        waiters.  The runtime's background thread only (so ``_remaining`` needs no lock)."""
        self.results[index] = result
        self._remaining -= 1
        if self._remaining == 0:
            self._done.release()

    def fail_one(self, error: BaseException) -> None:
        """Record that one tensor of the operation failed with ``error`` (the first error
        is the one :meth:`value` raises); the background thread only, as
        :meth:`complete_one`."""
        if self._error is None:
            self._error = error
        self._remaining -= 1
        if self._remaining == 0:
            self._done.release()

    def done(self) -> bool:
        return not self._done.locked()

    def wait(self, timeout_s: float) -> bool:
        if self._hurry is not None and self._done.locked():
            self._hurry()
        if self._done.acquire(timeout=timeout_s):
            self._done.release()
            return True
        return False

    def value(self):
        """The result once done; raises the operation's error."""
        if self._error is not None:
            raise self._error
        if self._finish is not None:
            return self._finish(self.results)
        return self.results[0] if len(self.results) == 1 else self.results


class Entry:
    """One tensor of an operation: the request plus the local buffers."""

    __slots__ = ("request", "tensor", "output", "handle", "index", "enqueued_at", "wire")

    def __init__(self, request: Request, tensor: Any, output: Any, handle: Handle, index: int):
        self.request = request
        self.tensor = tensor
        self.output = output
        self.handle = handle
        self.index = index
        self.enqueued_at = 0.0
        self.wire = 0  # the request's wire bound, counted while in flight


#: the most request bytes (their wire bound) one rank may have in flight: a negotiation
#: sends them all in one payload whose length travels in the int32 control vector, and
#: every rank allocates a row that long for the allgather
MAX_IN_FLIGHT_WIRE_BYTES = 256 * 1024 * 1024


class TensorQueue:
    """Thread-safe inbox of entries with duplicate-name detection."""

    def __init__(self):
        self._lock = threading.Lock()
        self._incoming: List[Entry] = []
        self._in_flight: Dict[str, Entry] = {}
        self._closed_error: Optional[BaseException] = None
        self._wire = 0  # wire bound of every request in flight

    def _reserve(self, wire: int, count: int) -> None:
        if self._wire + wire > MAX_IN_FLIGHT_WIRE_BYTES:
            raise ValueError(
                f"{count + len(self._in_flight)} operations in flight would need "
                f"{(self._wire + wire) >> 20} MiB of requests in one negotiation (at most "
                f"{MAX_IN_FLIGHT_WIRE_BYTES >> 20} MiB); synchronize some handles first, or "
                f"use shorter names"
            )
        self._wire += wire

    def push_one(self, e: Entry, now: float) -> None:
        """:meth:`push` of one entry, the common case (one allreduce of an optimizer)."""
        name = e.request.name
        wire = e.wire = e.request.wire
        with self._lock:
            if self._closed_error is not None:
                raise self._closed_error
            if name in self._in_flight:
                raise HvdliteDuplicateNameError(
                    f"tensor name {name!r} is already in flight; wait for its handle or "
                    f"give each concurrent operation a distinct name"
                )
            if self._wire + wire > MAX_IN_FLIGHT_WIRE_BYTES:
                self._reserve(wire, 1)  # raises, naming the limit
            self._wire += wire
            e.enqueued_at = now
            self._in_flight[name] = e
            self._incoming.append(e)

    def push(self, entries: List[Entry], now: float) -> None:
        if len(entries) == 1:
            self.push_one(entries[0], now)
            return
        with self._lock:
            if self._closed_error is not None:
                raise self._closed_error
            seen = set()
            for e in entries:
                name = e.request.name
                if name in self._in_flight or name in seen:
                    raise HvdliteDuplicateNameError(
                        f"tensor name {name!r} is already in flight; wait for its handle or "
                        f"give each concurrent operation a distinct name"
                    )
                seen.add(name)
            for e in entries:
                e.wire = e.request.wire
            self._reserve(sum(e.wire for e in entries), len(entries))
            for e in entries:
                e.enqueued_at = now
                self._in_flight[e.request.name] = e
            self._incoming.extend(entries)

    def drain(self) -> List[Entry]:
        with self._lock:
            out, self._incoming = self._incoming, []
        return out

    def finish(self, names: List[str]) -> None:
        """Forget completed names."""
        with self._lock:
            pop = self._in_flight.pop
            for name in names:
                e = pop(name, None)
                if e is not None:
                    self._wire -= e.wire

    def close(self, error: BaseException) -> List[Entry]:
        """Refuse new work with ``error``; return every entry still in flight."""
        with self._lock:
            self._closed_error = error
            left = list(self._in_flight.values())
            self._in_flight.clear()
            self._wire = 0
            self._incoming = []
        return left

    def incoming(self) -> List[Entry]:
        """A copy of the submissions not yet drained (any thread; for diagnostics)."""
        return list(self._incoming)

    def has_incoming(self) -> bool:
        return bool(self._incoming)
