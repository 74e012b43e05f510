"""From an entry of ``redlock_urls`` to the quorum member it stands for.

- ``redis://``, ``rediss://``, ``unix://`` — one standalone server;
- ``redis+cluster://[user:password@]host:port[,host:port...][?options]`` (``rediss+cluster://``
  with TLS) — a Redis Cluster, found through any of the seed servers;
- ``redis+sentinel://[user:password@]host:26379[,host:26379...]/<service>[/<db>][?options]``
  (``rediss+sentinel://``) — the master that the sentinels name for the service. The credentials
  are the master's; sentinels that require their own take ``sentinel_username`` and
  ``sentinel_password`` options.

Query options are redis-py's (``ssl_ca_certs=...``) and apply to every server of the member.
"""

from __future__ import annotations

from collections.abc import Sequence

from ...settings import CLUSTER_SCHEMES, SENTINEL_SCHEMES, MultiHostURL
from .cluster import ClusterNode
from .endpoint import Endpoint
from .members import LockNode, StandaloneNode
from .sentinel import SentinelNode
from .tls import TLSContexts


def members_from_urls(
    urls: Sequence[str],
    node_timeout: float,
    username: str | None = None,
    password: str | None = None,
    wait_replicas: int = 0,
) -> list[LockNode]:
    """The members of a quorum, one per URL (each already checked by `settings.check_url`):
    ``username`` and ``password`` apply where a URL names no credentials, ``wait_replicas`` to
    Cluster and Sentinel members."""

    tls_contexts = TLSContexts()  # members with the same TLS options share one context

    def server(url: str) -> Endpoint:
        return Endpoint.from_url(url, node_timeout, username, password, tls_contexts)

    members: list[LockNode] = []
    for url in urls:
        scheme = url.partition("://")[0]
        if scheme in CLUSTER_SCHEMES:
            parts = MultiHostURL.parse(url)
            seeds = [server(parts.server_url(host, port)) for host, port in parts.hosts]
            members.append(ClusterNode(url, seeds, wait_replicas))
        elif scheme in SENTINEL_SCHEMES:
            parts = MultiHostURL.parse(url)
            service, _, database = parts.path.strip("/").partition("/")
            sentinels = [
                Endpoint.from_url(
                    parts.server_url(host, port, sentinel=True),
                    node_timeout,
                    tls_contexts=tls_contexts,
                )
                for host, port in parts.hosts
            ]
            host, port = parts.hosts[0]
            master = server(parts.server_url(host, port, f"/{database or 0}"))
            members.append(SentinelNode(url, sentinels, service, master, wait_replicas))
        else:
            members.append(StandaloneNode(server(url)))
    return members
