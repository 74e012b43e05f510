"""The members of a quorum (`LockNode`): what one entry of ``redlock_urls`` stands for, and where
a command on a key goes. A standalone server (`StandaloneNode`) is one endpoint; a Redis Cluster
(`nodes.cluster`) routes each key to the master of its hash slot; a Sentinel-managed master
(`nodes.sentinel`) is whichever server the sentinels name.
"""

from __future__ import annotations

from typing import NamedTuple

from .endpoint import Endpoint
from .resp import ErrorReply


class Redirect(NamedTuple):
    """Where to send a command again after an error reply: to ``endpoint``, after ``ASKING`` when
    ``asking`` (a slot being migrated)."""

    endpoint: Endpoint
    asking: bool = False


class LockNode:
    """One member of the quorum: it grants or refuses as one, whatever it is made of.

    ``wait_replicas`` (Cluster and Sentinel members): a grant counts only once that many replicas
    acknowledged it (Redis ``WAIT``). ``fixed_endpoint``: the one server of a member whose
    server never changes (a standalone one), used without calling `endpoint_for`
    (`round.endpoint_of`)."""

    name = ""
    wait_replicas = 0
    fixed_endpoint: Endpoint | None = None

    def endpoint_for(self, key: str) -> Endpoint | None:
        """The server a command on ``key`` goes to now; None while that is not known (the member
        is still finding out, which counts as backed off)."""
        raise NotImplementedError

    def endpoints(self) -> list[Endpoint]:
        """Every server holding this member's keys now (a cluster's masters)."""
        raise NotImplementedError

    def locating_error(self) -> str:
        """Why `endpoint_for` knows no server."""
        return "its servers are not located yet"

    def redirect(self, reply: ErrorReply, endpoint: Endpoint) -> Redirect | None:
        """Where to send a command again after ``endpoint`` answered ``reply`` (MOVED, ASK,
        READONLY...), or None when the reply is the answer."""
        return None

    def notice(self, reply: ErrorReply, endpoint: Endpoint) -> None:
        """Take note of an error reply from ``endpoint`` that may mean the keys live elsewhere
        now (MOVED after a failover or a resharding, READONLY from a demoted master): learn
        again where, in the background."""

    def notice_failure(self, endpoint: Endpoint) -> None:
        """Take note that ``endpoint`` did not answer (a cluster learns its slot map anew: a
        master that fails may have been replaced by its replica)."""

    def vouches_for(self, endpoint: Endpoint) -> str:
        """Why a grant or an extension ``endpoint`` just made does not count (empty when it
        does): it is no longer the master of the member's keys, or a failover is under way (a
        replaced master keeps accepting writes the new one never sees)."""
        return ""

    def confirm(self, extension: bool) -> None:
        """Before a round that grants a lock (``extension``: extends one), make sure that what
        the member knows of its master is current (a Sentinel member that cannot hear every
        sentinel asks them now; before an extension it always does)."""

    def close(self) -> None:
        """Stop what the member runs in the background in this process (a later use starts it
        again)."""


class StandaloneNode(LockNode):
    """One independent Redis (or Valkey) server: ``redis://``, ``rediss://`` or ``unix://``."""

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = self.fixed_endpoint = endpoint
        self.name = endpoint.name

    def endpoint_for(self, key: str) -> Endpoint:
        return self.endpoint

    def endpoints(self) -> list[Endpoint]:
        return [self.endpoint]
