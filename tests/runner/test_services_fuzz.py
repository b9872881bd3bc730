"""Driver, task service and rendezvous store under forged, unsigned, truncated,
replayed and malformed frames: each is rejected, nothing changes, the service stays up."""

import hashlib
import hmac
import os
import random
import socket
import struct
import threading
import time

import pytest

from hvdlite.common.exceptions import HvdliteError
from hvdlite.common.net.framing import NONCE_BYTES, SecureChannel, encode_body, new_key
from hvdlite.common.net.kv import KVClient
from hvdlite.common.net.service import Client, ServiceError
from hvdlite.runner.tasks.driver_service import DriverService
from hvdlite.runner.store.rendezvous import KVStoreService
from hvdlite.runner.tasks.task_service import TaskService

pytestmark = pytest.mark.timeout(600)
#: unauthenticated / mutated frames per listener: a CI-sized run by default; set
#: HVD_FUZZ_FRAMES=10000 (e.g. ``HVD_FUZZ_FRAMES=10000 make test``) for the full run
N_RAW = int(os.environ.get("HVD_FUZZ_FRAMES", "1200"))
N_AUTH = 300  # authenticated but malformed requests per service
HELLO = {"hello": 1}


def _frame(key, nonce, seq, header, blob=b""):
    body = encode_body(header, blob)
    mac = hmac.new(key, b"C" + nonce + struct.pack("!Q", seq) + body, hashlib.sha256).digest()
    return struct.pack("!I", len(body)) + mac + body


def _connect(addr):
    s = socket.create_connection(addr, timeout=5)
    nonce = b""
    while len(nonce) < NONCE_BYTES:
        chunk = s.recv(NONCE_BYTES - len(nonce))
        if not chunk:
            break
        nonce += chunk
    return s, nonce


def _mutations(rng, key, valid_header):
    """Yield (kind, builder(nonce) -> bytes, replies a correct service sends).

    Half of the attacks come before the hello (a stranger), half after a valid hello (a
    connection that proved the key once, then sends forged frames).
    """
    other_nonce = os.urandom(NONCE_BYTES)
    wrong_key = new_key()
    kinds = [
        "random",
        "flip",
        "truncate",
        "replay_other_conn",
        "wrong_key",
        "unsigned",
        "replay_same_conn",
        "huge_length",
        "seq_skip",
        "big_before_hello",
        "hello_replayed",
    ]
    for _ in range(N_RAW):
        kind = rng.choice(kinds)
        after_hello = rng.random() < 0.5
        seq = 1 if after_hello else 0

        def pre(n, after_hello=after_hello):
            return _frame(key, n, 0, HELLO) if after_hello else b""

        if kind == "random":
            data = os.urandom(rng.randrange(0, 300))
            yield kind, lambda n, d=data, p=pre: p(n) + d, 0
        elif kind == "flip":
            pos, bit = rng.randrange(0, 10_000), rng.randrange(8)

            def b(n, pos=pos, bit=bit, seq=seq, p=pre):
                f = bytearray(_frame(key, n, seq, valid_header))
                f[pos % len(f)] ^= 1 << bit
                return p(n) + bytes(f)

            yield kind, b, 0
        elif kind == "truncate":
            cut = rng.randrange(1, 60)
            yield (
                kind,
                lambda n, c=cut, seq=seq, p=pre: p(n) + _frame(key, n, seq, valid_header)[:-c],
                0,
            )
        elif kind == "replay_other_conn":
            yield (
                kind,
                lambda n, seq=seq, p=pre: p(n) + _frame(key, other_nonce, seq, valid_header),
                0,
            )
        elif kind == "wrong_key":
            yield kind, lambda n, seq=seq, p=pre: p(n) + _frame(wrong_key, n, seq, valid_header), 0
        elif kind == "unsigned":
            yield (
                kind,
                lambda n, p=pre: (
                    p(n)
                    + (
                        struct.pack("!I", len(encode_body(valid_header)))
                        + b"\0" * 32
                        + encode_body(valid_header)
                    )
                ),
                0,
            )
        elif kind == "replay_same_conn":
            # hello, a valid ping, then the same ping again: one answer, then refused
            yield (
                kind,
                lambda n: _frame(key, n, 0, HELLO) + _frame(key, n, 1, {"op": "ping"}) * 2,
                1,
            )
        elif kind == "huge_length":
            yield kind, lambda n, p=pre: p(n) + struct.pack("!I", 0xFFFFFFF0) + os.urandom(40), 0
        elif kind == "big_before_hello":
            # a correctly signed but large first frame: refused before its body is read
            yield kind, lambda n: _frame(key, n, 0, {"op": "ping", "pad": "x" * 4096}), 0
        elif kind == "hello_replayed":
            yield kind, lambda n: _frame(key, n, 0, HELLO) * 2, 0
        else:
            yield kind, lambda n, p=pre: p(n) + _frame(key, n, 5, valid_header), 0


_JUNK = [None, 1.5, -1, 2**70, [], {}, [1, "a"], True, {"a": [None]}, [[1, 2, 3]], ""]


def _auth_junk(rng, ops, fields):
    header = {"op": rng.choice(ops + ["", "nope", None, 7])}
    for f in fields:
        if rng.random() < 0.8:
            header[f] = rng.choice(_JUNK)
    return header


def _frames_from(sock):
    """Read everything the service sends until it closes; count the reply frames."""
    data = b""
    try:
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    except (socket.timeout, OSError):
        pass
    frames = 0
    while len(data) >= 4:
        (length,) = struct.unpack("!I", data[:4])
        if len(data) < 4 + 32 + length:
            break
        data = data[4 + 32 + length :]
        frames += 1
    return frames


#: per listener: (frames sent, answers a correct service gives, answers seen)
RESULTS = {}


def _hammer(name, addr, key, valid_header, ops, fields, seed):
    rng = random.Random(seed)
    sent = expected = answered = 0
    for kind, build, replies in _mutations(rng, key, valid_header):
        s, nonce = _connect(addr)
        try:
            try:
                s.sendall(build(nonce))
                s.shutdown(socket.SHUT_WR)
            except OSError:  # the service already dropped us: fine
                continue
            finally:
                sent += 1
                expected += replies
            s.settimeout(2)
            answered += _frames_from(s)
        finally:
            s.close()
    RESULTS[name] = (sent, expected, answered)
    print(
        f"fuzz {name}: {sent} frames, {answered} answered, {expected} expected "
        f"(the valid ping of each replay pair)"
    )
    assert answered == expected, f"{name} answered a forged frame"
    # authenticated but malformed: an error reply each, connection stays usable
    chan = SecureChannel.connect(addr, key, 5)
    errors = 0
    for _ in range(N_AUTH):
        chan.send(_auth_junk(rng, ops, fields), os.urandom(rng.randrange(0, 8)))
        reply, _ = chan.recv(timeout_s=5)
        errors += not reply.get("ok")
    chan.close()
    return errors


def _wait_rejected(service, at_least, timeout_s=10):
    deadline = time.monotonic() + timeout_s
    while service.rejected < at_least and time.monotonic() < deadline:
        time.sleep(0.05)
    return service.rejected


def test_fuzz_rendezvous_store():
    key = new_key()
    store = KVStoreService(key)
    try:
        kv = KVClient(store.address, key, timeout_s=5, prefix="job/")
        kv.set("a", b"1")
        kv.add("n", 5)
        before = dict(store._data)
        errors = _hammer(
            "rendezvous store",
            store.address,
            key,
            {"op": "set", "key": "job/a", "x": 1},
            ["set", "get", "add", "check", "wait", "compare_set", "delete", "num_keys"],
            ["key", "keys", "amount", "timeout_s", "expected"],
            1,
        )
        assert errors > N_AUTH * 0.6
        assert _wait_rejected(store, N_RAW // 2) >= N_RAW // 2
        assert dict(store._data) == before
        assert kv.get("a") == b"1" and kv.add("n", 1) == 6  # still serving
        # a process without the key can neither read nor write
        with pytest.raises((ConnectionError, OSError, Exception)):
            KVClient(store.address, new_key(), timeout_s=2).get("job/a")
        assert dict(store._data) == {**before, "job/n": b"6"}
    finally:
        store.shutdown()


def test_fuzz_driver():
    key = new_key()
    drv = DriverService(key, "jobx", bind_addr="127.0.0.1")
    try:
        # no host yet: every worker_exit and register names a host index out of range
        errors = _hammer(
            "driver",
            drv.address,
            key,
            {"op": "worker_exit", "host_index": 0, "local_rank": 0, "code": 9},
            ["register", "worker_exit", "ping"],
            ["host_index", "hostname", "nics", "port", "driver_reachable", "local_rank", "code"],
            2,
        )
        assert errors > N_AUTH * 0.6
        assert _wait_rejected(drv, N_RAW // 2) >= N_RAW // 2
        assert drv.registrations == {} and drv.slot_exits == []
        assert drv.add_host("h0") == 0 and drv.add_host("h1") == 1
        c = Client(drv.address, key, 5, name="driver")
        assert c.request({"op": "ping"})[0]["job_id"] == "jobx"
        with pytest.raises(ServiceError, match="local_rank"):
            c.request({"op": "worker_exit", "host_index": 0, "local_rank": -1, "code": 0})
        with pytest.raises(ServiceError, match="hostname does not match"):
            c.request(
                {
                    "op": "register",
                    "host_index": 1,
                    "hostname": "h0",
                    "nics": {},
                    "port": 5,
                    "driver_reachable": [],
                }
            )
        c.request({"op": "worker_exit", "host_index": 1, "local_rank": 0, "code": 0})
        assert drv.slot_exits == [(("h1", 0), 0)]
        c.close()
    finally:
        drv.shutdown()


def test_fuzz_task_service():
    key = new_key()
    calls = []
    task = TaskService(
        key,
        "joby",
        0,
        on_run=lambda *a: calls.append(("run", a)),
        on_terminate=lambda: calls.append(("terminate",)),
        bind_addr="127.0.0.1",
    )
    try:
        errors = _hammer(
            "task service",
            task.address,
            key,
            {"op": "terminate"},
            ["run", "probe", "ping", "py_spy"],
            ["slots", "command", "env", "targets", "expect_host_index", "timeout_s"],
            3,
        )
        assert errors > N_AUTH * 0.6
        assert _wait_rejected(task, N_RAW // 2) >= N_RAW // 2
        assert calls == []
        c = Client(task.address, key, 5, name="task")
        assert c.request({"op": "ping"})[0]["host_index"] == 0
        # the probe checks identity: it reaches itself as host 0, not as host 1
        target = [["lo", "127.0.0.1", task.address[1]]]
        assert c.request(
            {"op": "probe", "targets": target, "expect_host_index": 0, "timeout_s": 2}
        )[0]["reachable"] == ["lo"]
        assert (
            c.request({"op": "probe", "targets": target, "expect_host_index": 1, "timeout_s": 2})[
                0
            ]["reachable"]
            == []
        )
        c.close()
    finally:
        task.shutdown()


class _SilentFirst:
    """A TCP proxy to ``target`` that holds its first ``silent`` connections open without a
    word, as a lossy link does with a ping whose packets it drops."""

    def __init__(self, target, silent: int):
        self.target, self.silent, self.held = target, silent, []
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            if len(self.held) < self.silent:
                self.held.append(conn)
                continue
            up = socket.create_connection(self.target)
            for a, b in ((conn, up), (up, conn)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src, dst):
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self):
        self.sock.close()
        for c in self.held:
            c.close()


def test_a_probe_tries_a_silent_interface_again():
    """One ping lost on a lossy link must not rule out the only interface between two
    hosts: with ``attempts`` the probe asks again; without, the silence is an answer."""
    key = new_key()
    task = TaskService(
        key, "joby", 0, on_run=lambda *a: None, on_terminate=lambda: None, bind_addr="127.0.0.1"
    )
    proxy = _SilentFirst(task.address, silent=2)
    try:
        c = Client(task.address, key, 10, name="task")
        target = [["eth9", "127.0.0.1", proxy.port]]
        probe = {"op": "probe", "targets": target, "expect_host_index": 0, "timeout_s": 0.5}
        assert c.request(probe, timeout_s=5)[0]["reachable"] == []
        assert c.request({**probe, "attempts": 3}, timeout_s=5)[0]["reachable"] == ["eth9"]
        assert len(proxy.held) == 2
        with pytest.raises(HvdliteError, match="attempts"):
            c.request({**probe, "attempts": 9}, timeout_s=5)
        c.close()
    finally:
        proxy.close()
        task.shutdown()
