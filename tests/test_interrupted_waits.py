"""A waiting attempt that a signal handler's exception interrupts while it subscribes to the
lock's release notifications leaves no subscription behind.

The subscriptions are made, and confirmed by the servers, before the attempt's ``with`` block
that drops them begins: Celery's soft time limit raising in between left them for the life of
the process (one channel per interruption on every server, subscribed again at every
reconnection). The subscribed connection holds its listeners weakly now.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Callable

from redlock_support import wait_until
from robustness.interruptions import after_call_of, raising_once

from celery_redlock import Redlock
from celery_redlock.lock.nodes.group import ReleaseListener
from celery_redlock.testing import RedisNodes

SUBSCRIBING = ReleaseListener.__init__.__code__


class Injected(Exception):
    """Raised where a signal handler's exception can land."""


def interrupt_subscribing(call: Callable[[], object]) -> bool:
    """Run ``call``, raising `Injected` in it right after its release listener was subscribed
    and the servers confirmed it; True if it was raised."""
    landing = after_call_of(SUBSCRIBING, "wait")
    with (
        raising_once(
            [SUBSCRIBING], lambda frame, _: frame.f_lasti == landing, Injected()
        ) as raised,
        contextlib.suppress(Injected),
    ):
        call()
    return bool(raised)


def subscribed_channels(nodes: RedisNodes) -> list[set[str]]:
    """The lock channels each server has subscribers for."""
    channels = []
    for server in nodes:
        with server.client(decode_responses=True) as client:
            channels.append(set(client.pubsub_channels("redlock:*")))
    return channels


def test_an_interrupted_subscription_goes_at_the_next_release_on_its_channel(
    three_nodes: RedisNodes,
) -> None:
    holder = Redlock(three_nodes.urls, node_timeout=0.5)
    waiter = Redlock(three_nodes.urls, node_timeout=0.5)
    lock = holder.acquire("interrupted-listener", ttl=10.0)
    assert lock is not None
    assert interrupt_subscribing(lambda: waiter.attempt("interrupted-listener", 10.0, wait=5.0))
    assert all(lock.key in channels for channels in subscribed_channels(three_nodes))
    gc.collect()  # the interrupted listener is gone with its exception's traceback
    assert holder.release(lock)  # its release notification finds nobody listening
    assert wait_until(
        lambda: not any(lock.key in channels for channels in subscribed_channels(three_nodes)),
        timeout=3.0,
    ), subscribed_channels(three_nodes)
    # The waiter's next wait hears releases as before.
    blocker = holder.acquire("interrupted-listener", ttl=10.0)
    assert blocker is not None
    release = threading.Timer(0.3, holder.release, (blocker,))
    release.start()
    assert waiter.acquire("interrupted-listener", ttl=10.0, blocking=True, timeout=5.0)
    release.join()


def test_an_interrupted_subscription_goes_when_a_new_channel_is_listened_to(
    three_nodes: RedisNodes,
) -> None:
    # A lock never released (it expires): its channel carries no message, so the leftover goes
    # when the next wait subscribes to a channel of its own.
    holder = Redlock(three_nodes.urls, node_timeout=0.5)
    waiter = Redlock(three_nodes.urls, node_timeout=0.5)
    expiring = holder.acquire("expiring", ttl=10.0)
    assert expiring is not None
    assert interrupt_subscribing(lambda: waiter.attempt("expiring", 10.0, wait=5.0))
    gc.collect()
    assert all(expiring.key in channels for channels in subscribed_channels(three_nodes))
    blocker = holder.acquire("next-wait", ttl=0.6)
    assert blocker is not None
    assert waiter.acquire("next-wait", ttl=10.0, blocking=True, timeout=5.0)
    assert wait_until(
        lambda: not any(expiring.key in channels for channels in subscribed_channels(three_nodes)),
        timeout=3.0,
    ), subscribed_channels(three_nodes)
