"""Real Redis topologies of the harness: a Redis Cluster (failover, slot migration with ASK and
MOVED redirections) and a Sentinel group (failover). Seconds each: marked ``topology``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis
from topologies import RedisCluster, SentinelGroup
from topologies.servers import role

from celery_redlock.testing import RedisServer

pytestmark = pytest.mark.topology


def _cluster_state(server: RedisServer) -> str:
    with server.client(decode_responses=True) as client:
        information = str(client.execute_command("CLUSTER", "INFO"))
    return information.splitlines()[0].strip()


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisCluster]:
    """Three masters with a replica each. Tests leave it stable, in whatever roles they chose."""
    with RedisCluster(masters=3, replicas_per_master=1) as started:
        yield started


def test_cluster_starts_ready_on_every_node(cluster: RedisCluster) -> None:
    assert len(cluster) == 6
    assert all(_cluster_state(server) == "cluster_state:ok" for server in cluster)
    assert cluster.url == "redis+cluster://" + ",".join(
        f"127.0.0.1:{server.port}" for server in cluster
    )
    assert cluster.urls == [f"redis://127.0.0.1:{server.port}/0" for server in cluster]
    masters = cluster.masters()
    assert len(masters) == 3
    assert all(len(cluster.replicas_of(master)) == 1 for master in masters)
    assert {cluster.slot_owner(slot) for slot in (0, 8000, 16383)} == set(masters)
    # The cluster routes keys: a cluster client finds every key's master.
    with redis.RedisCluster(host="127.0.0.1", port=cluster[0].port) as client:
        for name in ("a", "b", "c", "{x}1"):
            client.set(name, name)
            assert client.get(name) == name.encode()


def test_cluster_failover_hands_the_slot_to_the_replica(cluster: RedisCluster) -> None:
    slot = cluster.key_slot("{failover}")
    old_owner = cluster.slot_owner(slot)
    with old_owner.client() as client:
        client.set("{failover}key", "kept")
    replica = cluster.replicas_of(old_owner)[0]
    new_owner = cluster.failover(old_owner)
    assert new_owner is replica
    assert cluster.slot_owner(slot) is replica
    assert role(replica) == "master"
    assert role(old_owner) == "slave"
    with replica.client() as client:
        assert client.get("{failover}key") == b"kept"  # replicated before the switch
    with old_owner.client() as client, pytest.raises(redis.exceptions.MovedError):
        client.get("{failover}key")


def test_slot_migration_step_by_step_shows_ask_then_moved(cluster: RedisCluster) -> None:
    slot = cluster.key_slot("{moving}")
    source = cluster.slot_owner(slot)
    destination = next(master for master in cluster.masters() if master is not source)
    with source.client() as client:
        client.set("{moving}first", "1")
        client.set("{moving}second", "2")

    migration = cluster.begin_slot_migration(slot, destination)
    with source.client() as client:
        assert client.get("{moving}first") == b"1"  # still here: served
        with pytest.raises(redis.exceptions.AskError) as asked:
            client.get("{moving}absent")  # not here: ask the destination
    assert asked.value.slot_id == slot
    assert asked.value.node_addr == ("127.0.0.1", destination.port)

    assert migration.move_keys(1) == 1
    assert migration.remaining_keys() == 1
    moved_key = next(key for key in ("{moving}first", "{moving}second") if _missing_on(source, key))
    with source.client() as client, pytest.raises(redis.exceptions.AskError):
        client.get(moved_key)
    with destination.client() as client:
        with pytest.raises(redis.exceptions.MovedError):
            client.get(moved_key)  # without ASKING the destination does not serve it yet
        pipeline = client.pipeline(transaction=False)
        pipeline.execute_command("ASKING")
        pipeline.get(moved_key)
        assert pipeline.execute()[1] is not None

    migration.move_keys()
    migration.finish()
    assert cluster.slot_owner(slot) is destination
    with source.client() as client, pytest.raises(redis.exceptions.MovedError) as moved:
        client.get("{moving}first")
    assert moved.value.node_addr == ("127.0.0.1", destination.port)
    with destination.client() as client:
        assert client.mget("{moving}first", "{moving}second") == [b"1", b"2"]


def _missing_on(server: RedisServer, key: str) -> bool:
    with server.client() as client:
        try:
            client.get(key)
        except redis.exceptions.AskError:
            return True
    return False


def test_cluster_master_killed_is_replaced_by_its_replica() -> None:
    with RedisCluster(masters=3, replicas_per_master=1, node_timeout=1.0) as cluster:
        master = cluster.slot_owner(0)
        replica = cluster.replicas_of(master)[0]
        assert cluster.kill_master(master) is replica
        assert not master.is_running
        assert cluster.slot_owner(0) is replica
        assert master not in cluster.masters()
        survivors = [server for server in cluster if server.is_running]
        assert all(_cluster_state(server) == "cluster_state:ok" for server in survivors)


def test_sentinel_failover_changes_the_reported_master() -> None:
    with SentinelGroup(replicas=1, service_name="locks") as group:
        addresses = ",".join(f"127.0.0.1:{sentinel.port}" for sentinel in group.sentinels)
        assert group.url == f"redis+sentinel://{addresses}/locks"
        old = group.master()
        assert old is group.servers[0]
        assert role(old) == "master"
        with old.client() as client:
            client.set("before", "failover")
            assert client.wait(1, 5000) == 1  # the replica has it

        new = group.failover()
        assert new is not old
        assert new is group.servers[1]
        assert group.master() is new
        assert {sentinel.master_address() for sentinel in group.sentinels} == {new.address}
        assert role(new) == "master"
        with new.client() as client:
            assert client.get("before") == b"failover"
        assert group.replicas() == [old]  # the sentinels turn it into a replica in a while


def test_sentinels_replace_a_killed_master() -> None:
    with SentinelGroup(replicas=2, down_after=1.0) as group:
        old = group.master()
        new = group.kill_master()
        assert not old.is_running
        assert new in group.servers[1:]
        assert group.master() is new
        assert role(new) == "master"
