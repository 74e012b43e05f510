"""The nodes layer: every socket of the package, and one multiplexed round over the members of a
quorum.

- `resp`: commands encoded, replies parsed incrementally;
- `endpoint`: one server — how to connect to it, and its back-off and probes;
- `channel`: one connection per server and process, shared by every thread (pipelined);
- `reactor`: the waiting threads take turns reading the connections;
- `subscriber`: one subscribed connection per server and process for release notifications;
- `members`: what one entry of ``redlock_urls`` stands for (`StandaloneNode`; `cluster`,
  `sentinel`), made from its URL by `members_from_urls`;
- `round`: one script call on every member, its replies judged as they arrive;
- `group`: `NodeGroup`, its connections in this process, and release listeners.
"""

from __future__ import annotations

from .channel import HUNG_AFTER, NO_REPLY, hung_after
from .endpoint import (
    ACL_HINT,
    FIRST_BACKOFF_SECONDS,
    MAX_BACKOFF_SECONDS,
    Endpoint,
    OwnPoolClient,
    describe_failure,
)
from .group import NodeGroup, ReleaseListener
from .members import LockNode, StandaloneNode
from .resp import ErrorReply, pack_command
from .round import Judge, RoundResult
from .urls import member_from_url, members_from_urls

__all__ = [
    "ACL_HINT",
    "FIRST_BACKOFF_SECONDS",
    "HUNG_AFTER",
    "MAX_BACKOFF_SECONDS",
    "NO_REPLY",
    "Endpoint",
    "ErrorReply",
    "Judge",
    "LockNode",
    "NodeGroup",
    "OwnPoolClient",
    "ReleaseListener",
    "RoundResult",
    "StandaloneNode",
    "describe_failure",
    "hung_after",
    "member_from_url",
    "members_from_urls",
    "pack_command",
]
