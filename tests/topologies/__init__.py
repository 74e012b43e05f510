"""The Redis topologies this repository's own tests and benchmarks run on, over the package's
harness (`celery_redlock.testing`): Redis Cluster (`RedisCluster`, with failovers and
step-by-step slot migrations, `SlotMigration`), Sentinel (`SentinelGroup` of `SentinelServer`s),
TLS (`TLSCertificates`), replicas (`TopologyServer`, a `RedisServer` with TLS, cluster and
replica options) and Valkey (`ValkeyServer`, `find_valkey_server`). Not shipped: users' tests
get `celery_redlock.testing` and the pytest plugin.
"""

from __future__ import annotations

from .cluster import REDIS_CLI_ENVIRONMENT_VARIABLE, RedisCluster, find_redis_cli
from .sentinel import SentinelGroup, SentinelServer
from .servers import CLUSTER_BUS_PORT_OFFSET, TopologyServer
from .slot_migration import SlotMigration
from .tls import TLSCertificates
from .valkey import VALKEY_SERVER_ENVIRONMENT_VARIABLE, ValkeyServer, find_valkey_server

__all__ = [
    "CLUSTER_BUS_PORT_OFFSET",
    "REDIS_CLI_ENVIRONMENT_VARIABLE",
    "VALKEY_SERVER_ENVIRONMENT_VARIABLE",
    "RedisCluster",
    "SentinelGroup",
    "SentinelServer",
    "SlotMigration",
    "TLSCertificates",
    "TopologyServer",
    "ValkeyServer",
    "find_redis_cli",
    "find_valkey_server",
]
