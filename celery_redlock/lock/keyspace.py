"""The layout of every key celery_redlock writes: one home for each prefix and suffix.

The lock on a resource lives at ``<prefix>{<resource>}``. Every other key of that lock is the lock
key plus a suffix, so the braces (a Redis Cluster hash tag) put them all in the lock's hash slot,
where one script can touch them together: ``:fence`` (the fencing counter), ``:pending`` (the
reservation of the next holder, a lock itself), ``:done:<hash of a task id>`` (completion
records) and ``:schedule`` (the beat leader's records). Waiters listen on the lock key itself as
the release channel. Operators' tools leave alone what is no lock key (`is_lock_key`).

celery_redlock 0.2 locked ``<prefix><resource>`` (reservation: ``<prefix><resource>:pending``),
without braces (`legacy_key`). While a fleet is upgraded, a lock is taken only where its 0.2 key
is free too, and written there as well (`scripts.ACQUIRE`), so 0.2 and later workers exclude
each other.
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
    """The completion records of ``task_id`` under the lock at ``key`` (the id is hashed: it could
    otherwise make the key end like a lock key)."""
    return key + RECORDS_INFIX + hashlib.sha256(task_id.encode()).hexdigest()[:32]


def schedule_key(key: str) -> str:
    """The beat leader's schedule records beside its lease at ``key``."""
    return key + SCHEDULE_SUFFIX


def is_lock_key(prefix: str, key: str) -> bool:
    """True if ``key`` is the key of a lock, or of a lock's reservation, under ``prefix`` (no
    other key ends the way these do)."""
    return key.startswith(prefix + "{") and key.endswith(("}", "}" + RESERVATION_SUFFIX))


def resource_of(prefix: str, key: str) -> str | None:
    """The resource locked at ``key`` (for a reservation: the resource it reserves), or None
    when ``key`` is not a lock key under ``prefix``."""
    if not is_lock_key(prefix, key):
        return None
    return key[len(prefix) + 1 :].removesuffix(RESERVATION_SUFFIX)[:-1]


def legacy_key(prefix: str, key: str) -> str | None:
    """Where 0.2 workers lock what the lock (or reservation) key ``key`` locks:
    ``<prefix><resource>`` (``:pending``); None when ``key`` is no lock key under ``prefix``."""
    resource = resource_of(prefix, key)
    if resource is None:
        return None
    return prefix + resource + (RESERVATION_SUFFIX if key.endswith(RESERVATION_SUFFIX) else "")


def legacy_resource_of(prefix: str, key: str) -> str | None:
    """The resource a 0.2-layout lock (or reservation) key locks, or None when ``key`` cannot be
    one: no key under ``prefix`` without braces, or a fencing counter, completion marker or
    schedule record. Its value tells for sure."""
    rest = key[len(prefix) :]
    if not key.startswith(prefix) or not rest or rest.startswith(("{", LEGACY_RECORDS_PREFIX)):
        return None
    if key.endswith((FENCE_SUFFIX, SCHEDULE_SUFFIX)):
        return None
    return rest.removesuffix(RESERVATION_SUFFIX)


def key_of_legacy(prefix: str, key: str) -> str | None:
    """The lock key (or reservation key) of today's layout for the 0.2-layout key ``key``."""
    resource = legacy_resource_of(prefix, key)
    if resource is None:
        return None
    current = lock_key(prefix, resource)
    return reservation_key(current) if key.endswith(RESERVATION_SUFFIX) else current


def scan_pattern(prefix: str, legacy: bool = False) -> str:
    """A ``SCAN MATCH`` pattern (``prefix`` escaped) for every key under ``prefix`` that can be a
    lock key; with ``legacy``, every key under it (0.2 lock keys have no braces)."""
    escaped = "".join("\\" + char if char in "*?[]\\" else char for char in prefix)
    return escaped + ("*" if legacy else "{*}*")
