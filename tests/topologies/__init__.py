"""The Redis topologies this repository's own tests and benchmarks run on, over the package's
harness (`celery_redlock.testing`): Redis Cluster (`RedisCluster`, with failovers and
step-by-step slot migrations, `SlotMigration`), Sentinel (`SentinelGroup` of `SentinelServer`s),
TLS (`TLSCertificates`) and replicas (`TopologyServer`, a `RedisServer` with TLS, cluster and
replica options). Not shipped: users' tests get `celery_redlock.testing` and the pytest plugin.
"""

from __future__ import annotations

from .cluster import REDIS_CLI_ENVIRONMENT_VARIABLE, RedisCluster, find_redis_cli
from .sentinel import SentinelGroup, SentinelServer
from .servers import CLUSTER_BUS_PORT_OFFSET, TopologyServer
from .slot_migration import SlotMigration
from .tls import TLSCertificates

__all__ = [
    "CLUSTER_BUS_PORT_OFFSET",
    "REDIS_CLI_ENVIRONMENT_VARIABLE",
    "RedisCluster",
    "SentinelGroup",
    "SentinelServer",
    "SlotMigration",
    "TLSCertificates",
    "TopologyServer",
    "find_redis_cli",
]
