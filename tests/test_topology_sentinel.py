"""A Sentinel-managed master as one lock node (``redis+sentinel://h:p,h:p/<service>``), on real
sentinels: locks on the master the sentinels name, the node following a failover (``SENTINEL
FAILOVER``, a killed master), and ``redlock_wait_replicas``: a grant counts only once a replica
acknowledged it. Seconds each: marked ``topology``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from redlock_support import value_on, wait_until
from reply_faults import LateReadingSocket
from topologies import SentinelGroup
from topology_support import HoldThroughFailover, Rival, lock_managers, unique

from celery_redlock import Redlock, admin
from celery_redlock.errors import RedlockError
from celery_redlock.lock.nodes import Endpoint, sentinel
from celery_redlock.lock.outcomes import Acquired, Held, Unavailable
from celery_redlock.testing import RedisNodes, RedisServer

pytestmark = pytest.mark.topology
LISTENING = "celery-redlock announcements"


@pytest.fixture(scope="module")
def group() -> Iterator[SentinelGroup]:
    """A master, one replica and three sentinels that no test fails over."""
    with SentinelGroup(replicas=1, service_name="topology") as started:
        yield started


def master_address(manager: Redlock) -> tuple[str, int] | None:
    """The server the manager's one (Sentinel) node uses now."""
    (node,) = manager.nodes
    endpoints = node.endpoints()
    return endpoints[0].address if endpoints else None


def replicated(server: RedisServer) -> None:
    """Wait until a replica of ``server`` acknowledged every write so far."""
    with server.client() as client:
        assert client.wait(1, 5000) >= 1


def taken(manager: Redlock, resource: str) -> bool:
    """Whether ``manager`` takes (and releases) the lock on ``resource`` in one attempt."""
    outcome = manager.attempt(resource, 10.0, rounds=1)
    if isinstance(outcome, Acquired):
        assert manager.release(outcome.lock)
        return True
    return False


def replica_lag(master: RedisServer) -> int:
    """How many bytes of the master's writes its (first) replica has not acknowledged."""
    with master.client() as client:
        information: dict[str, Any] = client.info("replication")
    return int(information["master_repl_offset"]) - int(information["slave0"]["offset"])


# -- locks on the master ------------------------------------------------------------------------


def test_a_sentinel_node_grants_on_the_master_the_sentinels_name(group: SentinelGroup) -> None:
    resource = unique("sentinel")
    with lock_managers([group.url]) as (holder, rival):
        assert (len(holder.nodes), holder.quorum, [node.name for node in holder.nodes]) == (
            1,
            1,
            [group.url],
        )
        lock = holder.acquire(resource, 10.0, owner="first")
        assert lock is not None
        master = group.master()
        assert master_address(holder) == ("127.0.0.1", master.port)
        assert value_on(master, lock.key) == lock.value
        outcome = rival.attempt(resource, 10.0, rounds=1)
        assert isinstance(outcome, Held) and outcome.holder == "first"
        assert holder.extend(lock)
        assert holder.release(lock)
        assert value_on(master, lock.key) is None
        assert taken(rival, resource)


def test_status_reports_the_master_and_what_its_replicas_mean(group: SentinelGroup) -> None:
    app = Celery("topology_sentinel_status", broker="memory://", set_as_current=False)
    app.conf.redlock_urls = [group.url]
    (status,) = admin.status_report(app, timeout=2.0).nodes
    assert status.reachable and status.node == group.url
    assert (status.role, status.connected_replicas) == ("master", 1)
    assert any("redlock_wait_replicas 0" in warning for warning in status.warnings)

    app = Celery("topology_sentinel_status_wait", broker="memory://", set_as_current=False)
    app.conf.redlock_urls = [group.url]
    app.conf.redlock_wait_replicas = 2  # one replica only: WAIT 2 can never be satisfied
    (status,) = admin.status_report(app, timeout=2.0).nodes
    assert any("WAIT cannot be satisfied" in warning for warning in status.warnings)


# -- failovers ------------------------------------------------------------------------------------


def test_after_a_sentinel_failover_the_node_follows_the_new_master() -> None:
    with SentinelGroup(replicas=1) as group, lock_managers([group.url]) as (holder, rival):
        resource = unique("held")
        lock = holder.acquire(resource, 20.0, owner="holder")
        assert lock is not None
        old = group.master()
        replicated(old)
        assert taken(rival, unique("before"))  # the rival knows the old master too

        new = group.failover()  # the old master keeps running, as a master, for some seconds
        with lock_managers([group.url], count=1) as (newcomer,):
            outcome = newcomer.attempt(resource, 10.0, rounds=1)
            assert isinstance(outcome, Held) and outcome.holder == "holder"  # the replica had it

            # Nothing tells a node that used the old master; it asks the sentinels again within
            # about a second. (Until then, without redlock_wait_replicas, it would grant on the
            # old master: see the wait_replicas tests.)
            for manager in (holder, rival):
                assert wait_until(
                    lambda manager=manager: (
                        manager.holder_of(resource) is not None
                        and master_address(manager) == ("127.0.0.1", new.port)
                    ),
                    timeout=4.0,
                    interval=0.1,
                )
            assert holder.extend(lock)
            with new.client() as client:
                assert client.pttl(lock.key) > 15_000  # extended where the lock lives now

            fresh = unique("fresh")
            first = rival.attempt(fresh, 10.0, rounds=1)
            assert isinstance(first, Acquired)
            assert isinstance(newcomer.attempt(fresh, 10.0, rounds=1), Held)
            assert rival.release(first.lock)
            assert holder.release(lock)
            assert value_on(new, lock.key) is None
            assert taken(newcomer, resource)


def test_a_killed_master_is_replaced_under_a_held_lock() -> None:
    with (
        SentinelGroup(replicas=1, down_after=1.0) as group,
        lock_managers([group.url]) as (holder, rival_manager),
    ):
        resource = unique("killed")
        lock = holder.acquire(resource, 20.0)
        assert lock is not None
        replicated(group.master())
        with Rival(rival_manager, resource, lock) as rival:
            rival.wait_for_attempts(3)
            group.kill_master(wait=False)
            # A connection failure makes the node ask the sentinels again, until they name the
            # replica they promoted.
            assert wait_until(lambda: holder.extend(lock), timeout=20.0, interval=0.1)
            new = group.master()
            assert master_address(holder) == ("127.0.0.1", new.port)
            rival.wait_for_attempts(5)
        assert rival.errors == []
        assert rival.granted == []
        assert value_on(new, lock.key) == lock.value
        assert holder.release(lock)
        again = holder.acquire(unique("after"), 10.0)
        assert again is not None
        assert value_on(new, again.key) == again.value
        assert holder.release(again)


def test_a_sentinel_node_listens_to_every_sentinel_until_closed(group: SentinelGroup) -> None:
    def listening() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name.startswith(LISTENING)}

    before = listening()  # other tests' lock managers, not closed yet
    with lock_managers([group.url], count=1) as (manager,):
        assert taken(manager, unique("listening"))
        (node,) = manager.nodes
        assert isinstance(node, sentinel.SentinelNode)
        assert wait_until(node.announcements.heard_all, timeout=5.0)
        assert len(listening() - before) == len(group.sentinels)
    # Closed: the threads end within a wait for an announcement.
    assert wait_until(lambda: not listening() - before, sentinel.LISTEN_SECONDS + 2.0)


def test_a_sentinel_that_stops_answering_is_no_longer_counted_as_heard(
    group: SentinelGroup,
) -> None:
    # A subscription whose connection died unannounced (a frozen sentinel, a firewall that
    # forgot the connection) hears nothing: an unanswered PING tells, and until the sentinel is
    # heard again the member asks the sentinels before every grant.
    with lock_managers([group.url], count=1) as (manager,):
        assert taken(manager, unique("heard"))
        (node,) = manager.nodes
        assert isinstance(node, sentinel.SentinelNode)
        assert wait_until(node.announcements.heard_all, timeout=5.0)
        frozen = group.sentinels[0]
        frozen.pause()
        try:
            assert wait_until(
                lambda: not node.announcements.heard_all(), sentinel.SILENT_SECONDS + 3.0
            )
            assert taken(manager, unique("while deaf"))  # the others answer
        finally:
            frozen.resume()
        assert wait_until(node.announcements.heard_all, timeout=10.0)


@pytest.mark.parametrize(
    ("event", "text", "service"),
    [
        ("+switch-master", "locks 10.0.0.5 6379 10.0.0.6 6380", "locks"),
        ("+try-failover", "master locks 10.0.0.5 6379", "locks"),
        ("+selected-slave", "slave 10.0.0.6:6380 10.0.0.6 6380 @ locks 10.0.0.5 6379", "locks"),
        ("+failover-end", "master other 10.0.0.5 6379", "other"),
        ("+odown", "sentinel 10.0.0.7:26379 10.0.0.7 26379", ""),
    ],
)
def test_an_announcement_names_its_service(event: str, text: str, service: str) -> None:
    assert sentinel.announced_service(event, text) == service


@pytest.mark.parametrize(
    ("ttl", "heard"), [(1.0, True), (3.0, True), (1.0, False)], ids=["1s", "3s", "1s-deaf"]
)
def test_a_failover_under_a_kept_lock_never_makes_a_second_holder(
    ttl: float, heard: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The old master keeps accepting writes for seconds after the sentinels promoted its
    # replica: an extension counted there is not on the new master, where the lock expires and
    # contenders take it while the holder goes on. Heard as it starts (the sentinels' events),
    # a failover stops the holder's extensions from counting until the sentinels name the new
    # master, where a lock that lasted that long is extended as it was; a shorter one is lost
    # before anybody else can take it. A process that cannot hear the sentinels (not
    # ``heard``) asks them before every grant and extension.
    if not heard:
        monkeypatch.setattr(sentinel.Announcements, "listen", lambda self: None)
    with (
        SentinelGroup(replicas=1) as group,
        HoldThroughFailover([group.url], ttl) as hold,
    ):
        hold.watch(ttl / 2)
        new = group.failover()
        hold.watch(ttl + 1.0)
        assert hold.overlaps == []
        if hold.lost_at is not None:
            # The sentinels name the new master about a second after the failover began: a 1 s
            # lock is usually lost by then, and the contenders take it once it is.
            assert ttl < 2.0 and hold.granted_at
        else:
            assert hold.granted_at == []
            assert value_on(new, hold.lock.key) == hold.lock.value


# -- redlock_wait_replicas -------------------------------------------------------------------------


def test_wait_replicas_a_failover_right_after_the_grant_keeps_the_lock() -> None:
    # Two replicas: once one is promoted, the other replicates it and can acknowledge again.
    with (
        SentinelGroup(replicas=2, down_after=1.0) as group,
        lock_managers([group.url], count=1, wait_replicas=1) as (holder,),
    ):
        resource = unique("acknowledged")
        lock = holder.acquire(resource, 20.0, owner="first caller")
        assert lock is not None  # counted: a replica acknowledged the grant
        old = group.master()
        new = group.kill_master()  # at once: no time for anything else to reach the replicas
        assert value_on(new, lock.key) == lock.value
        with lock_managers([group.url], count=1, wait_replicas=1) as (second,):
            outcome = second.attempt(resource, 10.0, rounds=1)
            assert isinstance(outcome, Held) and outcome.holder == "first caller"
        # The holder keeps it on the new master (once that has a replica again).
        assert wait_until(lambda: holder.extend(lock), timeout=20.0, interval=0.1)
        assert master_address(holder) == ("127.0.0.1", new.port) != ("127.0.0.1", old.port)
        assert holder.release(lock)


def test_wait_replicas_a_node_still_on_the_old_master_cannot_grant_a_second_holder() -> None:
    with (
        SentinelGroup(replicas=2) as group,
        lock_managers([group.url], count=1, wait_replicas=1) as (stale,),
    ):
        assert taken(stale, unique("before"))  # it uses the first master
        group.failover()  # the old master keeps answering as a master for some seconds
        with lock_managers([group.url], count=1, wait_replicas=1) as (newcomer,):
            resource = unique("contended")
            # The stale node's first grant goes to the old master, whose replicas follow the
            # new master now: no replica acknowledges it, so it does not count. Whichever way
            # each attempt goes, never both.
            outcomes = [manager.attempt(resource, 10.0, rounds=1) for manager in (stale, newcomer)]
        granted = [outcome for outcome in outcomes if isinstance(outcome, Acquired)]
        assert len(granted) <= 1, outcomes


def test_wait_replicas_refuses_a_grant_no_replica_acknowledged(group: SentinelGroup) -> None:
    master = group.master()
    (replica,) = group.replicas()
    with (
        lock_managers([group.url], count=1, wait_replicas=1) as (waiting,),
        lock_managers([group.url], count=1) as (eager,),
    ):
        assert taken(waiting, unique("before"))
        replica.pause()  # WAIT 1 cannot be satisfied while it is frozen
        try:
            refused = waiting.attempt(unique("refused"), 10.0, rounds=1)
            # The contrast, without waiting for replicas: the grant counts although no
            # replica has it — a failover now would hand that lock to a second caller.
            granted = eager.attempt(unique("eager"), 10.0, rounds=1)
            lag = replica_lag(master)
        finally:
            replica.resume()
        assert isinstance(refused, Unavailable)
        assert isinstance(granted, Acquired)
        assert lag > 0
        assert eager.release(granted.lock)
        assert wait_until(lambda: taken(waiting, unique("after")), timeout=5.0, interval=0.1)


def test_a_member_waiting_for_replicas_counts_once_when_its_replies_are_read_together(
    group: SentinelGroup, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A member that waits for replicas answers a grant twice, back to back: the script's reply,
    # then WAIT's. A reader that gets the CPU late reads both in one go; the member still counts
    # once. With both other members frozen, one member of three neither extends a lock (its
    # holder would go on while the lock expires on the majority) nor makes an attempt anything
    # but unavailable (a duplicate there is skipped by the policy: work lost).
    open_socket = Endpoint.open_socket
    monkeypatch.setattr(
        Endpoint, "open_socket", lambda self: LateReadingSocket(open_socket(self), late=0.02)
    )
    with (
        RedisNodes(2) as others,
        lock_managers([group.url, *others.urls], count=1, wait_replicas=1) as (manager,),
    ):
        lock = manager.acquire(unique("read together"), 20.0)
        assert lock is not None
        for other in others:
            other.pause()
        try:
            extended = manager.extend(lock)
            outcome = manager.attempt(unique("one member of three"), 10.0, rounds=1)
        finally:
            for other in others:
                other.resume()
        assert not extended
        assert isinstance(outcome, Unavailable), outcome


def test_a_grant_refused_for_want_of_replicas_leaves_nothing_behind(group: SentinelGroup) -> None:
    master = group.master()
    (replica,) = group.replicas()
    resource = unique("refused")
    with lock_managers([group.url], count=1, wait_replicas=1) as (waiting,):
        replica.pause()
        try:
            refused = waiting.attempt(resource, 10.0, rounds=1)
            assert isinstance(refused, Unavailable)
            assert "replicas acknowledged" in str(refused.error)
            # The master answered (0 replicas acknowledged): it is not backed off...
            assert waiting.holder_of(resource) is None
            # ...and the attempt took back what it set.
            assert wait_until(lambda: value_on(master, waiting.key_for(resource)) is None, 2.0)
        finally:
            replica.resume()


def test_wait_replicas_on_a_healthy_group_every_extension_and_grant_counts(
    group: SentinelGroup,
) -> None:
    # A master whose replica is up acknowledges every write within WAIT's time: no extension
    # may come back False and no grant unavailable (issue 39 saw about 1 extension in 250 fail).
    with lock_managers([group.url], count=1, wait_replicas=1) as (waiting,):
        lock = waiting.acquire(unique("extended"), 10.0)
        assert lock is not None
        refused = [number for number in range(1000) if not waiting.extend(lock, 10.0)]
        assert refused == [], f"{len(refused)} of 1,000 extensions returned False"
        outcomes = [waiting.attempt(unique("granted"), 10.0, rounds=1) for _ in range(200)]
        assert all(isinstance(outcome, Acquired) for outcome in outcomes), [
            outcome for outcome in outcomes if not isinstance(outcome, Acquired)
        ][:3]
        assert waiting.release(lock)


@pytest.mark.parametrize(
    ("change", "refusal"),
    [
        ({"is_sdown": True, "flags": "master,s_down"}, "up as a master"),
        ({"is_odown": True}, "up as a master"),
        ({"is_master": False, "flags": "slave"}, "up as a master"),
        ({"num-other-sentinels": -1}, "other sentinels"),
        ({"port": 0}, "no valid master address"),
        ({"ip": ""}, "no valid master address"),
    ],
)
def test_a_sentinel_naming_a_master_it_sees_down_is_not_believed(
    change: dict[str, object], refusal: str
) -> None:
    # The checks of redis-py's Sentinel.discover_master, on the reply as redis-py parses it.
    state = {
        "name": "locks",
        "ip": "10.0.0.5",
        "port": 6379,
        "flags": "master",
        "is_master": True,
        "is_sdown": False,
        "is_odown": False,
        "num-other-sentinels": 2,
    }
    assert sentinel.master_address(state) == ("10.0.0.5", 6379)
    with pytest.raises(RedlockError, match=refusal):
        sentinel.master_address({**state, **change})
    with pytest.raises(RedlockError, match="reply no sentinel gives"):
        sentinel.master_address(["locks", "10.0.0.5"])
