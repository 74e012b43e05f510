"""Connections to the independent Redis masters, and one multiplexed round over all of them.

A *round* sends one script call to every node at once and then collects the replies as they
arrive (one `select` over the sockets), so its latency is that of the quorum-th fastest node, not
the sum of all round trips. Every node is bounded by ``node_timeout``; a node that fails or does
not answer in time is backed off (skipped without any network traffic) and probed again later,
so a dead or hung node costs at most one timeout per back-off period rather than one per call.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import select
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.connection import AbstractConnection, Connection, ConnectionPool
from redis.exceptions import NoScriptError
from redis.exceptions import RedisError as RedisClientError
from redis.retry import Retry

from .errors import ConfigurationError
from .scripts import Script

logger = logging.getLogger(__name__)

FIRST_BACKOFF_SECONDS = 0.25
MAX_BACKOFF_SECONDS = 5.0


class _NoReply:
    """Marks a node that gave no usable reply in a round (down, backed off, timed out)."""

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


def redact_url(url: str) -> str:
    """The URL with any password replaced by ``***``, safe to log."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rpartition("@")[2]  # as written: parts.port raises on a bad port
    return urlunsplit((parts.scheme, f"{user}:***@{host}", parts.path, parts.query, ""))


def pack_command(*arguments: str | int | bytes) -> bytes:
    """Encode one command in the Redis protocol (RESP), the same bytes for every node."""
    encoded = [
        argument if isinstance(argument, bytes) else str(argument).encode()
        for argument in arguments
    ]
    parts = [b"*%d\r\n" % len(encoded)]
    for argument in encoded:
        parts.append(b"$%d\r\n%s\r\n" % (len(argument), argument))
    return b"".join(parts)


class Node:
    """One independent Redis master: where it is and whether it is currently backed off.

    Health is shared by every connection to the node in this process.
    """

    def __init__(self, url: str, node_timeout: float) -> None:
        if not isinstance(url, str) or not url.startswith(("redis://", "rediss://", "unix://")):
            raise ConfigurationError(
                f"lock node URL {url!r} is not a Redis URL; use redis://host:port/db, "
                "rediss://host:port/db (TLS) or unix:///path/to/redis.sock"
            )
        try:
            pool = ConnectionPool.from_url(
                url,
                socket_timeout=node_timeout,
                socket_connect_timeout=node_timeout,
                retry=Retry(NoBackoff(), 0),
                health_check_interval=0,
                protocol=2,
            )
        except (ValueError, TypeError) as error:
            raise ConfigurationError(
                f"cannot parse lock node URL {redact_url(url)!r}: {error}; "
                "the form is redis://[user:password@]host:port/db"
            ) from error
        self.name = redact_url(url)
        self._connection_class: type[AbstractConnection] = pool.connection_class
        self._connection_kwargs: dict[str, Any] = dict(pool.connection_kwargs)
        # No CLIENT SETINFO in the handshake: connecting to a hung node then costs nothing until
        # the round's own command, which every node is waited for in parallel.
        self._connection_kwargs.update(_NO_CLIENT_SETINFO)
        self._down_until = 0.0
        self._backoff = 0.0
        self._probe_guard = threading.Lock()
        self._probing_pid = 0  # the process whose probe thread is checking this node, or 0
        self._probe_finished = threading.Event()

    def new_connection(self) -> AbstractConnection:
        """A fresh, not yet connected connection to this node."""
        return self._connection_class(**self._connection_kwargs)

    def client(self) -> redis.Redis:
        """A plain redis-py client for this node (administration, tests), with the same timeouts."""
        return redis.Redis(
            connection_pool=ConnectionPool(
                connection_class=self._connection_class, **self._connection_kwargs
            )
        )

    def is_backed_off(self, now: float) -> bool:
        """True while the node is skipped after a failure.

        Once the back-off period is over, a background thread probes the node (connect, PING)
        and it stays skipped until it answers: a round never waits on connecting to a node known
        to have failed (a hung node accepts TCP connections but never answers the handshake, so
        connecting inside a round costs a full node_timeout per such node, one after the other).
        """
        if now < self._down_until:
            return True
        if not self._backoff:
            return False
        self._start_probe()
        return True

    def _start_probe(self) -> None:
        pid = os.getpid()
        with self._probe_guard:
            if self._probing_pid == pid:
                return  # a probe is already on its way in this process
            self._probing_pid = pid
            self._probe_finished.clear()
        threading.Thread(
            target=self._probe, name=f"celery-redlock probe {self.name}", daemon=True
        ).start()

    def _probe(self) -> None:
        connection = self.new_connection()
        try:
            connection.connect()
            connection.send_command("PING", check_health=False)
            connection.read_response()
        except (RedisClientError, OSError) as error:
            self.mark_down(time.monotonic(), error)
        else:
            self.mark_up()
        finally:
            with contextlib.suppress(RedisClientError, OSError):
                connection.disconnect()
            with self._probe_guard:
                self._probing_pid = 0
                self._probe_finished.set()

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
        self._backoff = min(MAX_BACKOFF_SECONDS, max(FIRST_BACKOFF_SECONDS, self._backoff * 2))
        self._down_until = now + self._backoff
        if was_up:
            logger.warning(
                "lock node %s is unavailable (%s); skipping it for %.2fs, then probing again",
                self.name,
                reason,
                self._backoff,
            )

    def mark_up(self) -> None:
        """Record a successful reply: the node takes part in every round again."""
        if self._backoff:
            logger.info("lock node %s answers again", self.name)
            self._backoff = 0.0
            self._down_until = 0.0


class Link:
    """One connection to one node, used by one thread at a time.

    Replies still owed by the server from earlier rounds that decided without them are counted
    in ``owed`` and skipped before the reply of the current round is read; ``sent_at`` holds
    when each owed command was sent, oldest first.
    """

    def __init__(self, node: Node) -> None:
        self.node = node
        self.connection: AbstractConnection | None = None
        self.owed = 0
        self.sent_at: collections.deque[float] = collections.deque()

    def socket_fileno(self) -> int:
        assert self.connection is not None
        sock = self.connection._sock  # redis-py keeps the socket here; select() needs it
        return sock.fileno() if sock is not None else -1

    def send(self, packed: list[bytes], now: float, node_timeout: float) -> bool:
        """Send one packed command; False (and the node backed off) if that failed.

        Ages are measured on the clock, not from ``now`` (the round's start): connecting to
        hung nodes earlier in the same round can take longer than ``node_timeout``, and a
        command sent after that must not count as already overdue.
        """
        if self.owed and self._overdue(node_timeout):
            self.fail(now, "no reply within node_timeout")
            return False
        try:
            if self.connection is None:
                self.connection = self.node.new_connection()
            self.connection.send_packed_command(packed, check_health=False)
        except (RedisClientError, OSError) as error:
            self.fail(now, error)
            return False
        self.owed += 1
        self.sent_at.append(time.monotonic())
        return True

    def send_now(self, packed: bytes) -> None:
        """Send one more command on an open connection inside the current round."""
        assert self.connection is not None
        self.connection.send_packed_command([packed], check_health=False)
        self.owed += 1
        self.sent_at.append(time.monotonic())

    def _overdue(self, node_timeout: float) -> bool:
        """True if a reply owed by an earlier round is more than ``node_timeout`` late (after
        reading those that arrived), or the connection broke. Each owed command has its own send
        time: one sent by the previous round a moment ago may well still be on its way, and is
        no failure even if older replies were late (they have arrived since).
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
        """One reply; an error reply (such as NOSCRIPT) is returned, not raised."""
        assert self.connection is not None
        self.owed -= 1
        self.sent_at.popleft()
        try:
            reply = self.connection.read_response()
        except redis.ResponseError as error:
            reply = error
        self.node.mark_up()  # any reply, even one owed by an earlier round: the node answers
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

    def fail(self, now: float, reason: object) -> None:
        """Drop the connection (and anything owed on it) and back the node off."""
        self.close()
        self.node.mark_down(now, reason)

    def close(self) -> None:
        """Close the connection; the next send opens a new one."""
        if self.connection is not None:
            with contextlib.suppress(RedisClientError, OSError):
                self.connection.disconnect()
        self.connection = None
        self.owed = 0
        self.sent_at.clear()


@dataclass
class RoundResult:
    """What one round learned: each node's reply (or ``NO_REPLY``) and how many succeeded."""

    replies: list[Any]
    successes: int
    answered: int
    finished_at: float


class LinkSet:
    """One connection per node, owned by one thread of one process."""

    def __init__(self, nodes: Sequence[Node]) -> None:
        self.links = [Link(node) for node in nodes]
        self.pid = os.getpid()


class NodeGroup:
    """The lock nodes of one `Redlock`, with one set of connections per thread, opened lazily.

    A thread always uses the same connections, so its commands reach each node in the order it
    sent them (a release never overtakes its own acquisition's late SET). Connections are opened
    in the process that uses them: after a fork, the child leaves the parent's sockets alone and
    opens its own.
    """

    def __init__(self, urls: Sequence[str], node_timeout: float) -> None:
        self.nodes = [Node(url, node_timeout) for url in urls]
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
                for link in links.links:
                    link.close()

    def run(
        self,
        script: Script,
        keys: Sequence[str],
        arguments: Sequence[str | int],
        succeeded: Callable[[Any], bool],
        wait: bool = True,
        every: bool = False,
    ) -> RoundResult:
        """Run ``script`` on every node at once and collect replies until the outcome is known.

        The outcome is known when a quorum succeeded, when a quorum can no longer succeed, or
        when ``node_timeout`` has passed; with ``every=True`` only when every node answered or
        timed out (operators' commands that report per node). With ``wait=False`` the commands
        are only sent (their replies are skipped by a later round), for clean-ups nobody waits on.
        """
        return self._run(self._links().links, script, keys, arguments, succeeded, wait, every)

    def _run(
        self,
        links: list[Link],
        script: Script,
        keys: Sequence[str],
        arguments: Sequence[str | int],
        succeeded: Callable[[Any], bool],
        wait: bool,
        every: bool,
    ) -> RoundResult:
        count = len(links)
        started = time.monotonic()
        replies: list[Any] = [NO_REPLY] * count
        call = (len(keys), *keys, *arguments)
        if wait and not script.inline:
            packed = [pack_command("EVALSHA", script.sha, *call)]
        else:
            # Nobody reads a NOSCRIPT reply of these (clean-ups, or a release whose quorum is
            # reached before a restarted node answers): send the source, which cannot miss.
            packed = [pack_command("EVAL", script.source, *call)]
        waiting: dict[int, int] = {}  # file descriptor -> node index
        poller = select.poll()
        probing: list[int] = []

        def send(index: int, now: float) -> None:
            link = links[index]
            if link.send(packed, now, self.node_timeout):
                descriptor = link.socket_fileno()
                waiting[descriptor] = index
                poller.register(descriptor, select.POLLIN)

        for index, link in enumerate(links):
            if link.node.is_backed_off(started):
                if link.node.probing:
                    probing.append(index)
                continue
            send(index, started)
        if wait and probing and len(waiting) < self.quorum:
            # Too few nodes in the round to reach a quorum: give the nodes being probed (in
            # parallel) one node_timeout to answer, and take in those that did.
            until = time.monotonic() + self.node_timeout
            for index in probing:
                links[index].node.wait_for_probe(until - time.monotonic())
            now = time.monotonic()
            for index in probing:
                if not links[index].node.is_backed_off(now):
                    send(index, now)
        if not wait:
            return RoundResult(replies, 0, 0, time.monotonic())

        # Opening connections (connect and handshake) happens in the loop above, one node after
        # the other: the nodes' own time to answer starts when the last command is sent.
        deadline = time.monotonic() + self.node_timeout
        successes = answered = 0
        failures = count - len(waiting)
        needed_failures = count - self.quorum + 1

        def decided() -> bool:
            if every:
                return False
            if successes >= self.quorum:
                return True
            if failures < needed_failures:
                return False
            # Failed either way; keep reading only while the replies in flight can still tell
            # "held by someone" (a quorum answered) from "no quorum" (QuorumUnavailable).
            return answered >= self.quorum or answered + len(waiting) < self.quorum

        while waiting and not decided():
            # poll(0) once the deadline passed: a reply already there is not a timeout (the
            # thread may have been descheduled, e.g. waiting for the GIL).
            events = poller.poll(max(0.0, deadline - time.monotonic()) * 1000)
            if not events:
                break
            for descriptor, _ in events:
                index = waiting.pop(descriptor)
                poller.unregister(descriptor)
                link = links[index]
                try:
                    arrived, reply = link.read_current()
                    if arrived and isinstance(reply, NoScriptError):
                        # The node lost its script cache (restart, SCRIPT FLUSH): send the source.
                        link.send_now(pack_command("EVAL", script.source, *call))
                        arrived = False
                except (RedisClientError, OSError) as error:
                    link.fail(time.monotonic(), error)
                    failures += 1
                    continue
                if not arrived:
                    waiting[descriptor] = index
                    poller.register(descriptor, select.POLLIN)
                    continue
                link.node.mark_up()
                replies[index] = reply
                answered += 1
                if succeeded(reply):
                    successes += 1
                else:
                    failures += 1
        finished = time.monotonic()
        if not decided():
            # Timed out: whoever is still silent is hung or far away.
            for index in waiting.values():
                links[index].fail(finished, f"no reply within {self.node_timeout}s")
        return RoundResult(replies, successes, answered, finished)
