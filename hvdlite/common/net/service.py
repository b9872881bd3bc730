"""A small authenticated request/response server and its client.

Subclasses of :class:`Service` implement :meth:`Service.handle`; everything
else (listening, the per-connection nonce, HMAC checks, rejecting and logging
bad frames) lives here once.  The launcher's driver, task service and
rendezvous store are all built on it; workers use :class:`Client` (through
:mod:`hvdlite.common.net.kv`).
"""

import abc
import errno
import logging
import random
import selectors
import socket
import struct
import threading
import time
from typing import Any, Dict, Optional, Tuple

from hvdlite.common.exceptions import HvdliteAuthError, HvdliteError, HvdliteTimeoutError
from hvdlite.common.net import limits, preauth
from hvdlite.common.net.framing import ChannelClosed, SecureChannel

log = logging.getLogger(__name__)

Header = Dict[str, Any]

#: accept() failures that mean "out of descriptors or memory": back off, then retry
_RESOURCE_ERRNOS = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}


class ServiceError(HvdliteError):
    """The service answered a request with an error; the message is the service's."""


def is_int(x) -> bool:
    """Whether a decoded request field is an integer (JSON's ``true`` is a bool, not 1)."""
    return isinstance(x, int) and not isinstance(x, bool)


class Service(abc.ABC):
    """A TCP server that answers authenticated requests.

    A new connection first has to prove the key with a small hello frame within
    ``preauth_timeout_s``.  Until then it costs no thread: the accept thread sends
    its nonce and reads its hello without blocking, in a bounded table
    (:mod:`hvdlite.common.net.preauth`; :mod:`hvdlite.common.net.limits` lists every
    bound a stranger meets).  When that table is full, the oldest waiting connection
    of the busiest source address is closed to make room, so idle strangers cannot
    keep our own clients out; authenticated connections are never closed for a
    newcomer.  Each authenticated connection is then served on its own thread,
    requests one at a time.  A frame that fails verification closes that connection
    and is noted in a rate-limited log; the service itself keeps running.

    ``expected_peers`` sizes the listen backlog and the connection caps for a job of
    that many processes.
    """

    def __init__(
        self,
        name: str,
        key: bytes,
        bind_addr: str = "127.0.0.1",
        port: int = 0,
        expected_peers: int = 0,
        max_connections: Optional[int] = None,
        max_unauthenticated: Optional[int] = None,
        preauth_timeout_s: float = limits.PREAUTH_TIMEOUT_S,
    ):
        self.name = name
        self._key = key
        self.rejected = 0  # frames that failed verification, for tests and logs
        #: connections refused at accept because a cap was reached
        self.refused = 0
        #: connections closed before their hello to make room for a newcomer
        self.evicted = 0
        self.rejections = limits.RejectLog(log, name)
        self._max_connections = max_connections or limits.max_connections_for(expected_peers)
        if max_unauthenticated is None:
            max_unauthenticated = limits.max_unauthenticated_default()
        # every rank of a big job may connect at the same moment: room for all of them
        self._max_unauth = max(max_unauthenticated, 2 * int(expected_peers))
        self._preauth_timeout_s = preauth_timeout_s
        self._pending = preauth.PreauthTable(
            per_source=max(self._max_unauth // 2, 2 * int(expected_peers), 1),
            min_age_s=limits.EVICT_MIN_AGE_S,
        )
        self._count_lock = threading.Lock()
        self._open_auth = 0
        self._backoff = limits.ACCEPT_BACKOFF_S[0]
        self._stopping = threading.Event()
        self._selector = selectors.DefaultSelector()
        family = socket.AF_INET6 if ":" in bind_addr else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((bind_addr, port))
            sock.listen(limits.backlog_for(expected_peers))
            sock.setblocking(False)  # accept only after the selector says so
            self._selector.register(sock, selectors.EVENT_READ)
        except OSError:
            sock.close()
            self._selector.close()
            raise
        self._sock: Optional[socket.socket] = sock
        self._address = sock.getsockname()[:2]
        # shutdown() writes here so the accept thread's select returns at once (a job's end
        # then waits for no select slice)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._thread = threading.Thread(
            target=self._accept_loop, name=f"{name}-service", daemon=True
        )
        self._thread.start()

    @property
    def address(self) -> Tuple[str, int]:
        return self._address

    @property
    def key(self) -> bytes:
        """The secret key this service verifies frames with: the launcher's side of the
        task services signs its own requests to them with the same key."""
        return self._key

    @abc.abstractmethod
    def handle(self, header: Header, blob: bytes, client: Tuple[str, int]) -> Tuple[Header, bytes]:
        """Answer one verified request.

        Runs on the connection's thread; may block (bounded by the request's
        own timeout).  Raise :class:`ServiceError` (or any ``HvdliteError``,
        ``ValueError``, ``KeyError``, ``TypeError``) to send an error answer naming
        it; the connection stays open.
        """

    # -- the accept thread: new connections and their hellos -------------------------------

    def _accept_loop(self) -> None:
        listener = self._sock
        try:
            while not self._stopping.is_set():
                due = self._pending.next_deadline(self._preauth_timeout_s)
                wait = 0.2 if due is None else min(0.2, max(0.0, due - time.monotonic()))
                ready = self._selector.select(wait)
                accept = False
                for key, _ in ready:
                    if key.fileobj is self._wake_r:
                        continue
                    if key.fileobj is listener:
                        accept = True
                        continue
                    pending = self._pending.get(key.fd)
                    if pending is not None:
                        self._read_hello(pending)
                if accept and listener is not None:
                    self._accept_some(listener)
                self._expire()
        finally:
            for pending in self._pending:
                self._close_pending(pending, rst=True)
            self._selector.close()

    def _accept_some(self, listener: socket.socket) -> None:
        """Accept what is queued, a bounded number per turn (waiting hellos are read between
        turns, so a flood of connections does not starve them)."""
        for _ in range(limits.ACCEPTS_PER_TURN):
            try:
                conn, peer = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue
            except OSError as exc:
                if exc.errno in _RESOURCE_ERRNOS:
                    # the queued connection stays queued: sleep instead of spinning on it
                    self.rejections.note(
                        "(accept)",
                        f"accept failed ({exc.strerror}); backing off {self._backoff:.2f}s",
                    )
                else:
                    log.warning("%s: accept failed: %s", self.name, exc)
                self._stopping.wait(self._backoff)
                self._backoff = min(self._backoff * 2, limits.ACCEPT_BACKOFF_S[1])
                return
            self._backoff = limits.ACCEPT_BACKOFF_S[0]
            self._admit(conn, peer)

    def _admit(self, conn: socket.socket, peer) -> None:
        """Make room for ``conn`` in the table of waiting connections (closing the victim
        the table names), send it the nonce and wait for its hello; or refuse it."""
        now = time.monotonic()
        for _ in range(4):
            with self._count_lock:
                room = min(self._max_unauth, self._max_connections - self._open_auth)
            victim = self._pending.victim(peer[0], room, now)
            if victim is None:
                break
            if victim is preauth.REFUSE:
                return self._refuse(conn, peer)
            if self._read_hello(victim) is None:  # still no hello: it gives way
                self.evicted += 1
                self.rejections.note(
                    f"{victim.peer[0]}:{victim.peer[1]}",
                    "closed a connection still waiting for its hello, to make room for a new one",
                )
                self._close_pending(victim, rst=True)
        else:
            return self._refuse(conn, peer)
        try:
            conn.setblocking(False)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            chan = SecureChannel.accept(conn, self._key)  # 16 bytes: fits the empty buffer
            pending = preauth.Pending(conn, peer, chan, now)
            self._selector.register(conn, selectors.EVENT_READ)
        except OSError:
            _drop(conn)
            return
        self._pending.add(pending)

    def _refuse(self, conn: socket.socket, peer) -> None:
        self.refused += 1
        self.rejections.note(
            f"{peer[0]}:{peer[1]}", "refused a connection (too many open or unauthenticated)"
        )
        _drop(conn)

    def _read_hello(self, pending: preauth.Pending) -> Optional[bool]:
        """Read what ``pending`` sent so far, without blocking and never past its hello.

        Returns True once the hello is verified (the connection then gets its own
        thread), False when the connection is gone (closed, or a bad hello), None while
        the hello is incomplete.
        """
        while True:
            try:
                chunk = pending.sock.recv(pending.need - len(pending.buf))
            except (BlockingIOError, InterruptedError):
                return None
            except OSError:
                chunk = b""
            if not chunk:
                self._close_pending(pending)
                return False
            pending.buf += chunk
            if len(pending.buf) < pending.need:
                return None
            try:
                if pending.need == preauth.PREFIX_BYTES:
                    pending.need = SecureChannel.hello_size(bytes(pending.buf))
                    continue
                pending.chan.take_hello(bytes(pending.buf))
            except HvdliteAuthError as exc:
                self._reject(pending.peer, exc)
                self._close_pending(pending)
                return False
            self._promote(pending)
            return True

    def _expire(self) -> None:
        for pending in self._pending.expired(time.monotonic(), self._preauth_timeout_s):
            client = pending.peer
            self.rejections.note(
                f"{client[0]}:{client[1]}",
                f"closed a connection that did not prove the key within "
                f"{self._preauth_timeout_s:g}s",
            )
            self._close_pending(pending, rst=True)

    def _close_pending(self, pending: preauth.Pending, rst: bool = False) -> None:
        self._forget(pending)
        if rst:
            _drop(pending.sock)
        else:
            _close(pending.sock)

    def _forget(self, pending: preauth.Pending) -> None:
        self._pending.remove(pending)
        try:
            self._selector.unregister(pending.sock)
        except (KeyError, ValueError):
            pass

    def _promote(self, pending: preauth.Pending) -> None:
        """Give an authenticated connection its own thread (within ``max_connections``)."""
        self._forget(pending)
        with self._count_lock:
            full = self._open_auth >= self._max_connections
            if not full:
                self._open_auth += 1
        if full:
            return self._refuse(pending.sock, pending.peer)
        try:
            pending.sock.setblocking(True)
            threading.Thread(
                target=self._serve_connection,
                args=(pending.chan, pending.peer),
                name=f"{self.name}-conn",
                daemon=True,
            ).start()
        except (RuntimeError, OSError):  # no more threads: refuse this one
            with self._count_lock:
                self._open_auth -= 1
            _drop(pending.sock)

    # -- one thread per authenticated connection ------------------------------------------

    def _reject(self, client, exc: Exception) -> None:
        self.rejected += 1
        self.rejections.note(f"{client[0]}:{client[1]}", f"rejected a frame ({exc})")

    def _serve_connection(self, chan: SecureChannel, client) -> None:
        try:
            while True:
                try:
                    header, blob = chan.recv(timeout_s=None)
                except ChannelClosed:
                    return
                except HvdliteAuthError as exc:
                    self._reject(client, exc)
                    return
                except OSError:
                    return
                reply, out = self._answer(header, blob, client)
                try:
                    chan.send(reply, out)
                except OSError:
                    return
        finally:
            with self._count_lock:
                self._open_auth -= 1
            chan.close()

    def _answer(self, header: Header, blob: bytes, client) -> Tuple[Header, bytes]:
        try:
            reply, out = self.handle(header, blob, client)
            return dict(reply, ok=True), out
        except (HvdliteError, ValueError, KeyError, TypeError) as exc:
            return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}, b""
        except Exception as exc:  # a handler bug must not take the service down
            log.exception(
                "%s: handler failed on %r from %s", self.name, header.get("op"), client[0]
            )
            return {"ok": False, "error": f"internal error: {type(exc).__name__}"}, b""

    def shutdown(self) -> None:
        """Stop accepting, close the listening socket and the connections still waiting
        for their hello, and log the summary of rejections (idempotent)."""
        if self._sock is None:
            return
        sock, self._sock = self._sock, None
        self._stopping.set()
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._thread.join(timeout=5)
        for end in (sock, self._wake_r, self._wake_w):
            try:
                end.close()
            except OSError:
                pass
        self.rejections.flush()


def _close(conn: socket.socket) -> None:
    try:
        conn.close()
    except OSError:
        pass


def _drop(conn: socket.socket) -> None:
    """Close a refused connection at once (RST: no TIME_WAIT, the peer learns now)."""
    try:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    try:
        conn.close()
    except OSError:
        pass


class Client:
    """A connection to a :class:`Service`; one request at a time (thread-safe).

    Connecting is retried, with a growing pause, until ``timeout_s`` while the service
    drops us before its nonce (its caps were reached).  ``request`` reconnects once if
    the connection was dropped; requests that can be retried that way must be idempotent
    on the service side.
    """

    def __init__(self, addr: Tuple[str, int], key: bytes, timeout_s: float, name: str = "service"):
        self._addr = (addr[0], int(addr[1]))
        self._key = key
        self._timeout_s = timeout_s
        self._name = name
        self._chan: Optional[SecureChannel] = None
        self._lock = threading.Lock()

    #: first and longest pause (s) before connecting again after the service dropped us
    #: before its nonce (its table of waiting connections was full: a burst of ranks, or a
    #: flood of strangers); the pause doubles, with jitter, until the client's timeout
    RETRY_PAUSE_S = (0.05, 1.0)

    def _connect(self, timeout_s: Optional[float] = None) -> SecureChannel:
        """Connect within ``timeout_s`` (default: the client's timeout)."""
        timeout_s = self._timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        pause, tries = self.RETRY_PAUSE_S[0], 0
        try:
            while True:
                tries += 1
                left = max(0.05, deadline - time.monotonic())
                try:
                    return SecureChannel.connect(self._addr, self._key, left)
                except (ConnectionResetError, ChannelClosed) as exc:
                    if time.monotonic() + pause >= deadline:
                        raise ConnectionError(
                            f"{exc} ({tries} tries in {timeout_s:.0f}s)"
                        ) from None
                    time.sleep(pause * random.uniform(0.5, 1.0))
                    pause = min(pause * 2, self.RETRY_PAUSE_S[1])
        except socket.timeout:
            raise HvdliteTimeoutError(
                f"connecting to the {self._name} at {self._addr[0]}:{self._addr[1]} "
                f"timed out after {timeout_s:.0f}s"
            ) from None
        except OSError as exc:
            raise ConnectionError(
                f"cannot connect to the {self._name} at {self._addr[0]}:{self._addr[1]}: {exc}"
            ) from None

    def request(
        self, header: Header, blob: bytes = b"", timeout_s: Optional[float] = None
    ) -> Tuple[Header, bytes]:
        wait = self._timeout_s if timeout_s is None else timeout_s
        with self._lock:
            for attempt in (0, 1):
                if self._chan is None:  # a request's timeout bounds its connecting too
                    self._chan = self._connect(min(wait, self._timeout_s))
                try:
                    self._chan.send(header, blob)
                    reply, out = self._chan.recv(timeout_s=wait)
                    break
                except socket.timeout:
                    self.close_locked()
                    raise HvdliteTimeoutError(
                        f"no answer from the {self._name} at {self._addr[0]}:{self._addr[1]} "
                        f"to {header.get('op')!r} within {wait:.0f}s"
                    ) from None
                except (ChannelClosed, ConnectionError, BrokenPipeError):
                    self.close_locked()
                    if attempt:
                        raise ConnectionError(
                            f"the {self._name} at {self._addr[0]}:{self._addr[1]} closed the "
                            f"connection during {header.get('op')!r}"
                        ) from None
        if not reply.get("ok"):
            raise ServiceError(f"{self._name}: {reply.get('error')}")
        return reply, out

    def close_locked(self) -> None:
        if self._chan is not None:
            self._chan.close()
            self._chan = None

    def close(self) -> None:
        with self._lock:
            self.close_locked()
