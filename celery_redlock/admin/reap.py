"""Reaping: free, by token, the locks whose holder is proven gone — on demand (`reap`) or on a
timer in every worker (`start_reaper_thread`, with ``redlock_reap_interval`` set).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from celery.bootsteps import CLOSE, RUN, TERMINATE

from ..errors import QuorumUnavailable, RedlockError
from ..integration.runtime import AppRuntime
from ..integration.task import SingletonTask
from ..lock.owner import Owner
from ..lock.redlock import release_stored
from . import records
from .locks import singleton_tasks
from .reading import FoundLock, LockReader
from .records import DEFAULT_TIMEOUT, ReapResult
from .workers import WorkerState, inspect_workers, worker_node_name, worker_node_names

logger = logging.getLogger(__name__)

# Server-side pttl against the client's clock: allowance for the time a read takes.
PTTL_TOLERANCE_SECONDS = 0.25
# A live keeper extends a third of the way through a lock's validity; allow for its lateness.
KEEPER_LATENESS_SECONDS = 1.0
REAPER_THREAD_NAME = "celery-redlock reaper"


def process_exists(pid: int) -> bool:
    """True when process ``pid`` exists here (a zombie does not); True too for an unusable
    ``pid``, since nothing can be concluded then."""
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
class Verdict:
    action: str
    reason: str
    proof: str | None = None


def kept(reason: str) -> Verdict:
    return Verdict(records.KEPT, reason)


def proven(proof: str, reason: str) -> Verdict:
    return Verdict(records.FREED, reason, proof)


@dataclass
class Watch:
    """A held lock being judged; ``pttls``: node -> (pttl ms, when read) of copies holding its
    value."""

    found: FoundLock
    owner: Owner
    pttls: dict[int, tuple[int, float]]
    extends: bool = True
    worker_answered: bool = False
    verdict: Verdict | None = None


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

    Returns one `ReapResult` per held lock, sorted by key. A lock's exact stored value is deleted
    atomically on every node only with a proof (in full: docs/operations.md): its process is gone
    from this host (``PROOF_PROCESS_GONE``; ``check_local_processes=False`` turns this off), its
    worker answers without running it (``PROOF_NOT_RUNNING``), or its worker stays silent for
    ``grace`` while the lock is not extended (``PROOF_SILENT``). Never freed: a
    ``lock_on_enqueue`` claim, a task without auto-extension, a lock maybe in its ``lock_hold``
    window, a task this app does not define, a value without a readable owner.

    ``grace`` defaults to ``redlock_reap_grace`` (0: no silent proof); the call waits only when a
    lock needs watching, and tells ``progress``. ``dry_run`` deletes nothing (`WOULD_FREE`).
    Raises `QuorumUnavailable` when fewer than a majority of nodes answer.
    """
    with LockReader(app, timeout) as reader:
        grace = reader.settings.reap_grace if grace is None else grace
        read = reader.read(None)
        reachable = len(reader.nodes) - len(read.unreachable)
        if reachable < reader.quorum:
            raise QuorumUnavailable("*", reachable, reader.quorum)
        read_at = time.monotonic()
        watches = [
            Watch(entry, entry.record.owner or Owner(id=None), pttls_holding(entry, entry, read_at))
            for entry in read.found
            if entry.record.held
        ]
        tasks = singleton_tasks(app)
        for watch in watches:
            watch.verdict = first_look(watch, tasks, check_local_processes)
        asking = [watch for watch in watches if watch.verdict is None]
        workers = inspect_workers(app, worker_node_names(watch.owner for watch in asking), timeout)
        for watch in asking:
            watch.verdict = worker_verdict(watch, workers) or grace_verdict(watch, grace)
        # Locks proven at once are freed before the others are watched.
        results = {
            watch.found.record.key: settle(reader, watch, dry_run)
            for watch in watches
            if watch.verdict is not None
        }
        undecided = [watch for watch in watches if watch.verdict is None]
        if undecided:
            if progress is not None:
                progress(f"watching {len(undecided)} lock(s) for {grace:g}s")
            watch_for_grace(app, reader, undecided, grace, timeout)
            for watch in undecided:
                results[watch.found.record.key] = settle(reader, watch, dry_run)
        return [results[key] for key in sorted(results)]


def pttls_holding(
    entry: FoundLock, holding: FoundLock, read_at: float
) -> dict[int, tuple[int, float]]:
    """Per node, the pttl of ``entry``'s copies that still hold ``holding``'s value."""
    return {
        copy.node: (copy.milliseconds_left, read_at)
        for copy in entry.copies
        if copy.value == holding.value
    }


def first_look(
    watch: Watch, tasks: Mapping[str, SingletonTask], check_local_processes: bool
) -> Verdict | None:
    """The verdict that needs neither the workers nor watching, if any."""
    record, owner = watch.found.record, watch.owner
    if record.owner is None:
        return kept("the stored value names no owner celery_redlock can read")
    if owner.queued:
        return kept(
            "a claim taken when the call was queued (lock_on_enqueue): not extended; the run "
            "takes it over, or it expires by itself"
        )
    if record.time_left is None:
        return kept("the key has no expiry: celery_redlock did not write it")
    hold, extends = 0.0, True  # the beat leader's lease is extended and never held on
    if owner.role is None:
        task = tasks.get(owner.task or "")
        if task is None:
            return kept(
                f"task {owner.task!r} is not a singleton task of this app, so its lock_hold and "
                "auto-extension are unknown: run this with the app that defines it"
            )
        try:
            hold, extends = task.lock_plan.hold, task.lock_plan.auto_extend
        except RedlockError as error:
            return kept(f"task {owner.task!r} has invalid lock options: {error}")
    if hold and record.time_left <= hold + PTTL_TOLERANCE_SECONDS:
        return kept(f"it may be in its lock_hold window (kept {hold:g}s after a run on purpose)")
    local = check_local_processes and owner.host == socket.gethostname()
    if local and not process_exists(owner.pid):
        reason = f"process {owner.pid} no longer exists on this host"
        return proven(records.PROOF_PROCESS_GONE, reason)
    watch.extends = extends
    return None


def grace_verdict(watch: Watch, grace: float) -> Verdict | None:
    """Kept when watching cannot prove the holder gone; None: watch it for ``grace``."""
    record, owner = watch.found.record, watch.owner
    assert record.time_left is not None
    if not watch.extends:
        return kept(
            f"no proof: task {owner.task} does not auto-extend its lock, so a live holder would "
            f"not extend it either; it expires in {record.time_left:g}s"
        )
    if grace <= 0:
        return kept("no proof without watching it, and the grace is 0")
    needed = record.time_left / 3 + KEEPER_LATENESS_SECONDS
    if needed > grace:
        return kept(
            f"no proof: a live holder need not extend it for {needed:.1f}s, longer than the "
            f"grace of {grace:g}s; it expires in {record.time_left:g}s"
        )
    return None


def worker_verdict(watch: Watch, workers: Mapping[str, WorkerState]) -> Verdict | None:
    """The verdict the holder's worker gives by answering, if any."""
    owner = watch.owner
    state = workers.get(worker_node_name(owner) or "")
    if state is None or not state.replies:
        return None
    if state.replies > 1:
        return kept(f"{state.replies} workers answer to {owner.worker}: no telling them apart")
    watch.worker_answered = True
    if state.running is None or state.pid is None:
        return kept(f"worker {owner.worker} answers ping, but not inspect and stats")
    if owner.id is not None and owner.id in state.running:
        return kept(f"worker {owner.worker} answers and is running task {owner.id}")
    if owner.pid == state.pid:
        return proven(
            records.PROOF_NOT_RUNNING,
            f"worker {owner.worker} answers and is not running the task, in the holder's own "
            f"process {owner.pid}",
        )
    if owner.pid not in state.pool_processes:
        return proven(
            records.PROOF_NOT_RUNNING,
            f"worker {owner.worker} answers, is not running the task, and the holder's process "
            f"{owner.pid} is none of its processes",
        )
    return None  # still one of its pool processes: watch that the lock is not extended


def watch_for_grace(
    app: Any, reader: LockReader, watches: Sequence[Watch], grace: float, timeout: float
) -> None:
    """About once a second for ``grace``, ask the workers and re-read the locks; whatever is
    undecided at the end is proven gone."""
    started = time.monotonic()
    while True:
        left = started + grace - time.monotonic()
        watching = [watch for watch in watches if watch.verdict is None]
        if not watching or left <= 0:
            break
        pause_until = time.monotonic() + min(1.0, left)
        names = worker_node_names(watch.owner for watch in watching)
        workers = inspect_workers(app, names, min(timeout, left))
        time.sleep(max(0.0, pause_until - time.monotonic()))
        read_at = time.monotonic()
        again = reader.read([watch.found.record.key for watch in watching])
        by_key = {entry.record.key: entry for entry in again.found}
        for watch in watching:
            watch.verdict = worker_verdict(watch, workers) or look_again(
                watch, by_key.get(watch.found.record.key), read_at
            )
    watched = time.monotonic() - started
    for watch in watches:
        if watch.verdict is None:
            if watch.worker_answered:
                why = f"worker {watch.owner.worker} answers and is not running the task"
                proof = records.PROOF_NOT_RUNNING
            else:
                why = f"worker {watch.owner.worker} did not answer"
                why = why if worker_node_name(watch.owner) else "no worker node name to ask"
                proof = records.PROOF_SILENT
            reason = f"{why}, and the lock was not extended for {watched:.1f}s"
            watch.verdict = proven(proof, reason)


def look_again(watch: Watch, now: FoundLock | None, read_at: float) -> Verdict | None:
    """None while the new read shows no change."""
    if now is None or not now.record.held or now.value != watch.found.value:
        return Verdict(records.GONE, "released, expired or taken by another holder while watched")
    for node, (milliseconds, when) in pttls_holding(now, watch.found, read_at).items():
        last = watch.pttls.get(node)
        # Without an extension the pttl falls as fast as time passes; any rise is an extension.
        expected = last[0] - (when - last[1]) * 1000 if last is not None else milliseconds
        if milliseconds > expected + PTTL_TOLERANCE_SECONDS * 1000:
            return kept("its holder extended it while it was watched: it is alive")
        watch.pttls[node] = (milliseconds, when)
    return None


def settle(reader: LockReader, watch: Watch, dry_run: bool) -> ReapResult:
    """The result for one lock, freeing it (by its exact stored value) when proven gone."""
    verdict = watch.verdict
    assert verdict is not None
    record = watch.found.record
    if verdict.action != records.FREED:
        return ReapResult(record, verdict.action, verdict.proof, verdict.reason)
    if dry_run:
        return ReapResult(record, records.WOULD_FREE, verdict.proof, verdict.reason)
    # Deleted only where the key still holds this very value (token): a new holder is untouched.
    freed = release_stored(reader.redlock, record.key, watch.found.value)
    if not freed:
        return ReapResult(
            record, records.GONE, verdict.proof, f"{verdict.reason}; released meanwhile"
        )
    if record.nodes_holding - freed >= reader.quorum:
        reason = f"{verdict.reason}; deleted on {freed} node(s) only, still held"
        return ReapResult(record, records.KEPT, verdict.proof, reason, freed)
    logger.warning("reaped lock %s of %s: %s", record.key, record.describe(), verdict.reason)
    return ReapResult(record, records.FREED, verdict.proof, verdict.reason, freed)


def start_reaper_thread(app: Any, worker: Any) -> threading.Thread | None:
    """Start and return a daemon thread running `reap_while_worker_runs` for ``worker`` (the
    ``worker_init`` sender) when ``redlock_reap_interval`` is set; else None."""
    if app.conf.get("redlock_reap_interval") is None:
        return None
    interval = AppRuntime.for_app(app).settings.reap_interval
    assert interval is not None
    thread = threading.Thread(
        target=reap_while_worker_runs,
        args=(app, interval, weakref.ref(worker)),
        name=REAPER_THREAD_NAME,
        daemon=True,
    )
    thread.start()
    return thread


def reap_while_worker_runs(app: Any, interval: float, worker: Callable[[], Any]) -> None:
    """Run `reap` every ``interval`` seconds until the worker (``worker()``, None once gone)
    closes or terminates; a failed reap is logged."""
    while True:
        time.sleep(interval)
        # A cold shutdown sends no worker_shutdown: the worker's own state tells.
        state = getattr(getattr(worker(), "blueprint", None), "state", TERMINATE)
        if state in (CLOSE, TERMINATE):
            return
        if state != RUN:
            continue
        try:
            reap(app)
        except Exception as error:  # the timer must outlive nodes and brokers that fail
            logger.warning("reaping locks whose holder is gone failed: %s", error)
