"""The Redlock algorithm over N independent Redis masters.

Acquisition sets one key with one random token on every node at once (``SET NX PX`` inside a
script) and succeeds only when a majority agreed before the ttl ran out; the lock is then valid
for ``ttl - elapsed - drift``. A failed attempt releases on every node, because a SET may have
landed on a node whose reply was lost, and is retried after a jittered delay. Extension and
release compare the token inside Lua, so only the holder can extend or release.
"""

from __future__ import annotations

import logging
import random
import secrets
import select
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from redis.connection import AbstractConnection
from redis.exceptions import RedisError as RedisClientError

from . import scripts
from .errors import ConfigurationError, LockNotAcquired, QuorumUnavailable
from .nodes import Node, NodeGroup, RoundResult

logger = logging.getLogger(__name__)

TOKEN_BYTES = 20
FENCE_SUFFIX = ":fence"
DRIFT_CONSTANT_SECONDS = 0.002


@dataclass
class Lock:
    """A lock held on a majority of nodes.

    ``validity`` is how many seconds the lock was guaranteed to stay valid when acquisition (or
    the last extension) finished; `remaining` says how much of it is left now. ``owner`` is
    non-secret metadata stored beside the token (who holds the lock), shown to other contenders.

    ``fencing_token`` grows with every acquisition of the same resource (as long as a majority
    of nodes keeps its data and the clients' clocks agree within the ttl): pass it to the storage
    you write to and have it reject writes carrying a smaller token than it has seen.
    """

    resource: str
    key: str
    token: str
    validity: float
    ttl: float
    owner: str = ""
    valid_until: float = field(default=0.0, repr=False)
    fencing_token: int = 0

    @property
    def value(self) -> str:
        """What is stored on the nodes: the token, then the owner description."""
        return f"{self.token}|{self.owner}" if self.owner else self.token

    def remaining(self) -> float:
        """Seconds of guaranteed validity left now (negative once it ran out)."""
        return self.valid_until - time.monotonic()


@dataclass(frozen=True)
class Contention:
    """What a failed attempt learned about the current holder, when a majority agreed on one."""

    holder: str | None
    holder_ttl: float


def _is_one(reply: Any) -> bool:
    return reply == 1 and not isinstance(reply, bool)


def _is_integer(reply: Any) -> bool:
    return isinstance(reply, int) and not isinstance(reply, bool)


class Redlock:
    """A distributed lock manager over independent Redis masters (the Redlock algorithm).

    One instance per process is meant to be shared by all its threads; connections open lazily
    and are reopened after a fork. ``urls`` accepts ``redis://``, ``rediss://`` (TLS) and
    ``unix://`` URLs with optional ``user:password@`` and database number.
    """

    def __init__(
        self,
        urls: Sequence[str] | str,
        retry_count: int = 3,
        retry_delay: float = 0.2,
        clock_drift_factor: float = 0.01,
        node_timeout: float = 0.05,
        key_prefix: str = "redlock:",
    ) -> None:
        if isinstance(urls, str):
            urls = [urls]
        if not urls:
            raise ConfigurationError(
                "no lock node URLs given; pass a list such as "
                "['redis://r1:6379/0', 'redis://r2:6379/0', 'redis://r3:6379/0']"
            )
        if isinstance(retry_count, bool) or not isinstance(retry_count, int) or retry_count < 1:
            raise ConfigurationError(
                f"retry_count must be an integer of at least 1 (attempts per acquire), "
                f"got {retry_count!r}"
            )
        _require_number("retry_delay", retry_delay, minimum=0.0, allow_minimum=True)
        _require_number(
            "clock_drift_factor", clock_drift_factor, 0.0, allow_minimum=True, unit="a fraction"
        )
        if clock_drift_factor >= 0.5:
            raise ConfigurationError(
                f"clock_drift_factor must be below 0.5 (a fraction of the ttl; 0.01 is usual), "
                f"got {clock_drift_factor!r}"
            )
        _require_number("node_timeout", node_timeout, minimum=0.0)
        if not isinstance(key_prefix, str):
            raise ConfigurationError(f"key_prefix must be a string, got {key_prefix!r}")
        self.retry_count = retry_count
        self.retry_delay = float(retry_delay)
        self.clock_drift_factor = float(clock_drift_factor)
        self.node_timeout = float(node_timeout)
        self.key_prefix = key_prefix
        self._group = NodeGroup(list(urls), self.node_timeout)
        self.quorum = self._group.quorum
        if len(self._group.nodes) % 2 == 0:
            logger.warning(
                "%d lock nodes configured: an even number tolerates no more failures than one "
                "node fewer (%d of %d must agree) while adding a node that can fail; "
                "use an odd number such as 3 or 5",
                len(self._group.nodes),
                self.quorum,
                len(self._group.nodes),
            )

    @property
    def nodes(self) -> list[Node]:
        """The configured lock nodes (``.name`` is the URL with its password redacted)."""
        return list(self._group.nodes)

    @property
    def node_names(self) -> list[str]:
        """The configured nodes, passwords redacted."""
        return [node.name for node in self._group.nodes]

    def key_for(self, resource: str) -> str:
        """The Redis key that locks ``resource``."""
        return self.key_prefix + resource

    def drift(self, ttl: float) -> float:
        """Seconds subtracted from the validity of a ``ttl``-second lock for clock drift."""
        return ttl * self.clock_drift_factor + DRIFT_CONSTANT_SECONDS

    def check_ttl(self, ttl: float) -> None:
        """Raise `ConfigurationError` unless a ``ttl``-second lock can have positive validity."""
        _require_number("ttl", ttl, minimum=0.0)
        if ttl - self.drift(ttl) - self.node_timeout <= 0:
            raise ConfigurationError(
                f"ttl={ttl!r}s leaves no validity after the clock drift allowance "
                f"({self.drift(ttl):.3f}s) and one node_timeout ({self.node_timeout}s); "
                "use a ttl of at least a few tenths of a second"
            )

    def acquire(
        self,
        resource: str,
        ttl: float,
        blocking: bool = False,
        timeout: float | None = None,
        owner: str = "",
    ) -> Lock | None:
        """Take the lock on ``resource`` for ``ttl`` seconds.

        Returns the `Lock`, or None when it is held by someone else (with ``blocking=True``:
        when it stayed held for ``timeout`` seconds; ``timeout=None`` waits for ever). A blocking
        acquire sleeps until the holder releases (a notification from the nodes) or its lock
        expires, instead of polling. Raises `QuorumUnavailable` when fewer than a majority of
        nodes answered in every attempt.
        """
        lock, _ = self.try_acquire(resource, ttl, owner)
        if lock is not None or not blocking:
            return lock
        return self._wait_and_acquire(resource, ttl, owner, timeout)

    def try_acquire(
        self, resource: str, ttl: float, owner: str = "", take_over_from: str = ""
    ) -> tuple[Lock | None, Contention | None]:
        """One non-blocking acquire (up to ``retry_count`` attempts).

        Returns the lock, or None and what was learned about the holder. A lock whose owner
        description contains ``take_over_from`` (when given) is taken over as if it were free.
        Raises `QuorumUnavailable` when no attempt reached a majority of nodes.
        """
        self.check_ttl(ttl)
        if not isinstance(resource, str) or not resource:
            raise ConfigurationError(f"resource must be a non-empty string, got {resource!r}")
        if "|" in owner:
            raise ConfigurationError(f"owner must not contain '|', got {owner!r}")
        key = self.key_for(resource)
        ttl_ms = max(1, int(ttl * 1000))
        most_answered = 0
        # One token for every attempt: a SET of an earlier attempt that lands late on a slow
        # node is then this acquire's own, not a stranger blocking it for a whole ttl.
        token = secrets.token_hex(TOKEN_BYTES)
        value = f"{token}|{owner}" if owner else token
        for attempt in range(self.retry_count):
            if attempt:
                time.sleep(random.uniform(0.5, 1.5) * self.retry_delay)
            started = time.monotonic()
            result = self._group.run(
                scripts.ACQUIRE,
                (key, key + FENCE_SUFFIX),
                (value, ttl_ms, time.time_ns() // 1000, take_over_from),
                _is_integer,
            )
            fencing_token = self._agree_on_fencing_token(key, result, ttl_ms)
            finished = time.monotonic()
            validity = ttl - (finished - started) - self.drift(ttl)
            if fencing_token is not None and validity > 0:
                return Lock(
                    resource, key, token, validity, ttl, owner, finished + validity, fencing_token
                ), None
            # Release everywhere, including nodes that seemed to fail: a SET may have landed.
            self._group.run(scripts.RELEASE, (key,), (value, key), _is_one, wait=False)
            most_answered = max(most_answered, result.answered)
            contention = self._contention(result)
            if contention is not None:
                return None, contention
        if most_answered < self.quorum:
            raise QuorumUnavailable(key, most_answered, self.quorum)
        return None, Contention(None, ttl)

    def _agree_on_fencing_token(self, key: str, result: RoundResult, ttl_ms: int) -> int | None:
        """The fencing token of a round that reached a quorum, or None if it did not.

        The token is the largest a node returned; nodes that returned less (a node that missed
        acquisitions while down, or restarted empty) are raised to it first, so that any later
        majority includes a node that will hand out a larger one.
        """
        if result.successes < self.quorum:
            return None
        tokens: list[int] = [reply for reply in result.replies if _is_integer(reply)]
        fencing_token = max(tokens)
        if tokens.count(fencing_token) >= self.quorum:
            return fencing_token
        raised = self._group.run(
            scripts.RAISE_FENCE, (key + FENCE_SUFFIX,), (fencing_token, ttl_ms), _is_one
        )
        return fencing_token if raised.successes >= self.quorum else None

    def _contention(self, result: RoundResult) -> Contention | None:
        """The holder when a majority of replies name the same one; None for a split vote."""
        holders: dict[str, list[int]] = {}
        for reply in result.replies:
            if isinstance(reply, list) and len(reply) == 2:
                holder = reply[0].decode() if isinstance(reply[0], bytes) else str(reply[0])
                holders.setdefault(holder, []).append(int(reply[1]))
        for holder, remaining_ms in holders.items():
            if holder and len(remaining_ms) >= self.quorum:
                owner = holder.partition("|")[2] or None
                # The holder's lock is gone once a majority of its keys expired.
                # Sorted soonest first: the majority is gone once all but quorum - 1 expired.
                expires = sorted(remaining_ms)[len(remaining_ms) - self.quorum]
                return Contention(owner, max(expires, 0) / 1000)
        return None

    def _wait_and_acquire(
        self, resource: str, ttl: float, owner: str, timeout: float | None
    ) -> Lock | None:
        key = self.key_for(resource)
        deadline = None if timeout is None else time.monotonic() + timeout
        with _ReleaseListener(self._group.nodes, key, self.node_timeout) as listener:
            while True:
                # Listening before each attempt: a release between attempt and wait still wakes us.
                lock, contention = self.try_acquire(resource, ttl, owner)
                if lock is not None:
                    return lock
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    return None
                pause = contention.holder_ttl if contention else self.retry_delay
                pause = max(pause, 0.001) + random.uniform(0, self.retry_delay / 4)
                if deadline is not None:
                    pause = min(pause, deadline - now)
                listener.wait(pause)

    def extend(self, lock: Lock, ttl: float | None = None) -> bool:
        """Reset the lock's time to live to ``ttl`` seconds (default: its own ttl).

        True only if a majority of nodes extended it while it was still valid; the lock's
        ``validity`` and `remaining` are then updated. False means the lock cannot be relied on;
        when a majority answered that the token is gone, `Lock.remaining` drops to zero too.
        """
        ttl = lock.ttl if ttl is None else ttl
        self.check_ttl(ttl)
        started = time.monotonic()
        if lock.valid_until <= started:
            return False
        result = self._group.run(
            scripts.EXTEND,
            (lock.key, lock.key + FENCE_SUFFIX),
            (lock.value, max(1, int(ttl * 1000))),
            _is_one,
        )
        if result.answered - result.successes >= len(self._group.nodes) - self.quorum + 1:
            lock.valid_until = 0.0  # a majority says the token is gone: nothing left to rely on
            return False
        if result.successes < self.quorum or result.finished_at >= lock.valid_until:
            return False
        lock.validity = ttl - (result.finished_at - started) - self.drift(ttl)
        lock.valid_until = result.finished_at + lock.validity
        lock.ttl = ttl
        return lock.validity > 0

    def release(self, lock: Lock) -> bool:
        """Release the lock on every node, only where it still holds this lock's token.

        Returns True if a majority confirmed the release (the lock was still held), False if it
        had already expired or been taken over. Never removes somebody else's lock.
        """
        result = self._group.run(scripts.RELEASE, (lock.key,), (lock.value, lock.key), _is_one)
        lock.valid_until = 0.0
        return result.successes >= self.quorum

    def release_if_owner_matches(self, resource: str, owner_fragment: str) -> int:
        """Delete the lock on ``resource`` where its owner description contains
        ``owner_fragment``; returns on how many nodes. For freeing a lost process's lock."""
        key = self.key_for(resource)
        result = self._group.run(
            scripts.RELEASE_IF_OWNER_MATCHES, (key,), (owner_fragment, key), _is_one, every=True
        )
        return result.successes

    def force_release(self, resource: str) -> int:
        """Delete the lock on ``resource`` whoever holds it (operators only); nodes that did."""
        key = self.key_for(resource)
        result = self._group.run(scripts.FORCE_RELEASE, (key,), (key,), _is_one, every=True)
        return result.successes

    @contextmanager
    def lock(
        self,
        resource: str,
        ttl: float,
        blocking: bool = False,
        timeout: float | None = None,
        owner: str = "",
    ) -> Iterator[Lock]:
        """Hold the lock on ``resource`` for the ``with`` block; release it on the way out.

        Raises `LockNotAcquired` when the lock is held by someone else.
        """
        lock = self.acquire(resource, ttl, blocking=blocking, timeout=timeout, owner=owner)
        if lock is None:
            raise LockNotAcquired(self.key_for(resource))
        try:
            yield lock
        finally:
            self.release(lock)

    def close(self) -> None:
        """Close this process's idle connections to the nodes."""
        self._group.close()


class _ReleaseListener:
    """Subscriptions to a lock's release channel on every reachable node, for blocking waits."""

    def __init__(self, nodes: Sequence[Any], channel: str, node_timeout: float) -> None:
        self._connections: list[AbstractConnection] = []
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

    def __enter__(self) -> _ReleaseListener:
        return self

    def __exit__(self, *exc_info: object) -> None:
        for connection in self._connections:
            connection.disconnect()

    def wait(self, seconds: float) -> bool:
        """Sleep up to ``seconds``; True as soon as any node announced a release."""
        if not self._connections:
            time.sleep(seconds)
            return False
        by_descriptor: dict[int, AbstractConnection] = {}
        poller = select.poll()
        for connection in self._connections:
            sock: Any = connection._sock
            if sock is not None:
                by_descriptor[sock.fileno()] = connection
                poller.register(sock.fileno(), select.POLLIN)
        woken = False
        for descriptor, _ in poller.poll(max(seconds, 0) * 1000):
            connection = by_descriptor[descriptor]
            try:
                while connection.can_read(timeout=0):
                    message = connection.read_response()
                    woken = woken or (isinstance(message, list) and message[:1] == [b"message"])
            except (RedisClientError, OSError):
                self._connections.remove(connection)
        return woken


def _require_number(
    name: str, value: object, minimum: float, allow_minimum: bool = False, unit: str = "seconds"
) -> None:
    valid = (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and value == value  # not NaN
        and (value >= minimum if allow_minimum else value > minimum)
        and value != float("inf")
    )
    if not valid:
        bound = f">= {minimum}" if allow_minimum else f"> {minimum}"
        raise ConfigurationError(f"{name} must be a number {bound} ({unit}), got {value!r}")
