"""The nodes layer: every socket of the package, and one round over the members of a quorum
(`NodeGroup.run`). Its modules, bottom up: `forks` (the locks a forked child makes anew),
`wakeups` (waits that a signal handler raising in the waiter cannot break), `resp`
(the wire protocol), `endpoint` (one server, its back-off and probes), `channel` (one pipelined
connection per server and process), `subscriber` (release notifications), `reactor` (the one
thread per process that owns every connection; the layer's invariants are stated there),
`members`, `cluster`, `sentinel`, `locating`, `urls` (what an entry of ``redlock_urls`` stands
for), `round` (one script call on every member, judged as replies arrive) and `group`."""

from __future__ import annotations

from .endpoint import Endpoint, OwnPoolClient
from .group import NodeGroup
from .members import LockNode
from .round import Judge, RoundResult
from .urls import members_from_urls

__all__ = [
    "Endpoint",
    "Judge",
    "LockNode",
    "NodeGroup",
    "OwnPoolClient",
    "RoundResult",
    "members_from_urls",
]
