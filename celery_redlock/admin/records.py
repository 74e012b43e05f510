"""The records the operators' API returns: frozen dataclasses with a ``to_json()``, never
holding a lock token."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import RedlockError
from ..lock.owner import Owner

DEFAULT_TIMEOUT = 1.0  # seconds per node (and worker control command) and command

# Reap proofs (see `reap`): the holder's worker answers and is not running the task; the holder
# ran on this host and its process is gone; its worker stayed silent and the lock unextended.
PROOF_NOT_RUNNING = "worker-not-running-it"
PROOF_PROCESS_GONE = "process-gone"
PROOF_SILENT = "silent-not-extended"

# Reap actions: deleted; would be deleted (a dry run); kept (no proof its holder is gone);
# proven, but released or taken by someone else before it could be freed.
FREED = "freed"
WOULD_FREE = "would-free"
KEPT = "kept"
GONE = "gone"

LEGACY_NOTE = "0.2 key layout: a celery-redlock 0.2 worker's lock; 0.3 workers treat it as held"


class JsonRecord:
    """A record whose JSON form (`to_json`) is its fields in their order (`fields_json`): tuples
    as lists, records in their JSON form."""

    def to_json(self) -> dict[str, Any]:
        return self.fields_json()

    def fields_json(self, *leave_out: str) -> dict[str, Any]:
        def shown(value: Any) -> Any:
            if isinstance(value, tuple):
                return [shown(item) for item in value]
            return value.to_json() if hasattr(value, "to_json") else value

        fields = dataclasses.fields(self)  # type: ignore[arg-type]
        return {f.name: shown(getattr(self, f.name)) for f in fields if f.name not in leave_out}


def names_by_warning(named: Iterable[tuple[str, Iterable[str]]]) -> dict[str, list[str]]:
    """Each warning of the ``(name, warnings)`` pairs -> the names that have it."""
    grouped: dict[str, list[str]] = {}
    for name, warnings in named:
        for warning in warnings:
            grouped.setdefault(warning, []).append(name)
    return grouped


@dataclass(frozen=True)
class NodeError(JsonRecord):
    """A lock node that did not answer (or gave replies no Redis server gives), and why."""

    node: str
    error: str


@dataclass(frozen=True)
class NodeStatus(JsonRecord):
    """What one lock node told about itself; None where it could not be learnt (``error`` says
    why it is unreachable, ``could_not_read`` what an ACL or a managed service refused).
    ``warnings`` name settings that weaken the lock's safety, with the fix; ``servers`` holds a
    cluster's masters' own records (the node's fields are what they agree on)."""

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

    def summary(self) -> str:
        """The node in one line, for people (or why it is unreachable)."""
        if not self.reachable:
            return f"unreachable: {self.error}"
        persistence = {True: "aof on", False: "aof off", None: "aof unknown"}[self.aof_enabled]
        if self.aof_enabled and self.appendfsync:
            persistence += f" (appendfsync {self.appendfsync})"
        shape = f"cluster of {len(self.servers)} masters  " if self.servers else ""
        version = self.redis_version or "?"
        server = version if version.startswith("valkey ") else f"redis {version}"
        replicas = (
            "" if self.connected_replicas is None else f"  {self.connected_replicas} replica(s)"
        )
        return (
            f"{shape}{self.round_trip_milliseconds or 0:.2f} ms  "
            f"{server}  {self.role or 'role ?'}  {persistence}{replicas}"
        )

    def to_json(self) -> dict[str, Any]:
        """The JSON form (``run_id`` only serves to find duplicate nodes and is left out)."""
        return self.fields_json("run_id")


@dataclass(frozen=True)
class StatusReport(JsonRecord):
    """Every lock node's status, and ``warnings`` about the group (node count, duplicates, nodes
    down). ``largest_lock_ttl``: how long a crashed node without ``appendfsync always`` must
    stay down (the longest ttl or ``lock_hold``)."""

    nodes: tuple[NodeStatus, ...]
    quorum: int
    largest_lock_ttl: float
    warnings: tuple[str, ...]

    @property
    def reachable(self) -> int:
        return sum(status.reachable for status in self.nodes)

    @property
    def nodes_total(self) -> int:
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
        """Every warning, for people: ``"<nodes>: <warning>"`` once per node warning, then the
        group's."""
        grouped = names_by_warning((status.node, status.warnings) for status in self.nodes)
        lines = [f"{', '.join(names)}: {warning}" for warning, names in grouped.items()]
        return lines + list(self.warnings)

    def to_json(self) -> dict[str, Any]:
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
class LockRecord(JsonRecord):
    """One lock key as seen across the nodes, token left out.

    ``held`` when one value is on a majority of nodes, ``owner`` saying who (None: unreadable);
    else the copies are minority leftovers that expire by themselves. ``time_left``: None for no
    expiry. ``worker_answers`` and ``task_active`` (None unless ``check_workers=True``): whether
    the holder's worker answered a ping, and runs the holder's task id. ``legacy_layout``: a
    0.2-layout key (a celery-redlock 0.2 worker's lock, which today's workers treat as held).
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
        return self.owner.id if self.owner else None

    @property
    def worker(self) -> str | None:
        """The holder's Celery worker node name (``name@host``), when it ran in a worker."""
        return self.owner.worker if self.owner else None

    @property
    def host(self) -> str | None:
        return self.owner.host if self.owner else None

    @property
    def pid(self) -> int | None:
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
class LockListing(JsonRecord):
    """``locks`` held by a majority, ``minority`` leftovers, and the nodes that did not answer;
    nothing about held locks is certain without ``has_quorum``."""

    locks: tuple[LockRecord, ...]
    minority: tuple[LockRecord, ...]
    nodes_total: int
    quorum: int
    unreachable: tuple[NodeError, ...]

    @property
    def reachable(self) -> int:
        return self.nodes_total - len(self.unreachable)

    @property
    def has_quorum(self) -> bool:
        """True when a majority answered, so ``locks`` is every lock held now."""
        return self.reachable >= self.quorum

    def to_json(self) -> dict[str, Any]:
        return {**self.fields_json(), "reachable": self.reachable}


@dataclass(frozen=True)
class CallKey(JsonRecord):
    """The lock a call takes: ``key``, ``resource`` (without the prefix), ``basis`` (in words)."""

    task: str
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]
    basis: str
    resource: str
    key: str

    def to_json(self) -> dict[str, Any]:
        """The JSON form (the arguments as given: they never reach Redis)."""
        return {
            **self.fields_json("basis", "kwargs"),
            "kwargs": dict(self.kwargs),
            "locks_on": self.basis,
        }


@dataclass(frozen=True)
class Refusal(JsonRecord):
    """A node where the key is not a lock, and why: `force_release` leaves it alone there."""

    node: str
    reason: str


@dataclass(frozen=True)
class ReleaseResult(JsonRecord):
    """What `force_release` did: the lock found (None: none), the nodes it was deleted on, those
    still holding a copy, and those where the key is not a lock (``refused``: left alone)."""

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
        return {**self.fields_json("quorum"), "found": self.found, "deleted": len(self.deleted_on)}

    def refusal_lines(self) -> list[str]:
        """``"<key> is not a lock on <node>: <reason>"`` per refusal."""
        return [
            f"{self.key} is not a lock on {refusal.node}: {refusal.reason}"
            for refusal in self.refused
        ]


@dataclass(frozen=True)
class ReapResult(JsonRecord):
    """What `reap` decided about one held lock: ``action`` (`FREED`, `WOULD_FREE`, `KEPT`,
    `GONE`), ``proof`` (a ``PROOF_*`` when the holder was proven gone), ``reason`` in words, and
    ``nodes_freed``, the nodes that confirmed the deletion."""

    lock: LockRecord
    action: str
    proof: str | None
    reason: str
    nodes_freed: int = 0


class UnknownTask(RedlockError, LookupError):
    """The app has no singleton task of that name (the message lists the close matches)."""


class NotALock(RedlockError, ValueError):
    """A key that is not a lock key: operators' commands refuse it (``"<key> is not a lock"``)."""
