"""Authenticated, length-prefixed messages for every control-plane connection.

A connection starts with the server sending a fresh random nonce.  Every frame
after that is ``u32 length | 32-byte HMAC-SHA256 | body`` where the MAC covers
the direction, the connection's nonce, a per-direction sequence number and the
body.  A frame is verified before a single byte of its body is decoded, so a
forged, truncated, reordered or replayed frame (from this or another
connection) is rejected without being interpreted.

Bodies are explicit: a JSON header (plain data, never code) plus optional raw
bytes.  Nothing here unpickles anything.
"""

import hashlib
import hmac
import json
import os
import socket
import struct
from typing import Any, Dict, Optional, Tuple

from hvdlite.common.exceptions import HvdliteAuthError

KEY_BYTES = 32
NONCE_BYTES = 16
MAC_BYTES = 32
MAX_FRAME_BYTES = 256 * 1024 * 1024
_LEN = struct.Struct("!I")
_SEQ = struct.Struct("!Q")


def new_key() -> bytes:
    """A fresh per-job secret."""
    return os.urandom(KEY_BYTES)


class ChannelClosed(ConnectionError):
    """The peer closed the connection (cleanly or mid-frame)."""


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks = []
    while n:
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
        header = json.loads(body[_LEN.size:_LEN.size + hlen])
    except ValueError as exc:
        raise HvdliteAuthError(f"malformed message header: {exc}") from None
    if not isinstance(header, dict):
        raise HvdliteAuthError("malformed message: header is not an object")
    return header, body[_LEN.size + hlen:]


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

    @classmethod
    def accept(cls, sock: socket.socket, key: bytes) -> "SecureChannel":
        """Server side: send a fresh nonce, return the channel."""
        nonce = os.urandom(NONCE_BYTES)
        sock.sendall(nonce)
        return cls(sock, key, nonce, is_server=True)

    @classmethod
    def connect(cls, addr: Tuple[str, int], key: bytes, timeout_s: float) -> "SecureChannel":
        """Client side: connect and read the server's nonce, within ``timeout_s``."""
        sock = socket.create_connection(addr, timeout=timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            nonce = _recv_exact(sock, NONCE_BYTES)
        except BaseException:
            sock.close()
            raise
        return cls(sock, key, nonce, is_server=False)

    def _mac(self, tag: bytes, seq: int, body: bytes) -> bytes:
        return hmac.new(self._key, tag + self._nonce + _SEQ.pack(seq) + body,
                        hashlib.sha256).digest()

    def send(self, header: Dict[str, Any], blob: bytes = b"") -> None:
        body = encode_body(header, blob)
        mac = self._mac(self._send_tag, self._send_seq, body)
        self._send_seq += 1
        self.sock.sendall(_LEN.pack(len(body)) + mac + body)

    def recv(self, timeout_s: Optional[float] = None) -> Tuple[Dict[str, Any], bytes]:
        """Read one frame; raise HvdliteAuthError before decoding anything unverified."""
        self.sock.settimeout(timeout_s)
        (length,) = _LEN.unpack(_recv_exact(self.sock, _LEN.size))
        if length > MAX_FRAME_BYTES:
            raise HvdliteAuthError(f"frame of {length} bytes exceeds {MAX_FRAME_BYTES}")
        mac = _recv_exact(self.sock, MAC_BYTES)
        body = _recv_exact(self.sock, length)
        if not hmac.compare_digest(mac, self._mac(self._recv_tag, self._recv_seq, body)):
            raise HvdliteAuthError("message failed HMAC verification "
                                   "(wrong job key, forged, replayed or reordered)")
        self._recv_seq += 1
        return decode_body(body)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
