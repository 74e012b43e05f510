"""The holders' workers, asked with control commands: does one answer, and run the holder's
task? A broker that fails, or a worker that does not answer, is no answer, never an exception.
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
    """What one worker node name answered; ``replies``: how many workers answered the ping."""

    replies: int
    running: frozenset[str] | None = None  # task ids active or reserved; None: unknown
    pid: int | None = None
    pool_processes: frozenset[int] = frozenset()


def worker_node_name(owner: Owner | None) -> str | None:
    """The node name (``name@host``) to ask about ``owner``; None for a plain host name (solo
    and threads pools), which no worker answers to."""
    worker = owner.worker if owner is not None else None
    return worker if worker and "@" in worker else None


def worker_node_names(owners: Iterable[Owner | None]) -> list[str]:
    return sorted({name for name in map(worker_node_name, owners) if name is not None})


def broadcast(
    app: Any, command: str, names: Sequence[str], timeout: float, limit: int | None = None
) -> list[dict[str, Any]]:
    """The replies of the workers ``names`` to control ``command`` (none when the broker fails)."""
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
    """Ping the workers ``names`` (waiting the whole ``timeout``, so duplicate names show) and
    ask those that answer for their active and reserved tasks and their processes."""
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
    """``records`` with ``worker_answers`` and ``task_active`` of held locks' workers."""
    names = worker_node_names(record.owner for record in records if record.held)
    states = inspect_workers(app, names, timeout)

    def checked(record: LockRecord) -> LockRecord:
        state = states.get(worker_node_name(record.owner) or "")
        if state is None:
            return record
        active, answers = None, state.replies == 1
        if answers and state.running is not None and record.task_id is not None:
            active = record.task_id in state.running
        return dataclasses.replace(record, worker_answers=answers, task_active=active)

    return [checked(record) for record in records]
