"""Release notifications (`Subscriber`): one subscribed connection per server and process,
whoever listens. A release publishes on the lock key's channel; every thread waiting for that
lock is woken, instead of each waiting thread holding a connection of its own.

Like a `nodes.channel.Channel`, a subscriber is touched by its process's reactor thread alone.
It holds its listeners weakly: a listener its caller never closed (a signal handler's exception
cut the caller short while it subscribed) is gone once nothing else holds it, and so is its
subscription, instead of lasting as long as the process."""

from __future__ import annotations

import contextlib
import ssl
import time
import weakref
from typing import Any

from redis.exceptions import RedisError as RedisClientError

from .channel import READ_SIZE, Slot, Waiter
from .endpoint import Endpoint, describe_failure
from .resp import INCOMPLETE, ProtocolError, new_reply_parser, pack_command


class Subscriber:
    """The subscribed connection to one server, shared by every listener of this process. A
    listener is told by a slot tagged ``("subscribed", endpoint)`` (the server confirmed its
    subscription), ``("message", endpoint)`` (a release) or ``("lost", endpoint)`` (the
    connection failed, or could not be made)."""

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        self.socket: Any = None
        self.connecting = 0  # the number of the connection attempt under way (0: none)
        self.attempts = 0
        self._parser = new_reply_parser()
        self._listeners: dict[str, set[weakref.ReferenceType[Waiter]]] = {}
        self._outbox: list[bytes] = []
        self._confirmed: set[str] = set()

    def fileno(self) -> int:
        """The connection's descriptor, -1 while it is closed."""
        sock = self.socket
        return sock.fileno() if sock is not None else -1

    def listen(self, channel: str, listener: Waiter, told: list[Slot]) -> bool:
        """Have ``listener`` told of releases on ``channel`` (told at once, in ``told``, when the
        server confirmed that subscription before). Returns True if a connection must be made
        first (`start_connecting`)."""
        first = channel not in self._listeners
        if first:
            self._drop_unheard()
        self._listeners.setdefault(channel, set()).add(weakref.ref(listener))
        if self.socket is None:
            return not self.connecting
        if first:
            self._outbox.append(pack_command("SUBSCRIBE", channel))
        elif channel in self._confirmed:
            told.append(Slot(listener, ("subscribed", self.endpoint)))
        return False

    def stop(self, channel: str, listener: Waiter) -> None:
        """Stop telling ``listener`` of releases on ``channel``."""
        listeners = self._listeners.get(channel)
        if listeners is None:
            return
        listeners.discard(weakref.ref(listener))
        if not self._live(channel):
            self._unsubscribe(channel)

    def _live(self, channel: str) -> list[Waiter]:
        """The listeners of ``channel`` still held by somebody."""
        return [
            listener
            for reference in self._listeners.get(channel, ())
            if (listener := reference()) is not None
        ]

    def _unsubscribe(self, channel: str) -> None:
        del self._listeners[channel]
        self._confirmed.discard(channel)
        if self.socket is not None:
            self._outbox.append(pack_command("UNSUBSCRIBE", channel))

    def _drop_unheard(self) -> None:
        """Unsubscribe from the channels whose every listener is gone unclosed."""
        for channel in [channel for channel in self._listeners if not self._live(channel)]:
            self._unsubscribe(channel)

    def start_connecting(self) -> int:
        """Note that a connection is being made; returns the attempt's number."""
        self.attempts += 1
        self.connecting = self.attempts
        return self.attempts

    def connected(self, attempt: int, sock: Any) -> bool:
        """Take ``sock`` (from attempt ``attempt``) and subscribe to every channel listened to.
        False (and the socket closed) if the attempt is stale or nobody listens any more."""
        if attempt != self.connecting or not self._listeners:
            with contextlib.suppress(OSError):
                sock.close()
            if attempt == self.connecting:
                self.connecting = 0
            return False
        self.connecting = 0
        sock.setblocking(False)
        self.socket = sock
        self._parser = new_reply_parser()
        self._outbox = []
        self._drop_unheard()
        if not self._listeners:
            self.close()
            return False
        self._outbox.append(pack_command("SUBSCRIBE", *self._listeners))
        return True

    def connect_failed(self, attempt: int, error: object) -> list[Slot]:
        """Connection attempt ``attempt`` failed: every listener is told (``"lost"``)."""
        if attempt != self.connecting:
            return []
        self.connecting = 0
        return self._lose(f"cannot connect: {describe_failure(error)}")

    def write(self) -> list[Slot]:
        """Write the (un)subscriptions queued; the listeners are told if the connection fails."""
        if not self._outbox or self.socket is None:
            return []
        payload = b"".join(self._outbox)
        self._outbox.clear()
        try:
            self.socket.sendall(payload)
        except (OSError, RedisClientError):
            return self._lose("the subscribed connection was lost")
        return []

    def read(self, told: list[Slot]) -> None:
        """Read what arrived; add to ``told`` a slot per listener to tell (see `Subscriber`)."""
        sock = self.socket
        if sock is None:
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
        if not data:
            told += self._lose("the subscribed connection was lost")
            return
        try:
            self._parser.feed(data)
            while (message := self._parser.next_reply()) is not INCOMPLETE:
                told += self._notifications(message)
        except ProtocolError:  # not RESP: what was read is in doubt
            told += self._lose("the subscribed connection sent what is not RESP")
            return
        if self._outbox:  # unsubscriptions from channels nobody listens to any more
            told += self.write()

    def _notifications(self, message: Any) -> list[Slot]:
        if not isinstance(message, list) or len(message) != 3:
            return []
        kind, name = message[0], message[1]
        channel = name.decode(errors="replace") if isinstance(name, bytes) else str(name)
        if kind == b"subscribe":
            self._confirmed.add(channel)
            tag = ("subscribed", self.endpoint)
        elif kind == b"message":
            tag = ("message", self.endpoint)
        else:
            return []
        listeners = self._live(channel)
        if not listeners and channel in self._listeners:
            self._unsubscribe(channel)
        return [Slot(listener, tag) for listener in listeners]

    def _lose(self, reason: str) -> list[Slot]:
        listeners = {listener for channel in self._listeners for listener in self._live(channel)}
        self.close()
        self.endpoint.mark_down(time.monotonic(), reason)
        return [Slot(listener, ("lost", self.endpoint)) for listener in listeners]

    def close(self) -> None:
        """Close the connection (the listeners stay: a new connection subscribes them again)."""
        sock, self.socket = self.socket, None
        self.connecting = 0
        self._outbox.clear()
        self._confirmed.clear()
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()
