"""The connections of one listener that have not proved the key yet, and which one goes first.

A listener keeps these in one table, served by its accept thread (no thread per stranger),
so that holding one costs a descriptor and a few hundred bytes.  The table is bounded; when
a new connection finds it full, the table names a *victim* to close instead of refusing the
newcomer, because refusing is what let a few dozen idle connections lock a job's own
clients out:

* the victim is the oldest connection of the source address that holds the most places
  (so one address flooding us competes with itself, not with a peer that connects once);
* a connection younger than ``min_age_s`` is never the victim: every connection we accept
  gets at least that long to send its hello, so a peer with the key is not pushed out
  before it could speak; when nothing is old enough, the newcomer is refused (and our
  clients connect again);
* one source never holds more than ``per_source`` places: a newcomer from a source at
  its share takes the place of that source's oldest connection (same age rule).

Authenticated connections are not in the table and are never closed to make room.
"""

import collections
import socket
from typing import Dict, Iterator, Optional

from hvdlite.common.net.framing import SecureChannel

#: bytes of a frame's length prefix, the first part of a hello read
PREFIX_BYTES = 4


class Pending:
    """One accepted connection waiting for its hello (read without blocking into ``buf``)."""

    __slots__ = ("sock", "fd", "peer", "chan", "since", "buf", "need")

    def __init__(self, sock: socket.socket, peer, chan: SecureChannel, since: float):
        self.sock = sock
        self.fd = sock.fileno()
        self.peer = peer
        self.chan = chan
        self.since = since
        self.buf = bytearray()
        #: bytes of the hello needed so far: its length prefix, then the whole frame
        self.need = PREFIX_BYTES

    @property
    def source(self) -> str:
        return self.peer[0]


#: what :meth:`PreauthTable.victim` answers when the newcomer must be refused
REFUSE = object()


class PreauthTable:
    """Bounded table of :class:`Pending` connections, in the order they were accepted."""

    def __init__(self, per_source: int, min_age_s: float):
        self._all: "collections.OrderedDict[int, Pending]" = collections.OrderedDict()
        self._by_source: Dict[str, "collections.OrderedDict[int, Pending]"] = {}
        self._per_source = per_source
        self._min_age_s = min_age_s

    def __len__(self) -> int:
        return len(self._all)

    def __iter__(self) -> Iterator[Pending]:
        return iter(list(self._all.values()))

    def add(self, p: Pending) -> None:
        self._all[p.fd] = p
        self._by_source.setdefault(p.source, collections.OrderedDict())[p.fd] = p

    def remove(self, p: Pending) -> None:
        """Forget ``p`` (idempotent)."""
        if self._all.get(p.fd) is not p:
            return
        del self._all[p.fd]
        same = self._by_source[p.source]
        del same[p.fd]
        if not same:
            del self._by_source[p.source]

    def get(self, fd: int) -> Optional[Pending]:
        return self._all.get(fd)

    def victim(self, source: str, capacity: int, now: float):
        """What must go so that one more connection from ``source`` fits in ``capacity``
        places: ``None`` (it fits), a :class:`Pending` to close, or :data:`REFUSE`."""
        same = self._by_source.get(source)
        if same is not None and len(same) >= self._per_source:
            oldest = next(iter(same.values()))
        elif len(self._all) >= capacity:
            if not self._all:
                return REFUSE
            biggest = max(self._by_source.values(), key=len)
            oldest = next(iter(biggest.values()))
        else:
            return None
        return oldest if now - oldest.since >= self._min_age_s else REFUSE

    def expired(self, now: float, timeout_s: float) -> Iterator[Pending]:
        """The connections accepted more than ``timeout_s`` ago (oldest first)."""
        for p in list(self._all.values()):
            if now - p.since < timeout_s:
                return
            yield p

    def next_deadline(self, timeout_s: float) -> Optional[float]:
        """When the oldest connection's hello deadline passes (monotonic), if any."""
        for p in self._all.values():
            return p.since + timeout_s
        return None
