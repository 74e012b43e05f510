"""One owner per process for the connections of one group (`Reactor`), and what callers wait on
(`Waiting`).

The invariants of the nodes layer stand here:

- **One thread owns every connection.** The reactor thread (a greenlet where gevent or eventlet
  patch the process) alone connects (through short-lived connect threads that hand it the
  socket), writes, reads, and touches a `Channel` or a `Subscriber`: their queues, parsers and
  sockets. What is queued for a socket goes out in one write; every readable socket is read
  per wake-up.
- **Callers only post and wait.** A caller (any thread) hands the reactor a request — a
  function and its arguments appended to the inbox, one atomic step — and wakes it; then it
  waits on its `Waiting` until the waiting is satisfied, calls for attention, or its deadline
  passes. A signal handler raising in a caller (Celery's soft time limit, SIGALRM, Ctrl-C: they
  run in the main thread only) can cut short only that caller: a request is in the inbox whole
  or not at all, and the reactor finishes whatever is in it. Nothing a caller does can shift a
  reply onto another caller's slot.
- **Waiters are judged under the reactor's lock.** The reactor hands each answered slot to its
  waiter (`Waiter.deliver`, e.g. a round counting votes) with `Reactor.lock` held; a caller reads
  or changes its waiting's state under the same lock. The lock is never held during I/O, and
  what a waiter returns from `deliver` (a follow-up: a redirection, a script load) runs on the
  reactor thread once the lock is free, and only posts requests, or queues one on a connection
  at once (`send_at_once`) where it must go ahead of what callers posted since.
- **Every wait has a deadline.** A server that owes replies and stays silent for the node
  timeout is backed off by the reactor's own timer (rounds that decide at quorum without it
  would never notice), and once silent for `hung_after` its connection fails and every slot on
  it is answered with `NO_REPLY`; a caller never waits past its own deadline, whatever the
  reactor does.
- **A forked child gets its own reactor** (`nodes.group`): the parent's sockets are closed in
  the child, and its thread does not exist there.
- **A caller's first request starts the thread**, and a handler may interrupt that start with
  the thread left running or dead (`threads.start_thread`): the thread holds `_running` while it
  runs, so the next request starts one exactly when none runs.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import select
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from redis.exceptions import RedisError as RedisClientError

from ..scripts import LOADED_ON_CONNECT
from .channel import Channel, Slot, hung_after, patience
from .endpoint import Endpoint
from .resp import pack_command
from .subscriber import Subscriber
from .threads import start_thread
from .wakeups import Flag, Wakeup

logger = logging.getLogger(__name__)

IDLE_SECONDS = 0.25
"""How long the reactor sleeps at most when nothing is due: a request whose wake-up a signal
handler cut short (it interrupted its caller between posting and waking) waits no longer."""

IDLE_CHECK_SECONDS = 0.25
"""A connection idle this long is checked for a server that closed it before it is used."""

CLOSE_WAIT_SECONDS = 5.0
"""How long `Reactor.close` waits for the reactor thread to close the connections."""

# Sent before the first command of every new connection (their replies are skipped): a round
# that decides before a slow server answers would never read its NOSCRIPT.
SCRIPT_LOADS = tuple(pack_command("SCRIPT", "LOAD", script.source) for script in LOADED_ON_CONNECT)

Target = Channel | Subscriber


class Waiting:
    """Something a caller waits for (a round of replies, release notifications). Subclasses
    define `deliver`, told of each answered slot of theirs on the reactor thread, and call
    `satisfy` (with the reactor's lock held) once it is complete."""

    def __init__(self) -> None:
        self.satisfied = False
        self.attention = False  # its caller must act before waiting on (see `call_attention`)
        self.wakeup = Wakeup()

    def satisfy(self) -> None:
        """Mark the wait complete and wake its caller."""
        self.satisfied = True
        self.wakeup.wake()

    def call_attention(self) -> None:
        """Wake the caller to act (send a follow-up command) before it waits on."""
        self.attention = True
        self.wakeup.wake()


class _Poller:
    """The sockets the reactor reads, by descriptor: ``poll`` where there is one, else
    ``select`` (eventlet's monkey patching removes ``select.poll``)."""

    def __init__(self) -> None:
        self._poll = select.poll() if hasattr(select, "poll") else None
        self.watched: dict[int, Any] = {}

    def watch(self, descriptor: int, target: Any) -> None:
        self.watched[descriptor] = target
        if self._poll is not None:
            self._poll.register(descriptor, select.POLLIN)

    def forget(self, descriptor: int, target: Any) -> None:
        """Stop polling ``descriptor`` unless it was taken over by another target since (a new
        socket with the number of a closed one)."""
        if self.watched.get(descriptor) is not target:
            return
        del self.watched[descriptor]
        if self._poll is not None:
            with contextlib.suppress(KeyError, ValueError):
                self._poll.unregister(descriptor)

    def ready(self, timeout: float) -> list[int]:
        if self._poll is not None:
            return [descriptor for descriptor, _ in self._poll.poll(max(timeout, 0.0) * 1000)]
        readable, _, _ = select.select(list(self.watched), [], [], max(timeout, 0.0))
        return list(readable)


class Reactor:
    """This process's connections to the servers of one group (one `Channel` and one
    `Subscriber` per server), and the thread that owns them (see the module docstring).
    ``node_timeout`` sets how long a silent server is waited for (`hung_after`)."""

    def __init__(self, node_timeout: float) -> None:
        self.pid = os.getpid()
        self.node_timeout = node_timeout
        self.hung_after = hung_after(node_timeout)
        self.lock = threading.Lock()  # over the waiters' state (see the module docstring)
        self.channels: dict[Endpoint, Channel] = {}
        self.subscribers: dict[Endpoint, Subscriber] = {}
        self._inbox: collections.deque[tuple[Callable[..., None], tuple[Any, ...]]] = (
            collections.deque()
        )
        self._answered: list[Slot] = []  # slots to hand to their waiters this turn
        self._looks: list[Flag] = []  # set once this turn has read every socket (`look`)
        self._next_check = 0.0  # when a silent server may next be due (`_check_silences`)
        self._writers: dict[Target, None] = {}  # targets with something to write this turn
        self._poller = _Poller()
        self._registered: dict[Target, int] = {}
        self._wake_reader, self._wake_writer = socket.socketpair()
        self._wake_reader.setblocking(False)
        self._wake_writer.setblocking(False)
        self._wake_descriptor = self._wake_reader.fileno()
        self._woken = False
        self._running = threading.Lock()  # held by the reactor thread for as long as it runs
        self._starting = threading.Lock()
        self._ident: int | None = None
        self.disposed = False

    # -- what callers do (any thread) --------------------------------------------------------

    def send(self, endpoint: Endpoint, payload: bytes, slots: Sequence[Slot]) -> None:
        """Have ``payload`` written to ``endpoint``'s connection, its replies going to
        ``slots`` in order (or `NO_REPLY`: the server is backed off, cannot be reached, or its
        connection fails)."""
        self._post(self._send, (endpoint, payload, slots))

    def send_at_once(self, endpoint: Endpoint, payload: bytes, slots: Sequence[Slot]) -> None:
        """On the reactor thread only (what a waiter left to do): `send`, queued on the
        connection now, ahead of every request still in the inbox."""
        self._send(endpoint, payload, slots)

    def listen(self, endpoint: Endpoint, channel: str, listener: Any) -> None:
        """Subscribe ``listener`` (a `Waiter`) to ``channel`` on ``endpoint``."""
        self._post(self._listen, (endpoint, channel, listener))

    def stop_listening(self, endpoint: Endpoint, channel: str, listener: Any) -> None:
        """Unsubscribe ``listener`` from ``channel`` on ``endpoint``."""
        self._post(self._stop_listening, (endpoint, channel, listener))

    def silent_for(self, endpoint: Endpoint, now: float, seconds: float) -> bool:
        """True if ``endpoint`` has owed replies for ``seconds`` without sending anything."""
        channel = self.channels.get(endpoint)
        return channel is not None and channel.silent_for(now, seconds)

    def wait(self, waiting: Waiting, deadline: float) -> None:
        """Wait until ``waiting`` is satisfied, calls for attention, or ``deadline``
        (``time.monotonic()``) passes."""
        wakeup = waiting.wakeup
        while not (waiting.satisfied or waiting.attention):
            left = deadline - time.monotonic()
            if left <= 0:
                return
            wakeup.sleep(left)

    def look(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds until the reactor thread has read every readable
        socket once more, and handed what it read to its waiters."""
        looked = Flag()
        self._post(self._look, (looked,))
        looked.wait(timeout)

    def close(self) -> None:
        """Close every connection (the slots still waiting are answered with `NO_REPLY`); a
        later request opens them again. Waits for the reactor thread to do it."""
        if self.pid != os.getpid() or self.disposed:
            return
        done = Flag()
        self._post(self._close_all, (done,))
        if threading.get_ident() != self._ident:
            done.wait(CLOSE_WAIT_SECONDS)

    def dispose(self) -> None:
        """Stop for good: for a group that is gone, or the parent's reactor in a forked child
        (where its thread does not exist)."""
        self.disposed = True
        if self.pid == os.getpid() and self._running.locked():
            self._wake()  # the thread closes the sockets on its way out
        else:
            self.close_sockets()

    def close_sockets(self) -> None:
        """Close every socket without taking any lock (in a forked child, another thread of the
        parent may have held one at the fork)."""
        targets: list[Target] = [*self.channels.values(), *self.subscribers.values()]
        for sock in (*[target.socket for target in targets], self._wake_reader, self._wake_writer):
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.close()

    def _post(self, function: Callable[..., None], arguments: tuple[Any, ...]) -> None:
        self._inbox.append((function, arguments))
        if not self._running.locked():
            self._start()
        self._wake()

    def _wake(self) -> None:
        if not self._woken:
            self._woken = True
            try:  # noqa: SIM105 -- every round passes here: no context manager per call
                self._wake_writer.send(b"x")
            except OSError:  # full (woken anyway) or closed (disposed)
                pass

    def _start(self) -> None:
        # A thread that finds another running leaves at once: two never own the connections.
        with self._starting:
            if self._running.locked() or self.disposed:
                return
            start_thread(self._run, name="celery-redlock reactor")

    # -- the reactor thread ------------------------------------------------------------------

    def _run(self) -> None:
        if not self._running.acquire(blocking=False):
            return
        self._ident = threading.get_ident()
        try:
            self._poller.watch(self._wake_descriptor, None)
            while not self.disposed:
                try:
                    self._turn()
                except Exception:  # a bug, not a server's fault: the connections start anew
                    logger.exception("celery-redlock's reactor failed; reconnecting")
                    self._close_all(None)
        finally:
            with contextlib.suppress(Exception):
                self._close_all(None)
            self.close_sockets()
            self._running.release()
            self._drop_requests()

    def _drop_requests(self) -> None:
        """Once disposed of: drop what is left in the inbox, closing the sockets of connections
        made too late."""
        while True:
            try:
                function, arguments = self._inbox.popleft()
            except IndexError:
                return
            if function == self._connection_made:
                with contextlib.suppress(OSError):
                    arguments[2].close()

    def _turn(self) -> None:
        """One turn: take the requests, write, hand replies over, wait for sockets (or the
        next timer, or a request), read them."""
        self._take_requests()
        self._write_and_deliver()
        if self._inbox or self._looks:  # a look reads what is there now, without waiting
            timeout = 0.0
        else:
            timeout = min(self._next_check - time.monotonic(), IDLE_SECONDS)
        ready = self._poller.ready(timeout)
        wake = self._wake_descriptor
        answered = self._answered
        for descriptor in ready:
            target = self._poller.watched.get(descriptor)
            if descriptor == wake:
                try:  # noqa: SIM105 -- every round passes here: no context manager per call
                    self._wake_reader.recv(4096)
                except OSError:
                    pass
            elif target is not None:
                target.read(answered)
                if target.socket is None:  # a read only ever closes a socket
                    self._rewatch(target)
        now = time.monotonic()
        if now >= self._next_check:
            self._check_silences(now)
        self._write_and_deliver()
        if self._looks:
            looks, self._looks = self._looks, []
            for looked in looks:
                looked.set()

    def _take_requests(self) -> None:
        self._woken = False  # first: a request posted from now on wakes the next poll
        inbox = self._inbox
        while inbox:
            function, arguments = inbox.popleft()
            function(*arguments)

    def _write_and_deliver(self) -> None:
        answered = self._answered
        if self._writers:
            writers, self._writers = self._writers, {}
            for target in writers:
                answered += target.write()
                if target.socket is None:  # a write only ever closes a socket
                    self._rewatch(target)
        if answered:
            batch = answered[:]
            answered.clear()
            self._deliver(batch)

    def _deliver(self, slots: list[Slot]) -> None:
        """Hand answered slots to their waiters; then run what the waiters left to do."""
        afterwards = []
        with self.lock:
            for slot in slots:
                if slot.waiter is not None:
                    then = slot.waiter.deliver(slot)
                    if then is not None:
                        afterwards.append(then)
        for then in afterwards:
            then()

    def _patience(self, channel: Channel) -> float:
        """Seconds ``channel``'s server may stay silent before it is backed off: the node
        timeout, or longer while its replies have been late (a busy host, `patience`)."""
        return patience(self.node_timeout, [channel.endpoint.lateness], 1)

    def _check_silences(self, now: float) -> None:
        """Back off the servers silent for their patience, fail the connections of those silent
        for `hung_after`, and note when the next may be due."""
        due = now + IDLE_SECONDS
        for channel in list(self.channels.values()):
            silence = channel.silence(now) if channel.socket is not None else 0.0
            if not silence:
                continue
            waited = self._patience(channel)
            if silence > waited:
                channel.back_off_if_silent(now, waited)
            if silence > self.hung_after:
                self._answered += channel.fail_if_hung(now, self.hung_after)
                self._rewatch(channel)
            due = min(due, now - silence + (waited if silence <= waited else self.hung_after))
        self._next_check = due + 0.001

    def _rewatch(self, target: Target) -> None:
        """Poll ``target``'s current socket (none when it closed)."""
        descriptor = target.fileno()
        registered = self._registered.get(target, -1)
        if descriptor == registered:
            return
        if registered != -1:
            self._poller.forget(registered, target)
            del self._registered[target]
        if descriptor != -1:
            self._poller.watch(descriptor, target)
            self._registered[target] = descriptor

    def _channel(self, endpoint: Endpoint) -> Channel:
        channel = self.channels.get(endpoint)
        if channel is None:
            channel = self.channels[endpoint] = Channel(endpoint, SCRIPT_LOADS)
        return channel

    def _send(self, endpoint: Endpoint, payload: bytes, slots: Sequence[Slot]) -> None:
        now = time.monotonic()
        channel = self._channel(endpoint)
        if channel.socket is None and not channel.connecting and endpoint.is_backed_off(now):
            for slot in slots:
                slot.failure, slot.done = endpoint.last_error, True
            self._answered += slots
            return
        if channel.socket is not None:
            if channel.owes:
                # A server owing replies for longer than hung_after is hung: the command is not
                # queued behind it, and the server is backed off (the slots fail at once).
                self._answered += channel.fail_if_hung(now, self.hung_after)
            else:
                channel.close_if_closed_by_server(now, IDLE_CHECK_SECONDS)
            self._rewatch(channel)
            if channel.socket is None and endpoint.is_backed_off(now):
                for slot in slots:
                    slot.failure, slot.done = endpoint.last_error, True
                self._answered += slots
                return
        if not channel.owes:  # its silence starts now: due at the node timeout at the earliest
            self._next_check = min(self._next_check, now + self.node_timeout)
        if channel.queue(payload, slots, now):
            self._connect(channel)
        else:
            self._writers[channel] = None

    def _listen(self, endpoint: Endpoint, channel: str, listener: Any) -> None:
        subscriber = self.subscribers.get(endpoint)
        if subscriber is None:
            subscriber = self.subscribers[endpoint] = Subscriber(endpoint)
        if subscriber.listen(channel, listener, self._answered):
            self._connect(subscriber)
        else:
            self._writers[subscriber] = None

    def _stop_listening(self, endpoint: Endpoint, channel: str, listener: Any) -> None:
        subscriber = self.subscribers.get(endpoint)
        if subscriber is not None:
            subscriber.stop(channel, listener)
            self._writers[subscriber] = None

    def _connect(self, target: Target) -> None:
        """Make a connection for ``target`` in a thread of its own (a handshake blocks), so that
        every other connection goes on meanwhile and several are made at once."""
        attempt = target.start_connecting()
        start_thread(
            self._make_connection,
            target,
            attempt,
            name=f"celery-redlock connect {target.endpoint.name}",
        )

    def _make_connection(self, target: Target, attempt: int) -> None:
        """In a connect thread: open the socket and hand it to the reactor thread."""
        try:
            sock = target.endpoint.open_socket()
        except (RedisClientError, OSError) as error:
            self._post(self._connection_failed, (target, attempt, error))
            return
        except Exception as error:  # a bug in a connection class: the commands still fail
            logger.exception("connecting to %s failed", target.endpoint.name)
            self._post(self._connection_failed, (target, attempt, error))
            return
        self._post(self._connection_made, (target, attempt, sock))
        if self.disposed:
            self._drop_requests()  # the reactor thread may be gone: nobody else takes it

    def _connection_made(self, target: Target, attempt: int, sock: Any) -> None:
        if target.connected(attempt, sock):
            self._rewatch(target)
            self._writers[target] = None

    def _connection_failed(self, target: Target, attempt: int, error: object) -> None:
        self._answered += target.connect_failed(attempt, error)

    def _look(self, looked: Flag) -> None:
        self._looks.append(looked)

    def _close_all(self, done: Flag | None) -> None:
        for channel in self.channels.values():
            self._answered += channel.close()
            self._rewatch(channel)
        for subscriber in self.subscribers.values():
            subscriber.close()
            self._rewatch(subscriber)
        self._write_and_deliver()
        if done is not None:
            done.set()
