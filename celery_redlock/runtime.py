"""What one Celery app needs at run time — its settings, its `Redlock` and its lock keeper — and
the lock state of one task run, from the moment its token exists to its release.

Created on first use in each app and kept on the app object; connections inside open lazily in
the process that uses them, so a prefork parent never shares sockets with its children.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from celery import states
from redis.exceptions import RedisError as RedisClientError

from . import events, signals
from .errors import RedlockError
from .keeper import KeptLock, LockKeeper
from .redlock import Lock, Record, Redlock, even_node_warning
from .settings import RedlockSettings, has_password, redact_url

logger = logging.getLogger(__name__)

RUNTIME_ATTRIBUTE = "_celery_redlock_runtime"
RUN_ATTRIBUTE = "celery_redlock_run"
"""The task request attribute holding the current run's `RunLock`."""

# A body that ended in one of these ran: a redelivered copy of the same attempt must not run.
# REJECTED is not among them: a rejected message may be queued again, and must then run.
COMPLETED_STATES = frozenset({states.SUCCESS, states.FAILURE, states.RETRY, states.IGNORED})


@dataclass(eq=False, slots=True)
class RunLock:
    """The lock of one task run. Until ``kept`` is set the acquisition is under way: its token is
    known but the lock may or may not be held, and a clean-up releases it by that token."""

    runtime: AppRuntime
    lock: Lock
    task_id: str | None
    hold: float
    record: Record | None
    started: float
    kept: KeptLock | None = None


class AppRuntime:
    """Settings, lock manager and keeper of one Celery app (one of each per app and process)."""

    def __init__(self, settings: RedlockSettings) -> None:
        self.settings = settings
        self.redlock = Redlock.from_settings(settings)
        self.keeper = LockKeeper(self.redlock)
        self._nodes_checked = False

    @staticmethod
    def installed(app: Any) -> AppRuntime | None:
        """The runtime ``app`` holds now, or None before its first use."""
        runtime: AppRuntime | None = app.__dict__.get(RUNTIME_ATTRIBUTE)
        return runtime

    @staticmethod
    def install(app: Any, runtime: AppRuntime | None) -> AppRuntime | None:
        """Give ``app`` this runtime (None: none, so the next use creates one from the app's
        settings); returns the one it replaced. For test harnesses that keep a runtime across
        tests with the same settings."""
        previous: AppRuntime | None = app.__dict__.pop(RUNTIME_ATTRIBUTE, None)
        if runtime is not None:
            app.__dict__[RUNTIME_ATTRIBUTE] = runtime
        return previous

    @classmethod
    def for_app(cls, app: Any) -> AppRuntime:
        """The app's runtime, created (and its settings validated) on first use."""
        runtime = app.__dict__.get(RUNTIME_ATTRIBUTE)
        if runtime is None:
            runtime = app.__dict__.setdefault(
                RUNTIME_ATTRIBUTE, cls(RedlockSettings.from_conf(app.conf))
            )
        return runtime  # type: ignore[no-any-return]

    def check_nodes(self) -> None:
        """Once per app and process: warn about an even node count and nodes that do not
        answer (a worker starts anyway: locks work while a majority answers)."""
        if self._nodes_checked:
            return
        self._nodes_checked = True
        nodes = self.redlock.nodes
        warning = even_node_warning(len(nodes))
        if warning:
            logger.warning(warning)
        for url in self.settings.urls:
            if has_password(url):
                logger.warning(
                    "redlock_urls carries a password for lock node %s: `celery inspect conf` and "
                    "`celery report` print redlock_urls as written; set redlock_password (which "
                    "Celery masks) and leave the password out of the URL",
                    redact_url(url),
                )
        for node in nodes:
            client = node.client(timeout=max(self.settings.node_timeout, 1.0))
            try:
                client.ping()
            except (RedisClientError, OSError) as error:
                logger.warning(
                    "lock node %s does not answer at worker start (%s); singleton tasks work "
                    "while a majority of the %d lock nodes answer",
                    node.name,
                    error,
                    len(nodes),
                )
            finally:
                client.close()

    def finish(self, task: Any, run: RunLock, state: str) -> bool:
        """End a run's lock: release it (or keep it ``hold`` more seconds, never on RETRY),
        record that this message's attempt completed when the body ran, and report it. Returns
        whether a majority confirmed the lock was still held. Safe to call again after an
        interruption.
        """
        kept = run.kept
        if kept is not None:
            self.keeper.stop(kept)
        body_ran = kept is not None and state in COMPLETED_STATES
        reported = kept is not None and events.listening(task, signals.lock_released)
        released = False
        try:
            # Sent even for a lock known to be lost: copies may still be on some nodes. Only a
            # receiver of lock_released (or a monitor) needs the answer; otherwise the run does
            # not wait for it (the next command this thread sends a node runs after it).
            released = self.redlock.release(
                run.lock,
                hold=run.hold if state != states.RETRY else 0.0,
                record=run.record if body_ran else None,
                confirm=reported,
            )
        except RedlockError as error:
            logger.warning(
                "releasing lock %s failed (it expires by itself): %s", run.lock.key, error
            )
        if kept is None:
            return released
        if kept.is_lost:
            logger.error(
                "task %s[%s] finished after losing its lock %s (%s)",
                task.name,
                run.task_id,
                run.lock.key,
                kept.lost_reason,
            )
        if reported:
            events.report(
                task,
                signals.lock_released,
                run.task_id,
                key=run.lock.key,
                state=state,
                held=time.monotonic() - run.started,
                released=released and not (run.hold and state != states.RETRY),
            )
        return released
