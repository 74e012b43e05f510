"""From an entry of ``redlock_urls`` to the quorum member it stands for."""

from __future__ import annotations

from collections.abc import Sequence

from .cluster import ClusterNode
from .endpoint import Endpoint
from .members import LockNode, StandaloneNode
from .sentinel import SentinelNode

CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")


def member_from_url(
    url: str,
    node_timeout: float,
    username: str | None = None,
    password: str | None = None,
    wait_replicas: int = 0,
) -> LockNode:
    """The member ``url`` names (a URL already checked by `celery_redlock.settings.check_url`):
    a standalone server, a Redis Cluster or a Sentinel-managed master. ``username`` and
    ``password`` apply where the URL names no credentials; ``wait_replicas`` to Cluster and
    Sentinel members."""
    scheme = url.partition("://")[0]
    if scheme in CLUSTER_SCHEMES:
        return ClusterNode.from_url(url, node_timeout, username, password, wait_replicas)
    if scheme in SENTINEL_SCHEMES:
        return SentinelNode.from_url(url, node_timeout, username, password, wait_replicas)
    return StandaloneNode(Endpoint.from_url(url, node_timeout, username, password))


def members_from_urls(
    urls: Sequence[str],
    node_timeout: float,
    username: str | None = None,
    password: str | None = None,
    wait_replicas: int = 0,
) -> list[LockNode]:
    """The members of a quorum, one per URL."""
    return [member_from_url(url, node_timeout, username, password, wait_replicas) for url in urls]
