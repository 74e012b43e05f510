"""The layout of every key celery_redlock writes: one home for each prefix and suffix.

The lock on a resource lives at ``<prefix>{<resource>}``. Every other key that belongs to that
lock is the lock key plus a suffix, so the braces — a Redis Cluster *hash tag* — put all of them
in the lock's hash slot, which lets one script touch them together on a cluster node:

- ``<lock key>:fence`` — the fencing counter (never a lock);
- ``<lock key>:pending`` — the reservation of the lock's next holder (a lock itself);
- ``<lock key>:done:<hash of a task id>`` — the completion records of one task id (never a
  lock);
- ``<lock key>:schedule`` — the beat leader's schedule records (never a lock).

The release channel that waiters listen on is the lock key itself. Anything under the prefix
that is not a lock key (`is_lock_key`) is left alone by the operators' tools.

celery_redlock 0.2 locked ``<prefix><resource>`` (a reservation: ``<prefix><resource>:pending``),
without braces: `legacy_key` names it. While a fleet is upgraded, a lock is taken only where its
0.2-layout key is free too, and is written there as well (`scripts.ACQUIRE`), so
that 0.2 and later workers exclude each other; `is_legacy_lock_key` tells such keys apart.
"""

from __future__ import annotations

import hashlib

FENCE_SUFFIX = ":fence"
RESERVATION_SUFFIX = ":pending"
RECORDS_INFIX = ":done:"
SCHEDULE_SUFFIX = ":schedule"
LEGACY_RECORDS_PREFIX = "done:"  # 0.2's completion markers: <prefix>done:<task id>


def lock_key(prefix: str, resource: str) -> str:
    """The key of the lock on ``resource``."""
    return f"{prefix}{{{resource}}}"


def fence_key(key: str) -> str:
    """The fencing counter of the lock at ``key``."""
    return key + FENCE_SUFFIX


def reservation_key(key: str) -> str:
    """The reservation of the next holder of the lock at ``key`` (a lock itself)."""
    return key + RESERVATION_SUFFIX


def records_key(key: str, task_id: str) -> str:
    """The completion records of task id ``task_id`` under the lock at ``key``. The id is
    hashed: task ids are chosen by applications and could otherwise make the key end like a
    lock key."""
    return key + RECORDS_INFIX + hashlib.sha256(task_id.encode()).hexdigest()[:32]


def schedule_key(key: str) -> str:
    """The beat leader's schedule records beside its lease at ``key``."""
    return key + SCHEDULE_SUFFIX


def is_lock_key(prefix: str, key: str) -> bool:
    """True if ``key`` is the key of a lock, or of a lock's reservation, under ``prefix``.
    Fencing counters, completion records and schedule records are not: no lock key ends the
    way they do."""
    return key.startswith(prefix + "{") and (
        key.endswith("}") or key.endswith("}" + RESERVATION_SUFFIX)
    )


def resource_of(prefix: str, key: str) -> str | None:
    """The resource locked at ``key`` (for a reservation: the resource it reserves), or None
    when ``key`` is not a lock key under ``prefix``."""
    if not is_lock_key(prefix, key):
        return None
    return key[len(prefix) + 1 :].removesuffix(RESERVATION_SUFFIX)[:-1]


def legacy_key(prefix: str, key: str) -> str | None:
    """The 0.2 layout of the lock key (or reservation key) ``key``: ``<prefix><resource>``
    (``<prefix><resource>:pending``), where 0.2 workers lock the same resource; None when
    ``key`` is not a lock key under ``prefix``."""
    resource = resource_of(prefix, key)
    if resource is None:
        return None
    return prefix + resource + (RESERVATION_SUFFIX if key.endswith(RESERVATION_SUFFIX) else "")


def is_legacy_lock_key(prefix: str, key: str) -> bool:
    """True if ``key`` can be a lock key of the 0.2 layout (no braces) under ``prefix``: not a
    0.2 fencing counter, completion marker or schedule record. Its value tells for sure."""
    rest = key[len(prefix) :]
    return (
        key.startswith(prefix)
        and bool(rest)
        and not rest.startswith("{")
        and not rest.startswith(LEGACY_RECORDS_PREFIX)
        and not key.endswith((FENCE_SUFFIX, SCHEDULE_SUFFIX))
    )


def legacy_resource_of(prefix: str, key: str) -> str | None:
    """The resource a 0.2-layout lock key locks (for a reservation: the resource it reserves),
    or None when ``key`` cannot be one."""
    if not is_legacy_lock_key(prefix, key):
        return None
    return key[len(prefix) :].removesuffix(RESERVATION_SUFFIX)


def key_of_legacy(prefix: str, key: str) -> str | None:
    """The lock key (or reservation key) of today's layout for the 0.2-layout key ``key``."""
    resource = legacy_resource_of(prefix, key)
    if resource is None:
        return None
    current = lock_key(prefix, resource)
    return reservation_key(current) if key.endswith(RESERVATION_SUFFIX) else current


def scan_pattern(prefix: str) -> str:
    """A ``SCAN MATCH`` pattern for every key under ``prefix`` that can be a lock key."""
    return escaped_prefix(prefix) + "{*}*"


def escaped_prefix(prefix: str) -> str:
    """``prefix`` with the characters a ``SCAN MATCH`` pattern treats specially escaped."""
    return "".join("\\" + char if char in "*?[]\\" else char for char in prefix)


def legacy_scan_pattern(prefix: str) -> str:
    """A ``SCAN MATCH`` pattern for every key under ``prefix`` (0.2-layout lock keys have no
    braces to match on)."""
    return escaped_prefix(prefix) + "*"
