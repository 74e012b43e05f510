"""One connection to one server, shared by every thread of a process (`Channel`), and the slots its
replies go to (`Slot`).

A channel is touched by one thread only: its process's reactor thread (`nodes.reactor`), which
queues commands with the slot each reply goes to, writes them, reads the replies and hands them
to the slots in order (a RESP connection answers in the order it was asked). Nothing here takes
a lock, and no signal handler can run on that thread: the order of slots and bytes holds by
construction.

A slot is answered exactly once: with its own reply, or — when the connection fails or its order
can no longer be trusted (a write or a read that failed, bytes that are not RESP, more replies
than commands) — with `NO_REPLY` and the reason; the connection is then closed, every slot still
waiting on it fails with it, and the next command opens a new one.
"""

from __future__ import annotations

import collections
import contextlib
import select
import socket
import ssl
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from redis.exceptions import RedisError as RedisClientError

from .endpoint import Endpoint, describe_failure
from .resp import INCOMPLETE, ErrorReply, ProtocolError, new_reply_parser

READ_SIZE = 65536

HUNG_AFTER = 1.0
"""Seconds a server may owe replies without sending anything before it counts as hung (when the
node timeout is shorter) and its connection is closed. Silent for longer than the node timeout,
it is backed off but keeps its connection and scripts until then; one that keeps answering, only
late (a fork, an fsync, a busy CPU), is neither backed off nor reconnected to by every client at
once: its late reply only misses its round."""


def hung_after(node_timeout: float) -> float:
    """Seconds of silence after which a server with this node timeout counts as hung."""
    return max(node_timeout, HUNG_AFTER)


PATIENCE_PER_LATENESS = 3.0
LONGEST_PATIENCE = 10.0
"""A round waits for its members ``node_timeout``, or three times the lateness of the replies
its quorum-th member sent of late, whichever is longer, but at most ten node timeouts. On a busy
host replies are read late because the reading thread waits for a CPU: that is not a node
failing, and a round deciding at quorum loses nothing by waiting longer while a majority
answers; only a round without a majority waits the longer time."""


def patience(node_timeout: float, lateness: list[float], quorum: int) -> float:
    """Seconds a round waits for the members whose recent lateness is ``lateness``."""
    if not 0 < quorum <= len(lateness):
        return node_timeout
    late = sorted(lateness)[quorum - 1] * PATIENCE_PER_LATENESS
    return min(max(node_timeout, late), node_timeout * LONGEST_PATIENCE)


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
    """Whoever waits for slots: told of each once it is answered (on the reactor thread, with the
    reactor's lock held); what it returns is called there once that lock is released."""

    def deliver(self, slot: Slot) -> Callable[[], object] | None:
        """Take note of ``slot``'s reply (or failure)."""


class Slot:
    """Where the reply to one queued command goes. ``tag`` is the waiter's own mark (which node,
    which command); ``failure`` says why the reply is `NO_REPLY`. ``sent_at`` is when the
    command was sent (by its caller, or else when the reactor queued it), ``channel`` and
    ``queued_as`` (the channel's `Channel.queued` count then) set when the reactor queues it."""

    __slots__ = ("channel", "done", "failure", "queued_as", "reply", "sent_at", "tag", "waiter")

    def __init__(self, waiter: Waiter | None, tag: Any = None) -> None:
        self.waiter = waiter
        self.tag = tag
        self.reply: Any = NO_REPLY
        self.failure = ""
        self.done = False
        self.sent_at = 0.0
        self.channel: Channel | None = None
        self.queued_as = 0


def readable_now(sock: Any) -> bool:
    """True if ``sock`` has something to read now (data, or the end of the stream)."""
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


class Channel:
    """One connection to ``endpoint`` for every thread of this process, used by the reactor
    thread alone. ``greeting`` is sent first on every new connection (script loads), its replies
    skipped. Commands queued while the connection is being made wait for it."""

    def __init__(self, endpoint: Endpoint, greeting: Sequence[bytes]) -> None:
        self.endpoint = endpoint
        self.greeting = tuple(greeting)
        self.socket: Any = None
        self.connecting = 0  # the number of the connection attempt under way (0: none)
        self.attempts = 0
        self._parser = new_reply_parser()
        self._pending: collections.deque[Slot] = collections.deque()
        self._outbox: list[bytes] = []
        self._last_used = 0.0
        self._last_received = 0.0  # when bytes last arrived from the server
        self._silence_reported: Slot | None = None  # the slot the server was backed off over
        self.queued = 0  # payloads queued so far: nothing was queued after a slot queued as this

    def fileno(self) -> int:
        """The connection's descriptor, -1 while it is closed."""
        sock = self.socket
        return sock.fileno() if sock is not None else -1

    @property
    def owes(self) -> bool:
        """True while the server owes replies, or commands wait to be written."""
        return bool(self._pending or self._outbox)

    def queue(self, payload: bytes, slots: Sequence[Slot], now: float) -> bool:
        """Queue ``payload``, whose replies go to ``slots`` in order, to be written by `write`.
        Returns True if a connection must be made first (`start_connecting`)."""
        self.queued += 1
        for slot in slots:
            slot.sent_at = slot.sent_at or now  # when its caller sent it, if it said
            slot.channel = self
            slot.queued_as = self.queued
        self._pending.extend(slots)
        self._outbox.append(payload)
        self._last_used = now
        return self.socket is None and not self.connecting

    def start_connecting(self) -> int:
        """Note that a connection is being made; returns the attempt's number."""
        self.attempts += 1
        self.connecting = self.attempts
        return self.attempts

    def connected(self, attempt: int, sock: Any) -> bool:
        """Take ``sock``, made by connection attempt ``attempt``: the greeting goes first, then
        whatever was queued meanwhile. False (and the socket closed) if the attempt is stale."""
        if attempt != self.connecting:
            with contextlib.suppress(OSError):
                sock.close()
            return False
        self.connecting = 0
        # Non-blocking from here on: reads follow a poll, and a write that does not fit in the
        # socket's buffer means the server stopped reading (hung): the connection fails.
        sock.setblocking(False)
        self.socket = sock
        self._parser = new_reply_parser()
        self._last_received = time.monotonic()
        if self.greeting:
            greeting = []
            for _ in self.greeting:
                slot = Slot(None, "greeting")
                slot.sent_at, slot.channel = self._last_received, self
                greeting.append(slot)
            self._pending.extendleft(reversed(greeting))
            self._outbox.insert(0, b"".join(self.greeting))
        return True

    def connect_failed(self, attempt: int, error: object) -> list[Slot]:
        """Connection attempt ``attempt`` failed: the server is backed off, and every slot
        queued fails; returns those."""
        if attempt != self.connecting:
            return []
        self.connecting = 0
        return self.fail(f"cannot connect: {describe_failure(error)}")

    def write(self) -> list[Slot]:
        """Write what is queued, in one write. Returns the slots that failed with the
        connection (answered with `NO_REPLY`)."""
        outbox = self._outbox
        if not outbox or self.socket is None:
            return []
        payload = outbox[0] if len(outbox) == 1 else b"".join(outbox)
        outbox.clear()
        try:
            self.socket.sendall(payload)
        except (OSError, RedisClientError) as error:
            return self.fail(f"write failed: {describe_failure(error)}")
        return []

    def read(self, answered: list[Slot]) -> None:
        """Read what arrived, adding the slots answered (or failed with the connection) to
        ``answered``. Anything that cuts the read short fails the connection: bytes read and not
        parsed would shift every later reply."""
        sock = self.socket
        if sock is None:
            return
        count = len(answered)
        try:
            data = sock.recv(READ_SIZE)
            if isinstance(sock, ssl.SSLSocket):
                while sock.pending():  # decrypted bytes poll() cannot see
                    data += sock.recv(READ_SIZE)
        except (BlockingIOError, ssl.SSLWantReadError):
            return  # woken early, or only part of a TLS record arrived
        except (OSError, RedisClientError) as error:
            answered += self.fail(f"read failed: {describe_failure(error)}")
            return
        if not data:
            if self._pending:
                answered += self.fail("the server closed the connection")
            else:  # idle: a restarted server, or one that drops idle clients
                self.close("the server closed the idle connection")
            return
        self._last_used = self._last_received = time.monotonic()
        answers = False  # a reply that is not an error: the server works
        try:
            self._parser.feed(data)
            while (reply := self._parser.next_reply()) is not INCOMPLETE:
                if not self._pending:
                    raise ProtocolError("a reply to no command")
                slot = self._pending.popleft()
                slot.reply = reply
                slot.done = True
                answered.append(slot)
                answers = answers or reply.__class__ is not ErrorReply
        except ProtocolError as error:
            answered += self.fail(f"read failed: {describe_failure(error)}")
            return
        if answers:
            self.endpoint.mark_answered(self._last_received - answered[count].sent_at)

    def silent_for(self, now: float, seconds: float) -> bool:
        """True if the server has owed replies for ``seconds`` without sending anything: one
        slow but answering is not silent, a hung one is. Any thread may ask: it only reads."""
        return self.silence(now) >= seconds

    def silence(self, now: float) -> float:
        """Seconds the server has owed replies without sending anything (0 when it owes none)."""
        try:
            first = self._pending[0].sent_at
        except IndexError:
            return 0.0
        return now - max(first, self._last_received)

    def fail_if_hung(self, now: float, timeout: float) -> list[Slot]:
        """Fail the connection if its server has owed replies for more than ``timeout`` seconds
        without sending anything (hung or far away); returns the slots that failed."""
        if self.socket is None or self.silence(now) <= timeout or readable_now(self.socket):
            return []  # readable: replies, which the next read takes
        return self.fail(f"no reply within {timeout}s")

    def back_off_if_silent(self, now: float, waited: float) -> None:
        """Back the server off (once per silence) if it has owed replies for ``waited``
        seconds without sending anything: rounds stop sending to it, though each decided at
        quorum without it, and it keeps its connection until it counts as hung."""
        pending = self._pending
        if not pending or pending[0] is self._silence_reported or self.socket is None:
            return
        if self.silence(now) > waited and not readable_now(self.socket):
            self._silence_reported = pending[0]
            self.endpoint.mark_down(now, f"no reply within {waited:.3g}s")

    def close_if_closed_by_server(self, now: float, idle_for: float) -> None:
        """Close an idle connection that the server has closed (restarted, or dropping idle
        clients), so that the next command opens a new one instead of being lost."""
        if (
            self.socket is not None
            and not self._pending
            and now - self._last_used > idle_for
            and readable_now(self.socket)
        ):
            self.close("the server closed the idle connection")

    def fail(self, reason: object, back_off: bool = True) -> list[Slot]:
        """Close the connection, back the server off (if the fault was its own), and answer every
        slot waiting with `NO_REPLY`; returns those."""
        if back_off:
            self.endpoint.mark_down(time.monotonic(), reason)
        return self.close(self.endpoint.last_error if back_off else str(reason))

    def close(self, reason: str = "the connection was closed") -> list[Slot]:
        """Close the connection (a connection attempt under way is dropped when it ends);
        returns the slots still waiting, answered with `NO_REPLY`."""
        slots = list(self._pending)
        sock, self.socket = self.socket, None
        self.connecting = 0
        self._pending.clear()
        self._outbox.clear()
        self._parser = new_reply_parser()
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()
        for slot in slots:
            if not slot.done:
                slot.failure, slot.done = reason, True
        return slots
