"""A process's connections to the servers of one group (`Connections`), and who reads them: the
threads that wait, one at a time (`Reactor`).

A thread that waits for replies (a `Waiting`) becomes the *reader* when nobody else is reading:
it polls every connection of the process and reads what arrives into the slots it answers. After
every poll the layer above hands those slots to their waiters (`nodes.round.deliver`); the waiter
of a slot is woken only once what it waits for is complete. When its own wait is over, the
reader passes the role to one thread still waiting. A thread on its own is always the reader —
no hand-off, no extra thread. Commands queued while the reader polls, on connections that owe
replies, are written by the reader when its poll ends (`Channel.flush`). There is no thread per
call and no background reader: with gevent or eventlet, the waiting greenlets take turns the
same way.

Everything that waits here has a deadline; a deadline that passes wakes its waiter whatever the
others do. After a fork, the child has a reactor of its own (`nodes.group`).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Generator, Sequence

from ..scripts import LOADED_ON_CONNECT
from .channel import Channel, Slot, wait_readable
from .endpoint import Endpoint
from .resp import pack_command
from .subscriber import Subscriber


class Waiting:
    """Something a thread waits for (a round of replies, a release notification). Subclasses
    define `deliver`, told of each answered slot of theirs, and call `satisfy` (with the
    reactor's lock held) once it is complete."""

    def __init__(self) -> None:
        self.satisfied = False
        self.attention = False  # its thread must act before waiting on (see `call_attention`)
        self.asleep = False  # its thread sleeps (or is about to): only then is it woken
        self._wakeup = threading.Lock()
        self._wakeup.acquire()

    def satisfy(self) -> None:
        """Mark the wait complete and wake its thread."""
        self.satisfied = True
        self.wake()

    def call_attention(self) -> None:
        """Wake the waiting thread to act (send a follow-up command) before it waits on."""
        self.attention = True
        self.wake()

    def wake(self) -> None:
        """Wake the waiting thread (to find itself satisfied, or to take over reading) if it
        sleeps; a thread that reads finds out by itself. Called with the reactor's lock held."""
        if self.asleep:
            self.asleep = False
            with contextlib.suppress(RuntimeError):  # woken already
                self._wakeup.release()


class Reactor:
    """The reads of one process's connections (see the module docstring)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.channels: list[Channel | Subscriber] = []
        self.writers: list[Channel] = []
        self.polling = False  # a reader polls: it flushes the writers once the poll ends
        self._reading = False
        self._waiting: dict[Waiting, None] = {}  # those asleep or about to be, in order
        # Written to when a connection is added while a reader polls, so that it polls it too.
        self._wake_reader_read, self._wake_reader_write = os.pipe()
        os.set_blocking(self._wake_reader_read, False)
        os.set_blocking(self._wake_reader_write, False)
        # Under eventlet, a second green thread writing the pipe while a first waits to is an
        # error: connections opened at once (`Connections.open`) wake the reader one at a time.
        self._wake_reader_guard = threading.Lock()

    def add_channel(self, channel: Channel | Subscriber, writer: Channel | None = None) -> None:
        """Read ``channel`` too from now on; ``writer`` (the channel itself, when it leaves
        commands to the reader) is flushed after every poll."""
        with self.lock:
            if channel not in self.channels:
                self.channels.append(channel)
            if writer is not None and writer not in self.writers:
                self.writers.append(writer)

    def connection_opened(self) -> None:
        """A channel opened a new connection: a reader polling now must poll it as well."""
        with self._wake_reader_guard, contextlib.suppress(OSError):  # full: woken anyway
            os.write(self._wake_reader_write, b"x")

    def wait(
        self, waiting: Waiting, deadline: float, answered: list[Slot]
    ) -> Generator[None, None, None]:
        """Wait until ``waiting`` is satisfied, calls for attention, or ``deadline``
        (``time.monotonic()``) passes, reading for everybody while nobody else does. Yields
        whenever a read put slots in ``answered``: the caller hands them to their waiters, and
        empties the list, before it resumes the wait.

        Safe against a signal handler raising at any point (a soft time limit): on the way out
        (closed, too) the reading role is always given back, and the waiter taken off the list;
        slots read before the interruption are in ``answered``."""
        reading = looked = left = False
        try:
            while True:
                with self.lock:
                    if reading:  # back from reading: the role is free again
                        self._reading = False
                        reading = False
                    now = time.monotonic()
                    done = waiting.satisfied or waiting.attention
                    if not done and now >= deadline:
                        # A thread the CPU got to late may find its replies arrived in time,
                        # unread: one last look (without waiting) before it gives up on them.
                        done = looked or self._reading
                        looked = True
                        deadline = now
                    if done:
                        # On the way out with the lock held already (the `finally` clause takes
                        # it only when cut short); leaving twice does no harm.
                        self._leave_locked(waiting)
                        left = True
                        return
                    if not self._reading:
                        reading = True  # first: an interruption in between leaves no role held
                        self._reading = True
                        self._waiting.pop(waiting, None)
                    else:
                        waiting.asleep = True
                        self._waiting[waiting] = None
                if reading:
                    yield from self._read_until(waiting, deadline, answered)
                else:
                    waiting._wakeup.acquire(timeout=max(deadline - now, 0.0))  # until woken
        finally:
            if not left:
                with self.lock:
                    if reading:
                        self._reading = False
                    self._leave_locked(waiting)

    def _leave_locked(self, waiting: Waiting) -> None:
        """Off the list; with nobody reading, wake one waiting thread to take over the reading
        (``waiting``'s may have been woken to; the one woken may find itself done and pass it on
        in turn)."""
        waiting.asleep = False
        self._waiting.pop(waiting, None)
        if self._reading:
            return
        for other in self._waiting:
            if not other.satisfied:
                other.wake()
                return

    def _read_until(
        self, waiting: Waiting, deadline: float, answered: list[Slot]
    ) -> Generator[None, None, None]:
        """Read until ``waiting`` is satisfied or calls for attention, or ``deadline`` passes;
        at least one look, without waiting, even when it has passed already. Yields after every
        poll that answered slots (see `wait`)."""
        wake_descriptor = self._wake_reader_read
        looked = False
        while not (waiting.satisfied or waiting.attention):
            left = deadline - time.monotonic()
            if left <= 0 and looked:
                return
            looked = True
            with self.lock:
                by_descriptor = {channel.fileno(): channel for channel in self.channels}
                writers = self.writers
            by_descriptor.pop(-1, None)
            self.polling = True
            try:
                ready = wait_readable([wake_descriptor, *by_descriptor], max(left, 0.0))
            finally:
                # First, even when a signal handler raises: the commands left to this reader
                # while it polled (a command queued from now on is written by its sender).
                self.polling = False
                for writer in writers:
                    answered += writer.flush()
            for descriptor in ready:
                if descriptor == wake_descriptor:
                    with contextlib.suppress(OSError):
                        os.read(wake_descriptor, 4096)
                    continue
                by_descriptor[descriptor].read(descriptor, answered)
            if answered:
                yield

    def close(self) -> None:
        """Close the wake-up pipe (the channels are closed by their owners)."""
        for descriptor in (self._wake_reader_read, self._wake_reader_write):
            with contextlib.suppress(OSError):
                os.close(descriptor)


# Sent before the first command of every new connection (their replies are skipped): a round
# that decides before a slow server answers would never read its NOSCRIPT.
SCRIPT_LOADS = tuple(pack_command("SCRIPT", "LOAD", script.source) for script in LOADED_ON_CONNECT)


class Connections:
    """This process's connections to the servers of one group: one `Channel` per server, one
    `Subscriber` per server for release notifications, and the `Reactor` that reads them."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.reactor = Reactor()
        self.guard = threading.Lock()
        self.channels: dict[int, Channel] = {}
        self.subscribers: dict[int, Subscriber] = {}

    def channel(self, endpoint: Endpoint) -> Channel:
        """The connection to ``endpoint`` (made, not yet opened, on first use)."""
        channel = self.channels.get(id(endpoint))
        if channel is None:
            with self.guard:
                channel = self.channels.get(id(endpoint))
                if channel is None:
                    reactor = self.reactor
                    channel = Channel(endpoint, SCRIPT_LOADS, reactor)
                    reactor.add_channel(channel, channel)
                    self.channels[id(endpoint)] = channel
        return channel

    def open(self, endpoints: Sequence[Endpoint]) -> None:
        """Open the connections to ``endpoints`` not open yet all at once, each in a thread of
        its own but one in the caller's: a round's first call costs one connection's set-up
        (a TLS handshake), not one per member. A connection is opened whole or not at all in
        each thread; one interrupted in the caller's (a signal handler raising) is closed
        (`Endpoint.open_socket`), and the others are opened all the same."""
        # A channel whose lock is held while it has no connection is being connected by
        # another thread: the first command waits for that connection, in parallel with these.
        closed = [
            channel
            for channel in map(self.channel, endpoints)
            if channel.socket is None and not channel.lock.locked()
        ]
        if len(closed) < 2:
            return  # opened by its first command
        helpers = [
            threading.Thread(
                target=channel.open,
                name=f"celery-redlock connect {channel.endpoint.name}",
                daemon=True,
            )
            for channel in closed[1:]
        ]
        for helper in helpers:
            helper.start()
        closed[0].open()
        for helper in helpers:
            helper.join()

    def subscriber(self, endpoint: Endpoint) -> Subscriber:
        """The release-notification connection to ``endpoint`` (made on first use)."""
        subscriber = self.subscribers.get(id(endpoint))
        if subscriber is None:
            with self.guard:
                subscriber = self.subscribers.get(id(endpoint))
                if subscriber is None:
                    subscriber = Subscriber(endpoint, self.reactor.connection_opened)
                    self.reactor.add_channel(subscriber)
                    self.subscribers[id(endpoint)] = subscriber
        return subscriber

    def close(self) -> list[Slot]:
        """Close every connection; returns the slots still waiting, answered with no reply."""
        failed: list[Slot] = []
        for channel in list(self.channels.values()):
            failed += channel.close()
        for subscriber in list(self.subscribers.values()):
            subscriber.close()
        return failed

    def dispose(self) -> None:
        """Close every socket without taking any lock: for a group that is gone, or the parent's
        connections in a forked child (where another thread may have held a lock at the fork)."""
        sockets = [channel.socket for channel in self.channels.values()]
        sockets += [subscriber.socket for subscriber in self.subscribers.values()]
        for sock in sockets:
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.close()
        self.reactor.close()
