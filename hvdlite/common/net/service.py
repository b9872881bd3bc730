"""A small authenticated request/response server and its client.

Subclasses of :class:`Service` implement :meth:`Service.handle`; everything
else (listening, the per-connection nonce, HMAC checks, rejecting and logging
bad frames) lives here once.  The launcher's driver, task service and
rendezvous store are all built on it; workers use :class:`Client` (through
:mod:`hvdlite.common.net.kv`).
"""

import abc
import logging
import socket
import socketserver
import threading
from typing import Any, Dict, Optional, Tuple

from hvdlite.common.exceptions import HvdliteAuthError, HvdliteError, HvdliteTimeoutError
from hvdlite.common.net.framing import ChannelClosed, SecureChannel

log = logging.getLogger(__name__)

Header = Dict[str, Any]


class ServiceError(HvdliteError):
    """The service answered a request with an error; the message is the service's."""


class Service(abc.ABC):
    """A threaded TCP server that answers authenticated requests.

    Each connection is served on its own thread, requests on one connection
    one at a time.  A frame that fails verification closes that connection and
    is logged; the service itself keeps running.
    """

    def __init__(self, name: str, key: bytes, bind_addr: str = "127.0.0.1", port: int = 0):
        self.name = name
        self._key = key
        self.rejected = 0          # frames that failed verification, for tests and logs
        service = self

        class _Handler(socketserver.BaseRequestHandler):
            def handle(self):
                service._serve_connection(self.request, self.client_address)

        class _Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self._server = _Server((bind_addr, port), _Handler)
        self._address = self._server.server_address[:2]
        self._thread = threading.Thread(target=self._server.serve_forever,
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

    def _serve_connection(self, sock: socket.socket, client) -> None:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            chan = SecureChannel.accept(sock, self._key)
        except OSError:
            return
        while True:
            try:
                header, blob = chan.recv(timeout_s=None)
            except ChannelClosed:
                return
            except HvdliteAuthError as exc:
                self.rejected += 1
                log.warning("%s: rejected a frame from %s:%s: %s", self.name, client[0],
                            client[1], exc)
                chan.close()
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
        """Stop accepting and close the listening socket (idempotent)."""
        if self._server is None:
            return
        server, self._server = self._server, None
        server.shutdown()
        server.server_close()
        self._thread.join(timeout=5)


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

    def _connect(self) -> SecureChannel:
        try:
            return SecureChannel.connect(self._addr, self._key, self._timeout_s)
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
