"""Read the lock nodes: what every operators' command starts from.

`LockReader.ask` puts one question to every node at once over plain redis-py clients
(`NodeReads`: SCAN, GET, PTTL, PING, INFO, CONFIG GET); scripts go through `NodeGroup` rounds.
Whatever a node does ends as its one-line error (`NodeAnswer.error`), never as an exception; an
ACL denial is named with the ``ACL SETUSER`` grant that allows it. `LockReader.read` finds lock
keys (SCAN, never KEYS) holding lock values only, 0.2-layout keys included unless on a cluster.
"""

from __future__ import annotations

import contextlib
import re
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, Generic, TypeVar
from urllib.parse import urlsplit

import redis
from redis.exceptions import AskError, NoPermissionError, ResponseError
from redis.exceptions import RedisError as RedisClientError

from ..integration.runtime import AppRuntime
from ..lock import keyspace, scripts
from ..lock.nodes import Endpoint, LockNode, NodeGroup
from ..lock.outcomes import majority_holder
from ..lock.owner import Owner, owner_text_of
from ..lock.redlock import from_settings, legacy_layout
from ..lock.replies import is_copy, judge_copy
from ..settings import RedlockSettings
from .records import LockRecord, NodeError

Answer = TypeVar("Answer")

SCAN_BATCH = 500
SCAN_CALLS_LIMIT = 100_000  # a node whose cursor never comes back to 0 is not Redis
LOCK_VALUE = re.compile(r"[0-9a-f]{40}(\|.*)?", re.DOTALL)
NOT_A_LOCK_VALUE = (
    "its value is not a lock token (40 lowercase hex digits, then optionally | and owner)"
)
DENIED_COMMAND = re.compile(r"'([^']+)' command")
SCRIPT_DENIED = "The user executing the script can't run this command"


class BadReply(Exception):
    """A reply no Redis server gives to that command: the node is broken, or not Redis."""

    def __init__(self, command: str, reply: Any, expected: str) -> None:
        shown = repr(reply)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        super().__init__(f"bad reply to {command}: {shown}, not {expected}")


@dataclass(frozen=True)
class NodeAnswer(Generic[Answer]):
    """One node's answer to a question: ``value``, or ``error`` (one line) when it has none."""

    node: str
    value: Answer | None = None
    error: str | None = None


class NodeReads:
    """One lock node's servers through raw redis-py clients (no reply parsing: callers check
    replies); ``user`` is the ACL user its URL names (``<user>`` when none)."""

    def __init__(self, member: LockNode, timeout: float) -> None:
        self.member = member
        self.node = member.name
        self.user = urlsplit(member.name).username or "<user>"
        self.timeout = timeout
        self.last_server = ""  # the server asked last: named when a node of several fails
        self._clients: dict[int, redis.Redis] = {}

    def servers(self) -> list[Endpoint]:
        """The servers holding the node's keys now (a cluster's masters)."""
        endpoints = self.member.endpoints()
        if not endpoints:
            raise ConnectionError(self.member.locating_error())
        return endpoints

    def server_for(self, key: str) -> Endpoint:
        endpoint = self.member.endpoint_for(key)
        if endpoint is None:
            raise ConnectionError(self.member.locating_error())
        return endpoint

    def call(self, server: Endpoint, *arguments: str | int | bytes) -> Any:
        return self._client(server).execute_command(*arguments)

    def pipeline(self, server: Endpoint, commands: Sequence[Sequence[str | int]]) -> list[Any]:
        """The replies to ``commands`` in order, an error reply as a `ResponseError`."""
        pipeline = self._client(server).pipeline(transaction=False)
        for command in commands:
            pipeline.execute_command(*command)
        return list(pipeline.execute(raise_on_error=False))

    def _client(self, server: Endpoint) -> redis.Redis:
        self.last_server = server.name
        client = self._clients.get(id(server))
        if client is None:
            client = self._clients[id(server)] = server.client(self.timeout)
            client.response_callbacks.clear()
        return client

    def where(self, error: str) -> str:
        """``error``, naming the server that gave it when the node is several servers."""
        if self.last_server and self.last_server != self.node:
            return f"{self.last_server}: {error}"
        return error

    def close(self) -> None:
        for client in self._clients.values():
            with contextlib.suppress(RedisClientError, OSError):
                client.close()
        self._clients.clear()


@dataclass(frozen=True)
class StoredCopy:
    """One node's (by index) copy of a lock: its value, token included, and pttl (-1: none)."""

    node: int
    value: str
    milliseconds_left: int


@dataclass(frozen=True)
class FoundLock:
    """A lock key: its record, the value holding it (the majority's, else the commonest), and
    every node's copy."""

    record: LockRecord
    value: str
    copies: tuple[StoredCopy, ...]


@dataclass(frozen=True)
class LockRead:
    """Locks found (by key), nodes that did not answer, and per key node -> why not a lock."""

    found: list[FoundLock]
    unreachable: tuple[NodeError, ...]
    not_locks: dict[str, dict[str, str]]


# Per node: lock key -> (stored value, pttl in ms), and key -> why it is not a lock there.
NodeRead = tuple[dict[str, tuple[str, int]], dict[str, str]]


class LockReader:
    """The app's settings and a `Redlock` over its nodes with ``timeout`` per node and command;
    a context manager that closes its connections."""

    def __init__(self, app: Any, timeout: float) -> None:
        self.timeout = timeout
        self.settings: RedlockSettings = AppRuntime.for_app(app).settings
        self.redlock = from_settings(replace(self.settings, node_timeout=timeout))
        self.nodes: list[LockNode] = self.redlock.nodes
        self.quorum = self.redlock.quorum
        self.prefix = self.settings.key_prefix

    def __enter__(self) -> LockReader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.redlock.close()

    def ask(
        self, question: Callable[[NodeReads], Answer], timeout: float | None = None
    ) -> list[NodeAnswer[Answer]]:
        """One `NodeAnswer` per node, in order, all asked at once."""

        def ask(node: LockNode) -> NodeAnswer[Answer]:
            reads = NodeReads(node, timeout or self.timeout)
            try:
                return NodeAnswer(node.name, value=question(reads))
            except Exception as error:
                return NodeAnswer(node.name, error=reads.where(failure(error, reads.user)))
            finally:
                reads.close()

        with ThreadPoolExecutor(len(self.nodes), thread_name_prefix="redlock-admin") as pool:
            return list(pool.map(ask, self.nodes))

    def read(self, keys: Sequence[str] | None) -> LockRead:
        """``keys`` (None: every lock key under the prefix) as found across the nodes."""
        answers = self.ask(
            lambda reads: read_keys(reads, self.scan(reads) if keys is None else keys)
        )
        by_key: dict[str, list[StoredCopy]] = {}
        not_locks: dict[str, dict[str, str]] = {}
        for index, answer in enumerate(answers):
            if answer.value is None:
                continue
            locks, others = answer.value
            for key, (value, milliseconds) in locks.items():
                current = keyspace.key_of_legacy(self.prefix, key)
                if current is not None and locks.get(current, ("", 0))[0] == value:
                    continue  # a lock of today's layout, written at its 0.2 key too
                by_key.setdefault(key, []).append(StoredCopy(index, value, milliseconds))
            for key, reason in others.items():
                not_locks.setdefault(key, {})[answer.node] = reason
        found = [self.found_lock(key, copies) for key, copies in sorted(by_key.items())]
        unreachable = tuple(
            NodeError(answer.node, answer.error or "no answer")
            for answer in answers
            if answer.value is None
        )
        return LockRead(found, unreachable, not_locks)

    def scan(self, reads: NodeReads) -> list[str]:
        """Every lock key under the prefix on one node (SCAN on each of its servers)."""
        legacy = legacy_layout(self.redlock)
        pattern = keyspace.scan_pattern(self.prefix, legacy)
        found: set[str] = set()
        for server in reads.servers():
            cursor = "0"
            for _ in range(SCAN_CALLS_LIMIT):
                reply = reads.call(server, "SCAN", cursor, "MATCH", pattern, "COUNT", SCAN_BATCH)
                if not (isinstance(reply, list) and len(reply) == 2 and isinstance(reply[1], list)):
                    raise BadReply("SCAN", reply, "a cursor and a list of keys")
                cursor = expect_text(reply[0], "SCAN")
                if not cursor.isdigit():
                    raise BadReply("SCAN", reply[0], "a cursor")
                for key in (expect_text(key, "SCAN") for key in reply[1]):
                    if keyspace.is_lock_key(self.prefix, key) or (
                        legacy and keyspace.legacy_resource_of(self.prefix, key) is not None
                    ):
                        found.add(key)
                if cursor == "0":
                    break
            else:
                raise BadReply(
                    "SCAN", cursor, f"the end of the keys after {SCAN_CALLS_LIMIT} calls"
                )
        return sorted(found)

    def found_lock(self, key: str, copies: Sequence[StoredCopy]) -> FoundLock:
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


def read_keys(reads: NodeReads, keys: Sequence[str]) -> NodeRead:
    """GET and PTTL of ``keys`` on one node, pipelined per server; absent keys left out, and a
    key whose slot moved read again through a round of the read script, which follows it."""
    read: NodeRead = ({}, {})
    by_server: dict[int, tuple[Endpoint, list[str]]] = {}
    for key in keys:
        server = reads.server_for(key)
        by_server.setdefault(id(server), (server, []))[1].append(key)
    moved: list[str] = []
    for server, server_keys in by_server.values():
        for start in range(0, len(server_keys), SCAN_BATCH):
            batch = server_keys[start : start + SCAN_BATCH]
            commands = [command for key in batch for command in (("GET", key), ("PTTL", key))]
            replies = iter(reads.pipeline(server, commands))
            for key, value, milliseconds in zip(batch, replies, replies, strict=True):
                if isinstance(value, AskError) or isinstance(milliseconds, AskError):
                    moved.append(key)
                    continue
                if isinstance(milliseconds, ResponseError):
                    raise milliseconds
                if isinstance(value, ResponseError):
                    if not str(value).startswith("WRONGTYPE"):
                        raise value
                    kind = expect_text(reads.call(server, "TYPE", key), "TYPE")
                    read[1][key] = f"it is a {kind}, not a string"
                    continue
                file_copy(read, key, value, milliseconds)
    for key, reply in zip(moved, read_in_rounds(reads, moved), strict=True):
        file_copy(read, key, reply[0] or None, reply[1])
    return read


def read_in_rounds(reads: NodeReads, keys: Sequence[str]) -> list[Any]:
    """The read script's (value, pttl) of each of ``keys``, in rounds that follow moved slots."""
    if not keys:
        return []
    replies = []
    with contextlib.closing(NodeGroup([reads.member], reads.timeout)) as group:
        for key in keys:
            result = group.run(scripts.READ, (key,), (), judge_copy)
            reply = result.replies[0]
            if not is_copy(reply):
                raise ConnectionError(result.failures[0] or "no reply to the read script")
            replies.append(reply)
    return replies


def file_copy(read: NodeRead, key: str, value: Any, milliseconds: Any) -> None:
    """File one key's value and pttl under the node's locks or not-locks (absent: nowhere)."""
    if value is None:
        return
    stored = expect_text(value, "GET")
    if not isinstance(milliseconds, int) or isinstance(milliseconds, bool) or milliseconds < -2:
        raise BadReply("PTTL", milliseconds, "an integer of -2 or more")
    if milliseconds == -2:  # expired between the two commands
        return
    if LOCK_VALUE.fullmatch(stored):
        read[0][key] = (stored, milliseconds)
    else:
        read[1][key] = NOT_A_LOCK_VALUE


def failure(error: Exception, user: str = "<user>") -> str:
    """One line about what went wrong reading a node."""
    if isinstance(error, BadReply):
        return str(error)
    if isinstance(error, (RedisClientError, OSError)):
        return describe_error(error, user)
    return f"unreadable reply ({describe_error(error)})"


def describe_error(error: BaseException, user: str = "<user>") -> str:
    """One line about a connection or command error (an ACL denial with its grant)."""
    fix = access_fix(error, user)
    if fix is not None:
        return fix
    text = str(error).strip()
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def access_fix(error: BaseException, user: str) -> str | None:
    """For an error reply an ACL causes, what is denied and how to grant it; else None."""
    error_text = str(error)
    if isinstance(error, NoPermissionError) or error_text.startswith("NOPERM"):
        command = DENIED_COMMAND.search(error_text)
        if command is not None:
            name = command.group(1)
            return f"the node's user may not run '{name}'; grant it with ACL SETUSER {user} +{name}"
        if "key" in error_text:
            return (
                "the node's user may not access these keys; grant it the key prefix with "
                f"ACL SETUSER {user} ~<key prefix>*"
            )
        if "channel" in error_text:
            return (
                "the node's user may not use the release channels; grant them with "
                f"ACL SETUSER {user} &<key prefix>*"
            )
        return f"NOPERM {error_text} (an ACL denial: see ACL GETUSER {user})"
    if isinstance(error, ResponseError) and SCRIPT_DENIED in error_text:
        return (
            "the node's user may not run a command inside the script; grant the read, write "
            f"and scripting commands with ACL SETUSER {user} +@read +@write +@scripting"
        )
    return None


def text(value: Any) -> str:
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else str(value)


def expect_text(reply: Any, command: str) -> str:
    if isinstance(reply, (bytes, str)):
        return text(reply)
    raise BadReply(command, reply, "a string")
