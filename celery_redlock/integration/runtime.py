"""What one Celery app needs at run time: its settings, its `Redlock` and its lock keeper.

Created on first use in each app and kept on the app object; connections inside open lazily in
the process that uses them, so a prefork parent never shares sockets with its children.
"""

from __future__ import annotations

import logging
from typing import Any

from ..lock.keeper import LockKeeper
from ..lock.owner import Tokens
from ..lock.redlock import from_settings
from ..settings import RedlockSettings, even_node_warning, has_password, redact_url

logger = logging.getLogger(__name__)

RUNTIME_ATTRIBUTE = "_celery_redlock_runtime"


class AppRuntime:
    """Settings, lock manager and keeper of one Celery app (one of each per app and process)."""

    def __init__(self, settings: RedlockSettings) -> None:
        self.settings = settings
        self.redlock = from_settings(settings)
        self.keeper = LockKeeper(self.redlock)
        self.tokens = Tokens()  # the runs' tokens
        self._nodes_checked = False

    @staticmethod
    def install(app: Any, runtime: AppRuntime | None) -> AppRuntime | None:
        """Give ``app`` this runtime (None: the next use creates one); returns the one it replaced.
        For test harnesses that keep a runtime across tests with the same settings."""
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
        """Once per app and process: warn about an even node count and passwords in URLs (whether
        the nodes answer is the worker's start-up report, `celery_redlock.admin.startup`)."""
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
