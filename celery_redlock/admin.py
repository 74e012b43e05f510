"""Inspect and repair the locks of a Celery app from Python: the operators' API.

Every function takes the Celery app whose ``redlock_*`` settings name the lock nodes, asks all
nodes at once (each bounded by ``timeout`` seconds per command), and returns frozen records with a
``to_json()``. A node that does not answer is reported, never fatal; what can only be known from a
majority of nodes raises `QuorumUnavailable` without one. Lock tokens (the secret part of a stored
lock value, which allows releasing the lock) never appear in a record.

- `status_report` / `node_status`: every lock node — reachable, round trip, version, role,
  persistence, eviction — with the settings that weaken the lock's safety;
- `held_locks` / `lock_listing`: the locks held now and who holds them;
- `lock_key`, `call_key`, `holder`: the key a call would lock, and that call's holder;
- `force_release`: delete a lock on every node, whoever holds it;
- `reap`: free, by token, only the locks whose holder is proven gone (see `reap`).

`celery redlock` (celery_redlock.cli) is these functions with a command line around them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import logging
import os
import socket
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import redis
from redis.exceptions import RedisError as RedisClientError
from redis.exceptions import ResponseError

from . import scripts
from .beat import SCHEDULE_SUFFIX
from .errors import QuorumUnavailable, RedlockError
from .nodes import Node
from .owner import Owner, owner_text_of
from .redlock import FENCE_SUFFIX, Redlock, even_node_warning, majority_holder
from .runtime import AppRuntime
from .settings import RedlockSettings
from .task import COMPLETION_PREFIX, SingletonTask

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 1.0
"""Seconds each node (and the workers, for control commands) gets per command by default."""

SCAN_BATCH = 500

PROOF_NOT_RUNNING = "worker-not-running-it"
"""Reap proof: the holder's worker answers and is not running the task (see `reap`)."""
PROOF_PROCESS_GONE = "process-gone"
"""Reap proof: the holder ran on this host and its process no longer exists."""
PROOF_SILENT = "silent-not-extended"
"""Reap proof: the worker stayed silent and the lock was not extended for the grace period."""

FREED = "freed"
WOULD_FREE = "would-free"
KEPT = "kept"
GONE = "gone"

# Server-side pttl against the client's clock: allowance for the time a read takes.
PTTL_TOLERANCE_SECONDS = 0.25
# A live keeper extends a third of the way through a lock's validity; allow for its lateness.
KEEPER_LATENESS_SECONDS = 1.0

Answer = TypeVar("Answer")


# -- records ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeError:
    """A lock node that did not answer, and why."""

    node: str
    error: str

    def to_json(self) -> dict[str, str]:
        """``{"node": ..., "error": ...}``."""
        return {"node": self.node, "error": self.error}


@dataclass(frozen=True)
class NodeStatus:
    """What one lock node told about itself. Fields are None where it could not be learnt
    (unreachable, or INFO/CONFIG refused by an ACL); ``warnings`` name the node's settings that
    weaken the lock's safety, each with the fix."""

    node: str
    reachable: bool
    error: str | None = None
    round_trip_milliseconds: float | None = None
    redis_version: str | None = None
    run_id: str | None = None
    role: str | None = None
    master: str | None = None
    aof_enabled: bool | None = None
    appendfsync: str | None = None
    maxmemory: int | None = None
    maxmemory_policy: str | None = None
    warnings: tuple[str, ...] = ()

    def summary(self) -> str:
        """The node in one line, for people: round trip, version, role, persistence; or why it
        is unreachable."""
        if not self.reachable:
            return f"unreachable: {self.error}"
        persistence = {True: "aof on", False: "aof off", None: "aof unknown"}[self.aof_enabled]
        if self.aof_enabled and self.appendfsync:
            persistence += f" (appendfsync {self.appendfsync})"
        return (
            f"{self.round_trip_milliseconds or 0:.2f} ms  redis {self.redis_version or '?'}  "
            f"{self.role or 'role ?'}  {persistence}"
        )

    def to_json(self) -> dict[str, Any]:
        """The JSON form (``run_id`` only serves to find duplicate nodes and is left out)."""
        return {
            "node": self.node,
            "reachable": self.reachable,
            "error": self.error,
            "round_trip_milliseconds": self.round_trip_milliseconds,
            "redis_version": self.redis_version,
            "role": self.role,
            "master": self.master,
            "aof_enabled": self.aof_enabled,
            "appendfsync": self.appendfsync,
            "maxmemory": self.maxmemory,
            "maxmemory_policy": self.maxmemory_policy,
            "warnings": list(self.warnings),
        }


@dataclass(frozen=True)
class StatusReport:
    """Every lock node's status, plus what only the group shows: the node count (one node, an
    even number), URLs that reach the same server, nodes down. ``largest_lock_ttl`` is the
    longest a lock key can live (the ttl setting, any singleton task's ttl or ``lock_hold``):
    how long a crashed node without ``appendfsync always`` must stay down."""

    nodes: tuple[NodeStatus, ...]
    quorum: int
    largest_lock_ttl: float
    warnings: tuple[str, ...]

    @property
    def reachable(self) -> int:
        """How many nodes answered."""
        return sum(status.reachable for status in self.nodes)

    @property
    def nodes_total(self) -> int:
        """How many nodes are configured."""
        return len(self.nodes)

    @property
    def unreachable(self) -> tuple[NodeError, ...]:
        """The nodes that did not answer, and why."""
        return tuple(
            NodeError(status.node, status.error or "")
            for status in self.nodes
            if not status.reachable
        )

    @property
    def has_quorum(self) -> bool:
        """True when a majority answered: locks can be taken."""
        return self.reachable >= self.quorum

    def warning_lines(self) -> list[str]:
        """Every warning, for people: a node warning shared by several nodes once, naming them
        all (``"<nodes>: <warning>"``), then the group's warnings."""
        by_warning: dict[str, list[str]] = {}
        for status in self.nodes:
            for warning in status.warnings:
                by_warning.setdefault(warning, []).append(status.node)
        lines = [f"{', '.join(names)}: {warning}" for warning, names in by_warning.items()]
        return lines + list(self.warnings)

    def to_json(self) -> dict[str, Any]:
        """The JSON form."""
        return {
            "nodes": [status.to_json() for status in self.nodes],
            "configured": len(self.nodes),
            "reachable": self.reachable,
            "quorum": self.quorum,
            "has_quorum": self.has_quorum,
            "largest_lock_ttl_seconds": self.largest_lock_ttl,
            "warnings": list(self.warnings),
        }


@dataclass(frozen=True)
class LockRecord:
    """One lock key as seen across the nodes, token left out.

    ``held`` when one value is on a majority of nodes: somebody holds the lock, and ``owner``
    says who (None when the value carries no owner celery_redlock can read); otherwise the copies
    are leftovers on a minority (a failed acquisition, or a lock whose majority expired), which
    expire by themselves. ``time_left`` is when the lock stops being held unless extended (None:
    the key has no expiry). ``worker_answers`` and ``task_active`` are None unless the workers
    were asked (``check_workers=True``): whether the holder's worker answered a ping, and whether
    the holder's task id is active or reserved there.
    """

    key: str
    resource: str
    owner: Owner | None
    held: bool
    time_left: float | None
    nodes_holding: int
    nodes_total: int
    nodes_with_other_values: int = 0
    worker_answers: bool | None = None
    task_active: bool | None = None

    @property
    def task(self) -> str | None:
        """The holder's task name (None for the beat leader's lease)."""
        return self.owner.task if self.owner else None

    @property
    def task_id(self) -> str | None:
        """The holder's task id."""
        return self.owner.id if self.owner else None

    @property
    def worker(self) -> str | None:
        """The holder's Celery worker node name (``name@host``), when it ran in a worker."""
        return self.owner.worker if self.owner else None

    @property
    def host(self) -> str | None:
        """The host the holder ran on."""
        return self.owner.host if self.owner else None

    @property
    def pid(self) -> int | None:
        """The holder's process id on its host."""
        return self.owner.pid if self.owner else None

    @property
    def role(self) -> str | None:
        """None for a task run; ``"beat leader"`` for the beat leader's lease."""
        return self.owner.role if self.owner else None

    @property
    def held_for(self) -> float | None:
        """Seconds since the holder took the lock (by this machine's clock)."""
        if self.owner is None or not self.owner.since or not self.held:
            return None
        return round(time.time() - self.owner.since, 3)

    def describe(self) -> str:
        """The holder in a few words, for people."""
        return self.owner.describe() if self.owner else "an unknown owner"

    def summary(self) -> str:
        """The lock in one line, for people: state, holder, nodes, time left."""
        left = "no expiry" if self.time_left is None else f"{self.time_left:.1f}s left"
        state = "held" if self.held else "NOT held (on a minority of nodes only)"
        nodes = f"{self.nodes_holding}/{self.nodes_total}"
        return f"{state} by {self.describe()}, on {nodes} nodes, {left}"

    def to_json(self) -> dict[str, Any]:
        """The JSON form: the owner's public fields, never the token."""
        owner = self.owner
        return {
            "key": self.key,
            "resource": self.resource,
            "held": self.held,
            "task": self.task,
            "task_id": self.task_id,
            "retries": owner.retries if owner else None,
            "nesting": owner.nesting if owner else None,
            "worker": self.worker,
            "host": self.host,
            "pid": self.pid,
            "role": self.role,
            "queued": owner.queued if owner else None,
            "since": owner.since if owner else None,
            "held_for_seconds": self.held_for,
            "time_left_seconds": self.time_left,
            "no_expiry": self.time_left is None,
            "nodes_holding": self.nodes_holding,
            "nodes_total": self.nodes_total,
            "nodes_with_other_values": self.nodes_with_other_values,
            "worker_answers": self.worker_answers,
            "task_active": self.task_active,
        }


@dataclass(frozen=True)
class LockListing:
    """The lock keys found on the nodes: ``locks`` held by a majority, ``minority`` leftovers,
    and which nodes did not answer. Nothing about held locks is certain without ``has_quorum``."""

    locks: tuple[LockRecord, ...]
    minority: tuple[LockRecord, ...]
    nodes_total: int
    quorum: int
    unreachable: tuple[NodeError, ...]

    @property
    def reachable(self) -> int:
        """How many nodes answered."""
        return self.nodes_total - len(self.unreachable)

    @property
    def has_quorum(self) -> bool:
        """True when a majority answered, so ``locks`` is every lock held now."""
        return self.reachable >= self.quorum

    def to_json(self) -> dict[str, Any]:
        """The JSON form."""
        return {
            "locks": [record.to_json() for record in self.locks],
            "minority": [record.to_json() for record in self.minority],
            "reachable": self.reachable,
            "nodes_total": self.nodes_total,
            "quorum": self.quorum,
            "unreachable": [node.to_json() for node in self.unreachable],
        }


@dataclass(frozen=True)
class CallKey:
    """The lock a call of a singleton task takes: ``key`` (under the key prefix), ``resource``
    (the key without it) and ``basis``, what the key is made of, in words."""

    task: str
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]
    basis: str
    resource: str
    key: str

    def to_json(self) -> dict[str, Any]:
        """The JSON form (the arguments as given: they never reach Redis)."""
        return {
            "task": self.task,
            "args": list(self.args),
            "kwargs": dict(self.kwargs),
            "locks_on": self.basis,
            "resource": self.resource,
            "key": self.key,
        }


@dataclass(frozen=True)
class ReleaseResult:
    """What `force_release` did: the lock it found (None: no reachable node had the key), the
    nodes it was deleted on and those where a copy is still present."""

    key: str
    resource: str
    lock: LockRecord | None
    deleted_on: tuple[str, ...]
    still_present_on: tuple[str, ...]
    nodes_total: int
    quorum: int
    unreachable: tuple[NodeError, ...]

    @property
    def found(self) -> bool:
        """True when a reachable node had the key."""
        return self.lock is not None

    @property
    def has_quorum(self) -> bool:
        """True when a majority answered (so a lock found is no longer held by a majority)."""
        return self.nodes_total - len(self.unreachable) >= self.quorum

    def to_json(self) -> dict[str, Any]:
        """The JSON form."""
        return {
            "key": self.key,
            "resource": self.resource,
            "found": self.found,
            "lock": self.lock.to_json() if self.lock else None,
            "deleted": len(self.deleted_on),
            "deleted_on": list(self.deleted_on),
            "still_present_on": list(self.still_present_on),
            "nodes_total": self.nodes_total,
            "unreachable": [node.to_json() for node in self.unreachable],
        }


@dataclass(frozen=True)
class ReapResult:
    """What `reap` decided about one held lock.

    ``action``: ``"freed"``, ``"would-free"`` (a dry run), ``"kept"``, or ``"gone"`` (proven, but
    released or taken by someone else before it could be freed: nothing was deleted). ``proof``
    is one of the ``PROOF_*`` constants when the holder was proven gone, else None; ``reason``
    says why in words. ``nodes_freed`` counts the nodes that confirmed the deletion (once a
    majority of them has, the others are not waited for).
    """

    lock: LockRecord
    action: str
    proof: str | None
    reason: str
    nodes_freed: int = 0

    @property
    def freed(self) -> bool:
        """True when the lock was deleted."""
        return self.action == FREED

    def to_json(self) -> dict[str, Any]:
        """The JSON form."""
        return {
            "lock": self.lock.to_json(),
            "action": self.action,
            "proof": self.proof,
            "reason": self.reason,
            "nodes_freed": self.nodes_freed,
        }


class UnknownTask(RedlockError, LookupError):
    """The app has no singleton task of that name (the message lists the close matches)."""


# -- talking to the nodes -----------------------------------------------------------------------


@dataclass(frozen=True)
class _NodeAnswer(Generic[Answer]):
    name: str
    value: Answer | None = None
    error: str | None = None


@dataclass(frozen=True)
class _Copy:
    """One node's copy of a key: the stored value (token included: never shown) and its pttl."""

    node: int
    value: str
    milliseconds_left: int  # -1: no expiry


@dataclass(frozen=True)
class _Found:
    """A key across the nodes: its public record, and the stored value that holds it."""

    record: LockRecord
    value: str
    copies: tuple[_Copy, ...]


class _Context:
    """The app, its settings and a `Redlock` over its nodes with the caller's timeout."""

    def __init__(self, app: Any, timeout: float) -> None:
        self.app = app
        self.timeout = timeout
        self.settings: RedlockSettings = AppRuntime.for_app(app).settings
        self.redlock = Redlock.from_settings(self.settings, node_timeout=timeout)
        self.nodes: list[Node] = self.redlock.nodes
        self.quorum = self.redlock.quorum
        self.prefix = self.settings.key_prefix

    def ask(self, question: Callable[[redis.Redis], Answer]) -> list[_NodeAnswer[Answer]]:
        """Ask every node ``question`` (a function of a client) at once; answers in node order."""

        def ask_one(node: Node) -> _NodeAnswer[Answer]:
            client = node.client(timeout=self.timeout)
            try:
                return _NodeAnswer(node.name, value=question(client))
            except (RedisClientError, OSError) as error:
                return _NodeAnswer(node.name, error=_describe_error(error))
            finally:
                with contextlib.suppress(RedisClientError, OSError):
                    client.close()

        with ThreadPoolExecutor(max_workers=len(self.nodes)) as pool:
            return list(pool.map(ask_one, self.nodes))

    def is_lock_key(self, key: str) -> bool:
        """True for lock keys: not a fencing counter, completion marker or schedule record."""
        records = self.prefix + self.settings.beat_lease_name + SCHEDULE_SUFFIX
        return not (
            key.endswith(FENCE_SUFFIX)
            or key.startswith(self.prefix + COMPLETION_PREFIX)
            or key == records
        )

    def read(self, keys: Sequence[str] | None) -> tuple[list[_Found], tuple[NodeError, ...]]:
        """``keys`` (None: every lock key under the prefix) as found across the nodes."""

        def question(client: redis.Redis) -> dict[str, tuple[str, int]]:
            wanted = keys
            if wanted is None:
                pattern = _glob_escape(self.prefix) + "*"
                scanned = (_text(key) for key in client.scan_iter(match=pattern, count=SCAN_BATCH))
                wanted = [key for key in scanned if self.is_lock_key(key)]
            return _read_values(client, wanted)

        answers = self.ask(question)
        by_key: dict[str, list[_Copy]] = {}
        for index, answer in enumerate(answers):
            for key, (value, milliseconds) in (answer.value or {}).items():
                by_key.setdefault(key, []).append(_Copy(index, value, milliseconds))
        found = [self.record_of(key, copies) for key, copies in sorted(by_key.items())]
        unreachable = tuple(
            NodeError(answer.name, answer.error) for answer in answers if answer.error is not None
        )
        return found, unreachable

    def record_of(self, key: str, copies: Sequence[_Copy]) -> _Found:
        """One key's record from its copies (at least one)."""
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
        record = LockRecord(
            key=key,
            resource=key.removeprefix(self.prefix),
            owner=Owner.parse(owner_text_of(value)),
            held=held is not None,
            time_left=time_left,
            nodes_holding=holding,
            nodes_total=len(self.nodes),
            nodes_with_other_values=len(pairs) - holding,
        )
        return _Found(record, value, tuple(copies))

    def close(self) -> None:
        """Close the lock manager's connections."""
        self.redlock.close()


@contextlib.contextmanager
def _context(app: Any, timeout: float) -> Iterator[_Context]:
    context = _Context(app, timeout)
    try:
        yield context
    finally:
        context.close()


def _describe_error(error: BaseException) -> str:
    """A one-line description of a connection or command error."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _text(value: Any) -> str:
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else str(value)


def _glob_escape(text: str) -> str:
    return "".join(f"\\{character}" if character in "*?[]\\" else character for character in text)


def _read_values(client: redis.Redis, keys: Sequence[str]) -> dict[str, tuple[str, int]]:
    """GET and PTTL of ``keys`` on one node (one pipeline per batch); absent keys and keys that
    are not strings (not ours) left out."""
    found: dict[str, tuple[str, int]] = {}
    for start in range(0, len(keys), SCAN_BATCH):
        batch = keys[start : start + SCAN_BATCH]
        pipeline = client.pipeline(transaction=False)
        for key in batch:
            pipeline.get(key)
            pipeline.pttl(key)
        replies = pipeline.execute(raise_on_error=False)
        for index, key in enumerate(batch):
            value, milliseconds = replies[2 * index], replies[2 * index + 1]
            if isinstance(value, bytes) and isinstance(milliseconds, int) and milliseconds != -2:
                found[key] = (_text(value), milliseconds)
    return found


# -- node status --------------------------------------------------------------------------------


def status_report(app: Any, timeout: float = DEFAULT_TIMEOUT) -> StatusReport:
    """Every lock node's status and the warnings about the group, asked at once.

    Promises: one `NodeStatus` per configured node, in ``redlock_urls`` order (an unreachable
    node is a record with ``reachable=False`` and the error, never an exception); passwords are
    redacted in every name; the call takes about one ``timeout`` however many nodes hang.
    """
    with _context(app, timeout) as context:
        answers = context.ask(_probe_node)
        largest_ttl = _largest_lock_ttl(app, context.settings)
    statuses = []
    for answer in answers:
        if answer.value is None:
            statuses.append(NodeStatus(answer.name, reachable=False, error=answer.error))
            continue
        node_warnings = (*answer.value.warnings, *_node_warnings(answer.value, largest_ttl))
        statuses.append(dataclasses.replace(answer.value, node=answer.name, warnings=node_warnings))
    group_warnings = _group_warnings(statuses, context.quorum)
    return StatusReport(tuple(statuses), context.quorum, largest_ttl, tuple(group_warnings))


def node_status(app: Any, timeout: float = DEFAULT_TIMEOUT) -> list[NodeStatus]:
    """One `NodeStatus` per lock node — reachable, round trip, version, role, persistence,
    eviction policy, warnings — in ``redlock_urls`` order. `status_report` adds the warnings
    about the group (node count, duplicates, nodes down)."""
    return list(status_report(app, timeout).nodes)


def _probe_node(client: redis.Redis) -> NodeStatus:
    """PING (round trip measured on an open connection), INFO and CONFIG of one node."""
    client.ping()  # connects (and authenticates): not part of the round trip
    started = time.perf_counter()
    client.ping()
    fields: dict[str, Any] = {
        "round_trip_milliseconds": round((time.perf_counter() - started) * 1000, 3)
    }
    warnings: list[str] = []
    try:
        server = client.info("server")
        fields["redis_version"] = _text(server.get("redis_version"))
        fields["run_id"] = _text(server.get("run_id"))
        replication = client.info("replication")
        fields["role"] = _text(replication.get("role"))
        if "master_host" in replication:
            fields["master"] = f"{replication['master_host']}:{replication.get('master_port')}"
        persistence = client.info("persistence")
        fields["aof_enabled"] = bool(int(persistence.get("aof_enabled", 0)))
        memory = client.info("memory")
        fields["maxmemory"] = int(memory.get("maxmemory", 0))
        fields["maxmemory_policy"] = _text(memory.get("maxmemory_policy", "unknown"))
    except ResponseError as error:
        warnings.append(
            f"INFO is not allowed ({_describe_error(error)}): role, persistence and eviction "
            "could not be checked"
        )
    with contextlib.suppress(ResponseError):  # CONFIG denied by an ACL (or renamed): unknown
        for name, value in client.config_get("appendfsync").items():
            if _text(name) == "appendfsync":
                fields["appendfsync"] = _text(value)
    return NodeStatus("", reachable=True, warnings=tuple(warnings), **fields)


def _node_warnings(status: NodeStatus, largest_ttl: float) -> list[str]:
    """The settings of one reachable node that weaken the lock's safety."""
    warnings: list[str] = []
    if status.role is not None and status.role != "master":
        of_master = f" of {status.master}" if status.master else ""
        warnings.append(
            f"role is {status.role}{of_master}: Redlock needs independent masters; a replica "
            "rejects lock writes (read-only), and a failover to it can hand a lock out twice"
        )
    delayed_restart = (
        f"restart a crashed node only after the largest lock ttl ({largest_ttl:g}s) has passed "
        "(delayed restart), or run it with appendonly yes and appendfsync always"
    )
    if status.aof_enabled is False:
        warnings.append(f"no AOF (appendonly no): {delayed_restart}")
    elif status.aof_enabled and status.appendfsync is None:
        warnings.append(
            f"AOF on, appendfsync unknown (CONFIG GET not allowed): unless it is 'always', "
            f"{delayed_restart}"
        )
    elif status.aof_enabled and status.appendfsync != "always":
        warnings.append(
            f"AOF with appendfsync {status.appendfsync} (not 'always'): a crash can lose "
            f"recent locks; {delayed_restart}"
        )
    if status.maxmemory and status.maxmemory_policy not in (None, "noeviction"):
        warnings.append(
            f"maxmemory-policy {status.maxmemory_policy} with maxmemory set: under memory "
            "pressure Redis may evict lock keys (they have a ttl) and hand a lock out twice; "
            "use noeviction on lock nodes"
        )
    return warnings


def _group_warnings(statuses: Sequence[NodeStatus], quorum: int) -> list[str]:
    """Warnings about the set of nodes as a whole."""
    total = len(statuses)
    warnings: list[str] = []
    if total == 1:
        warnings.append(
            "a single lock node: no fault tolerance; while it is down no lock can be taken, "
            "and a restart without persistence forgets every lock"
        )
    even = even_node_warning(total)
    if even and total > 1:
        warnings.append(even)
    by_server: dict[str, list[str]] = {}
    for status in statuses:
        if status.run_id:
            by_server.setdefault(status.run_id, []).append(status.node)
    for names in by_server.values():
        if len(names) > 1:
            warnings.append(
                f"{' and '.join(names)} are the same Redis server (same run_id): the nodes "
                "must be independent, or one crash removes several votes"
            )
    reachable = sum(status.reachable for status in statuses)
    if quorum <= reachable < total:
        warnings.append(
            f"{total - reachable} of {total} lock nodes unreachable: locks still work, "
            f"but {reachable - quorum + 1} more failure(s) stop them"
        )
    return warnings


def _singleton_tasks(app: Any) -> dict[str, SingletonTask]:
    if not getattr(app.loader, "worker_initialized", False):  # a worker imported them already
        with contextlib.suppress(Exception):  # tasks of a module that fails to import: not found
            app.loader.import_default_modules()
    return {name: task for name, task in list(app.tasks.items()) if isinstance(task, SingletonTask)}


def _largest_lock_ttl(app: Any, settings: RedlockSettings) -> float:
    """The longest a lock key can live: the ttl setting or any singleton task's ttl or hold."""
    largest = settings.ttl
    for task in _singleton_tasks(app).values():
        with contextlib.suppress(RedlockError):
            plan = task.lock_plan
            largest = max(largest, plan.ttl, plan.hold)
    return float(largest)


# -- locks held now -----------------------------------------------------------------------------


def lock_listing(
    app: Any,
    keys: Sequence[str] | None = None,
    *,
    check_workers: bool = False,
    timeout: float = DEFAULT_TIMEOUT,
) -> LockListing:
    """The lock keys on the nodes (``keys``, or every lock key under the prefix), split into
    held and minority leftovers, with the nodes that did not answer. Never raises for nodes
    that do not answer: check ``has_quorum``. ``check_workers`` fills ``worker_answers`` and
    ``task_active`` (one control round trip to the holders' workers, about ``timeout``).

    Fencing counters, completion markers and the beat leader's schedule records are not locks
    and are left out; the beat leader's lease is a lock whose owner has the role "beat leader".
    """
    with _context(app, timeout) as context:
        found, unreachable = context.read(keys)
    records = [entry.record for entry in found]
    if check_workers:
        records = _with_worker_checks(app, records, timeout)
    return LockListing(
        locks=tuple(record for record in records if record.held),
        minority=tuple(record for record in records if not record.held),
        nodes_total=len(context.nodes),
        quorum=context.quorum,
        unreachable=unreachable,
    )


def held_locks(
    app: Any, *, check_workers: bool = False, timeout: float = DEFAULT_TIMEOUT
) -> list[LockRecord]:
    """The locks held now (the same value on a majority of nodes), sorted by key: task, task id,
    worker, host, pid, attempt, since, time left, nodes holding — never the token.

    Raises `QuorumUnavailable` when fewer than a majority of nodes answer (the answer would be
    a guess). ``check_workers=True`` also asks each holder's worker whether it answers a ping
    and runs the task (one control round trip, about ``timeout`` seconds).
    """
    listing = lock_listing(app, check_workers=check_workers, timeout=timeout)
    _require_quorum(listing, "*")
    return list(listing.locks)


def _require_quorum(listing: LockListing, resource: str) -> None:
    if not listing.has_quorum:
        raise QuorumUnavailable(resource, listing.reachable, listing.quorum)


def find_task(app: Any, name: str) -> SingletonTask:
    """The app's singleton task ``name`` (its task modules imported first); `UnknownTask`, naming
    close matches and the app's singleton tasks, when there is none."""
    tasks = _singleton_tasks(app)
    task = tasks.get(name)
    if task is not None:
        return task
    known = ", ".join(sorted(tasks)) or "none"
    if name in app.tasks:
        raise UnknownTask(
            f"task {name!r} is not a SingletonTask: it takes no lock (singleton tasks of this "
            f"app: {known})"
        )
    close = difflib.get_close_matches(name, sorted(tasks), n=3)
    hint = f"did you mean {', '.join(close)}? " if close else ""
    raise UnknownTask(f"unknown task {name!r}; {hint}singleton tasks of this app: {known}")


def key_basis(task: SingletonTask) -> str:
    """What ``task``'s lock key is made of, in words."""
    recipe = task.lock_plan.recipe
    if recipe.lock_key is not None:
        if isinstance(recipe.lock_key, str):
            return f"lock_key template {recipe.lock_key!r}"
        return "lock_key callable"
    if recipe.lock_args is None:
        return "task name and all arguments"
    if not recipe.lock_args:
        return "task name alone (lock_args=())"
    return f"task name and lock_args {', '.join(recipe.lock_args)}"


def call_key(
    app: Any,
    task_name: str,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
) -> CallKey:
    """The lock a call of ``task_name`` with ``args`` and ``kwargs`` would take — the key the
    worker computes (`SingletonTask.lock_key_for`). Raises `UnknownTask`, or `LockKeyError` when
    the arguments do not fit the task's signature. Touches no node."""
    task = find_task(app, task_name)
    kwargs = dict(kwargs or {})
    resource = task.lock_plan.resource(tuple(args), kwargs)
    key = task.lock_plan.runtime.redlock.key_for(resource)
    return CallKey(task.name, tuple(args), kwargs, key_basis(task), resource, key)


def lock_key(app: Any, task_name: str, /, *args: Any, **kwargs: Any) -> str:
    """The Redis key (under the key prefix) a call ``task_name(*args, **kwargs)`` would lock;
    the same as ``task.lock_key_for(*args, **kwargs)``."""
    return call_key(app, task_name, args, kwargs).key


def holder(app: Any, task_name: str, /, *args: Any, **kwargs: Any) -> LockRecord | None:
    """The record of whoever holds the lock a call ``task_name(*args, **kwargs)`` would take,
    or None when it is free. Raises `QuorumUnavailable` when no majority of nodes answers."""
    key = lock_key(app, task_name, *args, **kwargs)
    listing = lock_listing(app, [key])
    _require_quorum(listing, key)
    return listing.locks[0] if listing.locks else None


def resolve_key(app: Any, key_or_resource: str) -> tuple[str, str]:
    """``(key, resource)`` for a full lock key (under the prefix) or a resource without it.
    Raises `ValueError` for a fencing counter."""
    if key_or_resource.endswith(FENCE_SUFFIX):
        raise ValueError(
            f"{key_or_resource!r} is a fencing counter, not a lock; pass the lock key without "
            f"{FENCE_SUFFIX!r}"
        )
    prefix = AppRuntime.for_app(app).settings.key_prefix
    if prefix and key_or_resource.startswith(prefix):
        return key_or_resource, key_or_resource.removeprefix(prefix)
    return prefix + key_or_resource, key_or_resource


def force_release(app: Any, key: str, *, timeout: float = DEFAULT_TIMEOUT) -> ReleaseResult:
    """Delete the lock ``key`` (a full key or a resource) on every node, whoever holds it.

    For stuck locks: the holder, if still running, is not stopped, and another run can start at
    once (waiters are woken). Nothing is deleted when no reachable node has the key. A copy on a
    node that does not answer stays until its ttl; ``still_present_on`` names nodes that answered
    but still have it.
    """
    full_key, resource = resolve_key(app, key)
    with _context(app, timeout) as context:
        before, unreachable = context.read([full_key])
        if not before:
            return ReleaseResult(
                full_key, resource, None, (), (), len(context.nodes), context.quorum, unreachable
            )
        had = {copy.node: copy.value for copy in before[0].copies}
        context.redlock.force_release(resource)
        after, _ = context.read([full_key])
    # A copy with another value is a new holder's (waiters are woken at once): not ours.
    copies = after[0].copies if after else ()
    still = {copy.node for copy in copies if had.get(copy.node) == copy.value}
    names = [node.name for node in context.nodes]
    return ReleaseResult(
        key=full_key,
        resource=resource,
        lock=before[0].record,
        deleted_on=tuple(names[index] for index in sorted(had) if index not in still),
        still_present_on=tuple(names[index] for index in sorted(still)),
        nodes_total=len(names),
        quorum=context.quorum,
        unreachable=unreachable,
    )


# -- the holders' workers -----------------------------------------------------------------------


@dataclass(frozen=True)
class _WorkerState:
    """What one worker node name answered. ``replies``: how many workers answered the ping
    under that name (more than one: duplicate names, nothing can be told apart)."""

    replies: int
    running: frozenset[str] | None = None  # task ids active or reserved; None: unknown
    pid: int | None = None
    pool_processes: frozenset[int] = frozenset()

    @property
    def answers(self) -> bool:
        """True when exactly one worker answered under the name."""
        return self.replies == 1

    @property
    def known(self) -> bool:
        """True when the worker answered every question (its tasks and processes are known)."""
        return self.answers and self.running is not None and self.pid is not None


def _node_name(owner: Owner | None) -> str | None:
    """The Celery node name (``name@host``) to ask about ``owner``, if it has one. Under the solo
    and threads pools Celery gives tasks the plain host name as ``request.hostname``, which no
    worker answers to."""
    worker = owner.worker if owner is not None else None
    return worker if worker and "@" in worker else None


def _node_names(owners: Iterable[Owner | None]) -> list[str]:
    return sorted({name for name in map(_node_name, owners) if name is not None})


def _broadcast(
    app: Any, command: str, names: Sequence[str], timeout: float, limit: int | None = None
) -> list[dict[str, Any]]:
    if not names:  # no destination would mean every worker
        return []
    try:
        replies = app.control.broadcast(
            command, destination=list(names), reply=True, timeout=timeout, limit=limit
        )
    except Exception as error:  # a broker can fail in many ways: no reply is no proof
        logger.warning("control command %s to %s failed: %s", command, ", ".join(names), error)
        return []
    return [reply for reply in replies or [] if isinstance(reply, dict)]


def _inspect_workers(app: Any, names: Sequence[str], timeout: float) -> dict[str, _WorkerState]:
    """Ping the workers ``names``; ask those that answer (once each) for their active and
    reserved tasks and their processes. Costs one ``timeout`` (the ping waits for every reply,
    so that duplicate names show), plus a round trip per question."""
    if not names:
        return {}
    counts: Counter[str] = Counter()
    for reply in _broadcast(app, "ping", names, timeout):
        counts.update(name for name in reply if name in names)
    single = [name for name in names if counts[name] == 1]
    answers: dict[str, dict[str, Any]] = {name: {} for name in single}
    for command in ("active", "reserved", "stats"):
        for reply in _broadcast(app, command, single, timeout, limit=len(single)):
            for name, value in reply.items():
                if name in answers and command in answers[name]:
                    counts[name] += 1  # a second worker under that name after all
                elif name in answers:
                    answers[name][command] = value
    states = {}
    for name in names:
        answer = answers.get(name, {})
        active, reserved, stats = (answer.get(key) for key in ("active", "reserved", "stats"))
        running = None
        if isinstance(active, list) and isinstance(reserved, list):
            requests = [request for request in active + reserved if isinstance(request, dict)]
            running = frozenset(str(request.get("id")) for request in requests)
        stats = stats if isinstance(stats, dict) else {}
        pool = stats.get("pool")
        processes = pool.get("processes") if isinstance(pool, dict) else None
        pid = stats.get("pid")
        states[name] = _WorkerState(
            replies=counts[name],
            running=running,
            pid=pid if isinstance(pid, int) else None,
            pool_processes=frozenset(
                process for process in processes or () if isinstance(process, int)
            ),
        )
    return states


def _with_worker_checks(
    app: Any, records: Sequence[LockRecord], timeout: float
) -> list[LockRecord]:
    names = _node_names(record.owner for record in records if record.held)
    states = _inspect_workers(app, names, timeout)
    checked = []
    for record in records:
        state = states.get(_node_name(record.owner) or "")
        if state is None:
            checked.append(record)
            continue
        active = None
        if state.answers and state.running is not None and record.task_id is not None:
            active = record.task_id in state.running
        checked.append(
            dataclasses.replace(record, worker_answers=state.answers, task_active=active)
        )
    return checked


# -- reaping ------------------------------------------------------------------------------------


def process_exists(pid: int) -> bool:
    """True when a process ``pid`` exists on this machine (in this PID namespace); True too
    when ``pid`` is not a usable process id, since nothing can be concluded then."""
    if pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists, under another user
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
            state = stat.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return True  # no /proc (not Linux): it exists
    return state not in ("Z", "X")  # a zombie has exited; only its parent has not reaped it


@dataclass(frozen=True)
class _Verdict:
    action: str
    reason: str
    proof: str | None = None


def _kept(reason: str) -> _Verdict:
    return _Verdict(KEPT, reason)


@dataclass
class _Watch:
    """A held lock being judged: what was read of it (node -> (pttl ms, when read), copies
    holding its value only), whether its worker answered at some point, and the verdict."""

    found: _Found
    owner: Owner
    pttls: dict[int, tuple[int, float]]
    extends: bool = True
    worker_answered: bool = False
    verdict: _Verdict | None = None


def reap(
    app: Any,
    dry_run: bool = False,
    *,
    grace: float | None = None,
    check_local_processes: bool = True,
    timeout: float = DEFAULT_TIMEOUT,
    progress: Callable[[str], None] | None = None,
) -> list[ReapResult]:
    """Free the held locks whose holder is proven gone — by token, never a live holder's.

    Returns one `ReapResult` per held lock, sorted by key. A lock is freed (its exact stored
    value deleted, atomically, on every node: a lock taken again meanwhile is untouched) only
    with one of these proofs:

    - ``PROOF_PROCESS_GONE``: the holder ran on this host (same host name) and its process no
      longer exists. ``check_local_processes=False`` turns this off: do so when machines or
      containers share host names.
    - ``PROOF_NOT_RUNNING``: the holder's worker answers (exactly one worker under its node
      name), has the task id neither active nor reserved, and the holder's process is that
      worker's main process (solo, threads: the body would run there) or none of its processes
      (the worker was restarted under the same name). When the holder's process is still one of
      its pool processes (a hard time limit being enforced, a release that failed), the lock
      must also stay unextended for the grace period.
    - ``PROOF_SILENT``: the holder's worker does not answer for the whole grace period (or
      there is no node name to ask: a run outside a worker, or a solo or threads pool, where
      Celery records the plain host name), and in that time the lock is not extended on any node
      nor its value changed. A live holder's lock keeper extends a third of the way through the
      lock's validity, so a lock is judged this way only when the grace exceeds a third of its
      time left plus `KEEPER_LATENESS_SECONDS`. Silence alone proves nothing: a solo or threads
      pool busy in a task does not answer control commands, and a partition looks the same. A
      holder frozen, or cut off from both the broker and the lock nodes, for the whole grace
      counts as gone.

    Never freed: a queued call's claim (``lock_on_enqueue``), a task without auto-extension, a
    lock that may be in its ``lock_hold`` window (time left within ``lock_hold``), a task this
    app does not define (its hold and extension are unknown), a value without a readable owner.

    ``grace`` defaults to ``redlock_reap_grace``; 0 turns the silent proof off. The call waits
    (``grace`` seconds) only when some lock needs watching, and then tells ``progress``. With
    ``dry_run`` the decisions are the same and nothing is deleted (action ``"would-free"``).
    Raises `QuorumUnavailable` when fewer than a majority of nodes answer.
    """
    with _context(app, timeout) as context:
        grace = context.settings.reap_grace if grace is None else grace
        found, unreachable = context.read(None)
        reachable = len(context.nodes) - len(unreachable)
        if reachable < context.quorum:
            raise QuorumUnavailable("*", reachable, context.quorum)
        watches = [
            _Watch(entry, entry.record.owner, _pttls(entry, entry, time.monotonic()))
            if entry.record.owner is not None
            else _Watch(entry, Owner(id=None), {}, verdict=_kept(NO_OWNER))
            for entry in found
            if entry.record.held
        ]
        tasks = _singleton_tasks(app)
        for watch in watches:
            if watch.verdict is None:
                watch.verdict = _first_look(watch, tasks, check_local_processes)
        asking = [watch for watch in watches if watch.verdict is None]
        workers = _inspect_workers(app, _node_names(watch.owner for watch in asking), timeout)
        for watch in asking:
            watch.verdict = _worker_verdict(watch, workers) or _grace_verdict(watch, grace)
        # Locks proven at once are freed before the others are watched.
        results = {
            watch.found.record.key: _settle(context, watch, dry_run)
            for watch in watches
            if watch.verdict is not None
        }
        undecided = [watch for watch in watches if watch.verdict is None]
        if undecided:
            if progress is not None:
                progress(f"watching {len(undecided)} lock(s) for {grace:g}s")
            _watch(app, context, undecided, grace, timeout)
            for watch in undecided:
                results[watch.found.record.key] = _settle(context, watch, dry_run)
        return [results[key] for key in sorted(results)]


NO_OWNER = "the stored value names no owner celery_redlock can read"


def _pttls(entry: _Found, holding: _Found, read_at: float) -> dict[int, tuple[int, float]]:
    """Per node, the pttl of the copies of ``entry`` that still hold ``holding``'s value."""
    return {
        copy.node: (copy.milliseconds_left, read_at)
        for copy in entry.copies
        if copy.value == holding.value
    }


def _first_look(
    watch: _Watch, tasks: Mapping[str, SingletonTask], check_local_processes: bool
) -> _Verdict | None:
    """The verdict that needs neither the workers nor watching, or None."""
    record, owner = watch.found.record, watch.owner
    if owner.queued:
        return _kept(
            "a claim taken when the call was queued (lock_on_enqueue): not extended; the run "
            "takes it over, or it expires by itself"
        )
    if record.time_left is None:
        return _kept("the key has no expiry: celery_redlock did not write it")
    hold, extends = 0.0, True  # the beat leader's lease is extended and never held on
    if owner.role is None:
        task = tasks.get(owner.task or "")
        if task is None:
            return _kept(
                f"task {owner.task!r} is not a singleton task of this app, so its lock_hold and "
                "auto-extension are unknown: run this with the app that defines it"
            )
        try:
            hold, extends = task.lock_plan.hold, task.lock_plan.auto_extend
        except RedlockError as error:
            return _kept(f"task {owner.task!r} has invalid lock options: {error}")
    if hold and record.time_left <= hold + PTTL_TOLERANCE_SECONDS:
        return _kept(f"it may be in its lock_hold window (kept {hold:g}s after a run on purpose)")
    local = check_local_processes and owner.host == socket.gethostname()
    if local and not process_exists(owner.pid):
        return _Verdict(
            FREED, f"process {owner.pid} no longer exists on this host", PROOF_PROCESS_GONE
        )
    watch.extends = extends
    return None


def _grace_verdict(watch: _Watch, grace: float) -> _Verdict | None:
    """For a lock whose worker is silent (or runs it no more in a live pool process): kept
    when watching cannot prove anything, else None (watch it for ``grace`` seconds)."""
    record, owner = watch.found.record, watch.owner
    assert record.time_left is not None
    if not watch.extends:
        return _kept(
            f"no proof: task {owner.task} does not auto-extend its lock, so a live holder would "
            f"not extend it either; it expires in {record.time_left:g}s"
        )
    if grace <= 0:
        return _kept("no proof without watching it, and the grace is 0")
    needed = record.time_left / 3 + KEEPER_LATENESS_SECONDS
    if needed > grace:
        return _kept(
            f"no proof: a live holder need not extend it for {needed:.1f}s, longer than the "
            f"grace of {grace:g}s; it expires in {record.time_left:g}s"
        )
    return None


def _worker_verdict(watch: _Watch, workers: Mapping[str, _WorkerState]) -> _Verdict | None:
    """The verdict the holder's worker gives by answering, or None (silent, or watch on)."""
    owner = watch.owner
    state = workers.get(_node_name(owner) or "")
    if state is None or not state.replies:
        return None
    if state.replies > 1:
        return _kept(f"{state.replies} workers answer to {owner.worker}: no telling them apart")
    watch.worker_answered = True
    if state.running is None or state.pid is None:
        return _kept(f"worker {owner.worker} answers ping, but not inspect and stats")
    if owner.id is not None and owner.id in state.running:
        return _kept(f"worker {owner.worker} answers and is running task {owner.id}")
    if owner.pid == state.pid:
        return _Verdict(
            FREED,
            f"worker {owner.worker} answers and is not running the task, in the holder's own "
            f"process {owner.pid}",
            PROOF_NOT_RUNNING,
        )
    if owner.pid not in state.pool_processes:
        return _Verdict(
            FREED,
            f"worker {owner.worker} answers, is not running the task, and the holder's process "
            f"{owner.pid} is none of its processes",
            PROOF_NOT_RUNNING,
        )
    return None  # still one of its pool processes: watch that the lock is not extended


def _watch(
    app: Any, context: _Context, watches: Sequence[_Watch], grace: float, timeout: float
) -> None:
    """Watch ``watches`` for ``grace`` seconds: about once a second, ask the silent workers
    and re-read the locks; a lock extended, changed, or found running is decided at once."""
    started = time.monotonic()
    while True:
        left = started + grace - time.monotonic()
        watching = [watch for watch in watches if watch.verdict is None]
        if not watching or left <= 0:
            break
        pause_until = time.monotonic() + min(1.0, left)
        names = _node_names(watch.owner for watch in watching)
        workers = _inspect_workers(app, names, min(timeout, left))
        time.sleep(max(0.0, pause_until - time.monotonic()))
        read_at = time.monotonic()
        found, _ = context.read([watch.found.record.key for watch in watching])
        by_key = {entry.record.key: entry for entry in found}
        for watch in watching:
            watch.verdict = _worker_verdict(watch, workers) or _look_again(
                watch, by_key.get(watch.found.record.key), read_at
            )
    watched = time.monotonic() - started
    for watch in watches:
        if watch.verdict is None:
            if watch.worker_answered:
                why = f"worker {watch.owner.worker} answers and is not running the task"
                proof = PROOF_NOT_RUNNING
            else:
                why = f"worker {watch.owner.worker} did not answer"
                why = why if _node_name(watch.owner) else "no worker node name to ask"
                proof = PROOF_SILENT
            reason = f"{why}, and the lock was not extended for {watched:.1f}s"
            watch.verdict = _Verdict(FREED, reason, proof)


def _look_again(watch: _Watch, now: _Found | None, read_at: float) -> _Verdict | None:
    """Compare a new read of the lock with the last one: None while nothing changed."""
    if now is None or not now.record.held or now.value != watch.found.value:
        return _Verdict(GONE, "released, expired or taken by another holder while watched")
    for node, (milliseconds, when) in _pttls(now, watch.found, read_at).items():
        last = watch.pttls.get(node)
        # Without an extension the pttl falls as fast as time passes; any rise is an extension.
        expected = last[0] - (when - last[1]) * 1000 if last is not None else milliseconds
        if milliseconds > expected + PTTL_TOLERANCE_SECONDS * 1000:
            return _kept("its holder extended it while it was watched: it is alive")
        watch.pttls[node] = (milliseconds, when)
    return None


def _settle(context: _Context, watch: _Watch, dry_run: bool) -> ReapResult:
    """The result for one lock, freeing it (by its exact stored value) when proven gone."""
    verdict = watch.verdict
    assert verdict is not None
    record = watch.found.record
    if verdict.action != FREED:
        return ReapResult(record, verdict.action, verdict.proof, verdict.reason)
    if dry_run:
        return ReapResult(record, WOULD_FREE, verdict.proof, verdict.reason)
    # The release script deletes the key only where it still holds this very value (token).
    result = context.redlock.run_script(
        scripts.RELEASE, (record.key, record.key + FENCE_SUFFIX), (watch.found.value, 0), _is_one
    )
    if not result.successes:
        return ReapResult(record, GONE, verdict.proof, f"{verdict.reason}; released meanwhile")
    if record.nodes_holding - result.successes >= context.quorum:
        reason = f"{verdict.reason}; deleted on {result.successes} node(s) only, still held"
        return ReapResult(record, KEPT, verdict.proof, reason, result.successes)
    logger.warning("reaped lock %s of %s: %s", record.key, record.describe(), verdict.reason)
    return ReapResult(record, FREED, verdict.proof, verdict.reason, result.successes)


def _is_one(reply: Any) -> bool:
    return reply == 1 and not isinstance(reply, bool)
