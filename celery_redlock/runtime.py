"""What one Celery app needs at run time: its settings, its `Redlock` and its lock keeper.

Created on first use in each app and kept on the app object; connections inside open lazily in
the process that uses them, so a prefork parent never shares sockets with its children.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from typing import Any

from .extension import KeptLock, LockKeeper
from .redlock import Lock, Redlock
from .settings import RedlockSettings

RUNTIME_ATTRIBUTE = "_celery_redlock_runtime"


@dataclass(eq=False)
class HeldLock:
    """The lock of one task run, as the release handler needs it."""

    runtime: AppRuntime
    kept: KeptLock
    task_id: str | None
    hold: float
    started: float

    @property
    def lock(self) -> Lock:
        """The lock itself."""
        return self.kept.lock


class AppRuntime:
    """Settings, lock manager and keeper of one Celery app (one of each per app and process)."""

    def __init__(self, settings: RedlockSettings) -> None:
        self.settings = settings
        self.redlock = Redlock(
            settings.urls,
            retry_count=settings.retry_count,
            retry_delay=settings.retry_delay,
            clock_drift_factor=settings.clock_drift_factor,
            node_timeout=settings.node_timeout,
            key_prefix=settings.key_prefix,
        )
        self.keeper = LockKeeper(self.redlock)

    @classmethod
    def for_app(cls, app: Any) -> AppRuntime:
        """The app's runtime, created (and its settings validated) on first use."""
        runtime = app.__dict__.get(RUNTIME_ATTRIBUTE)
        if runtime is None:
            runtime = app.__dict__.setdefault(
                RUNTIME_ATTRIBUTE, cls(RedlockSettings.from_conf(app.conf))
            )
        return runtime  # type: ignore[no-any-return]

    def release(self, held: HeldLock, state: str) -> bool:
        """End a run's lock: release it, or keep it ``hold`` more seconds (never on RETRY)."""
        self.keeper.stop(held.kept)
        if held.kept.is_lost:
            return False
        if held.hold > 0 and state != "RETRY":
            self.redlock.extend(held.lock, held.hold)
            return False
        return self.redlock.release(held.lock)


def owner_text(task_name: str, task_id: str | None, retries: int, queued: bool = False) -> str:
    """Who holds a lock, stored beside the token: task, id, attempt, host and process.

    ``queued`` marks the lock `SingletonTask.apply_async` takes with ``lock_on_enqueue``; the run
    of that task id takes it over (see `queued_fragment`).
    """
    owner: dict[str, Any] = {"task": task_name, "id": task_id}
    if queued:
        owner["queued"] = True
    owner |= {
        "retries": retries,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "since": round(time.time(), 3),
    }
    # '|' separates token and owner on the nodes; JSON may spell it as an escape instead.
    return json.dumps(owner, separators=(",", ":")).replace("|", "\\u007c")


def queued_fragment(task_id: str) -> str:
    """The part of `owner_text` that identifies the enqueue-time lock of ``task_id``."""
    return json.dumps({"id": task_id, "queued": True}, separators=(",", ":"))[1:-1]


def parse_owner(text: str | None) -> dict[str, Any]:
    """The owner description stored with a lock, or {} when there is none or it is not ours."""
    if not text:
        return {}
    try:
        owner = json.loads(text)
    except ValueError:
        return {}
    return owner if isinstance(owner, dict) else {}


def describe_owner(owner: dict[str, Any]) -> str:
    """A short human description of a lock owner, for logs and errors."""
    if not owner:
        return "an unknown owner"
    return (
        f"task {owner.get('task')}[{owner.get('id')}] on {owner.get('host')} pid {owner.get('pid')}"
    )
