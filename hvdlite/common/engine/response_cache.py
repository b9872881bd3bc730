"""Responses agreed before, so steady-state steps skip the request exchange.

Every rank updates its cache at the same points (when it executes a response),
in the same order, so a name sits in the same slot on every rank.  A rank's
pending request is a *hit* when its slot's stored signature equals the
request's; when every rank has a hit on a slot (one MIN-allreduce of a bit
vector), every rank can execute the stored response without negotiating.
"""

import collections
from typing import List, Optional, Tuple

from hvdlite.common.engine.message import Request, Response


class ResponseCache:
    """LRU map name -> (slot, response, this rank's request signature)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._by_name: "collections.OrderedDict[str, int]" = collections.OrderedDict()
        self._slots: List[Optional[Tuple[Response, Optional[tuple]]]] = []
        self._slot_names: List[Optional[str]] = []
        #: changes whenever a slot's response changes (fusion plans keyed on slots depend on it)
        self.version = 0

    def __len__(self) -> int:
        return len(self._by_name)

    def lookup(self, request: Request) -> int:
        """The slot whose stored response fits ``request``, or -1."""
        slot = self._by_name.get(request.name, -1)
        if slot >= 0 and self._slots[slot][1] == request.sig:
            return slot
        return -1

    def response(self, slot: int) -> Response:
        return self._slots[slot][0]

    def put(self, response: Response, own: Optional[Request]) -> None:
        """Record an executed response (same call order on every rank)."""
        if self.capacity == 0:
            return
        sig = own.sig if own is not None else None
        slot = self._by_name.get(response.name)
        if slot is not None:
            self._by_name.move_to_end(response.name)
        else:
            if len(self._by_name) >= self.capacity:
                _, slot = self._by_name.popitem(last=False)
            else:
                slot = len(self._slots)
                self._slots.append(None)
                self._slot_names.append(None)
            self._by_name[response.name] = slot
        old = self._slots[slot]
        if old is None or old[0] is not response or old[1] != sig:
            self.version += 1
        self._slots[slot] = (response, sig)
        self._slot_names[slot] = response.name

    def touch(self, name: str) -> None:
        if name in self._by_name:
            self._by_name.move_to_end(name)

    def touch_all(self, responses) -> None:
        """:meth:`touch` of every response's name (a cache-hit cycle's)."""
        by_name = self._by_name
        move = by_name.move_to_end
        for resp in responses:
            if resp.name in by_name:
                move(resp.name)

    def erase(self, name: str) -> None:
        slot = self._by_name.pop(name, None)
        if slot is not None:
            self.version += 1
            # keep the slot allocated but unusable; it is reused by the next put
            self._slots[slot] = (self._slots[slot][0], None)
            self._free_slot(slot)

    def _free_slot(self, slot: int) -> None:
        # Re-insert as the least recently used name-less slot so `put` reuses it first.
        placeholder = f"\0free{slot}"
        self._by_name[placeholder] = slot
        self._by_name.move_to_end(placeholder, last=False)
        self._slot_names[slot] = placeholder
