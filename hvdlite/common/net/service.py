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
import select
import socket
import struct
import threading
import time
from typing import Any, Dict, Optional, Set, Tuple

from hvdlite.common.exceptions import HvdliteAuthError, HvdliteError, HvdliteTimeoutError
from hvdlite.common.net import limits
from hvdlite.common.net.framing import ChannelClosed, SecureChannel

log = logging.getLogger(__name__)

Header = Dict[str, Any]

#: accept() failures that mean "out of descriptors or memory": back off, then retry
_RESOURCE_ERRNOS = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}


class ServiceError(HvdliteError):
    """The service answered a request with an error; the message is the service's."""


class Service(abc.ABC):
    """A TCP server that answers authenticated requests.

    Each connection is served on its own thread, requests on one connection
    one at a time.  A new connection first has to prove the key with a small
    hello frame within ``preauth_timeout_s`` (see :mod:`hvdlite.common.net.limits`
    for every bound a stranger meets); a frame that fails verification closes
    that connection and is noted in a rate-limited log; the service itself keeps
    running.  Connections over ``max_connections``, or over ``max_unauthenticated``
    (at least two per expected peer) still waiting for their hello, are refused at
    accept; :class:`Client` connects again when that happens.

    ``expected_peers`` sizes the listen backlog and the connection cap for a job of
    that many processes.
    """

    def __init__(self, name: str, key: bytes, bind_addr: str = "127.0.0.1", port: int = 0,
                 expected_peers: int = 0, max_connections: Optional[int] = None,
                 max_unauthenticated: int = limits.MAX_UNAUTHENTICATED,
                 preauth_timeout_s: float = limits.PREAUTH_TIMEOUT_S):
        self.name = name
        self._key = key
        self.rejected = 0          # frames that failed verification, for tests and logs
        #: connections refused at accept because a cap was reached
        self.refused = 0
        self.rejections = limits.RejectLog(log, name)
        self._max_connections = max_connections or limits.max_connections_for(expected_peers)
        # every rank of a big job may connect at the same moment: room for all of them
        self._max_unauth = max(max_unauthenticated, 2 * int(expected_peers))
        self._preauth_timeout_s = preauth_timeout_s
        self._count_lock = threading.Lock()
        self._open = 0
        self._unauth = 0
        self._conns: Set[socket.socket] = set()
        self._stopping = threading.Event()
        family = socket.AF_INET6 if ":" in bind_addr else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((bind_addr, port))
            sock.listen(limits.backlog_for(expected_peers))
            sock.setblocking(False)            # accept only after poll says so
        except OSError:
            sock.close()
            raise
        self._sock: Optional[socket.socket] = sock
        self._address = sock.getsockname()[:2]
        self._thread = threading.Thread(target=self._accept_loop,
                                        name=f"{name}-service", daemon=True)
        self._thread.start()

    @property
    def address(self) -> Tuple[str, int]:
        return self._address

    @abc.abstractmethod
    def handle(self, header: Header, blob: bytes, client: Tuple[str, int]) -> Tuple[Header, bytes]:
        """Answer one verified request.

        Runs on the connection's thread; may block (bounded by the request's
        own timeout).  Raise :class:`ServiceError` (or any ``HvdliteError``,
        ``ValueError``, ``KeyError``, ``TypeError``) to send an error answer naming
        it; the connection stays open.
        """

    def _accept_loop(self) -> None:
        backoff = limits.ACCEPT_BACKOFF_S[0]
        sock = self._sock
        poller = select.poll()              # not select(): descriptors may exceed 1024
        poller.register(sock, select.POLLIN)
        while not self._stopping.is_set():
            try:
                ready = poller.poll(200)
            except (OSError, ValueError):          # closed under us by shutdown()
                return
            if not ready:
                continue
            try:
                conn, peer = sock.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                continue
            except OSError as exc:
                if self._stopping.is_set():
                    return
                if exc.errno in _RESOURCE_ERRNOS:
                    # the queued connection stays queued: sleep instead of spinning on it
                    self.rejections.note("(accept)", f"accept failed ({exc.strerror}); "
                                         f"backing off {backoff:.2f}s")
                    self._stopping.wait(backoff)
                    backoff = min(backoff * 2, limits.ACCEPT_BACKOFF_S[1])
                    continue
                log.warning("%s: accept failed: %s", self.name, exc)
                self._stopping.wait(backoff)
                continue
            backoff = limits.ACCEPT_BACKOFF_S[0]
            with self._count_lock:
                full = (self._open >= self._max_connections
                        or self._unauth >= self._max_unauth)
                if not full:
                    self._open += 1
                    self._unauth += 1
                    self._conns.add(conn)
            if full:
                self.refused += 1
                self.rejections.note(f"{peer[0]}:{peer[1]}",
                                     "refused a connection (too many open or unauthenticated)")
                _drop(conn)
                continue
            try:
                threading.Thread(target=self._serve_connection_counted, args=(conn, peer),
                                 name=f"{self.name}-conn", daemon=True).start()
            except RuntimeError:                   # no more threads: refuse this one
                self._release(conn, authenticated=False)
                _drop(conn)

    def _release(self, conn: socket.socket, authenticated: bool) -> None:
        with self._count_lock:
            if conn in self._conns:
                self._conns.discard(conn)
                self._open -= 1
                if not authenticated:
                    self._unauth -= 1

    def _serve_connection_counted(self, sock: socket.socket, client) -> None:
        state = {"authenticated": False}
        try:
            self._serve_connection(sock, client, state)
        finally:
            self._release(sock, state["authenticated"])
            try:
                sock.close()
            except OSError:
                pass

    def _reject(self, client, exc: Exception) -> None:
        self.rejected += 1
        self.rejections.note(f"{client[0]}:{client[1]}", f"rejected a frame ({exc})")

    def _serve_connection(self, sock: socket.socket, client, state) -> None:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            chan = SecureChannel.accept(sock, self._key)
            chan.expect_hello(self._preauth_timeout_s)
        except HvdliteAuthError as exc:
            self._reject(client, exc)
            return
        except socket.timeout:
            self.rejections.note(f"{client[0]}:{client[1]}",
                                 f"closed a connection that did not prove the key within "
                                 f"{self._preauth_timeout_s:g}s")
            return
        except OSError:                           # ChannelClosed included
            return
        with self._count_lock:
            self._unauth -= 1
        state["authenticated"] = True
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
            try:
                reply, out = self.handle(header, blob, client)
                reply = dict(reply, ok=True)
            except (HvdliteError, ValueError, KeyError, TypeError) as exc:
                reply, out = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}, b""
            except Exception as exc:  # a handler bug must not take the service down
                log.exception("%s: handler failed on %r from %s", self.name,
                              header.get("op"), client[0])
                reply, out = {"ok": False, "error": f"internal error: {type(exc).__name__}"}, b""
            try:
                chan.send(reply, out)
            except OSError:
                return

    def shutdown(self) -> None:
        """Stop accepting, close the listening socket and log the summary of rejections
        (idempotent)."""
        if self._sock is None:
            return
        sock, self._sock = self._sock, None
        self._stopping.set()
        self._thread.join(timeout=5)
        try:
            sock.close()
        except OSError:
            pass
        self.rejections.flush()


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

    ``request`` reconnects once if the connection was dropped; requests that
    can be retried that way must be idempotent on the service side.
    """

    def __init__(self, addr: Tuple[str, int], key: bytes, timeout_s: float, name: str = "service"):
        self._addr = (addr[0], int(addr[1]))
        self._key = key
        self._timeout_s = timeout_s
        self._name = name
        self._chan: Optional[SecureChannel] = None
        self._lock = threading.Lock()

    #: pauses before connecting again when the service dropped us before its nonce (it was
    #: at its connection cap, e.g. while many ranks connect at once)
    _RETRY_PAUSES_S = (0.05, 0.2, 0.5, 1.0)

    def _connect(self) -> SecureChannel:
        deadline = time.monotonic() + self._timeout_s
        try:
            for pause in self._RETRY_PAUSES_S + (None,):
                try:
                    return SecureChannel.connect(self._addr, self._key, self._timeout_s)
                except (ConnectionResetError, ChannelClosed):
                    if pause is None or time.monotonic() + pause >= deadline:
                        raise
                    time.sleep(pause)
            raise AssertionError("unreachable")
        except socket.timeout:
            raise HvdliteTimeoutError(
                f"connecting to the {self._name} at {self._addr[0]}:{self._addr[1]} "
                f"timed out after {self._timeout_s:.0f}s") from None
        except OSError as exc:
            raise ConnectionError(
                f"cannot connect to the {self._name} at {self._addr[0]}:{self._addr[1]}: "
                f"{exc}") from None

    def request(self, header: Header, blob: bytes = b"",
                timeout_s: Optional[float] = None) -> Tuple[Header, bytes]:
        wait = self._timeout_s if timeout_s is None else timeout_s
        with self._lock:
            for attempt in (0, 1):
                if self._chan is None:
                    self._chan = self._connect()
                try:
                    self._chan.send(header, blob)
                    reply, out = self._chan.recv(timeout_s=wait)
                    break
                except socket.timeout:
                    self.close_locked()
                    raise HvdliteTimeoutError(
                        f"no answer from the {self._name} at {self._addr[0]}:{self._addr[1]} "
                        f"to {header.get('op')!r} within {wait:.0f}s") from None
                except (ChannelClosed, ConnectionError, BrokenPipeError):
                    self.close_locked()
                    if attempt:
                        raise ConnectionError(
                            f"the {self._name} at {self._addr[0]}:{self._addr[1]} closed the "
                            f"connection during {header.get('op')!r}") from None
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
