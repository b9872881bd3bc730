"""One stderr line for a warning that every rank prints: ``[0-3]<stderr>: ...``.

Lightning's, Hugging Face's and torch's warnings come from every rank at about the same
time; printed once per rank they bury what matters.  :class:`RankLineMerger` holds each
line for a short window, adds every other rank that prints the same text in it, and
prints the line once, tagged with the ranks that printed it (at once when all did).  A
rank's own lines keep their order: a line joins only a held line newer than the last
one it joined, and held lines are printed oldest first.
"""

import collections
import threading
import time
from typing import Callable, Deque, Dict, List, Optional

#: how long a line waits for the same line from the other ranks
WINDOW_S = 0.3


def rank_label(ranks) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    ordered = sorted(ranks)
    parts: List[str] = []
    start = prev = ordered[0]
    for r in ordered[1:] + [None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ",".join(parts)


class _Held:
    __slots__ = ("seq", "line", "ranks", "born")

    def __init__(self, seq: int, line: bytes, rank: int, born: float):
        self.seq, self.line, self.ranks, self.born = seq, line, {rank}, born


class RankLineMerger:
    """Merges the same line from several of ``size`` ranks; ``emit(label, line)`` prints
    one (``label`` as :func:`rank_label`).  A thread of its own prints lines whose window
    ended; :meth:`flush` prints everything held (before the job's summary)."""

    def __init__(self, size: int, emit: Callable[[str, bytes], None], window_s: float = WINDOW_S):
        self._size = size
        self._emit = emit
        self._window_s = window_s
        self._held: Deque[_Held] = collections.deque()
        #: line -> the held entries with that text, oldest first
        self._by_line: Dict[bytes, List[_Held]] = {}
        self._last_seq: Dict[int, int] = {}
        self._seq = 0
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="merged-rank-lines", daemon=True)
        self._thread.start()

    def add(self, rank: int, line: bytes) -> None:
        with self._cond:
            if self._closed:
                self._emit(str(rank), line)
                return
            last = self._last_seq.get(rank, -1)
            joined: Optional[_Held] = None
            for held in self._by_line.get(line, ()):
                if held.seq > last and rank not in held.ranks:
                    held.ranks.add(rank)
                    joined = held
                    break
            if joined is None:
                self._seq += 1
                joined = _Held(self._seq, line, rank, time.monotonic())
                self._held.append(joined)
                self._by_line.setdefault(line, []).append(joined)
            self._last_seq[rank] = joined.seq
            self._print_ready(time.monotonic())
            self._cond.notify()

    def _print_ready(self, now: float, everything: bool = False) -> None:
        while self._held:
            first = self._held[0]
            if not (
                everything or len(first.ranks) >= self._size or now - first.born >= self._window_s
            ):
                return
            self._held.popleft()
            same = self._by_line[first.line]
            same.remove(first)
            if not same:
                del self._by_line[first.line]
            self._emit(rank_label(first.ranks), first.line)

    def _run(self) -> None:
        with self._cond:
            while not self._closed:
                if not self._held:
                    self._cond.wait()
                    continue
                due = self._held[0].born + self._window_s - time.monotonic()
                if due > 0:
                    self._cond.wait(due)
                self._print_ready(time.monotonic())

    def flush(self) -> None:
        """Print every held line now."""
        with self._cond:
            self._print_ready(time.monotonic(), everything=True)

    def close(self) -> None:
        with self._cond:
            self._print_ready(time.monotonic(), everything=True)
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=1.0)
