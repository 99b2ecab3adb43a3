"""Framing between the pool and its workers: length-prefixed pickles of plain data only.

Both ends are trusted code (the sandboxed program never holds these sockets), but the receiving
side still refuses to unpickle anything but builtin containers and scalars, so that a corrupted
stream can at worst raise, never run code.
"""

from __future__ import annotations

import io
import pickle
import socket
import struct

_HEADER = struct.Struct("!Q")
MAX_FRAME = 1 << 31


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}")


def dumps(obj) -> bytes:
    body = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(body)) + body


def loads(body: bytes):
    return _PlainUnpickler(io.BytesIO(body)).load()


def send(sock: socket.socket, obj) -> None:
    sock.sendall(dumps(obj))


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise EOFError("peer closed the connection")
        buf += chunk
    return bytes(buf)


def recv(sock: socket.socket):
    (n,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    if n > MAX_FRAME:
        raise EOFError(f"frame of {n} bytes is too large")
    return loads(_recv_exact(sock, n))
