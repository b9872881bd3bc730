"""The key-value store workers rendezvous through, served by the launcher.

Unlike an open ``TCPStore``, every request is authenticated with the job's key
(see :mod:`hvdlite.runner.secure`): a process without the key can neither read
nor write.  The worker side wraps :class:`KVClient` into a
``torch.distributed.Store`` (``hvdlite.common.backend.gloo``); this module
itself needs no torch.
"""

import base64
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple

from hvdlite.common.exceptions import HvdliteTimeoutError
from hvdlite.runner.service import Client, Service, ServiceError


class KVStoreService(Service):
    """In-memory store: set/get/add/check/wait/compare_set/delete/num_keys.

    ``get`` and ``wait`` block until the keys exist or the request's
    ``timeout_s`` passes, then answer with an error naming the missing keys.
    """

    def __init__(self, key: bytes, bind_addr: str = "127.0.0.1", port: int = 0):
        self._data: Dict[str, bytes] = {}
        self._cond = threading.Condition()
        super().__init__("rendezvous store", key, bind_addr, port)

    def _wait_for(self, keys: Sequence[str], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                missing = [k for k in keys if k not in self._data]
                if not missing:
                    return
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
        if op == "get":
            self._wait_for([key], float(header["timeout_s"]))
            with self._cond:
                return {}, self._data[key]
        if op == "wait":
            self._wait_for(header["keys"], float(header["timeout_s"]))
            return {}, b""
        raise ServiceError(f"unknown store operation {op!r}")


class KVClient:
    """Client of :class:`KVStoreService`; keys are namespaced by ``prefix``.

    Blocking calls (``get``, ``wait``) are bounded by ``timeout_s`` and raise
    :class:`HvdliteTimeoutError` naming the key.
    """

    def __init__(self, addr: Tuple[str, int], key: bytes, timeout_s: float, prefix: str = ""):
        self._client = Client(addr, key, timeout_s, name="rendezvous store")
        self.timeout_s = timeout_s
        self.prefix = prefix

    def _k(self, key: str) -> str:
        return self.prefix + key

    def _blocking(self, header, what: str) -> bytes:
        # the store answers (with an error) once the wait's own timeout passes; allow for that
        try:
            _, out = self._client.request(header, timeout_s=float(header["timeout_s"]) + 5)
        except ServiceError as exc:
            raise HvdliteTimeoutError(f"rendezvous: {what}: {exc}") from None
        return out

    def set(self, key: str, value: bytes) -> None:
        self._client.request({"op": "set", "key": self._k(key)}, bytes(value))

    def get(self, key: str) -> bytes:
        return self._blocking({"op": "get", "key": self._k(key), "timeout_s": self.timeout_s},
                              f"waiting for key {key!r}")

    def add(self, key: str, amount: int) -> int:
        reply, _ = self._client.request({"op": "add", "key": self._k(key), "amount": int(amount)})
        return int(reply["value"])

    def check(self, keys: List[str]) -> bool:
        reply, _ = self._client.request({"op": "check", "keys": [self._k(k) for k in keys]})
        return bool(reply["present"])

    def wait(self, keys: List[str], timeout_s: Optional[float] = None) -> None:
        t = self.timeout_s if timeout_s is None else timeout_s
        self._blocking({"op": "wait", "keys": [self._k(k) for k in keys], "timeout_s": t},
                       f"waiting for keys {list(keys)[:5]}")

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        _, out = self._client.request(
            {"op": "compare_set", "key": self._k(key),
             "expected": base64.b64encode(bytes(expected)).decode()}, bytes(desired))
        return out

    def delete(self, key: str) -> bool:
        reply, _ = self._client.request({"op": "delete", "key": self._k(key)})
        return bool(reply["deleted"])

    def num_keys(self) -> int:
        reply, _ = self._client.request({"op": "num_keys"})
        return int(reply["value"])

    def close(self) -> None:
        self._client.close()
