"""The records the operators' API returns: frozen dataclasses with a ``to_json()``, none of which
holds a lock token (the secret part of a stored lock value, which allows releasing the lock).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import RedlockError
from ..lock.owner import Owner

DEFAULT_TIMEOUT = 1.0
"""Seconds each node (and the workers, for control commands) gets per command by default."""

PROOF_NOT_RUNNING = "worker-not-running-it"
"""Reap proof: the holder's worker answers and is not running the task (see `reap`)."""
PROOF_PROCESS_GONE = "process-gone"
"""Reap proof: the holder ran on this host and its process no longer exists."""
PROOF_SILENT = "silent-not-extended"
"""Reap proof: the worker stayed silent and the lock was not extended for the grace period."""

FREED = "freed"
"""Reap action: the lock was deleted."""
WOULD_FREE = "would-free"
"""Reap action in a dry run: the lock would have been deleted."""
KEPT = "kept"
"""Reap action: the lock stays (no proof its holder is gone)."""
GONE = "gone"
"""Reap action: proven, but released or taken by someone else before it could be freed."""

LEGACY_NOTE = "0.2 key layout: a celery-redlock 0.2 worker's lock; 0.3 workers treat it as held"
"""How a lock under a 0.2-layout key is described to people."""


def as_json(record: Any, *leave_out: str) -> dict[str, Any]:
    """A record's fields in their order, as JSON: tuples as lists, records in their JSON form."""

    def shown(value: Any) -> Any:
        if isinstance(value, tuple):
            return [shown(item) for item in value]
        return value.to_json() if hasattr(value, "to_json") else value

    fields = dataclasses.fields(record)
    return {f.name: shown(getattr(record, f.name)) for f in fields if f.name not in leave_out}


def names_by_warning(named: Iterable[tuple[str, Iterable[str]]]) -> dict[str, list[str]]:
    """Each warning of the ``(name, warnings)`` pairs, with the names that have it."""
    grouped: dict[str, list[str]] = {}
    for name, warnings in named:
        for warning in warnings:
            grouped.setdefault(warning, []).append(name)
    return grouped


@dataclass(frozen=True)
class NodeError:
    """A lock node that did not answer — no reply, an error reply, or a reply no Redis server
    gives (such a node is not trusted) — and why, in one line."""

    node: str
    error: str

    def to_json(self) -> dict[str, str]:
        """``{"node": ..., "error": ...}``."""
        return as_json(self)


@dataclass(frozen=True)
class NodeStatus:
    """What one lock node told about itself. Fields are None where it could not be learnt:
    unreachable (``error`` says why: no answer, or replies no Redis server gives), or a command
    refused by an ACL or renamed by a managed service (``could_not_read`` says what, and for an
    ACL which command to grant). ``warnings`` name the node's settings that weaken the lock's
    safety, each with the fix. ``connected_replicas`` is how many replicas the server has;
    ``servers``, for a node made of several servers (a Redis Cluster: one per master), each
    server's own record (the node's fields are then what they agree on)."""

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
    could_not_read: tuple[str, ...] = ()
    connected_replicas: int | None = None
    servers: tuple[NodeStatus, ...] = ()

    @property
    def server_text(self) -> str:
        """The server and its version as shown: ``redis 7.0.15``, ``valkey 9.1.2``."""
        version = self.redis_version or "?"
        return version if version.startswith("valkey ") else f"redis {version}"

    def summary(self) -> str:
        """The node in one line, for people: round trip, version, role, persistence, replicas;
        or why it is unreachable. A node of several servers (a cluster) says how many masters,
        with the slowest round trip and the fewest replicas of any master."""
        if not self.reachable:
            return f"unreachable: {self.error}"
        persistence = {True: "aof on", False: "aof off", None: "aof unknown"}[self.aof_enabled]
        if self.aof_enabled and self.appendfsync:
            persistence += f" (appendfsync {self.appendfsync})"
        shape = f"cluster of {len(self.servers)} masters  " if self.servers else ""
        replicas = (
            "" if self.connected_replicas is None else f"  {self.connected_replicas} replica(s)"
        )
        return (
            f"{shape}{self.round_trip_milliseconds or 0:.2f} ms  "
            f"{self.server_text}  {self.role or 'role ?'}  {persistence}{replicas}"
        )

    def to_json(self) -> dict[str, Any]:
        """The JSON form (``run_id`` only serves to find duplicate nodes and is left out)."""
        return as_json(self, "run_id")


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
        grouped = names_by_warning((status.node, status.warnings) for status in self.nodes)
        lines = [f"{', '.join(names)}: {warning}" for warning, names in grouped.items()]
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
    the holder's task id is active or reserved there. ``legacy_layout``: the key has the 0.2
    layout (no braces): a celery-redlock 0.2 worker holds it, and today's workers treat the
    lock as held.
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
    legacy_layout: bool = False

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
        layout = f" ({LEGACY_NOTE})" if self.legacy_layout else ""
        return f"{state} by {self.describe()}, on {nodes} nodes, {left}{layout}"

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
            "legacy_layout": self.legacy_layout,
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
class Refusal:
    """A node where a key is not a lock, and why (its type, or a value celery_redlock never
    writes): `force_release` leaves the key alone there."""

    node: str
    reason: str

    def to_json(self) -> dict[str, str]:
        """``{"node": ..., "reason": ...}``."""
        return as_json(self)


@dataclass(frozen=True)
class ReleaseResult:
    """What `force_release` did: the lock it found (None: no reachable node had a lock under
    the key), the nodes it was deleted on, those where a copy is still present, and those where
    the key is not a lock (``refused``: left alone)."""

    key: str
    resource: str
    lock: LockRecord | None
    deleted_on: tuple[str, ...]
    still_present_on: tuple[str, ...]
    nodes_total: int
    quorum: int
    unreachable: tuple[NodeError, ...]
    refused: tuple[Refusal, ...] = ()

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
            "refused": [refusal.to_json() for refusal in self.refused],
        }

    def refusal_lines(self) -> list[str]:
        """One line per node where the key is not a lock: ``"<key> is not a lock on <node>:
        <reason>"``."""
        return [
            f"{self.key} is not a lock on {refusal.node}: {refusal.reason}"
            for refusal in self.refused
        ]


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
        return as_json(self)


class UnknownTask(RedlockError, LookupError):
    """The app has no singleton task of that name (the message lists the close matches)."""


class NotALock(RedlockError, ValueError):
    """A key that is not a lock key (a fencing counter, completion records, schedule records,
    anything else): operators' commands refuse it by name (``"<key> is not a lock: ..."``)."""
