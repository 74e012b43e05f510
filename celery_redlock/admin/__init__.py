"""Inspect and repair the locks of a Celery app from Python: the operators' API.

Every function takes the Celery app whose ``redlock_*`` settings name the lock nodes, asks all
nodes at once (``timeout`` seconds per command), and returns frozen records with a ``to_json()``,
never holding a lock token. A node that does not answer, or answers what no Redis server would,
is an error record, never raised; what needs a majority of nodes raises `QuorumUnavailable`
without one. An ACL denial is reported with the grant that allows it. Modules: `status` (node
health), `locks` (held locks, keys, forced release), `reap`, with `records`, `reading` and
`workers` beneath; `celery redlock` (celery_redlock.cli) wraps them in a command line.
"""

from __future__ import annotations

from .locks import (
    call_key,
    force_release,
    held_locks,
    holder,
    keys_of_lock,
    lock_key,
    lock_listing,
    resolve_key,
)
from .reap import process_exists, reap, start_reaper_thread
from .records import (
    DEFAULT_TIMEOUT,
    FREED,
    GONE,
    KEPT,
    LEGACY_NOTE,
    PROOF_NOT_RUNNING,
    PROOF_PROCESS_GONE,
    PROOF_SILENT,
    WOULD_FREE,
    CallKey,
    LockListing,
    LockRecord,
    NodeError,
    NodeStatus,
    NotALock,
    ReapResult,
    Refusal,
    ReleaseResult,
    StatusReport,
    UnknownTask,
)
from .status import node_status, status_report

__all__ = [
    "DEFAULT_TIMEOUT",
    "FREED",
    "GONE",
    "KEPT",
    "LEGACY_NOTE",
    "PROOF_NOT_RUNNING",
    "PROOF_PROCESS_GONE",
    "PROOF_SILENT",
    "WOULD_FREE",
    "CallKey",
    "LockListing",
    "LockRecord",
    "NodeError",
    "NodeStatus",
    "NotALock",
    "ReapResult",
    "Refusal",
    "ReleaseResult",
    "StatusReport",
    "UnknownTask",
    "call_key",
    "force_release",
    "held_locks",
    "holder",
    "keys_of_lock",
    "lock_key",
    "lock_listing",
    "node_status",
    "process_exists",
    "reap",
    "resolve_key",
    "start_reaper_thread",
    "status_report",
]
