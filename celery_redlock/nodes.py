"""Connections to the independent Redis masters, and one multiplexed round over all of them.

A *round* sends one script call to every node at once and then collects the replies as they
arrive (one ``poll`` over the sockets), so its latency is that of the quorum-th fastest node, not
the sum of all round trips. Every node is bounded by ``node_timeout``. A node that fails, does
not answer in time, or answers with an error (out of memory, read-only replica, missing ACL
permission, still loading...) is backed off: skipped without any network traffic and probed again
from a background thread. Every socket of the package lives here, the release notifications that
waiting callers listen to included.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import re
import select
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

import redis
from redis.backoff import NoBackoff
from redis.connection import AbstractConnection, Connection, ConnectionPool
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import RedisError as RedisClientError
from redis.retry import Retry

from .errors import ConfigurationError
from .scripts import LOADED_ON_CONNECT, Script
from .settings import has_credentials, redact_url

logger = logging.getLogger(__name__)

FIRST_BACKOFF_SECONDS = 0.25
MAX_BACKOFF_SECONDS = 0.5  # a node that comes back is in use again within about a second


class _NoReply:
    """Marks a node that gave no usable reply in a round (down, backed off, late, an error)."""

    def __repr__(self) -> str:
        return "NO_REPLY"


NO_REPLY: Any = _NoReply()


def _no_client_setinfo() -> dict[str, Any]:
    """Connection arguments that turn off CLIENT SETINFO (spelled differently across redis-py)."""
    try:
        Connection(driver_info=None)  # redis-py 7 and later
    except TypeError:
        return {"lib_name": None, "lib_version": None}
    return {"driver_info": None}


_NO_CLIENT_SETINFO = _no_client_setinfo()


def pack_command(*arguments: str | int | bytes) -> bytes:
    """Encode one command in the Redis protocol (RESP), the same bytes for every node."""
    encoded = [
        argument.encode()
        if isinstance(argument, str)
        else argument
        if isinstance(argument, bytes)
        else str(argument).encode()
        for argument in arguments
    ]
    return b"*%d\r\n" % len(encoded) + b"".join(
        [b"$%d\r\n%b\r\n" % (len(argument), argument) for argument in encoded]
    )


# Sent before the first command of every new connection (their replies are skipped like any
# owed reply): a round that decides before a slow node answers would never read its NOSCRIPT.
SCRIPT_LOADS = tuple(pack_command("SCRIPT", "LOAD", script.source) for script in LOADED_ON_CONNECT)


class OwnPoolClient(redis.Redis):
    """A redis-py client that owns its connection pool: ``close()`` (and leaving a ``with``
    block) also closes the pool's connections, which redis-py 5.0's ``close()`` leaves open."""

    def close(self) -> None:
        """Return the client's connection and close every connection of its pool."""
        super().close()
        self.connection_pool.disconnect()


class PollableConnection(Protocol):
    """A redis-py connection whose socket can be waited on with ``poll``."""

    def fileno(self) -> int: ...
    def connect(self) -> None: ...
    def disconnect(self, *args: Any) -> None: ...
    def send_command(self, *args: Any, **kwargs: Any) -> None: ...
    def send_packed_command(self, command: Any, check_health: bool = True) -> None: ...
    def read_response(self, *args: Any, **kwargs: Any) -> Any: ...
    def can_read(self, timeout: float = 0) -> bool: ...


def _fileno(connection: AbstractConnection) -> int:
    # The one place the package reads redis-py's socket: poll() needs its descriptor.
    sock = connection._sock
    return sock.fileno() if sock is not None else -1


def _pollable_class(connection_class: type[AbstractConnection]) -> type[AbstractConnection]:
    """``connection_class`` with a public ``fileno()`` (TCP, TLS and unix sockets alike)."""
    return type(f"Pollable{connection_class.__name__}", (connection_class,), {"fileno": _fileno})


ACL_HINT = "apply the least-privilege ACL line of README's 'TLS, passwords, ACL users'"

# How nodes say that the ACL user may not do something: NOPERM replies, and the errors of commands
# run inside scripts (which the scripts' call() suffixes with "[command <name>]").
_DENIED = ("NOPERM", "can't run this command", "No permissions to access")


def describe_failure(reason: object) -> str:
    """A one-line account of why a node gave no usable reply. A denied command names the command
    and the ACL rule that grants it, instead of looking like a network failure."""
    text = str(reason)
    if not any(marker in text for marker in _DENIED):
        return text
    named = re.search(r"run the '([^']+)' command", text) or re.search(
        r"\[command ([^\]]+)\]", text
    )
    if "access a key" in text or "access a channel" in text:
        return (
            f"NOPERM: the node's user may not use celery_redlock's keys or channels ({text}); "
            f"its ACL needs ~<key prefix>* and &<key prefix>*; {ACL_HINT}"
        )
    if named is not None:
        command = named.group(1).lower()
        return (
            f"NOPERM: the node's user may not run {command!r}; grant it with "
            f"ACL SETUSER <user> +{command}, or {ACL_HINT}"
        )
    return f"NOPERM: the node's user lacks a permission ({text}); {ACL_HINT}"


class Node:
    """One independent Redis master: where it is and whether it is currently backed off.

    Health is shared by every connection to the node in this process. A failure backs the node
    off for 0.25 s, doubling up to 0.5 s while it keeps failing; once that passes, a background
    thread probes it (connect, PING) and rounds take it back when it answers. The back-off is
    forgotten only when a round gets a good reply, so a node that answers PING but fails every
    command (out of memory, read-only) stays backed off.
    """

    def __init__(
        self,
        url: str,
        node_timeout: float,
        username: str | None = None,
        password: str | None = None,
    ) -> None:
        # Credentials of the settings apply to a URL that names none of its own.
        credentials = {} if has_credentials(url) else {"username": username, "password": password}
        try:
            pool = ConnectionPool.from_url(
                url,
                socket_timeout=node_timeout,
                socket_connect_timeout=node_timeout,
                retry=Retry(NoBackoff(), 0),
                health_check_interval=0,
                protocol=2,
                **credentials,
            )
        except (ValueError, TypeError) as error:
            raise ConfigurationError(
                f"cannot use lock node URL {redact_url(url)!r}: {error}; "
                "the form is redis://[user:password@]host:port/db"
            ) from error
        self.name = redact_url(url)
        self._connection_class = _pollable_class(pool.connection_class)
        self._connection_kwargs: dict[str, Any] = dict(pool.connection_kwargs)
        # No CLIENT SETINFO in the handshake: connecting to a hung node then costs nothing until
        # the round's own command, which every node is waited for in parallel.
        self._connection_kwargs.update(_NO_CLIENT_SETINFO)
        self.last_error = ""  # why the node was last backed off, for error messages
        self._suspect = False  # True from a failure until a probe sees the node answer
        self._down_until = 0.0
        self._backoff = 0.0
        # No lock guards the probe: a lock held by another thread at a fork would stay held in
        # the child for ever. Two threads starting a probe at once merely probe twice.
        self._probing_pid = 0
        self._probe_finished = threading.Event()

    def new_connection(self) -> PollableConnection:
        """A fresh, not yet connected connection to this node."""
        return cast(PollableConnection, self._connection_class(**self._connection_kwargs))

    def client(self, timeout: float | None = None) -> redis.Redis:
        """A plain redis-py client for this node (administration, tests), by default with the
        node's own timeouts."""
        options = dict(self._connection_kwargs)
        if timeout is not None:
            options.update(socket_timeout=timeout, socket_connect_timeout=timeout)
        return OwnPoolClient(
            connection_pool=ConnectionPool(connection_class=self._connection_class, **options)
        )

    def is_backed_off(self, now: float) -> bool:
        """True while the node is skipped after a failure (starting a probe once it is due)."""
        if not self._suspect:
            return False
        if now >= self._down_until:
            self._start_probe()
        return True

    def _start_probe(self) -> None:
        pid = os.getpid()
        if self._probing_pid == pid:
            return  # a probe is already on its way in this process
        self._probing_pid = pid
        self._probe_finished = threading.Event()
        threading.Thread(
            target=self._probe,
            args=(self._probe_finished,),
            name=f"celery-redlock probe {self.name}",
            daemon=True,
        ).start()

    def _probe(self, finished: threading.Event) -> None:
        connection = self.new_connection()
        try:
            connection.connect()
            # PING is in the least-privilege ACL README documents; a user denied it still shows
            # that the node answers (its NOPERM is an answer), so it does not count against it.
            connection.send_command("PING", check_health=False)
            if connection.read_response() not in (b"PONG", "PONG"):
                raise ResponseError("the node does not answer PING with PONG")
        except ResponseError as error:
            if str(error).startswith("NOPERM"):
                self._suspect = False  # the node answers; the user may not PING (see module)
            else:
                self.mark_down(time.monotonic(), error)
        except (RedisClientError, OSError) as error:
            self.mark_down(time.monotonic(), error)
        else:
            self._suspect = False
        finally:
            with contextlib.suppress(RedisClientError, OSError):
                connection.disconnect()
            self._probing_pid = 0
            finished.set()

    @property
    def probing(self) -> bool:
        """True while this process's probe of the node is under way."""
        return self._probing_pid == os.getpid()

    def wait_for_probe(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the probe under way, if any, to finish."""
        if self.probing and timeout > 0:
            self._probe_finished.wait(timeout)

    def mark_down(self, now: float, reason: object) -> None:
        """Skip this node for a while (doubling each time it fails again, up to a cap)."""
        was_up = self._backoff == 0.0
        self.last_error = describe_failure(reason)
        self._backoff = min(MAX_BACKOFF_SECONDS, max(FIRST_BACKOFF_SECONDS, self._backoff * 2))
        self._down_until = now + self._backoff
        self._suspect = True
        if was_up:
            logger.warning(
                "lock node %s is unavailable (%s); skipping it for %.2fs, then probing again",
                self.name,
                self.last_error,
                self._backoff,
            )

    def mark_answered(self) -> None:
        """Record a good reply: the node takes part in every round again."""
        if self._backoff:
            logger.info("lock node %s answers again", self.name)
            self._backoff = 0.0
            self._suspect = False


class Link:
    """One connection to one node, used by one thread at a time.

    Replies still owed by the server from earlier rounds that decided without them are counted
    in ``owed`` and skipped before the reply of the current round is read; ``sent_at`` holds
    when each owed command was sent, oldest first.
    """

    def __init__(self, node: Node) -> None:
        self.node = node
        self.connection: PollableConnection | None = None
        self.owed = 0
        self.sent_at: collections.deque[float] = collections.deque()

    def fileno(self) -> int:
        """The connection's socket descriptor (-1 when it is closed)."""
        return self.connection.fileno() if self.connection is not None else -1

    def send(self, packed: bytes, node_timeout: float) -> bool:
        """Send one packed command; False (and the node backed off) if that failed.

        Ages are measured on the clock: connecting to hung nodes earlier in the same round can
        take longer than ``node_timeout``, and a command sent after that is not overdue yet.
        """
        if self.owed and self._overdue(node_timeout):
            self.fail("no reply within node_timeout")
            return False
        commands = [packed]
        try:
            if self.connection is None:
                self.connection = self.node.new_connection()
                commands[:0] = SCRIPT_LOADS
            self.connection.send_packed_command(commands, check_health=False)
        except (RedisClientError, OSError) as error:
            self.fail(error)
            return False
        self.owed += len(commands)
        self.sent_at.extend([time.monotonic()] * len(commands))
        return True

    def _overdue(self, node_timeout: float) -> bool:
        """True if a reply owed by an earlier round is more than ``node_timeout`` late (after
        reading those that arrived), or the connection broke. Each owed command has its own send
        time: one sent by the previous round a moment ago may well still be on its way.
        """
        assert self.connection is not None
        if time.monotonic() - self.sent_at[0] <= node_timeout:
            return False
        try:
            while self.owed and self.connection.can_read(timeout=0):
                self._read()
        except (RedisClientError, OSError):
            return True
        return bool(self.owed) and time.monotonic() - self.sent_at[0] > node_timeout

    def _read(self) -> Any:
        """One reply; an error reply (such as NOSCRIPT) is returned, not raised. Any other
        reply, even one owed by an earlier round, shows that the node answers."""
        assert self.connection is not None
        self.owed -= 1
        self.sent_at.popleft()
        try:
            reply = self.connection.read_response()
        except ResponseError as error:
            # Without its traceback: the frames it holds would hold the error again (a cycle
            # that keeps this connection's socket open until the garbage collector runs).
            return error.with_traceback(None)
        self.node.mark_answered()
        return reply

    def read_current(self) -> tuple[bool, Any]:
        """Read replies until this round's arrives: (True, reply), or (False, None) if it is still
        on its way. Raises the redis-py error on a broken connection.
        """
        assert self.connection is not None
        while self.owed > 1:
            self._read()
            if not self.connection.can_read(timeout=0):
                return False, None
        return True, self._read()

    def fail(self, reason: object) -> None:
        """Drop the connection (and anything owed on it) and back the node off."""
        self.close()
        self.node.mark_down(time.monotonic(), reason)

    def close(self) -> None:
        """Close the connection; the next send opens a new one."""
        if self.connection is not None:
            with contextlib.suppress(RedisClientError, OSError):
                self.connection.disconnect()
        self.connection = None
        self.owed = 0
        self.sent_at.clear()


Judge = Callable[[Any], "bool | None"]
"""Tells what one node's reply to a script means: True — it did what was asked; False — it
answered, and refused; None — the reply is not one the script can return (untrusted input: it
counts as no answer, like an error reply)."""


@dataclass
class RoundResult:
    """What one round learned: each node's reply (``NO_REPLY`` where there was none usable),
    how many nodes answered (error replies and replies the script cannot give are not answers),
    how many succeeded, and for each node without a usable reply why (else None)."""

    replies: list[Any]
    successes: int
    answered: int
    finished_at: float
    failures: list[str | None]

    def unavailable_reasons(self, names: Sequence[str]) -> tuple[str, ...]:
        """``"<node>: <why>"`` for every node that gave no usable reply."""
        return tuple(
            f"{name}: {why}" for name, why in zip(names, self.failures, strict=True) if why
        )


class Round:
    """One script call on every node at once, and its replies as they arrive."""

    def __init__(
        self,
        group: NodeGroup,
        links: list[Link],
        script: Script,
        call: tuple[Any, ...],
        judge: Judge,
        every: bool,
    ) -> None:
        self.group = group
        self.links = links
        self.script = script
        self.call = call
        self.judge = judge
        self.every = every
        self.replies: list[Any] = [NO_REPLY] * len(links)
        self.why_not: list[str | None] = ["not asked"] * len(links)
        self.waiting: dict[int, int] = {}  # socket descriptor -> node index
        self.poller = select.poll()
        self.successes = 0
        self.answered = 0
        self.failures = 0

    def send_to_available_nodes(self, wait: bool) -> None:
        """Send to every node that is not backed off. When those are too few for a quorum, give
        the nodes being probed (in parallel) one node_timeout and take in those that answered."""
        now = time.monotonic()
        if wait and not self.script.inline:
            packed = pack_command("EVALSHA", self.script.sha, *self.call)
        else:
            # Nobody reads a NOSCRIPT reply of these (clean-ups, or a release whose quorum is
            # reached before a restarted node answers): send the source, which cannot miss.
            packed = pack_command("EVAL", self.script.source, *self.call)
        self._drop_closed_connections()
        probing = []
        for index, link in enumerate(self.links):
            if link.node.is_backed_off(now):
                self.why_not[index] = f"skipped while backed off ({link.node.last_error})"
                if link.node.probing:
                    probing.append(index)
            else:
                self._send(index, packed)
        if wait and probing and len(self.waiting) < self.group.quorum:
            until = time.monotonic() + self.group.node_timeout
            for index in probing:
                self.links[index].node.wait_for_probe(until - time.monotonic())
            now = time.monotonic()
            for index in probing:
                if not self.links[index].node.is_backed_off(now):
                    self._send(index, packed)
        self.failures = len(self.links) - len(self.waiting)

    def _drop_closed_connections(self) -> None:
        """Close idle connections the server has closed (it restarted, or dropped idle clients):
        an idle connection with something to read holds only the end of the stream. One poll
        over all of them: a command sent on such a connection would be lost — a release, say,
        on a node that restarted and had the lock set again by an extension since."""
        idle = {link.fileno(): link for link in self.links if link.connection and not link.owed}
        idle.pop(-1, None)
        if not idle:
            return
        poller = select.poll()
        for descriptor in idle:
            poller.register(descriptor, select.POLLIN)
        for descriptor, _ in poller.poll(0):
            idle[descriptor].close()

    def _send(self, index: int, packed: bytes) -> None:
        link = self.links[index]
        if link.send(packed, self.group.node_timeout):
            descriptor = link.fileno()
            self.waiting[descriptor] = index
            self.poller.register(descriptor, select.POLLIN)
            self.why_not[index] = None
        else:
            self.why_not[index] = link.node.last_error

    def decided(self) -> bool:
        """True once the outcome is known: a quorum succeeded, a majority refused, or no quorum
        can succeed and every reply in flight has been read."""
        if self.every:
            return False
        quorum = self.group.quorum
        if self.successes >= quorum:
            return True
        if self.failures < len(self.links) - quorum + 1:
            return False
        # No quorum can succeed. Refused by a majority is an answer; otherwise the replies in
        # flight are still read (within node_timeout), so that the count of nodes that answered
        # is right when the caller reports "no quorum".
        return self.answered >= quorum or not self.waiting

    def collect_replies(self) -> None:
        """Read replies as they arrive until the outcome is known or node_timeout has passed
        (counted from the last send: connecting happens in the send loop, one node at a time)."""
        deadline = time.monotonic() + self.group.node_timeout
        while self.waiting and not self.decided():
            # poll(0) once the deadline passed: a reply already there is not a timeout (the
            # thread may have been descheduled, e.g. waiting for the GIL).
            events = self.poller.poll(max(0.0, deadline - time.monotonic()) * 1000)
            if not events:
                break
            for descriptor, _ in events:
                self._read_from(descriptor)
        if not self.decided():
            # Timed out: whoever is still silent is hung or far away.
            for index in self.waiting.values():
                self.links[index].fail(f"no reply within {self.group.node_timeout}s")
                self.why_not[index] = self.links[index].node.last_error

    def _read_from(self, descriptor: int) -> None:
        index = self.waiting.pop(descriptor)
        self.poller.unregister(descriptor)
        link = self.links[index]
        try:
            arrived, reply = link.read_current()
            if arrived and isinstance(reply, NoScriptError):
                # The node lost its script cache (restart, SCRIPT FLUSH): send the source.
                source = pack_command("EVAL", self.script.source, *self.call)
                if not link.send(source, self.group.node_timeout):
                    self.why_not[index] = link.node.last_error
                    self.failures += 1
                    return
                arrived = False
        except (RedisClientError, OSError) as error:
            link.fail(error)
            self.why_not[index] = link.node.last_error
            self.failures += 1
            return
        if not arrived:
            self.waiting[descriptor] = index
            self.poller.register(descriptor, select.POLLIN)
            return
        verdict = None if isinstance(reply, ResponseError) else self.judge(reply)
        if verdict is None:
            # Out of memory, read-only, no permission, loading, or a reply the script cannot
            # give: the node neither granted nor refused anything. It counts as not answering,
            # and is backed off like one.
            why = (
                f"error reply: {reply}"
                if isinstance(reply, ResponseError)
                else (f"a reply the {self.script.name} script cannot give: {reply!r:.80}")
            )
            link.node.mark_down(time.monotonic(), why)
            self.why_not[index] = link.node.last_error
            self.failures += 1
            return
        self.replies[index] = reply
        self.answered += 1
        if verdict:
            self.successes += 1
        else:
            self.failures += 1

    def result(self) -> RoundResult:
        """What the round learned."""
        return RoundResult(
            self.replies, self.successes, self.answered, time.monotonic(), self.why_not
        )


class LinkSet:
    """One connection per node, owned by one thread of one process. Its connections are closed
    when it is dropped (its `Redlock` or its thread gone), not left to the garbage collector."""

    def __init__(self, nodes: Sequence[Node]) -> None:
        self.links = [Link(node) for node in nodes]
        self.pid = os.getpid()
        weakref.finalize(self, close_links, self.links)


def close_links(links: Sequence[Link]) -> None:
    """Close every link's connection."""
    for link in links:
        link.close()


class NodeGroup:
    """The lock nodes of one `Redlock`, with one set of connections per thread, opened lazily.

    A thread always uses the same connections, so its commands reach each node in the order it
    sent them (a release never overtakes its own acquisition's late SET). Connections are opened
    in the process that uses them: after a fork, the child leaves the parent's sockets alone and
    opens its own.
    """

    def __init__(
        self,
        urls: Sequence[str],
        node_timeout: float,
        username: str | None = None,
        password: str | None = None,
    ) -> None:
        self.nodes = [Node(url, node_timeout, username, password) for url in urls]
        self.node_timeout = node_timeout
        self.quorum = len(self.nodes) // 2 + 1
        self._per_thread = threading.local()
        self._all_sets: weakref.WeakSet[LinkSet] = weakref.WeakSet()

    def _links(self) -> LinkSet:
        links: LinkSet | None = getattr(self._per_thread, "links", None)
        if links is None or links.pid != os.getpid():
            links = LinkSet(self.nodes)
            self._per_thread.links = links
            self._all_sets.add(links)
        return links

    def close(self) -> None:
        """Close this process's connections to the nodes; later rounds open new ones."""
        for links in list(self._all_sets):
            if links.pid == os.getpid():
                close_links(links.links)

    def close_thread(self) -> None:
        """Close the calling thread's connections in this process."""
        links: LinkSet | None = getattr(self._per_thread, "links", None)
        if links is not None and links.pid == os.getpid():
            close_links(links.links)

    def run(
        self,
        script: Script,
        keys: Sequence[str],
        arguments: Sequence[str | int],
        judge: Judge,
        wait: bool = True,
        every: bool = False,
    ) -> RoundResult:
        """Run ``script`` on every node at once and collect replies until the outcome is known.

        ``judge`` says what each reply means (`Judge`). The outcome is known when a quorum
        succeeded, when a quorum can no longer succeed, or
        when ``node_timeout`` has passed; with ``every=True`` only when every node answered or
        timed out (operators' commands that report per node). With ``wait=False`` the commands
        are only sent (their replies are skipped by a later round), for clean-ups nobody waits on.
        """
        links = self._links().links
        round_ = Round(self, links, script, (len(keys), *keys, *arguments), judge, every)
        try:
            round_.send_to_available_nodes(wait)
            if wait:
                round_.collect_replies()
        except BaseException:
            # Interrupted (a soft time limit, a signal): what each connection still owes is
            # unknown, so start afresh. Callers release what the round may have taken.
            for link in links:
                link.close()
            raise
        return round_.result()

    def listen_for_releases(self, channel: str) -> ReleaseListener:
        """Subscriptions to ``channel`` on every node that is not backed off."""
        return ReleaseListener(self.nodes, channel)


class ReleaseListener:
    """Subscriptions to a lock's release channel on every reachable node, for blocking waits."""

    def __init__(self, nodes: Sequence[Node], channel: str) -> None:
        self._connections: list[PollableConnection] = []
        now = time.monotonic()
        for node in nodes:
            if node.is_backed_off(now):
                continue
            connection = node.new_connection()
            try:
                connection.send_command("SUBSCRIBE", channel, check_health=False)
                connection.read_response()
            except (RedisClientError, OSError):
                connection.disconnect()
                continue
            self._connections.append(connection)

    def __enter__(self) -> ReleaseListener:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Drop the subscriptions."""
        for connection in self._connections:
            connection.disconnect()
        self._connections.clear()

    def wait(self, seconds: float) -> bool:
        """Sleep up to ``seconds``; True as soon as any node announced a release."""
        if not self._connections:
            time.sleep(max(seconds, 0))
            return False
        by_descriptor: dict[int, PollableConnection] = {}
        poller = select.poll()
        for connection in self._connections:
            descriptor = connection.fileno()
            if descriptor >= 0:
                by_descriptor[descriptor] = connection
                poller.register(descriptor, select.POLLIN)
        woken = False
        for descriptor, _ in poller.poll(max(seconds, 0) * 1000):
            connection = by_descriptor[descriptor]
            try:
                while connection.can_read(timeout=0):
                    message = connection.read_response()
                    woken = woken or (isinstance(message, list) and message[:1] == [b"message"])
            except (RedisClientError, OSError):
                connection.disconnect()
                self._connections.remove(connection)
        return woken
