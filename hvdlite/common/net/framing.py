"""Authenticated, length-prefixed messages for every control-plane connection.

A connection starts with the server sending a fresh random nonce.  Every frame
after that is ``u32 length | 32-byte HMAC-SHA256 | body`` where the MAC covers
the direction, the connection's nonce, a per-direction sequence number and the
body.  A frame is verified before a single byte of its body is decoded, so a
forged, truncated, reordered or replayed frame (from this or another
connection) is rejected without being interpreted.

Bodies are explicit: a JSON header (plain data, never code) plus optional raw
bytes.  Nothing here unpickles anything.

Before authentication a stranger gets almost nothing: the client's first frame
is a small *hello* (at most :data:`HELLO_MAX_BYTES`) that proves it holds the
key, and it must arrive within a deadline.  Only after that does the server
accept frames up to :data:`MAX_FRAME_BYTES`; so a peer without the key can
make the server hold a few KiB for a few seconds, never a 256 MiB buffer.
"""

import hashlib
import hmac
import json
import os
import socket
import struct
import time
from typing import Any, Dict, Optional, Tuple

from hvdlite.common.exceptions import HvdliteAuthError

KEY_BYTES = 32
NONCE_BYTES = 16
MAC_BYTES = 32
MAX_FRAME_BYTES = 256 * 1024 * 1024
#: the largest first frame a server reads from a peer that has not yet proved the key
HELLO_MAX_BYTES = 1024
#: what the hello frame's header says (a version, so a future change is refused clearly)
HELLO = {"hello": 1}
_LEN = struct.Struct("!I")
_SEQ = struct.Struct("!Q")


def new_key() -> bytes:
    """A fresh per-job secret."""
    return os.urandom(KEY_BYTES)


class ChannelClosed(ConnectionError):
    """The peer closed the connection (cleanly or mid-frame)."""


def _recv_exact(sock: socket.socket, n: int, deadline: Optional[float] = None) -> bytes:
    """``n`` bytes; with a ``deadline`` (monotonic) the whole read, not each chunk, is
    bounded, so a peer trickling one byte at a time cannot hold us past it."""
    chunks = []
    while n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout("deadline passed")
            sock.settimeout(left)
        chunk = sock.recv(min(n, 1 << 20))
        if not chunk:
            raise ChannelClosed("connection closed by peer")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def encode_body(header: Dict[str, Any], blob: bytes = b"") -> bytes:
    head = json.dumps(header, separators=(",", ":")).encode()
    return _LEN.pack(len(head)) + head + blob


def decode_body(body: bytes) -> Tuple[Dict[str, Any], bytes]:
    if len(body) < _LEN.size:
        raise HvdliteAuthError("malformed message: shorter than its header length")
    (hlen,) = _LEN.unpack_from(body)
    if hlen > len(body) - _LEN.size:
        raise HvdliteAuthError("malformed message: header length past the end")
    try:
        header = json.loads(body[_LEN.size : _LEN.size + hlen])
    except ValueError as exc:
        raise HvdliteAuthError(f"malformed message header: {exc}") from None
    if not isinstance(header, dict):
        raise HvdliteAuthError("malformed message: header is not an object")
    return header, body[_LEN.size + hlen :]


class SecureChannel:
    """One authenticated connection; ``send``/``recv`` are not thread-safe."""

    def __init__(self, sock: socket.socket, key: bytes, nonce: bytes, is_server: bool):
        self.sock = sock
        self._key = key
        self._nonce = nonce
        self._send_tag = b"S" if is_server else b"C"
        self._recv_tag = b"C" if is_server else b"S"
        self._send_seq = 0
        self._recv_seq = 0
        #: server side: the peer has sent a verified hello (proved the key)
        self.authenticated = not is_server

    @classmethod
    def accept(cls, sock: socket.socket, key: bytes) -> "SecureChannel":
        """Server side: send a fresh nonce, return the channel."""
        nonce = os.urandom(NONCE_BYTES)
        sock.sendall(nonce)
        return cls(sock, key, nonce, is_server=True)

    @classmethod
    def connect(cls, addr: Tuple[str, int], key: bytes, timeout_s: float) -> "SecureChannel":
        """Client side: connect, read the server's nonce and send the hello that proves
        the key, within ``timeout_s``.  The hello needs no answer (no extra round trip)."""
        sock = socket.create_connection(addr, timeout=timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            nonce = _recv_exact(sock, NONCE_BYTES, time.monotonic() + timeout_s)
            chan = cls(sock, key, nonce, is_server=False)
            chan.send(HELLO)
        except BaseException:
            sock.close()
            raise
        return chan

    @staticmethod
    def hello_size(prefix: bytes) -> int:
        """The whole size of a first frame whose 4-byte length prefix is ``prefix``.

        Raises:
            HvdliteAuthError: the declared length is over :data:`HELLO_MAX_BYTES`.
        """
        (length,) = _LEN.unpack(prefix)
        if length > HELLO_MAX_BYTES:
            raise HvdliteAuthError(
                f"frame of {length} bytes exceeds {HELLO_MAX_BYTES} (before the hello)"
            )
        return _LEN.size + MAC_BYTES + length

    def take_hello(self, frame: bytes) -> None:
        """Server side: check a whole first frame (read without blocking, see
        :meth:`hello_size`) is this connection's verified hello.

        Raises:
            HvdliteAuthError: a bad MAC, or not a hello.
        """
        (length,) = _LEN.unpack_from(frame)
        if length > HELLO_MAX_BYTES or len(frame) != _LEN.size + MAC_BYTES + length:
            raise HvdliteAuthError("malformed first frame")
        header, blob = self._verified(
            frame[_LEN.size : _LEN.size + MAC_BYTES], frame[_LEN.size + MAC_BYTES :]
        )
        if header != HELLO or blob:
            raise HvdliteAuthError("the first frame is not a hello")
        self.authenticated = True

    def _mac(self, tag: bytes, seq: int, body: bytes) -> bytes:
        return hmac.new(
            self._key, tag + self._nonce + _SEQ.pack(seq) + body, hashlib.sha256
        ).digest()

    def send(self, header: Dict[str, Any], blob: bytes = b"") -> None:
        body = encode_body(header, blob)
        mac = self._mac(self._send_tag, self._send_seq, body)
        self._send_seq += 1
        self.sock.sendall(_LEN.pack(len(body)) + mac + body)

    def recv(
        self,
        timeout_s: Optional[float] = None,
        deadline: Optional[float] = None,
        max_bytes: int = MAX_FRAME_BYTES,
    ) -> Tuple[Dict[str, Any], bytes]:
        """Read one frame; raise HvdliteAuthError before decoding anything unverified.

        ``timeout_s`` bounds each read from the socket, ``deadline`` (monotonic) the
        whole frame; a declared length over ``max_bytes`` is refused before its body is
        read.
        """
        self.sock.settimeout(timeout_s)
        (length,) = _LEN.unpack(_recv_exact(self.sock, _LEN.size, deadline))
        if length > max_bytes:
            raise HvdliteAuthError(
                f"frame of {length} bytes exceeds {max_bytes}"
                + ("" if self.authenticated else " (before the hello)")
            )
        mac = _recv_exact(self.sock, MAC_BYTES, deadline)
        body = _recv_exact(self.sock, length, deadline)
        return self._verified(mac, body)

    def _verified(self, mac: bytes, body: bytes) -> Tuple[Dict[str, Any], bytes]:
        """The decoded body, once its MAC is checked (the next sequence number counted)."""
        if not hmac.compare_digest(mac, self._mac(self._recv_tag, self._recv_seq, body)):
            raise HvdliteAuthError(
                "message failed HMAC verification (wrong job key, forged, replayed or reordered)"
            )
        self._recv_seq += 1
        return decode_body(body)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
