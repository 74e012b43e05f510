"""Release notifications (`Subscriber`): one subscribed connection per server and process,
whoever listens. A release publishes on the lock key's channel; every thread waiting for that
lock is woken, instead of each waiting thread holding a connection of its own."""

from __future__ import annotations

import contextlib
import ssl
import threading
import time
from collections.abc import Callable
from typing import Any

from redis.exceptions import RedisError as RedisClientError

from .channel import READ_SIZE, Slot, Waiter
from .endpoint import Endpoint
from .resp import INCOMPLETE, ProtocolError, new_reply_parser, pack_command


class Subscriber:
    """The subscribed connection to one server, shared by every listener of this process. A
    listener is told by a slot tagged ``"subscribed"`` (the server confirmed a subscription),
    ``"message"`` (a release) or ``"lost"`` (the connection failed)."""

    def __init__(self, endpoint: Endpoint, on_connect: Callable[[], None]) -> None:
        self.endpoint = endpoint
        self.on_connect = on_connect
        self.lock = threading.Lock()
        self.socket: Any = None
        self._parser = new_reply_parser()
        self._listeners: dict[str, set[Waiter]] = {}
        self._confirmed: set[str] = set()

    def fileno(self) -> int:
        """The connection's descriptor, -1 while it is closed."""
        sock = self.socket
        return sock.fileno() if sock is not None else -1

    def listen(self, channel: str, listener: Waiter) -> bool:
        """Have ``listener`` told of releases on ``channel``; False if the server cannot be
        reached (the listener then waits without notifications from it)."""
        with self.lock:
            try:
                if self.socket is None:
                    self.socket = self.endpoint.open_socket()
                    self._parser = new_reply_parser()
                    self._confirmed.clear()
                    names = list(self._listeners)
                    if names:
                        self.socket.sendall(pack_command("SUBSCRIBE", *names))
                    self.on_connect()
                first = channel not in self._listeners
                self._listeners.setdefault(channel, set()).add(listener)
                if first:
                    self.socket.sendall(pack_command("SUBSCRIBE", channel))
            except (RedisClientError, OSError):
                self._listeners.get(channel, set()).discard(listener)
                self._close_locked()
                return False
        return True

    def confirmed(self, channel: str) -> bool:
        """True once the server confirmed the subscription to ``channel`` (or the connection
        failed: there is nothing left to wait for)."""
        return self.socket is None or channel in self._confirmed

    def stop(self, channel: str, listener: Waiter) -> None:
        """Stop telling ``listener`` of releases on ``channel``."""
        with self.lock:
            listeners = self._listeners.get(channel)
            if listeners is None:
                return
            listeners.discard(listener)
            if listeners:
                return
            del self._listeners[channel]
            self._confirmed.discard(channel)
            if self.socket is not None:
                try:
                    self.socket.sendall(pack_command("UNSUBSCRIBE", channel))
                except OSError:
                    self._close_locked()

    def read(self, descriptor: int, told: list[Slot]) -> None:
        """Read what arrived; add to ``told`` a slot per listener to tell (see `Subscriber`)."""
        sock = self.socket
        if sock is None or sock.fileno() != descriptor:
            return
        try:
            data = sock.recv(READ_SIZE)
            if isinstance(sock, ssl.SSLSocket):
                while sock.pending():
                    data += sock.recv(READ_SIZE)
        except (BlockingIOError, ssl.SSLWantReadError):
            return
        except (OSError, RedisClientError):
            data = b""
        with self.lock:
            if not data:
                told += self._lose_locked()
                return
            try:
                self._parser.feed(data)
                while (message := self._parser.next_reply()) is not INCOMPLETE:
                    told += self._notifications(message)
            except BaseException as error:  # not RESP, or interrupted: what was read is in doubt
                told += self._lose_locked()
                if not isinstance(error, ProtocolError):
                    raise

    def _notifications(self, message: Any) -> list[Slot]:
        if not isinstance(message, list) or len(message) != 3:
            return []
        kind, name = message[0], message[1]
        channel = name.decode(errors="replace") if isinstance(name, bytes) else str(name)
        if kind == b"subscribe":
            self._confirmed.add(channel)
            tag = "subscribed"
        elif kind == b"message":
            tag = "message"
        else:
            return []
        return [Slot(listener, tag) for listener in self._listeners.get(channel, ())]

    def _lose_locked(self) -> list[Slot]:
        listeners = {listener for group in self._listeners.values() for listener in group}
        self._close_locked()
        self.endpoint.mark_down(time.monotonic(), "the subscribed connection was lost")
        return [Slot(listener, "lost") for listener in listeners]

    def _close_locked(self) -> None:
        if self.socket is not None:
            with contextlib.suppress(OSError):
                self.socket.close()
        self.socket = None
        self._confirmed.clear()

    def close(self) -> None:
        """Close the connection (listeners are not told; they wait out their time)."""
        with self.lock:
            self._close_locked()
            self._listeners.clear()
