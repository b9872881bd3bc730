"""An attacker without the key: idle connections, or junk frames, against a job's listeners.

Usage: flood.py --pid PID --cwd DIR --ready FILE --seconds S [--conns N] [--fuzz SEED]

Targets: the TCP ports the process PID listens on (the launcher: rendezvous store, driver)
and those of every task service whose working directory is DIR (the tests start the
launcher there; its tasks, local or over SSH, ``cd`` to it).  They are looked up again
every 50 ms, so a listener that starts later joins the attack.

Idle mode holds ``N`` connections per listener that never send a byte, opening another as
soon as one is closed.  ``--fuzz SEED`` instead sends random, truncated, replayed and
oversized frames on short connections (see ``frames()``), a few at a time.  Once every
listener found so far is under attack for 0.3 s, FILE is written (workers wait for it).
Ends after S seconds or when PID exits, and prints one JSON line: per port, connections
opened and closed by the listener, and (fuzz) frames sent and bytes answered; and under
"launcher" the first and highest descriptor, thread and memory counts of PID.
"""

import argparse
import collections
import errno
import hashlib
import hmac
import json
import os
import random
import resource
import selectors
import socket
import struct
import time

import psutil

from hvdlite.common import config as cfg

TASK_MODULE = "hvdlite.runner.tasks.task_service"
SECRET_ENV = cfg.SECRET_KEY
NONCE_BYTES = 16


def listeners(pid: int, cwd: str):
    """Where PID and the task services started in ``cwd`` listen (TCP over IPv4):
    (address, port) -> whose it is."""
    procs = []
    try:
        procs.append(psutil.Process(pid))
    except psutil.NoSuchProcess:
        return {}
    for p in psutil.process_iter(["cmdline"]):
        try:
            if TASK_MODULE in " ".join(p.info["cmdline"] or ()) and p.cwd() == cwd:
                procs.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    ports = {}
    for p in procs:
        try:
            conns = (
                p.net_connections(kind="tcp")
                if hasattr(p, "net_connections")
                else p.connections(kind="tcp")
            )
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        what = "task service" if p.pid != pid else "launcher"
        ports.update(
            (
                (c.laddr.ip if c.laddr.ip != "0.0.0.0" else "127.0.0.1", c.laddr.port),
                f"{what} (pid {p.pid}) on {c.laddr.ip}",
            )
            for c in conns
            if c.status == psutil.CONN_LISTEN and "." in c.laddr.ip
        )
    return ports


def sample(pid: int, peak) -> None:
    """Keep the launcher's most descriptors, threads and resident memory seen so far."""
    try:
        p = psutil.Process(pid)
        now = {
            "fds": p.num_fds(),
            "threads": p.num_threads(),
            "rss_mib": p.memory_info().rss // (1 << 20),
        }
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return
    for k, v in now.items():
        peak[f"{k}_first"] = peak.get(f"{k}_first", v)
        peak[f"{k}_max"] = max(peak[f"{k}_max"], v)


def job_key(pid: int):
    """The job key from a local rank's initial environment (``/proc/PID/environ``, which the
    same user may read): with it we forge what an eavesdropper could replay, frames signed
    for other connections, never one for the connection they are sent on."""
    try:
        kids = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return None
    for p in kids:
        try:
            value = p.environ().get(SECRET_ENV)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if value:
            return bytes.fromhex(value)
    return None


def signed(key: bytes, nonce: bytes, seq: int, header: dict) -> bytes:
    head = json.dumps(header).encode()
    body = struct.pack("!I", len(head)) + head
    mac = hmac.new(key, b"C" + nonce + struct.pack("!Q", seq) + body, hashlib.sha256).digest()
    return struct.pack("!I", len(body)) + mac + body


KINDS = [
    "random",
    "truncated",
    "oversized",
    "huge",
    "flipped",
    "replayed_hello",
    "replayed_request",
    "hello_then_replay",
]


def junk(rng: random.Random, key, nonce: bytes, other_nonce: bytes):
    """One message no listener may answer: random bytes, a truncated, oversized or
    bit-flipped frame, a huge declared length, or (with the key) a hello or request signed
    for another connection, or a valid hello followed by a frame replayed from another
    connection."""
    kind = rng.choice(KINDS if key else KINDS[:5])
    body = os.urandom(rng.randrange(0, 200))
    frame = struct.pack("!I", len(body)) + os.urandom(32) + body
    if kind == "random":
        return kind, os.urandom(rng.randrange(1, 400))
    if kind == "truncated":
        return kind, frame[: rng.randrange(1, len(frame))]
    if kind == "oversized":
        return kind, struct.pack("!I", 2048) + os.urandom(2048 + 32)
    if kind == "huge":
        return kind, struct.pack("!I", 0xFFFFFFF0) + os.urandom(64)
    if kind == "flipped":
        flipped = bytearray(frame)
        flipped[rng.randrange(len(flipped))] ^= 1 << rng.randrange(8)
        return kind, bytes(flipped)
    if kind == "replayed_hello":
        return kind, signed(key, other_nonce, 0, {"hello": 1})
    if kind == "replayed_request":
        return kind, signed(key, other_nonce, 1, {"op": "ping"})
    return kind, signed(key, nonce, 0, {"hello": 1}) + signed(key, other_nonce, 1, {"op": "ping"})


class Attack:
    def __init__(self, pid: int, conns: int, fuzz_seed):
        self.pid = pid
        self.conns = conns
        self.rng = random.Random(fuzz_seed) if fuzz_seed is not None else None
        self.key = None
        self.sel = selectors.DefaultSelector()
        self.stats = collections.defaultdict(collections.Counter)
        self.live = collections.Counter()
        self.since = {}
        #: fuzz: socket -> [nonce bytes so far, when the junk was sent or None]
        self.state = {}
        self.last_nonce = os.urandom(NONCE_BYTES)

    def open(self, port) -> None:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setblocking(False)
        err = s.connect_ex(port)
        if err not in (0, errno.EINPROGRESS):
            s.close()
            self.stats[port]["connect_failed"] += 1
            return
        self.sel.register(s, selectors.EVENT_READ, port)
        self.state[s] = [b"", None]
        self.live[port] += 1
        self.stats[port]["opened"] += 1

    def close(self, s, port: int, by_listener: bool) -> None:
        self.sel.unregister(s)
        del self.state[s]
        s.close()
        self.live[port] -= 1
        self.stats[port]["closed_by_listener" if by_listener else "closed_by_us"] += 1

    def on_readable(self, s, port: int) -> None:
        try:
            data = s.recv(65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            return self.close(s, port, by_listener=True)
        st = self.state[s]
        if len(st[0]) < NONCE_BYTES:
            take = NONCE_BYTES - len(st[0])
            st[0] += data[:take]
            data = data[take:]
        if data:
            self.stats[port]["answered_bytes"] += len(data)  # must stay 0
        if self.rng is not None and len(st[0]) == NONCE_BYTES and st[1] is None:
            kind, msg = junk(self.rng, self.key, st[0], self.last_nonce)
            self.last_nonce = st[0]
            try:
                s.sendall(msg)
                self.stats[port][f"sent_{kind}"] += 1
            except OSError:
                pass
            st[1] = time.monotonic()

    def sweep(self) -> None:
        """Fuzz: close our end of connections the listener kept 0.2 s after the junk."""
        now = time.monotonic()
        for s, (_, sent) in list(self.state.items()):
            if sent is not None and now - sent > 0.2:
                self.close(s, self.sel.get_key(s).data, by_listener=False)

    def top_up(self, ports) -> None:
        now = time.monotonic()
        for port in ports:
            self.since.setdefault(port, now)
            while self.live[port] < self.conns:
                self.open(port)
        if self.rng is not None and self.key is None:
            self.key = job_key(self.pid)

    def under_attack(self, ports) -> bool:
        now = time.monotonic()
        return bool(ports) and all(now - self.since.get(p, now) >= 0.3 for p in ports)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pid", type=int, required=True)
    ap.add_argument("--cwd", required=True)
    ap.add_argument("--ready", required=True)
    ap.add_argument("--seconds", type=float, required=True)
    ap.add_argument("--conns", type=int, default=1000)
    ap.add_argument("--fuzz", type=int)
    a = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, a.conns * 6 + 256)
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    attack = Attack(a.pid, a.conns, a.fuzz)
    end = time.monotonic() + a.seconds
    ports, where, next_look, ready = set(), {}, 0.0, False
    peak = collections.Counter()
    while time.monotonic() < end:
        if time.monotonic() >= next_look:
            if not psutil.pid_exists(a.pid):
                break
            found = listeners(a.pid, a.cwd)
            sample(a.pid, peak)
            where.update(found)
            ports = set(found)  # a listener that is gone is left alone
            next_look = time.monotonic() + 0.05
        attack.top_up(ports)
        if not ready and attack.under_attack(ports):
            with open(a.ready, "w") as f:
                f.write(" ".join(map(str, sorted(ports))))
            ready = True
        for key, _ in attack.sel.select(0.05):
            attack.on_readable(key.fileobj, key.data)
        if attack.rng is not None:
            attack.sweep()
    out = {f"{p[0]}:{p[1]}": dict(c, where=where.get(p, "?")) for p, c in attack.stats.items()}
    out["launcher"] = dict(peak)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
