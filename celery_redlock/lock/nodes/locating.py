"""Finding out where a member's keys live, again and again (`Locator`): a cluster's slot map, the
master a set of sentinels names. Every look runs in a background thread — at most one at a time
per process, at most every `RELOCATE_INTERVAL_SECONDS` — so that rounds never wait on seeds or
sentinels that hang: until the first look succeeds, a caller waits for it at most ``patience``
seconds from its start."""

from __future__ import annotations

import logging
import os
import queue
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from ...errors import RedlockError
from .endpoint import Endpoint
from .threads import start_thread
from .wakeups import Flag

logger = logging.getLogger(__name__)

RELOCATE_INTERVAL_SECONDS = 0.25

Answer = TypeVar("Answer")


def ask_each(
    candidates: Sequence[Endpoint], ask: Callable[[Endpoint], Answer]
) -> queue.Queue[tuple[Endpoint, Answer | None, str]]:
    """Ask every candidate at once, a thread each (one that hangs delays nothing); each puts
    ``(candidate, answer, "")``, or ``(candidate, None, why)`` when ``ask`` raised, on the queue
    returned."""
    answers: queue.Queue[tuple[Endpoint, Answer | None, str]] = queue.Queue()

    def run(candidate: Endpoint) -> None:
        try:
            answers.put((candidate, ask(candidate), ""))
        except Exception as error:
            answers.put((candidate, None, str(error)))

    for candidate in candidates:
        start_thread(run, candidate, name=f"celery-redlock ask {candidate.name}")
    return answers


def first_answer(candidates: Sequence[Endpoint], ask: Callable[[Endpoint], Answer]) -> Answer:
    """Ask every candidate at once and return the first answer; ``ask`` raises when a candidate
    has none. Raises `RedlockError` naming each candidate's failure when none answers."""
    answers = ask_each(candidates, ask)
    errors = []
    for _ in candidates:
        candidate, answer, error = answers.get()
        if answer is not None:
            return answer
        errors.append(f"{candidate.name}: {error}")
    raise RedlockError("; ".join(errors) or "nobody to ask")


def every_answer(
    candidates: Sequence[Endpoint], ask: Callable[[Endpoint], Answer], patience: float
) -> list[Answer]:
    """Ask every candidate at once and return the answers given within ``patience`` seconds;
    ``ask`` raises when a candidate has none. Raises `RedlockError` naming each candidate's
    failure when none answers."""
    answers = ask_each(candidates, ask)
    deadline = time.monotonic() + patience
    given: list[Answer] = []
    errors = []
    for _ in candidates:
        try:
            candidate, answer, error = answers.get(timeout=max(deadline - time.monotonic(), 0))
        except queue.Empty:
            errors.append(f"no answer within {patience:.3g}s")
            break
        if answer is not None:
            given.append(answer)
        else:
            errors.append(f"{candidate.name}: {error}")
    if not given:
        raise RedlockError("; ".join(errors) or "nobody to ask")
    return given


class Locator:
    """Runs ``look`` (which raises when it cannot find out) in the background, on first use and
    on request; callers wait for a first look at most ``patience`` seconds from its start."""

    def __init__(self, name: str, look: Callable[[], None], patience: float) -> None:
        self.name = name
        self._look = look
        self.patience = patience
        self.located = False
        self.last_error = ""
        self._looked_at = 0.0
        # No lock: one held by another thread at a fork would stay held in the child for ever.
        self._looking_pid = 0
        self._again = False  # a look was asked for while one was under way
        self._finished = Flag()

    def ensure(self, wait_for_the_look: bool = False) -> bool:
        """True once located. Until then, starts a look (unless one is under way or failed less
        than an interval ago) and waits for it — at most until ``patience`` seconds after it
        started, or with ``wait_for_the_look`` until it ends (operators' commands)."""
        if not self.located:
            self.relocate()
            if self._looking_pid == os.getpid():
                left = self._looked_at + self.patience - time.monotonic()
                self._finished.wait(None if wait_for_the_look else max(left, 0.0))
        return self.located

    def refresh_if_older(self, seconds: float) -> None:
        """Look again in the background when the last look started ``seconds`` ago or more: for
        what nothing announces (a master the sentinels replaced while it kept running)."""
        if self.located and time.monotonic() - self._looked_at >= seconds:
            self.relocate()

    def relocate(self, again: bool = False) -> None:
        """Look again in the background, unless a look is under way or was just made; ``again``
        (what the member heard may have changed where its keys live): after the look under way,
        or once `RELOCATE_INTERVAL_SECONDS` have passed since the last one."""
        pid = os.getpid()
        if again:
            self._again = True
        now = time.monotonic()
        just_looked = now - self._looked_at < RELOCATE_INTERVAL_SECONDS
        if self._looking_pid == pid or (just_looked and not again):
            return
        try:
            self._looking_pid = pid  # claimed first: callers from now on wait for this look
            starts_at = self._looked_at + RELOCATE_INTERVAL_SECONDS if just_looked else now
            self._looked_at = starts_at  # before the thread runs: `ensure` waits from it
            self._finished = finished = Flag()
            start_thread(self._run, finished, starts_at, name=f"celery-redlock locate {self.name}")
        except BaseException:
            # Interrupted (a soft time limit) before the look surely runs: the claim goes, or no
            # look would ever start in this process again. No signal handler can run between
            # entering this block and the claim's removal (there is no call in between).
            self._looking_pid = 0
            raise

    def _run(self, finished: Flag, starts_at: float) -> None:
        try:
            while True:
                time.sleep(max(starts_at - time.monotonic(), 0))
                self._again = False
                self._look_once()
                if not self._again:
                    return
                # Asked again meanwhile: looks are at most one every interval.
                starts_at = self._looked_at = max(
                    self._looked_at + RELOCATE_INTERVAL_SECONDS, time.monotonic()
                )
        finally:
            self._looking_pid = 0
            finished.set()

    def _look_once(self) -> None:
        try:
            self._look()
        except Exception as error:  # the member stays where it was last seen
            if error.__class__.__name__ != self.last_error.partition(":")[0]:
                logger.warning("lock node %s: cannot locate its servers: %s", self.name, error)
            self.last_error = f"{error.__class__.__name__}: {error}"
        else:
            self.located = True
            self.last_error = ""
