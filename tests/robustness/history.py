"""The history of a run: one JSON object per line, one file per client thread, merged by the
checker. Times are ``time.monotonic()`` seconds, which on Linux is one clock for every process
of the host, so records of different processes compare.

Every record has ``op``, ``owner`` (``<process>:<thread>``), ``key`` (the resource), ``start``
and ``end``. By ``op``:

- ``acquire``: ``outcome`` (``acquired``, ``held``, ``contended``, ``unavailable``, ``covered``,
  ``interrupted``, ``error``), ``ttl``; when acquired ``token`` (a hash of the lock's token),
  ``fence`` and ``valid_until``; when held ``holder`` (the owner text the nodes named).
- ``extend``: ``token``, ``ok`` (True, False, None when interrupted), ``valid_until`` after it.
- ``release``: ``token``, ``ok`` (as for extend).
- ``write``: ``token``, ``store`` (``redis`` or ``postgresql``), ``fence``, ``accepted`` (True,
  False for a `StaleFence`, None when interrupted or failed), ``stored`` (the refusal's token),
  ``error`` (the exception's class name when neither written nor refused).
- ``task``: the Celery workload: ``event`` (``sent``, ``ran``, ``skipped``; ``acquired``,
  ``released``, ``released-unconfirmed`` and ``lost`` for a run's lock), ``task_id``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

Record = dict[str, Any]


def token_hash(token: str) -> str:
    """A short stand-in for a lock token: histories name holds without keeping their secrets."""
    return hashlib.sha256(token.encode()).hexdigest()[:16]


class HistoryFile:
    """The records of one client thread, each written to ``path`` as it is added (one thread
    writes it, so no lock): a process that hangs or is killed keeps what it did until then."""

    def __init__(self, path: Path) -> None:
        self.file = path.open("a", encoding="utf-8", buffering=1)  # line-buffered

    def add(self, record: Record) -> None:
        self.file.write(json.dumps(record, separators=(",", ":")) + "\n")

    def close(self) -> None:
        self.file.close()


def read_history(directory: Path) -> list[Record]:
    """Every record of every ``*.jsonl`` file under ``directory``, in start order."""
    records = list(_records_in(directory))
    records.sort(key=lambda record: (record["start"], record["end"]))
    return records


def _records_in(directory: Path) -> Iterator[Record]:
    for path in sorted(directory.glob("*.jsonl")):
        with path.open(encoding="utf-8") as file:
            for line in file:
                if line.strip():
                    yield json.loads(line)
