"""A Sentinel-managed master as one member of the quorum (to be written)."""

from __future__ import annotations

from ..errors import ConfigurationError
from .members import LockNode


class SentinelNode(LockNode):
    """A Sentinel-managed master."""

    @classmethod
    def from_url(
        cls,
        url: str,
        node_timeout: float,
        username: str | None,
        password: str | None,
        wait_replicas: int,
    ) -> SentinelNode:
        """The master ``url`` names."""
        raise ConfigurationError("Sentinel lock nodes are not supported yet")
