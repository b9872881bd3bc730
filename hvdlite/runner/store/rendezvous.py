"""The key-value store workers rendezvous through, served by the launcher.

Unlike an open ``TCPStore``, every request is authenticated with the job's key
(see :mod:`hvdlite.common.net.framing`): a process without the key can neither
read nor write.  Workers reach it through :class:`hvdlite.common.net.kv.KVClient`.

:class:`RendezvousService` adds *rounds* on top: the job agent publishes each
round's slots (once for a static job, once per reset for an elastic one), and a
worker's ``init()`` joins the first round after the one it last joined, learning its
rank, size and local / cross ranks from its host and local slot.  Every key of a
round (the arrivals, Gloo's own) lives under ``<job>/round<N>/``
(:func:`hvdlite.common.net.kv.round_prefix`), so rounds never mix.
"""

import base64
import dataclasses
import logging
import threading
import time
from typing import Callable, Dict, Optional, Sequence, Tuple

from hvdlite.common.net.kv import PLACE_FIELDS, arrival_key, round_prefix
from hvdlite.common.net.service import Service, ServiceError, is_int
from hvdlite.runner.store.exit_reports import MAX_REPORTS, parse_exit_report
from hvdlite.runner.hosts import SlotInfo
from hvdlite.runner.store.metrics_inbox import MetricsInbox

log = logging.getLogger("hvdlite.runner.store.rendezvous")


class KVStoreService(Service):
    """In-memory store: set/get/add/check/wait/compare_set/delete/num_keys.

    ``get`` and ``wait`` block until the keys exist or the request's
    ``timeout_s`` passes, then answer with an error naming the missing keys.
    """

    def __init__(self, key: bytes, bind_addr: str = "127.0.0.1", port: int = 0,
                 expected_peers: int = 0, **limits):
        self._data: Dict[str, bytes] = {}
        self._cond = threading.Condition()
        super().__init__("rendezvous store", key, bind_addr, port,
                         expected_peers=expected_peers, **limits)

    def _superseded(self, round_) -> Optional[int]:
        """The newest round when it is newer than ``round_`` (a waiter's round), else None;
        a plain store has no rounds."""
        return None

    def _wait_for(self, keys: Sequence[str], timeout_s: float, round_=None) -> Optional[int]:
        """Block until ``keys`` exist; returns None then, or the newest round as soon as it
        is newer than ``round_`` (the waiter's round was replaced: stop waiting for it)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                newest = self._superseded(round_)
                if newest is not None:
                    return newest
                missing = [k for k in keys if k not in self._data]
                if not missing:
                    return None
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ServiceError(f"timed out after {timeout_s:.0f}s waiting for keys "
                                       f"{missing[:5]}")
                self._cond.wait(left)

    _KEYED = ("set", "add", "compare_set", "delete", "get")
    _MAX_WAIT_S = 24 * 3600.0

    def handle(self, header, blob, client):
        op = header.get("op")
        key = header.get("key")
        if op in self._KEYED and not isinstance(key, str):
            raise ServiceError(f"store operation {op!r}: key must be a string")
        if op in ("check", "wait"):
            keys = header.get("keys")
            if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
                raise ServiceError(f"store operation {op!r}: keys must be a list of strings")
        if op in ("get", "wait"):
            t = header.get("timeout_s")
            if not isinstance(t, (int, float)) or not 0 <= t <= self._MAX_WAIT_S:
                raise ServiceError(f"store operation {op!r}: timeout_s must be "
                                   f"0..{self._MAX_WAIT_S:.0f}")
        if op == "add" and (not isinstance(header.get("amount"), int)
                            or isinstance(header.get("amount"), bool)):
            raise ServiceError("store operation 'add': amount must be an integer")
        with self._cond:
            if op == "set":
                self._data[key] = blob
                self._cond.notify_all()
                return {}, b""
            if op == "add":
                value = int(self._data.get(key, b"0")) + int(header["amount"])
                self._data[key] = str(value).encode()
                self._cond.notify_all()
                return {"value": value}, b""
            if op == "check":
                return {"present": all(k in self._data for k in header["keys"])}, b""
            if op == "compare_set":
                expected = base64.b64decode(header["expected"])
                current = self._data.get(key)
                if (current is None and expected == b"") or current == expected:
                    self._data[key] = blob
                    self._cond.notify_all()
                    return {}, blob
                return {}, current if current is not None else expected
            if op == "delete":
                return {"deleted": self._data.pop(key, None) is not None}, b""
            if op == "num_keys":
                return {"value": len(self._data)}, b""
        round_ = header.get("round")
        if round_ is not None and not is_int(round_):
            raise ServiceError(f"store operation {op!r}: round must be an integer")
        if op == "get":
            newest = self._wait_for([key], float(header["timeout_s"]), round_)
            if newest is not None:
                return {"superseded": newest}, b""
            with self._cond:
                return {}, self._data[key]
        if op == "wait":
            newest = self._wait_for(header["keys"], float(header["timeout_s"]), round_)
            return ({} if newest is None else {"superseded": newest}), b""
        raise ServiceError(f"unknown store operation {op!r}")


class RendezvousService(KVStoreService):
    """The store plus rendezvous rounds.

    ``publish(slots)`` opens the next round with those slots; ``join_round``
    requests (``after``, ``hostname``, ``local_rank``) block until a round newer
    than ``after`` is open and answer with the caller's place in it.  A caller
    whose slot is not in the newest round is told so at once (``removed``): it is
    stale, or its host left the job, and must not meet the round's members.
    ``newest_round`` answers the newest round's number (workers poll it to notice
    membership changes).  A slot the agent has put on *standby* (:meth:`standby`: a
    replacement started ahead of the round that will take it) is not told to leave: its
    request is counted as ready (:meth:`ready`) and waits until a round has its place, so
    the agent publishes that round only once the new process can join at once.

    One process per slot: a slot is bound to the token of the process that first joined
    with it, and a process presenting another token is told to leave -- unless it joins
    for the first time (``after`` -1) after the agent announced a new process for the
    slot (:meth:`new_process`).  So the workers of a task the launcher cut off, back
    after a partition healed, cannot join beside (or instead of) their replacement.

    A reset nobody left: :meth:`all_asking` tells the agent when every member of the newest
    round asks for a round after it (a collective failed on every rank, e.g. one rank
    raised, and no process exited); the agent, which otherwise opens rounds only when
    membership changes, then opens one with the same members.  ``waker`` (see
    :meth:`set_waker`) is called the moment that happens.  With ``repeat_last=True`` (a static job)
    a request for a round after the newest one opens the next round with the same
    slots, so ``shutdown()`` then ``init()`` needs nobody to publish.
    """

    _MAX_WAIT_S = 24 * 3600.0

    def __init__(self, key: bytes, slots: Sequence[SlotInfo] = (), bind_addr: str = "127.0.0.1",
                 port: int = 0, repeat_last: bool = True, job_id: Optional[str] = None,
                 extra_ops: Optional[Dict[str, Callable]] = None):
        """``extra_ops``: more ops, each answered by ``handler(header, blob)`` (e.g. the
        ranks' stack reports, ``hvdlite.runner.store.stack_collection``)."""
        self._extra_ops = dict(extra_ops or {})
        self._repeat_last = repeat_last
        self._job_id = job_id
        self._round = -1
        self._places: Dict[Tuple[str, int], SlotInfo] = {}
        #: slots started ahead of their round, and those of them whose process is waiting
        self._standby: set = set()
        self._ready: set = set()
        #: slot -> the token of the process that holds it (see the class docstring)
        self._tokens: Dict[Tuple[str, int], str] = {}
        #: members of the newest round waiting in join_round for a round after it
        self._asking: set = set()
        self._waker: Optional[Callable[[], None]] = None
        self._reports: Dict[Tuple[str, int], dict] = {}
        #: what running ranks report: counters (op ``metrics``) and straggler lines
        self.inbox = MetricsInbox(self._host_of_rank)
        super().__init__(key, bind_addr, port, expected_peers=len(slots))
        if slots:
            self.publish(slots)

    @property
    def round(self) -> int:
        """The newest round (-1 before the first is published)."""
        return self._round

    def _superseded(self, round_) -> Optional[int]:
        # a waiter that names its round (elastic workers while a round forms) stops
        # waiting once a newer round is published: its peers may never come
        if round_ is not None and not self._repeat_last and self._round > round_:
            return self._round
        return None

    def publish(self, slots: Sequence[SlotInfo],
                ids: Optional[Sequence[Tuple[str, int]]] = None) -> int:
        """Open the next round with ``slots`` (one per rank); returns its number.

        ``ids[i]`` is the (host, local slot) of the worker that takes ``slots[i]``
        (default: each slot's own host and local rank); it is what that worker joins with.
        So an elastic round keeps its local ranks dense (a host's slots are local ranks
        0..k-1, as shared memory needs) while each worker joins under its own slot id.

        Raises:
            ValueError: two slots share an id, or ``ids`` does not match ``slots``.
        """
        if ids is None:
            ids = [(s.hostname, s.local_rank) for s in slots]
        if len(ids) != len(slots):
            raise ValueError("publish: one id per slot")
        places = dict(zip((tuple(i) for i in ids), slots))
        if len(places) != len(slots):
            raise ValueError("every slot of a round needs its own (host, local slot)")
        with self._cond:
            self._round += 1
            self._places = places
            self._asking = set()
            self._standby -= set(places)
            self._ready -= set(places)
            self._cond.notify_all()
            return self._round

    def standby(self, ids: Sequence[Tuple[str, int]]) -> None:
        """The slots whose new processes wait for a later round (replacing the previous
        set): their ``join_round`` waits for a round with their place instead of being
        told to leave.  A slot taken off the set is told to leave at once."""
        with self._cond:
            self._standby = {tuple(i) for i in ids} - set(self._places)
            self._ready &= self._standby
            self._cond.notify_all()

    def _ask_again(self, slot: Tuple[str, int]) -> None:
        """A member of the newest round waits for a round after it; the agent is woken once
        every member does (see the class docstring)."""
        if slot in self._asking:
            return
        self._asking.add(slot)
        if self._asking >= set(self._places) and self._waker is not None:
            self._waker()

    def all_asking(self, round_: int) -> bool:
        """Does every member of ``round_``, the newest round, wait for a round after it?"""
        with self._cond:
            return round_ == self._round and bool(self._places) and \
                self._asking >= set(self._places)

    def asking(self, round_: int) -> set:
        """The members of ``round_``, the newest round, that wait for a round after it."""
        with self._cond:
            return set(self._asking) if round_ == self._round else set()

    def set_waker(self, waker: Callable[[], None]) -> None:
        """Call ``waker()`` (thread-safe, quick) when every member asks for a new round."""
        self._waker = waker

    def new_process(self, ids: Sequence[Tuple[str, int]]) -> None:
        """New processes are being started on these slots: the first to join each binds
        it; the slot's previous process may no longer join."""
        with self._cond:
            for i in ids:
                self._tokens.pop(tuple(i), None)

    def _stale(self, slot: Tuple[str, int], token, after: int) -> Optional[str]:
        """Why the process with ``token`` may not join as ``slot`` (None: it may), binding
        the slot to a first-time joiner.  Requests without a token are not checked."""
        if not isinstance(token, str):
            return None
        held = self._tokens.get(slot)
        if held is None and after < 0:
            self._tokens[slot] = token
            return None
        if held == token:
            return None
        return (f"another process now holds host {slot[0]} local slot {slot[1]} (this one was "
                f"cut off from the job, e.g. by a partition that has healed)")

    def ready(self) -> set:
        """The standby slots whose process is waiting in ``join_round`` now."""
        with self._cond:
            return set(self._ready)

    def formed(self, round_: int) -> bool:
        """Did every rank of ``round_``, the newest round, reach ``init()`` (set its arrival
        key)?  True when that cannot be told (no job id given, or an older round)."""
        with self._cond:
            if self._job_id is None or round_ != self._round:
                return True
            prefix = round_prefix(self._job_id, round_)
            return all(prefix + arrival_key(r) in self._data for r in range(len(self._places)))

    def arrived(self, round_: int) -> set:
        """The ranks of ``round_``, the newest round, that reached ``init()`` in it."""
        with self._cond:
            if self._job_id is None or round_ != self._round:
                return set()
            prefix = round_prefix(self._job_id, round_)
            return {r for r in range(len(self._places)) if prefix + arrival_key(r) in self._data}

    def exit_reports(self) -> Dict[Tuple[str, int], dict]:
        """What ranks said about their exit: (host, local slot) -> ``{"peer": bool,
        "error": str, "at": monotonic arrival time}`` (see ``hvdlite.common.diagnostics.exit_report``)."""
        with self._cond:
            return dict(self._reports)

    def _take_exit_report(self, header) -> None:
        slot, report = parse_exit_report(header)
        with self._cond:
            if len(self._reports) < MAX_REPORTS:
                self._reports[slot] = report

    def _host_of_rank(self, rank: int) -> Optional[str]:
        with self._cond:
            return next((s.hostname for s in self._places.values() if s.rank == rank), None)

    #: the longest an ``await_round`` request is held (the worker asks again)
    _MAX_AWAIT_S = 60.0

    def _await_round(self, header):
        """Answer the newest round once it is newer than ``after``, or after ``timeout_s``
        whatever it is: a worker's round watcher holds one such request open, so it learns
        of a new round within a network round trip, without polling."""
        after, timeout_s = header.get("after"), header.get("timeout_s")
        if not (is_int(after) and isinstance(timeout_s, (int, float))
                and 0 <= timeout_s <= self._MAX_AWAIT_S):
            raise ServiceError(f"await_round: after (an integer) and timeout_s "
                               f"(0..{self._MAX_AWAIT_S:g} seconds) are required")
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._round <= after and time.monotonic() < deadline:
                self._cond.wait(max(0.0, deadline - time.monotonic()))
            return {"round": self._round}, b""

    def handle(self, header, blob, client):
        if header.get("op") == "metrics":
            self.inbox.take_metrics(header, blob)
            return {}, b""
        if header.get("op") == "straggler":
            self.inbox.take_straggler(header)
            return {}, b""
        if header.get("op") == "newest_round":
            with self._cond:
                return {"round": self._round}, b""
        if header.get("op") == "await_round":
            return self._await_round(header)
        if header.get("op") == "exit_report":
            self._take_exit_report(header)
            return {}, b""
        if header.get("op") in self._extra_ops:
            return self._extra_ops[header["op"]](header, blob)
        if header.get("op") != "join_round":
            return super().handle(header, blob, client)
        after, host = header.get("after"), header.get("hostname")
        local_rank, timeout_s = header.get("local_rank"), header.get("timeout_s")
        if not (is_int(after) and is_int(local_rank) and isinstance(host, str)
                and isinstance(timeout_s, (int, float))
                and 0 <= timeout_s <= self._MAX_WAIT_S):
            raise ServiceError("join_round: after, local_rank (integers), hostname (string) "
                               "and timeout_s (seconds) are required")
        deadline = time.monotonic() + timeout_s
        token = header.get("token")
        with self._cond:
            while True:
                if self._round <= after and self._repeat_last and self._places:
                    self.publish(list(self._places.values()), list(self._places))
                elif self._round <= after and (host, local_rank) in self._places:
                    self._ask_again((host, local_rank))
                if self._round > after:
                    slot = self._places.get((host, local_rank))
                    stale = None if slot is None and (host, local_rank) not in self._standby \
                        else self._stale((host, local_rank), token, after)
                    if stale is not None:
                        return {"round": self._round, "removed": stale}, b""
                    if slot is not None:
                        place = dataclasses.asdict(slot)
                        return dict({f: place[f] for f in PLACE_FIELDS},
                                    round=self._round), b""
                    if (host, local_rank) not in self._standby:
                        # an answer, not an error: the caller must leave
                        return {"round": self._round, "removed": (
                            f"round {self._round} has no place for host {host} local slot "
                            f"{local_rank} (its slots: {sorted(self._places)})")}, b""
                    if (host, local_rank) not in self._ready:     # waits for its round
                        self._ready.add((host, local_rank))
                        self._cond.notify_all()
                left = deadline - time.monotonic()
                if left <= 0:
                    self._ready.discard((host, local_rank))
                    self._asking.discard((host, local_rank))
                    raise ServiceError(f"no round after round {after} was opened within "
                                       f"{timeout_s:g}s")
                self._cond.wait(left)
