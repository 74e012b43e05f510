"""The Celery app the `celery redlock` command tests load (``celery -A tests.cli_app redlock ...``).

The lock nodes come from the ``CLI_APP_REDLOCK_URLS`` environment variable (comma-separated
harness URLs); `create_app` builds the same app in-process for click's `CliRunner`. The broker is
``memory://``: the command never talks to it.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from celery import Celery

from celery_redlock import SingletonTask, singleton_task

URLS_VARIABLE = "CLI_APP_REDLOCK_URLS"

# Set by a test to let `cli_app.blocking` finish; the task holds its lock until then.
GATE = threading.Event()


def create_app(urls: str | list[str] | None = None) -> Celery:
    """An app with a few singleton tasks (one per way of deriving a key) and a plain task.

    The tasks are not shared (``shared=False``): every app made here has its own.
    """
    app = Celery("cli_app", broker="memory://", backend="cache+memory://", set_as_current=False)
    if urls:
        app.conf.redlock_urls = urls
    app.conf.redlock_ttl = 20

    @singleton_task(
        app=app, shared=False, name="cli_app.sync_account", lock_args=("account_id",), lock_ttl=30
    )
    def sync_account(account_id: Any, full: bool = False) -> None:
        """Locks on the account alone."""

    @singleton_task(app=app, shared=False, name="cli_app.rebuild_report")
    def rebuild_report(account_id: Any, day: Any, options: Any = None) -> None:
        """Locks on every argument."""

    @app.task(
        base=SingletonTask, shared=False, name="cli_app.nightly_cleanup", lock_args=(), lock_hold=45
    )
    def nightly_cleanup() -> None:
        """Locks on the task name alone."""

    @singleton_task(
        app=app, shared=False, name="cli_app.by_template", lock_key="account:{account_id}"
    )
    def by_template(account_id: Any) -> None:
        """Locks on a rendered template."""

    @singleton_task(
        app=app, shared=False, name="cli_app.blocking", lock_args=("account_id",), bind=True
    )
    def blocking(self: Any, account_id: Any) -> str:
        """Holds its lock until the test opens `GATE`; returns the key it locked."""
        GATE.wait(10)
        return str(self.lock.key)

    @app.task(name="cli_app.plain", shared=False)
    def plain() -> None:
        """Not a singleton task."""

    return app


app = create_app(os.environ.get(URLS_VARIABLE))
