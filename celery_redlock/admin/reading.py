"""Read the locks on every node: what `lock_listing`, `force_release` and `reap` start from.

A `LockReader` holds the app's settings and a `Redlock` over its nodes (with the operator's
timeout) and reads lock keys — those named, or every lock key under the key prefix (SCAN, never
KEYS) — across the nodes at once. A node that is a Redis Cluster is read on every master, each
key where the cluster keeps it, and counts as one node. Only lock keys count
(`celery_redlock.lock.keyspace.is_lock_key`), and only lock values (`is_lock_value`): fencing
counters, completion records, schedule records, keys of other types and application values under
the prefix are never taken for locks.

Locks that celery_redlock 0.2 workers hold, under keys without braces
(`keyspace.is_legacy_lock_key`), are found too, unless a node has a cluster member (0.2 could not
use one); their records say so (``legacy_layout``). Today's workers write every lock at its 0.2
key as well: such a copy, holding the value of the lock's own key, is the same lock and is not
listed twice.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from redis.exceptions import AskError, ResponseError

from ..integration.runtime import AppRuntime
from ..lock import keyspace
from ..lock.nodes import LockNode
from ..lock.outcomes import majority_holder
from ..lock.owner import Owner, owner_text_of
from ..lock.redlock import from_settings, legacy_layout
from ..settings import RedlockSettings
from .fan_out import (
    BadReply,
    NodeAnswer,
    NodeClient,
    ServerClient,
    ask_every_node,
    expect_integer,
    expect_text,
)
from .records import LockRecord, NodeError

SCAN_BATCH = 500
SCAN_CALLS_LIMIT = 100_000  # a node whose cursor never comes back to 0 is not Redis

LOCK_VALUE = re.compile(r"[0-9a-f]{40}(\|.*)?", re.DOTALL)
NOT_A_LOCK_VALUE = (
    "its value is not a lock token (40 lowercase hex digits, then optionally | and owner)"
)


def is_lock_value(value: str) -> bool:
    """True for a value celery_redlock stores in a lock: a token (40 lowercase hex digits),
    alone or followed by ``|`` and the owner text."""
    return LOCK_VALUE.fullmatch(value) is not None


@dataclass(frozen=True)
class StoredCopy:
    """One node's copy of a lock: the stored value (token included: never shown) and its
    pttl in milliseconds (-1: no expiry). ``node`` is the node's index."""

    node: int
    value: str
    milliseconds_left: int


@dataclass(frozen=True)
class FoundLock:
    """A lock key across the nodes: its public record, the stored value that holds it (the
    majority's, else the commonest), and every node's copy."""

    record: LockRecord
    value: str
    copies: tuple[StoredCopy, ...]


@dataclass(frozen=True)
class NodeRead:
    """What one node holds under the keys read: lock copies, and the keys that are there but
    hold no lock (with why)."""

    locks: dict[str, tuple[str, int]]
    not_locks: dict[str, str]


@dataclass(frozen=True)
class LockRead:
    """Locks found (sorted by key), nodes that did not answer, and per key the nodes where it
    is not a lock (node name -> why)."""

    found: list[FoundLock]
    unreachable: tuple[NodeError, ...]
    not_locks: dict[str, dict[str, str]]


class LockReader:
    """The app, its settings and a `Redlock` over its nodes with the caller's ``timeout``
    (seconds per node and command). Use it as a context manager: it closes its connections."""

    def __init__(self, app: Any, timeout: float) -> None:
        self.app = app
        self.timeout = timeout
        self.settings: RedlockSettings = AppRuntime.for_app(app).settings
        self.redlock = from_settings(self.settings, node_timeout=timeout)
        self.nodes: list[LockNode] = self.redlock.nodes
        self.quorum = self.redlock.quorum
        self.prefix = self.settings.key_prefix

    def __enter__(self) -> LockReader:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def read(self, keys: Sequence[str] | None) -> LockRead:
        """``keys`` (None: every lock key under the prefix) as found across the nodes."""

        def question(client: NodeClient) -> NodeRead:
            wanted = self.scan(client) if keys is None else list(keys)
            return read_keys(client, wanted)

        answers = ask_every_node(self.nodes, question, self.timeout)
        by_key: dict[str, list[StoredCopy]] = {}
        not_locks: dict[str, dict[str, str]] = {}
        for index, answer in enumerate(answers):
            if answer.value is None:
                continue
            locks = answer.value.locks
            for key, (value, milliseconds) in locks.items():
                current = keyspace.key_of_legacy(self.prefix, key)
                if current is not None and locks.get(current, ("", 0))[0] == value:
                    continue  # a lock of today's layout, written at its 0.2 key too
                by_key.setdefault(key, []).append(StoredCopy(index, value, milliseconds))
            for key, reason in answer.value.not_locks.items():
                not_locks.setdefault(key, {})[answer.node] = reason
        found = [self.found_lock(key, copies) for key, copies in sorted(by_key.items())]
        return LockRead(found, unreachable_nodes(answers), not_locks)

    def scan(self, client: NodeClient) -> list[str]:
        """Every lock key under the prefix on one node: on each of its servers (a cluster's
        masters), SCAN in batches."""
        found: set[str] = set()
        for server in client.servers():
            found.update(self.scan_server(server))
        return sorted(found)

    def scan_server(self, server: ServerClient) -> list[str]:
        """Every lock key under the prefix on one server (SCAN, in batches)."""
        legacy = legacy_layout(self.redlock)
        scan = keyspace.legacy_scan_pattern if legacy else keyspace.scan_pattern
        pattern = scan(self.prefix)
        cursor = "0"
        found: list[str] = []
        for _ in range(SCAN_CALLS_LIMIT):
            reply = server.call("SCAN", cursor, "MATCH", pattern, "COUNT", SCAN_BATCH)
            if not (isinstance(reply, list) and len(reply) == 2 and isinstance(reply[1], list)):
                raise BadReply("SCAN", reply, "a cursor and a list of keys")
            cursor = expect_text(reply[0], "SCAN")
            if not cursor.isdigit():
                raise BadReply("SCAN", reply[0], "a cursor")
            keys = [expect_text(key, "SCAN") for key in reply[1]]
            found += [key for key in keys if self.is_lock_key(key, legacy)]
            if cursor == "0":
                return sorted(set(found))
        raise BadReply("SCAN", cursor, f"the end of the keys after {SCAN_CALLS_LIMIT} calls")

    def is_lock_key(self, key: str, legacy: bool) -> bool:
        """True for a lock key under the prefix (with ``legacy``, of the 0.2 layout too)."""
        if keyspace.is_lock_key(self.prefix, key):
            return True
        return legacy and keyspace.is_legacy_lock_key(self.prefix, key)

    def found_lock(self, key: str, copies: Sequence[StoredCopy]) -> FoundLock:
        """One lock's record from its copies (at least one)."""
        pairs = [(copy.value, copy.milliseconds_left) for copy in copies]
        held = majority_holder(pairs, self.quorum)
        if held is not None:
            # Acquisitions differ by token: the holder's value is the one on a majority.
            candidates = Counter(value for value, _ in pairs if owner_text_of(value) == held.holder)
            value = candidates.most_common(1)[0][0]
            time_left = None if held.expires_in == float("inf") else round(held.expires_in, 3)
        else:
            value = Counter(value for value, _ in pairs).most_common(1)[0][0]
            lefts = [milliseconds for stored, milliseconds in pairs if stored == value]
            time_left = None if min(lefts) < 0 else round(max(lefts) / 1000, 3)
        holding = sum(stored == value for stored, _ in pairs)
        resource = keyspace.resource_of(self.prefix, key)
        legacy_resource = None if resource else keyspace.legacy_resource_of(self.prefix, key)
        record = LockRecord(
            key=key,
            resource=resource or legacy_resource or key,
            owner=Owner.parse(owner_text_of(value)),
            held=held is not None,
            time_left=time_left,
            nodes_holding=holding,
            nodes_total=len(self.nodes),
            nodes_with_other_values=len(pairs) - holding,
            legacy_layout=legacy_resource is not None,
        )
        return FoundLock(record, value, tuple(copies))

    def close(self) -> None:
        """Close the lock manager's connections."""
        self.redlock.close()


def unreachable_nodes(answers: Sequence[NodeAnswer[Any]]) -> tuple[NodeError, ...]:
    """The nodes among ``answers`` that gave none, and why."""
    return tuple(
        NodeError(answer.node, answer.error or "no answer")
        for answer in answers
        if answer.value is None
    )


def read_keys(client: NodeClient, keys: Sequence[str]) -> NodeRead:
    """GET and PTTL of ``keys`` on one node, each on the server that holds it, one pipeline per
    server and batch. Keys that are absent are left out; keys that hold no lock value (another
    type, another value) are named with why."""
    locks: dict[str, tuple[str, int]] = {}
    not_locks: dict[str, str] = {}
    by_server: dict[int, tuple[ServerClient, list[str]]] = {}
    for key in keys:
        server = client.server_for(key)
        by_server.setdefault(id(server), (server, []))[1].append(key)
    for server, server_keys in by_server.values():
        for start in range(0, len(server_keys), SCAN_BATCH):
            batch = server_keys[start : start + SCAN_BATCH]
            replies = server.pipeline([command for key in batch for command in reading(key)])
            for index, key in enumerate(batch):
                value, milliseconds = replies[2 * index], replies[2 * index + 1]
                if isinstance(value, AskError) or isinstance(milliseconds, AskError):
                    # The key's slot moved, or is moving (a cluster): ask where it is now.
                    value = routed(client, key, "GET")
                    milliseconds = routed(client, key, "PTTL")
                judge_copy(client, key, value, milliseconds, locks, not_locks)
    return NodeRead(locks, not_locks)


def routed(client: NodeClient, key: str, command: str) -> Any:
    """The reply to ``command key`` from the server that holds ``key``, an error reply in its
    place (as in a pipeline)."""
    try:
        return client.call_for_key(key, command, key)
    except ResponseError as error:
        return error


def judge_copy(
    client: NodeClient,
    key: str,
    value: Any,
    milliseconds: Any,
    locks: dict[str, tuple[str, int]],
    not_locks: dict[str, str],
) -> None:
    """File one key's GET and PTTL replies under ``locks`` or ``not_locks`` (or nowhere, when
    the key is absent); raises for error replies and replies no server gives."""
    if isinstance(milliseconds, ResponseError):
        raise milliseconds
    if isinstance(value, ResponseError):
        if not str(value).startswith("WRONGTYPE"):
            raise value
        kind = expect_text(client.call_for_key(key, "TYPE", key), "TYPE")
        not_locks[key] = f"it is a {kind}, not a string"
        return
    if value is None:
        return
    stored = expect_text(value, "GET")
    if expect_integer(milliseconds, "PTTL") < -2:
        raise BadReply("PTTL", milliseconds, "an integer of -2 or more")
    if milliseconds == -2:  # expired between the two commands
        return
    if is_lock_value(stored):
        locks[key] = (stored, milliseconds)
    else:
        not_locks[key] = NOT_A_LOCK_VALUE


def reading(key: str) -> tuple[tuple[str, str], tuple[str, str]]:
    """The commands that read one key: its value, then its time to live."""
    return ("GET", key), ("PTTL", key)
