"""The locks themselves: which are held and by whom, the key a call locks, forced release."""

from __future__ import annotations

import contextlib
import difflib
from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import QuorumUnavailable
from ..integration.runtime import AppRuntime
from ..integration.task import SingletonTask
from ..lock import keyspace, scripts
from ..lock.nodes import NodeGroup
from ..lock.redlock import legacy_key_of
from ..lock.replies import judge_forced_release
from .reading import LockReader, text
from .records import (
    DEFAULT_TIMEOUT,
    CallKey,
    LockListing,
    LockRecord,
    NodeError,
    NotALock,
    Refusal,
    ReleaseResult,
    UnknownTask,
)
from .workers import with_worker_checks


def singleton_tasks(app: Any) -> dict[str, SingletonTask]:
    """The app's singleton tasks by name (its task modules imported first, unless a worker
    did already)."""
    if not getattr(app.loader, "worker_initialized", False):
        with contextlib.suppress(Exception):  # tasks of a module that fails to import: not found
            app.loader.import_default_modules()
    return {name: task for name, task in list(app.tasks.items()) if isinstance(task, SingletonTask)}


def find_task(app: Any, name: str) -> SingletonTask:
    """The app's singleton task ``name``; `UnknownTask`, naming close matches, when none."""
    tasks = singleton_tasks(app)
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
    """The lock a call of ``task_name`` would take (`SingletonTask.lock_key_for`); touches no
    node. Raises `UnknownTask`, or `LockKeyError` when the arguments do not fit."""
    task = find_task(app, task_name)
    kwargs = dict(kwargs or {})
    resource = task.lock_plan.recipe.resource(tuple(args), kwargs)
    key = task.lock_key_for(*args, **kwargs)
    return CallKey(task.name, tuple(args), kwargs, key_basis(task), resource, key)


def lock_key(app: Any, task_name: str, /, *args: Any, **kwargs: Any) -> str:
    """The Redis key (under the key prefix) a call ``task_name(*args, **kwargs)`` would lock;
    the same as ``task.lock_key_for(*args, **kwargs)``."""
    return call_key(app, task_name, args, kwargs).key


def resolve_key(app: Any, key_or_resource: str) -> tuple[str, str]:
    """``(key, resource)`` for a lock key (0.2 layout too) or a resource; `NotALock` for any
    other key under the prefix."""
    prefix = AppRuntime.for_app(app).settings.key_prefix
    resource = keyspace.resource_of(prefix, key_or_resource)
    if resource is None:
        resource = keyspace.legacy_resource_of(prefix, key_or_resource)
    if resource is not None:
        return key_or_resource, resource
    if key_or_resource.startswith(prefix):
        raise NotALock(f"{key_or_resource} is not a lock: {what_key(prefix, key_or_resource)}")
    return keyspace.lock_key(prefix, key_or_resource), key_or_resource


def what_key(prefix: str, key: str) -> str:
    if key.startswith(prefix + "{"):
        if key.endswith(keyspace.FENCE_SUFFIX):
            return "it is a fencing counter (it must outlive every lock it fenced)"
        if key.endswith(keyspace.SCHEDULE_SUFFIX):
            return "it holds the beat leader's schedule records"
        if keyspace.RECORDS_INFIX in key:
            return "it holds completion records"
    return f"lock keys look like {keyspace.lock_key(prefix, '<resource>')}"


def lock_listing(
    app: Any,
    keys: Sequence[str] | None = None,
    *,
    check_workers: bool = False,
    timeout: float = DEFAULT_TIMEOUT,
) -> LockListing:
    """The locks under ``keys`` (None: every lock key), held and minority leftovers, with the
    nodes that did not answer; never raises for a node: check ``has_quorum``. Only locks are
    listed (the beat leader's lease has the owner role "beat leader"). ``check_workers`` fills
    ``worker_answers`` and ``task_active`` (one control round trip, about ``timeout``)."""
    with LockReader(app, timeout) as reader:
        read = reader.read(keys)
    records = [entry.record for entry in read.found]
    if check_workers:
        records = with_worker_checks(app, records, timeout)
    return LockListing(
        locks=tuple(record for record in records if record.held),
        minority=tuple(record for record in records if not record.held),
        nodes_total=len(reader.nodes),
        quorum=reader.quorum,
        unreachable=read.unreachable,
    )


def held_locks(
    app: Any, *, check_workers: bool = False, timeout: float = DEFAULT_TIMEOUT
) -> list[LockRecord]:
    """The locks held now (the same value on a majority of nodes), sorted by key, never the
    token. Raises `QuorumUnavailable` without a majority of nodes; ``check_workers`` as for
    `lock_listing`."""
    listing = lock_listing(app, check_workers=check_workers, timeout=timeout)
    require_quorum(listing, "*")
    return list(listing.locks)


def keys_of_lock(app: Any, key: str) -> list[str]:
    """``key`` and, where 0.2 workers may lock the same resource, its 0.2-layout key."""
    legacy = legacy_key_of(AppRuntime.for_app(app).redlock, key)
    return [key] if legacy is None else [key, legacy]


def require_quorum(listing: LockListing, resource: str) -> None:
    if not listing.has_quorum:
        raise QuorumUnavailable(resource, listing.reachable, listing.quorum)


def holder(app: Any, task_name: str, /, *args: Any, **kwargs: Any) -> LockRecord | None:
    """The record of whoever holds the lock ``task_name(*args, **kwargs)`` would take (a 0.2
    worker's too), or None; `QuorumUnavailable` without a majority of nodes."""
    key = lock_key(app, task_name, *args, **kwargs)
    listing = lock_listing(app, keys_of_lock(app, key))
    require_quorum(listing, key)
    return listing.locks[0] if listing.locks else None


CANNOT_GIVE = f"a reply the {scripts.FORCE_RELEASE.name} script cannot give: "


def force_release(app: Any, key: str, *, timeout: float = DEFAULT_TIMEOUT) -> ReleaseResult:
    """Delete the lock ``key`` (a full key or a resource) on every node, whoever holds it.

    For stuck locks: a running holder is not stopped, and waiters are woken. ``key`` must be a
    lock key (else `NotALock`, nothing sent), and each node deletes it only when it holds a lock
    value (checked atomically; else in ``refused``); nothing when no reachable node has a lock
    under it. A copy on a node that does not answer stays until its ttl; ``still_present_on``
    names nodes that answered but still have it.
    """
    full_key, resource = resolve_key(app, key)
    with LockReader(app, timeout) as reader:
        before = reader.read([full_key])
        refusals = dict(before.not_locks.get(full_key, {}))
        errors = list(before.unreachable)
        deleted: list[str] = []
        still: set[int] = set()
        if before.found:
            # Only nodes that answered the read: the others' copies expire by their ttl.
            failed = {error.node for error in before.unreachable}
            answering = [node for node in reader.nodes if node.name not in failed]
            keys = keys_of_lock(app, full_key)
            with contextlib.closing(NodeGroup(answering, timeout)) as group:
                result = group.run(
                    scripts.FORCE_RELEASE, keys, (), judge_forced_release, every=True
                )
            for node, reply, why in zip(answering, result.replies, result.failures, strict=True):
                if why is not None:
                    # The operators' words for a reply the script cannot give.
                    if why.startswith(CANNOT_GIVE):
                        why = (
                            f"bad reply to the forced release: {why.removeprefix(CANNOT_GIVE)}, "
                            "not 1, 0 or why the key is not a lock"
                        )
                    errors.append(NodeError(node.name, why))
                elif reply == 1:
                    deleted.append(node.name)
                elif reply != 0:
                    refusals[node.name] = text(reply)
            had = {copy.node: copy.value for copy in before.found[0].copies}
            after = reader.read([full_key])
            # A copy with another value is a new holder's (waiters are woken at once): not ours.
            copies = after.found[0].copies if after.found else ()
            still = {copy.node for copy in copies if had.get(copy.node) == copy.value}
    names = [node.name for node in reader.nodes]
    return ReleaseResult(
        key=full_key,
        resource=resource,
        lock=before.found[0].record if before.found else None,
        deleted_on=tuple(deleted),
        still_present_on=tuple(names[index] for index in sorted(still)),
        nodes_total=len(names),
        quorum=reader.quorum,
        # Each node once: the release ran only on the nodes that answered the read.
        unreachable=tuple(errors),
        refused=tuple(Refusal(name, refusals[name]) for name in names if name in refusals),
    )
