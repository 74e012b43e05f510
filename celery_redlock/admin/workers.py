"""The holders' workers: does a holder's worker answer, and is it running the holder's task?

Celery control commands (``ping``, ``active``, ``reserved``, ``stats``) sent to the workers that
lock owners name. A broker that fails, or a worker that does not answer, is no answer: never a
proof and never an exception.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ..lock.owner import Owner
from .records import LockRecord

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerState:
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


def worker_node_name(owner: Owner | None) -> str | None:
    """The Celery node name (``name@host``) to ask about ``owner``, if it has one. Under the solo
    and threads pools Celery gives tasks the plain host name as ``request.hostname``, which no
    worker answers to."""
    worker = owner.worker if owner is not None else None
    return worker if worker and "@" in worker else None


def worker_node_names(owners: Iterable[Owner | None]) -> list[str]:
    """The distinct node names to ask about ``owners``, sorted."""
    return sorted({name for name in map(worker_node_name, owners) if name is not None})


def broadcast(
    app: Any, command: str, names: Sequence[str], timeout: float, limit: int | None = None
) -> list[dict[str, Any]]:
    """Send control ``command`` to the workers ``names`` and return their replies (none when
    the broker fails: that is logged, never raised)."""
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


def inspect_workers(app: Any, names: Sequence[str], timeout: float) -> dict[str, WorkerState]:
    """Ping the workers ``names``; ask those that answer (once each) for their active and
    reserved tasks and their processes. Costs one ``timeout`` (the ping waits for every reply,
    so that duplicate names show), plus a round trip per question."""
    if not names:
        return {}
    counts: Counter[str] = Counter()
    for reply in broadcast(app, "ping", names, timeout):
        counts.update(name for name in reply if name in names)
    single = [name for name in names if counts[name] == 1]
    answers: dict[str, dict[str, Any]] = {name: {} for name in single}
    for command in ("active", "reserved", "stats"):
        for reply in broadcast(app, command, single, timeout, limit=len(single)):
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
        states[name] = WorkerState(
            replies=counts[name],
            running=running,
            pid=pid if isinstance(pid, int) else None,
            pool_processes=frozenset(
                process for process in processes or () if isinstance(process, int)
            ),
        )
    return states


def with_worker_checks(app: Any, records: Sequence[LockRecord], timeout: float) -> list[LockRecord]:
    """``records`` with ``worker_answers`` and ``task_active`` filled in for held locks whose
    holder names a worker (one control round trip, about ``timeout``)."""
    names = worker_node_names(record.owner for record in records if record.held)
    states = inspect_workers(app, names, timeout)
    checked = []
    for record in records:
        state = states.get(worker_node_name(record.owner) or "")
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
