"""A Redis Cluster as one member of the quorum (to be written)."""

from __future__ import annotations

from ..errors import ConfigurationError
from .members import LockNode


class ClusterNode(LockNode):
    """A Redis Cluster."""

    @classmethod
    def from_url(
        cls,
        url: str,
        node_timeout: float,
        username: str | None,
        password: str | None,
        wait_replicas: int,
    ) -> ClusterNode:
        """The cluster ``url`` names."""
        raise ConfigurationError("Redis Cluster lock nodes are not supported yet")
