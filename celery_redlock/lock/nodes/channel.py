"""One connection to one server, shared by every thread of a process (`Channel`).

Callers queue commands with the `Slot` each reply goes to; a RESP connection answers in the order
it was asked, so the replies that arrive are handed to the slots in order. Commands queued while
another thread writes go out with its next write. Only one thread at a time reads
(`nodes.reactor`); commands queued while it polls, on a connection that owes replies, are left
to it: the next reply wakes it, and it writes them all at once (`Channel.flush`) — one write,
and no thread giving up the GIL to write, per command.

A slot is answered exactly once: with its own reply, or — when the connection fails or its order
can no longer be trusted (a write or a read cut short, bytes that are not RESP, more replies than
commands) — with `NO_REPLY` and the reason; the connection is then closed, every slot still
waiting on it fails with it, and the next command opens a new one.
"""

from __future__ import annotations

import collections
import contextlib
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from redis.exceptions import RedisError as RedisClientError

from .endpoint import Endpoint, describe_failure
from .resp import INCOMPLETE, ErrorReply, ProtocolError, new_reply_parser

READ_SIZE = 65536
IDLE_CHECK_SECONDS = 0.25
"""A connection idle this long is checked for a server that closed it before it is used."""

HUNG_AFTER = 1.0
"""Seconds a server may owe replies without sending anything before it counts as hung (when the
node timeout is shorter) and its connection is closed. Silent for longer than the node timeout,
it is backed off but keeps its connection and scripts until then; one that keeps answering, only
late (a fork, an fsync, a busy CPU), is neither backed off nor reconnected to by every client at
once: its late reply only misses its round."""


def hung_after(node_timeout: float) -> float:
    """Seconds of silence after which a server with this node timeout counts as hung."""
    return max(node_timeout, HUNG_AFTER)


class _NoReply:
    """Marks a slot (or a node in a round) that got no usable reply."""

    def __repr__(self) -> str:
        return "NO_REPLY"


NO_REPLY: Any = _NoReply()


def wait_readable(descriptors: Sequence[int], timeout: float) -> list[int]:
    """The descriptors readable within ``timeout`` seconds: by ``poll`` (no limit on descriptor
    numbers), else ``select`` (eventlet's monkey patching removes ``select.poll``)."""
    if hasattr(select, "poll"):
        poller = select.poll()
        for descriptor in descriptors:
            poller.register(descriptor, select.POLLIN)
        return [descriptor for descriptor, _ in poller.poll(max(timeout, 0.0) * 1000)]
    readable, _, _ = select.select(list(descriptors), [], [], max(timeout, 0.0))
    return list(readable)


class Waiter(Protocol):
    """Whoever waits for slots: told of each once it is answered (with the reactor's lock held);
    what it returns is called once that lock is released (work that may block)."""

    def deliver(self, slot: Slot) -> Callable[[], object] | None:
        """Take note of ``slot``'s reply (or failure)."""


class Poller(Protocol):
    """Whoever reads the connections (`nodes.reactor.Reactor`)."""

    polling: bool  # while a reader polls: it flushes what was left to it once the poll ends

    def connection_opened(self) -> None:
        """A channel opened a new connection: a reader polling now must poll it as well."""


class Slot:
    """Where the reply to one queued command goes. ``tag`` is the waiter's own mark (which node,
    which command); ``failure`` says why the reply is `NO_REPLY`."""

    __slots__ = ("channel", "done", "failure", "reply", "sent_at", "tag", "waiter")

    def __init__(self, waiter: Waiter | None, tag: Any = None) -> None:
        self.waiter = waiter
        self.tag = tag
        self.reply: Any = NO_REPLY
        self.failure = ""
        self.done = False
        self.sent_at = 0.0
        self.channel: Channel | None = None


class Channel:
    """One connection to ``endpoint`` for every thread of this process. ``greeting`` is sent first
    on every new connection (script loads), its replies skipped. Commands queued while ``poller``
    polls, behind replies owed, are left for it to write."""

    def __init__(self, endpoint: Endpoint, greeting: Sequence[bytes], poller: Poller) -> None:
        self.endpoint = endpoint
        self.greeting = tuple(greeting)
        self.poller = poller
        self.lock = threading.Lock()
        self.socket: Any = None
        self.generation = 0  # grows with every new connection and every failure
        self._parser = new_reply_parser()
        self._pending: collections.deque[Slot] = collections.deque()
        self._outbox: list[bytes] = []
        self._writing = False  # the current connection has a writer (a failure starts anew)
        # Sockets that threads use outside the lock (the writer, the reader), how many each: a
        # failed one is only shut down until the last of them is done, so that its descriptor
        # cannot be reused by the next connection while a stale write or read is still on it.
        self._users: dict[Any, int] = {}
        self._last_used = 0.0
        self._last_received = 0.0  # when bytes last arrived from the server

    def fileno(self) -> int:
        """The connection's descriptor, -1 while it is closed."""
        sock = self.socket
        return sock.fileno() if sock is not None else -1

    def send(
        self, payload: bytes, slots: Sequence[Slot], late_after: float | None = None
    ) -> list[Slot]:
        """Queue ``payload``, whose replies go to ``slots`` in order, and write it with whatever
        else is queued, unless another thread writes (it takes it along) or the poller polls
        while replies are owed (it writes it once the next one arrives: `flush`). Connects
        first when needed. With ``late_after``, a connection whose server has owed replies for
        that long without sending anything is failed first: the server is hung.
        Returns the slots that failed (other callers' too), answered with `NO_REPLY`."""
        queued = False
        generation = -1
        try:
            with self.lock:
                now = time.monotonic()
                pending = self._pending
                if self.socket is not None:
                    if pending:
                        if (
                            late_after is not None
                            and self._silence_locked(now) > late_after
                            and not self._closed_by_server()
                        ):
                            failed = self._fail_locked(f"no reply within {late_after}s")
                            for slot in slots:  # not queued behind a hung server
                                slot.failure, slot.done = self.endpoint.last_error, True
                            return failed + list(slots)
                    elif now - self._last_used > IDLE_CHECK_SECONDS and self._closed_by_server():
                        self._close_locked()  # a restarted server: the command must not be lost
                owed = bool(pending)  # a reply to come ends the poller's poll
                if self.socket is None:
                    owed = False
                    if self.endpoint.is_backed_off(now):
                        # A connection failed while this caller waited for the lock: it does
                        # not try again (every waiting thread would wait out the server in turn).
                        for slot in slots:
                            slot.failure, slot.done = self.endpoint.last_error, True
                        return list(slots)
                    try:
                        self._connect_locked()
                    except (RedisClientError, OSError) as error:
                        self.endpoint.mark_down(time.monotonic(), error)
                        for slot in slots:
                            slot.failure, slot.done = self.endpoint.last_error, True
                        return list(slots)
                    self.poller.connection_opened()
                self._last_used = now
                generation = self.generation
                queued = True  # from here on, an interruption leaves the order in doubt
                for slot in slots:
                    slot.sent_at = now
                    slot.channel = self
                pending.extend(slots)
                self._outbox.append(payload)  # behind the greeting of a new connection, if any
                if self._writing:
                    return []  # the thread writing now takes it along
                if owed and self.poller.polling:
                    return []  # the poller writes it when the next reply wakes it (`flush`)
            return self.flush()
        except BaseException as error:
            if not queued:
                raise
            return self._write_failed(generation, error)

    def flush(self) -> list[Slot]:
        """Write the commands left to the poller, unless a thread writes now (it takes them
        along). Returns the slots that failed, as `send` does."""
        if not self._outbox or self._writing:
            return []  # read without the lock: a command queued from now on is written anyway
        generation = -1
        leased: Any = None
        try:
            with self.lock:
                outbox = self._outbox
                if self.socket is None or self._writing or not outbox:
                    return []
                generation = self.generation
                self._writing = True
                sock = self.socket
                self._users[sock] = self._users.get(sock, 0) + 1
                leased = sock
                payload = b"".join(outbox)
                outbox.clear()
            while True:
                sock.sendall(payload)
                with self.lock:
                    if generation != self.generation:
                        # The connection failed while this thread wrote: the writer role and the
                        # outbox are the next connection's, whose own writer (if any) holds them.
                        return []
                    if not outbox:
                        self._writing = False
                        return []
                    payload = b"".join(outbox)
                    outbox.clear()
        except BaseException as error:
            if leased is None:
                raise
            return self._write_failed(generation, error)
        finally:
            if leased is not None:
                with self.lock:  # inline: an interruption on a call's entry would skip it
                    users = self._users[leased] - 1
                    if users:
                        self._users[leased] = users
                    else:
                        del self._users[leased]
                        if leased is not self.socket:  # failed while this thread wrote to it
                            with contextlib.suppress(OSError):
                                leased.close()

    def _write_failed(self, generation: int, error: BaseException) -> list[Slot]:
        """A write that failed, or a signal handler raising (a soft time limit, Ctrl-C) during
        the queueing or the writing: part of the commands may have gone out. The connection
        fails; only a failed write is the server's fault (an interruption is raised again)."""
        failing = isinstance(error, (OSError, RedisClientError))
        reason = f"write failed: {describe_failure(error)}" if failing else "interrupted"
        failed = self.fail(generation, reason, back_off=failing)
        if not failing:
            raise error
        return failed

    def open(self) -> None:
        """Connect now, unless connected or the server is backed off (a failure backs it off, and
        the next command fails with the reason): for several connections opened at once
        (`nodes.reactor.Connections.open`). The greeting goes out with the next write, or the
        reader, woken, writes it."""
        with self.lock:
            if self.socket is not None or self.endpoint.is_backed_off(time.monotonic()):
                return
            try:
                self._connect_locked()
            except (RedisClientError, OSError) as error:
                self.endpoint.mark_down(time.monotonic(), error)
                return
            self.poller.connection_opened()

    def _connect_locked(self) -> None:
        sock = self.endpoint.open_socket()
        try:
            # Non-blocking from here on: reads follow a poll, and a write that does not fit in
            # the socket's buffer means the server stopped reading (hung): the connection fails.
            sock.setblocking(False)
            self.socket = sock
        except BaseException:  # interrupted (a signal handler raising) before it was taken
            if self.socket is not sock:
                sock.close()
            raise
        self.generation += 1
        self._parser = new_reply_parser()
        if self.greeting:
            now = time.monotonic()
            for _ in self.greeting:
                slot = Slot(None, "greeting")
                slot.sent_at, slot.channel = now, self
                self._pending.append(slot)
            self._outbox.append(b"".join(self.greeting))

    def _closed_by_server(self) -> bool:
        """True if the connection has something to read: from an idle one, only the end of the
        stream (the server restarted or dropped idle clients). A plain socket is peeked at, not
        polled: under eventlet a second poll of a descriptor the reader polls is an error."""
        sock = self.socket
        if isinstance(sock, ssl.SSLSocket):
            if sock.pending():
                return True
            try:
                return bool(wait_readable([sock.fileno()], 0))
            except (OSError, ValueError):
                return True
        try:
            sock.recv(1, socket.MSG_PEEK)  # data, or b"" at the end of the stream
        except BlockingIOError:
            return False
        except OSError:
            return True
        return True

    # -- reading (one thread at a time: the reactor's reader) --------------------------------

    def read(self, descriptor: int, answered: list[Slot]) -> None:
        """Read what arrived on ``descriptor``, adding to ``answered`` as it goes (so that the
        caller has them even if the read is cut short) the slots answered, or failed with the
        connection. Anything that cuts the read short fails the connection: bytes read and not
        parsed would shift every later reply."""
        leased: Any = None
        try:
            with self.lock:
                sock, generation = self.socket, self.generation
                if sock is None or sock.fileno() != descriptor:
                    return  # closed, or reopened on another descriptor, since the poll
                self._users[sock] = self._users.get(sock, 0) + 1
                leased = sock
            self._read_leased(sock, generation, answered)
        finally:
            if leased is not None:
                with self.lock:  # inline: an interruption on a call's entry would skip it
                    users = self._users[leased] - 1
                    if users:
                        self._users[leased] = users
                    else:
                        del self._users[leased]
                        if leased is not self.socket:  # failed while this thread read it
                            with contextlib.suppress(OSError):
                                leased.close()

    def _read_leased(self, sock: Any, generation: int, answered: list[Slot]) -> None:
        count = len(answered)
        try:
            try:
                data = sock.recv(READ_SIZE)
                if isinstance(sock, ssl.SSLSocket):
                    while sock.pending():  # decrypted bytes poll() cannot see
                        data += sock.recv(READ_SIZE)
            except (BlockingIOError, ssl.SSLWantReadError):
                return  # woken early, or only part of a TLS record arrived
            if not data:
                answered += self.fail(generation, "the server closed the connection")
                return
            with self.lock:
                if generation != self.generation:
                    return  # the connection failed meanwhile; its slots were answered then
                self._last_used = self._last_received = time.monotonic()
                self._parser.feed(data)
                while True:
                    reply = self._parser.next_reply()
                    if reply is INCOMPLETE:
                        break
                    if not self._pending:
                        raise ProtocolError("a reply to no command")
                    slot = self._pending.popleft()
                    slot.reply = reply
                    slot.done = True
                    answered.append(slot)
        except BaseException as error:
            failing = isinstance(error, (OSError, RedisClientError, ProtocolError))
            reason = f"read failed: {describe_failure(error)}" if failing else "interrupted"
            answered += self.fail(generation, reason, back_off=failing)
            if not failing:
                raise
            return
        if any(not isinstance(slot.reply, ErrorReply) for slot in answered[count:]):
            self.endpoint.mark_answered(self._last_received - answered[count].sent_at)

    def fail(self, generation: int, reason: object, back_off: bool = True) -> list[Slot]:
        """Close the connection of ``generation`` if still current, back the server off (if the
        fault was its own), and answer every slot waiting with `NO_REPLY`; returns those."""
        with self.lock:
            if generation != self.generation:
                return []
            return self._fail_locked(reason, back_off)

    def silent_for(self, now: float, seconds: float) -> bool:
        """True if the server has owed replies for ``seconds`` without sending anything: one
        slow but answering is not silent, a hung one is."""
        with self.lock:
            return self._silence_locked(now) >= seconds and not self._closed_by_server()

    def _silence_locked(self, now: float) -> float:
        if not self._pending:
            return 0.0
        return now - max(self._pending[0].sent_at, self._last_received)

    def fail_if_late(self, now: float, timeout: float) -> list[Slot]:
        """Fail the connection if its server has owed replies for more than ``timeout`` seconds
        without sending anything (hung or far away); returns the slots that failed."""
        with self.lock:
            if self._silence_locked(now) <= timeout or self._closed_by_server():
                return []  # readable: replies nobody waited for, which the next reader takes
            return self._fail_locked(f"no reply within {timeout}s")

    def close(self) -> list[Slot]:
        """Close the connection; returns the slots still waiting, answered with `NO_REPLY`."""
        with self.lock:
            return self._fail_locked("the connection was closed", back_off=False)

    def _fail_locked(self, reason: object, back_off: bool = True) -> list[Slot]:
        slots = list(self._pending)
        self._close_locked()
        if back_off:
            self.endpoint.mark_down(time.monotonic(), reason)
        why = self.endpoint.last_error if back_off else str(reason)
        for slot in slots:
            slot.failure = why
            slot.done = True
        return slots

    def _close_locked(self) -> None:
        sock = self.socket
        in_use = sock in self._users
        if sock is not None and not in_use:
            with contextlib.suppress(OSError):
                sock.close()
        self.socket = None
        self.generation += 1
        self._pending.clear()
        self._outbox.clear()
        self._writing = False
        self._parser = new_reply_parser()
        if in_use:
            # A thread writes or reads it now: it is closed once that thread is done with it,
            # so that its descriptor is not reused meanwhile. Shut down, what that thread does
            # fails at once. Last: the channel is consistent even if this is cut short.
            with contextlib.suppress(OSError):
                if isinstance(sock, ssl.SSLSocket):
                    socket.socket.shutdown(sock, socket.SHUT_RDWR)  # the TLS object stays
                else:
                    sock.shutdown(socket.SHUT_RDWR)
