"""Waiting on a topology to settle (a cluster to agree, sentinels to name a master)."""

from __future__ import annotations

import time
from collections.abc import Callable

import redis

__all__ = ["wait_for_condition"]

POLL_INTERVAL = 0.05
"""Seconds between two checks of `wait_for_condition`."""


def wait_for_condition(problem: Callable[[], str | None], what: str, timeout: float) -> None:
    """Call ``problem`` every :data:`POLL_INTERVAL` seconds until it returns None (the condition
    holds); it returns what is still wrong otherwise. A connection error, a time-out or an error
    reply while checking counts as "still wrong" (a node may be restarting or electing).

    Raises:
        RuntimeError: the condition did not hold within ``timeout`` seconds; the message says
            what was waited for and what was last wrong.
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            found = problem()
        except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError) as error:
            found = f"{type(error).__name__}: {error}"
        if found is None:
            return
        if time.monotonic() >= deadline:
            raise RuntimeError(f"timed out after {timeout} s waiting for {what}; last: {found}")
        time.sleep(POLL_INTERVAL)
