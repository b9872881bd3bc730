"""The last error hvdlite's op layer raised to this rank's user code, for stall reports.

A rank that raises out of a collective (a bad argument, a set it is not in) while its
peers already wait in it leaves them stalled, and a test harness or a ``try`` block then
takes the rank elsewhere: its stack shows where it went, not why it left.  So the op
layer's entry points note the exception on its way out, with the user frame that called
them, and the rank's stack report carries it; the launcher prints it as "rank 1 left the
collective by raising ValueError: ...".  Only the newest is kept; the path that does not
raise pays one function call.
"""

import functools
import sys
import threading
import time
from typing import Callable, Optional, TypeVar

#: bound on the message carried in a report
MAX_MESSAGE = 500
#: how many caller frames are kept (the user's frame is found among them when reported)
MAX_CALLERS = 16

F = TypeVar("F", bound=Callable)

_lock = threading.Lock()
_last: Optional[dict] = None


def note(exc: BaseException, frame=None) -> None:
    """Keep ``exc`` as the newest error raised to user code, with ``frame`` (default: the
    caller's) and the frames that called it, innermost first."""
    global _last
    frame = frame if frame is not None else sys._getframe(1)
    callers = []
    while frame is not None and len(callers) < MAX_CALLERS:
        callers.append([frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name])
        frame = frame.f_back
    entry = {
        "type": type(exc).__name__,
        "message": str(exc)[:MAX_MESSAGE],
        "callers": callers,
        "at": time.monotonic(),
    }
    with _lock:
        _last = entry


def last() -> Optional[dict]:
    """The newest noted error: type, message, ``callers`` ([file, line, function],
    innermost first) and ``ago_s``, how long ago it was raised; None when there was none."""
    with _lock:
        entry = _last
    if entry is None:
        return None
    out = {k: v for k, v in entry.items() if k != "at"}
    out["ago_s"] = round(time.monotonic() - entry["at"], 1)
    return out


def noted(fn: F) -> F:
    """``fn``, noting any :class:`Exception` it raises (see :func:`note`) before it goes on
    to the caller (an entry point calling another notes it twice, with the same user
    frame)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            note(exc, sys._getframe(1))
            raise

    return wrapper  # type: ignore[return-value]
