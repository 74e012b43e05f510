"""The shape issue 37 asked the nodes layer to take, bare: a yardstick, not a lock library.

One I/O thread owns one connection to one Redis server; a caller hands it a command and waits
for the reply (`OwnerShape.call`), or only posts it (`OwnerShape.post`). A lock is ``SET name
token NX PX ttl``, its release the compare-and-delete script by SHA. Nothing else: no
deadlines, no second node, no redirections, no clean-ups, no fencing token, no checks of what
the server says. What ``celery_redlock`` costs beyond this is what its promises cost, and what
its code wastes; what this costs against a client that does its own I/O (redis-py's ``Lock``) is
what the shape costs on the machine at hand: two thread hand-offs per waited call.

``bench_layers.py`` times its pair beside ``Redlock``'s and redis-py's, and ``bench_celery.py``
runs it as the ``shape`` variant: a no-op task that takes such a lock first and posts its
release at the end, as ``@singleton_task`` does.
"""

from __future__ import annotations

import collections
import secrets
import selectors
import socket
import threading
from urllib.parse import urlsplit

RELEASE = (
    "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) "
    "else return 0 end"
)


def pack(*arguments: str | int) -> bytes:
    """One command in RESP."""
    parts = [f"*{len(arguments)}\r\n"]
    for argument in map(str, arguments):
        parts.append(f"${len(argument.encode())}\r\n{argument}\r\n")
    return "".join(parts).encode()


class Reply:
    """One command's reply, and the event its caller waits on."""

    __slots__ = ("arrived", "value")

    def __init__(self) -> None:
        self.arrived = threading.Event()
        self.value: bytes | int | None = None


class OwnerShape:
    """One connection to ``url``'s server (``redis://host:port``), owned by one daemon thread."""

    def __init__(self, url: str) -> None:
        address = urlsplit(url)
        self._socket = socket.create_connection((address.hostname, address.port or 6379))
        self._socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._socket.setblocking(False)
        self._wake_reader, self._wake_writer = socket.socketpair()
        self._wake_reader.setblocking(False)
        self._inbox: collections.deque[tuple[bytes, Reply]] = collections.deque()
        self._waiting: collections.deque[Reply] = collections.deque()
        self._unread = b""
        self._lock = threading.Lock()
        self._woken = False
        threading.Thread(target=self._own, name="owner-shape", daemon=True).start()
        self._release_sha = self.call(pack("SCRIPT", "LOAD", RELEASE))

    def acquire(self, name: str, ttl_ms: int) -> str | None:
        """A token if the lock was free (then it is held for ``ttl_ms``), else None."""
        token = secrets.token_hex(16)
        return token if self.call(pack("SET", name, token, "NX", "PX", ttl_ms)) == b"OK" else None

    def release(self, name: str, token: str, wait: bool = True) -> bool:
        """Delete the lock if ``token`` holds it: True if it did (when ``wait``; else True once
        the release is posted)."""
        command = pack("EVALSHA", str(self._release_sha, "ascii"), 1, name, token)
        if not wait:
            self.post(command)
            return True
        return self.call(command) == 1

    def call(self, command: bytes) -> bytes | int | None:
        """Send ``command`` through the owner thread and wait for its reply."""
        reply = self.post(command)
        reply.arrived.wait()
        return reply.value

    def post(self, command: bytes) -> Reply:
        """Hand ``command`` to the owner thread; its reply arrives in the returned `Reply`."""
        reply = Reply()
        with self._lock:
            self._inbox.append((command, reply))
            wake, self._woken = not self._woken, True
        if wake:
            self._wake_writer.send(b"x")
        return reply

    def _own(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self._wake_reader, selectors.EVENT_READ, self._write)
        selector.register(self._socket, selectors.EVENT_READ, self._read)
        while True:
            for key, _ in selector.select():
                key.data()

    def _write(self) -> None:
        self._wake_reader.recv(4096)
        with self._lock:
            commands = list(self._inbox)
            self._inbox.clear()
            self._woken = False
        self._waiting.extend(reply for _, reply in commands)
        self._socket.setblocking(True)
        self._socket.sendall(b"".join(command for command, _ in commands))
        self._socket.setblocking(False)

    def _read(self) -> None:
        unread = self._unread + self._socket.recv(65536)
        while (end := unread.find(b"\r\n")) >= 0:
            kind, line = unread[:1], unread[1:end]
            value: bytes | int | None = line
            used = end + 2
            if kind == b":":
                value = int(line)
            elif kind == b"$":
                length = int(line)
                if length < 0:
                    value = None
                elif len(unread) < used + length + 2:
                    break
                else:
                    value, used = unread[used : used + length], used + length + 2
            unread = unread[used:]
            reply = self._waiting.popleft()
            reply.value = value
            reply.arrived.set()
        self._unread = unread
