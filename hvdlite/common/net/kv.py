"""The worker's side of the launcher's rendezvous store.

The store itself (``hvdlite.runner.store.rendezvous.KVStoreService``) runs in the
launcher; workers only need this client, so it lives in the shared network
layer.  The Gloo backend wraps it into a ``torch.distributed.Store``; this
module itself needs no torch.
"""

import base64
import dataclasses
import secrets
from typing import List, Optional, Tuple

from hvdlite.common.exceptions import (
    HvdliteRemovedError,
    HvdliteRoundSupersededError,
    HvdliteTimeoutError,
)
from hvdlite.common.net.service import Client, ServiceError


#: what a rank learns when it joins a round (the same fields as the launcher's slots)
PLACE_FIELDS = ("rank", "size", "local_rank", "local_size", "cross_rank", "cross_size")


#: who this process is to the store: a slot joins with it, so that a stale process (of a
#: task the launcher cut off, back after a partition healed) cannot pass for the new
#: process started on its slot (see ``RendezvousService``)
PROCESS_TOKEN = secrets.token_hex(8)


def round_prefix(job_id: str, round_: int) -> str:
    """Where every key of one rendezvous round lives (ours and Gloo's): rounds never mix."""
    return f"{job_id}/round{round_}/"


def arrival_key(rank: int) -> str:
    """The key a rank sets (under its round's prefix) once it reached ``init()``; the
    launcher reads them to tell a round that formed from one that never did."""
    return f"arrived/{rank}"


@dataclasses.dataclass(frozen=True)
class Placement:
    """This process's place in one rendezvous round."""

    round: int
    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int


class KVClient:
    """Client of the launcher's store; keys are namespaced by ``prefix``.

    Blocking calls (``get``, ``wait``) are bounded by ``timeout_s`` and raise
    :class:`HvdliteTimeoutError` naming the key.
    """

    def __init__(self, addr: Tuple[str, int], key: bytes, timeout_s: float, prefix: str = ""):
        self._client = Client(addr, key, timeout_s, name="rendezvous store")
        self.timeout_s = timeout_s
        self.prefix = prefix
        #: set to the round this client's waits belong to (elastic jobs): a wait then ends
        #: with :class:`HvdliteRoundSupersededError` as soon as a newer round is published
        self.round: Optional[int] = None
        #: the newest round once a wait saw this client's round replaced (else None)
        self.superseded_by: Optional[int] = None

    def _k(self, key: str) -> str:
        return self.prefix + key

    def _blocking(self, header, what: str) -> bytes:
        if self.round is not None:
            header["round"] = self.round
        # the store answers (with an error) once the wait's own timeout passes; allow for that
        try:
            reply, out = self._client.request(header, timeout_s=float(header["timeout_s"]) + 5)
        except ServiceError as exc:
            raise HvdliteTimeoutError(f"rendezvous: {what}: {exc}") from None
        if "superseded" in reply:
            self.superseded_by = int(reply["superseded"])
            raise HvdliteRoundSupersededError(
                f"rendezvous: round {self.round} was replaced by round {self.superseded_by} "
                f"while {what}",
                self.superseded_by,
            )
        return out

    def set(self, key: str, value: bytes) -> None:
        self._client.request({"op": "set", "key": self._k(key)}, bytes(value))

    def get(self, key: str) -> bytes:
        return self._blocking(
            {"op": "get", "key": self._k(key), "timeout_s": self.timeout_s},
            f"waiting for key {key!r}",
        )

    def add(self, key: str, amount: int) -> int:
        reply, _ = self._client.request({"op": "add", "key": self._k(key), "amount": int(amount)})
        return int(reply["value"])

    def check(self, keys: List[str]) -> bool:
        reply, _ = self._client.request({"op": "check", "keys": [self._k(k) for k in keys]})
        return bool(reply["present"])

    def wait(self, keys: List[str], timeout_s: Optional[float] = None) -> None:
        t = self.timeout_s if timeout_s is None else timeout_s
        self._blocking(
            {"op": "wait", "keys": [self._k(k) for k in keys], "timeout_s": t},
            f"waiting for keys {list(keys)[:5]}",
        )

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        _, out = self._client.request(
            {
                "op": "compare_set",
                "key": self._k(key),
                "expected": base64.b64encode(bytes(expected)).decode(),
            },
            bytes(desired),
        )
        return out

    def delete(self, key: str) -> bool:
        reply, _ = self._client.request({"op": "delete", "key": self._k(key)})
        return bool(reply["deleted"])

    def num_keys(self) -> int:
        reply, _ = self._client.request({"op": "num_keys"})
        return int(reply["value"])

    def join_round(self, after: int, hostname: str, local_rank: int, timeout_s: float) -> Placement:
        """Join the first round newer than ``after`` that has a place for this host's
        ``local_rank`` slot; blocks until the launcher opens one.

        Raises:
            HvdliteTimeoutError: no such round within ``timeout_s``.
            HvdliteRemovedError: the newest round has no place for this slot (its host
                left the job, or this process is stale).
        """
        header = {
            "op": "join_round",
            "after": int(after),
            "hostname": hostname,
            "local_rank": int(local_rank),
            "timeout_s": float(timeout_s),
            "token": PROCESS_TOKEN,
        }
        try:
            reply, _ = self._client.request(header, timeout_s=float(timeout_s) + 5)
        except ServiceError as exc:
            raise HvdliteTimeoutError(
                f"rendezvous: host {hostname} slot {local_rank} could not join a round after "
                f"round {after}: {exc}"
            ) from None
        if "removed" in reply:
            raise HvdliteRemovedError(
                f"rendezvous: {reply['removed']}; this process must leave the job"
            )
        return Placement(int(reply["round"]), *(int(reply[f]) for f in PLACE_FIELDS))

    def newest_round(self) -> int:
        """The newest round the launcher has opened (-1: none yet)."""
        reply, _ = self._client.request({"op": "newest_round"})
        return int(reply["round"])

    def await_round(self, after: int, timeout_s: float) -> int:
        """The newest round, answered as soon as it is newer than ``after`` or once
        ``timeout_s`` has passed."""
        reply, _ = self._client.request(
            {"op": "await_round", "after": int(after), "timeout_s": float(timeout_s)},
            timeout_s=float(timeout_s) + 5,
        )
        return int(reply["round"])

    def close(self) -> None:
        self._client.close()
