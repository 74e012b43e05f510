"""Who holds a lock: the value stored on the lock nodes, built and parsed here and nowhere else.

A stored value is ``token + "|" + owner text``; the token is lowercase hex (fresh ones from
`Tokens`), so the first ``|`` ends it. An owner text is compact JSON whose first fields are
always ``id``, ``queued``, ``pid`` and ``host``, in that order: the Lua scripts match a holder by
the start of its owner text (`claim_prefix`, `run_prefix`), so task ids with any characters match
exactly. Owner texts never hold argument values or tokens.
"""

from __future__ import annotations

import collections
import json
import os
import secrets
import socket
import time
from dataclasses import asdict, dataclass
from typing import Any

SEPARATOR = "|"

TOKEN_BYTES = 20
TOKENS_PER_DRAW = 64


class Tokens:
    """Fresh lock tokens: `TOKEN_BYTES` random bytes from `secrets` as hex (never ``|``), drawn
    `TOKENS_PER_DRAW` at a time, since each ``getrandom`` call gives up the GIL (to another
    thread, when there are many). A forked child never takes a token its parent drew."""

    def __init__(self) -> None:
        self._drawn: tuple[int, collections.deque[str]] = (-1, collections.deque())

    def new(self) -> str:
        """A fresh token (160 random bits: no other call anywhere returns it but by chance)."""
        here = os.getpid()
        pid, drawn = self._drawn
        if pid != here:
            drawn = collections.deque()
            self._drawn = (here, drawn)
        try:
            return drawn.popleft()  # atomic: threads share the draw without a lock
        except IndexError:
            text = secrets.token_hex(TOKEN_BYTES * TOKENS_PER_DRAW)
            width = 2 * TOKEN_BYTES
            fresh = [text[start : start + width] for start in range(0, len(text), width)]
            drawn.extend(fresh[1:])
            return fresh[0]


def lock_value(token: str, owner_text: str) -> str:
    """The value stored on the nodes for a lock with ``token`` held by ``owner_text``."""
    return f"{token}{SEPARATOR}{owner_text}" if owner_text else token


def owner_text_of(value: str) -> str:
    """The owner text of a stored value ('' when the value carries none)."""
    return value.partition(SEPARATOR)[2]


_encode = json.JSONEncoder(separators=(",", ":")).encode  # built once: texts are made per run


@dataclass(frozen=True)
class Owner:
    """The public description of a lock holder: which task run, where, since when.

    ``queued`` marks the claim `SingletonTask.apply_async` takes with ``lock_on_enqueue`` (the
    run of that id takes it over); ``retries`` and ``nesting`` (Celery's
    ``replaced_task_nesting``) order the attempts of one task id.
    """

    id: str | None
    task: str | None = None
    retries: int = 0
    nesting: int = 0
    host: str = ""
    pid: int = 0
    worker: str | None = None
    since: float = 0.0
    queued: bool = False
    role: str | None = None  # None: a task run; "beat": the beat leader's lease

    @classmethod
    def here(
        cls,
        task: str | None,
        task_id: str | None,
        retries: int = 0,
        nesting: int = 0,
        **fields: Any,
    ) -> Owner:
        """An owner in this process (host name and process id filled in), starting now; the
        other ``fields`` (``worker``, ``queued``, ``role``) by keyword."""
        host, pid, since = socket.gethostname(), os.getpid(), round(time.time(), 3)
        return cls(task_id, task, retries, nesting, host, pid, since=since, **fields)

    @property
    def attempt(self) -> tuple[int, int]:
        """The attempt of its task id: later replacements and retries compare greater."""
        return (self.nesting, self.retries)

    def to_text(self) -> str:
        """The owner text stored beside the token (the matching prefixes come first)."""
        prefix = _prefix(self.id, self.queued, self.pid, _encode(self.host))
        task = _encode(self.task)
        return _owner_text(
            prefix, task, self.retries, self.nesting, self.since, self.worker, self.role
        )

    @classmethod
    def parse(cls, text: str | None) -> Owner | None:
        """The owner described by an owner text, or None when it is not one of ours."""
        if not text:
            return None
        try:
            fields = json.loads(text)
            if not isinstance(fields, dict):
                return None
            return cls(
                id=_optional_text(fields.get("id")),
                task=_optional_text(fields.get("task")),
                retries=int(fields.get("retries") or 0),
                nesting=int(fields.get("nesting") or 0),
                host=str(fields.get("host") or ""),
                pid=int(fields.get("pid") or 0),
                worker=_optional_text(fields.get("worker")),
                since=float(fields.get("since") or 0.0),
                queued=bool(fields.get("queued")),
                role=_optional_text(fields.get("role")),
            )
        except (TypeError, ValueError):
            return None

    def describe(self) -> str:
        """A short human description, for logs and errors."""
        where = self.worker or self.host
        if self.role:
            return f"{self.role} on {where} pid {self.pid}"
        what = "queued call" if self.queued else "task"
        return f"{what} {self.task}[{self.id}] on {where} pid {self.pid}"

    def to_json(self) -> dict[str, Any]:
        """The public fields as a JSON-ready dict (what signals and the admin API show)."""
        return {"task": self.task, **asdict(self)}  # "task" first, then the fields in order


class RunOwnerTexts:
    """The owner texts of one task's runs, as `Owner.to_text` writes them: what does not change
    from run to run (task, host, process) is encoded once per process."""

    def __init__(self, task: str) -> None:
        self._task = _encode(task)
        self._pid = 0
        self._host = ""

    def text(self, task_id: str | None, retries: int, nesting: int, worker: str | None) -> str:
        """The owner text of a run of ``task_id`` starting now in this process."""
        pid = os.getpid()
        if pid != self._pid:  # first use, or a forked child
            self._pid, self._host = pid, _encode(socket.gethostname())
        prefix = _prefix(task_id, False, pid, self._host)
        since = round(time.time(), 3)
        return _owner_text(prefix, self._task, retries, nesting, since, worker, None)


def _prefix(task_id: str | None, queued: bool, pid: int | None = None, host: str = "") -> str:
    # The fields the scripts match by prefix (host encoded).
    text = '{"id":' + _encode(task_id) + (',"queued":true,' if queued else ',"queued":false,')
    return text if pid is None else f'{text}"pid":{pid},"host":{host},'


def _owner_text(
    prefix: str,
    task: str,
    retries: int,
    nesting: int,
    since: float,
    worker: str | None,
    role: str | None,
) -> str:
    # The one place an owner text is built after its prefix (task encoded).
    text = f'{prefix}"task":{task},"retries":{retries},"nesting":{nesting},"since":{since}'
    if worker:
        text += ',"worker":' + _encode(worker)
    if role:
        text += ',"role":' + _encode(role)
    return text + "}"


def _optional_text(value: object) -> str | None:
    return None if value is None else str(value)


def claim_prefix(task_id: str) -> str:
    """How the owner text of the enqueue-time claim of ``task_id`` starts."""
    return _prefix(task_id, True)


def run_prefix(task_id: str, pid: int, host: str) -> str:
    """How the owner text of a run of ``task_id`` in process ``pid`` on ``host`` starts."""
    return _prefix(task_id, False, pid, _encode(host))


def describe_holder(owner_text: str | None) -> str:
    """A human description of whoever an owner text names."""
    owner = Owner.parse(owner_text)
    if owner is not None:
        return owner.describe()
    return owner_text or "an unknown owner"
