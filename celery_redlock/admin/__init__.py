"""Inspect and repair the locks of a Celery app from Python: the operators' API.

Every function takes the Celery app whose ``redlock_*`` settings name the lock nodes, asks all
nodes at once (each bounded by ``timeout`` seconds per command), and returns frozen records with a
``to_json()``. A node that does not answer, or answers what no Redis server would, is reported
as an error record (`NodeError`, or an unreachable `NodeStatus`), never raised; what can only be
known from a majority of nodes raises `QuorumUnavailable` without one. Lock tokens (the secret
part of a stored lock value, which allows releasing the lock) never appear in a record. Nothing
here needs CONFIG, KEYS, DEBUG, SCRIPT FLUSH or the default user: a command an ACL denies is
reported with the grant that allows it.

- `status_report` / `node_status` (`status`): every lock node — reachable, round trip,
  version, role, persistence, eviction, what could not be read — with the settings that weaken
  the lock's safety;
- `held_locks` / `lock_listing` (`locks`): the locks held now and who holds them;
- `lock_key`, `call_key`, `holder` (`locks`): the key a call would lock, and that call's holder;
- `force_release` (`locks`): delete a lock on every node, whoever holds it — only a lock;
- `reap` (`reap`): free, by token, only the locks whose holder is proven gone; workers run it
  on a timer (`start_reaper_thread`);

with the records in `records`, the holders' workers asked in `workers`, and the nodes read in
`reading` (plain reads such as SCAN and INFO; scripts in rounds of the nodes layer's
`NodeGroup`). `celery redlock` (celery_redlock.cli) is these functions with a command line around
them.
"""

from __future__ import annotations

from .locks import (
    call_key,
    find_task,
    force_release,
    held_locks,
    holder,
    key_basis,
    keys_of_lock,
    lock_key,
    lock_listing,
    resolve_key,
    singleton_tasks,
)
from .reading import SCAN_BATCH, NodeAnswer, is_lock_value
from .reap import (
    KEEPER_LATENESS_SECONDS,
    NO_OWNER,
    PTTL_TOLERANCE_SECONDS,
    process_exists,
    reap,
    reap_while_worker_runs,
    start_reaper_thread,
)
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
    "KEEPER_LATENESS_SECONDS",
    "KEPT",
    "LEGACY_NOTE",
    "NO_OWNER",
    "PROOF_NOT_RUNNING",
    "PROOF_PROCESS_GONE",
    "PROOF_SILENT",
    "PTTL_TOLERANCE_SECONDS",
    "SCAN_BATCH",
    "WOULD_FREE",
    "CallKey",
    "LockListing",
    "LockRecord",
    "NodeAnswer",
    "NodeError",
    "NodeStatus",
    "NotALock",
    "ReapResult",
    "Refusal",
    "ReleaseResult",
    "StatusReport",
    "UnknownTask",
    "call_key",
    "find_task",
    "force_release",
    "held_locks",
    "holder",
    "is_lock_value",
    "key_basis",
    "keys_of_lock",
    "lock_key",
    "lock_listing",
    "node_status",
    "process_exists",
    "reap",
    "reap_while_worker_runs",
    "resolve_key",
    "singleton_tasks",
    "start_reaper_thread",
    "status_report",
]
