"""Finding out where a member's keys live, again and again (`Locator`): a cluster's slot map, the
master a set of sentinels names. The first look happens in the thread that needs it; after that,
whenever a reply or a failure says the picture changed, a background thread looks again — at
most one at a time per process, at most every `RELOCATE_INTERVAL_SECONDS` — so that rounds never
wait on it."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

RELOCATE_INTERVAL_SECONDS = 0.25


class Locator:
    """Runs ``look`` (which raises when it cannot find out) on first use and on request."""

    def __init__(self, name: str, look: Callable[[], None]) -> None:
        self.name = name
        self._look = look
        self.located = False
        self.last_error = ""
        self._looked_at = 0.0
        # No lock: one held by another thread at a fork would stay held in the child for ever.
        self._looking_pid = 0

    def ensure(self) -> bool:
        """Look now unless looked before (or a look failed less than an interval ago); True once
        located."""
        if not self.located and time.monotonic() - self._looked_at >= RELOCATE_INTERVAL_SECONDS:
            self._run()
        return self.located

    def refresh_if_older(self, seconds: float) -> None:
        """Look again in the background when the last look started ``seconds`` ago or more: for
        what nothing announces (a master the sentinels replaced while it kept running)."""
        if self.located and time.monotonic() - self._looked_at >= seconds:
            self.relocate()

    def relocate(self) -> None:
        """Look again in the background (unless a look is under way or was just made)."""
        pid = os.getpid()
        if self._looking_pid == pid:
            return
        if time.monotonic() - self._looked_at < RELOCATE_INTERVAL_SECONDS:
            return
        self._looking_pid = pid
        threading.Thread(
            target=self._run_in_background, name=f"celery-redlock locate {self.name}", daemon=True
        ).start()

    def _run_in_background(self) -> None:
        try:
            self._run()
        finally:
            self._looking_pid = 0

    def _run(self) -> None:
        self._looked_at = time.monotonic()
        try:
            self._look()
        except Exception as error:  # the member stays where it was last seen
            if error.__class__.__name__ != self.last_error.partition(":")[0]:
                logger.warning("lock node %s: cannot locate its servers: %s", self.name, error)
            self.last_error = f"{error.__class__.__name__}: {error}"
            return
        self.located = True
        self.last_error = ""
