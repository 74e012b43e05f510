"""The members of one `Redlock`'s quorum, and one round over all of them (`NodeGroup.run`).

A round's latency is that of the quorum-th fastest member, each bounded by ``node_timeout``
(`nodes.round`). A member that fails, is late, or answers with an error or a reply its script
cannot give is backed off: skipped without network traffic, and probed again from a background
thread (`nodes.endpoint`).
"""

from __future__ import annotations

import contextlib
import os
import time
import weakref
from collections.abc import Sequence

from ..scripts import Script
from .channel import Slot
from .forks import ProcessLock
from .members import LockNode
from .reactor import Connections, Waiting
from .round import (
    Judge,
    Members,
    Round,
    RoundResult,
    ScriptHeads,
    deliver,
    endpoint_of,
    patience,
    wait,
)
from .subscriber import Subscriber


class NodeGroup:
    """The members of one `Redlock`, with this process's connections to them, opened lazily.

    Every thread of a process uses the same connection to a server, and a server answers the
    commands of one connection in the order they were sent, so a thread's release never
    overtakes its own acquisition's late SET. Connections are opened in the process that uses
    them: after a fork, the child leaves the parent's sockets alone and opens its own.
    """

    def __init__(self, nodes: Sequence[LockNode], node_timeout: float) -> None:
        self.nodes = list(nodes)
        self.node_timeout = node_timeout
        self.quorum = len(self.nodes) // 2 + 1
        self._replacing = ProcessLock()
        self._connections = self._new_connections()
        # Not a method of the group: rounds keep it, and a round still waiting in a connection
        # must not keep the group alive (its finalizer closes the connections).
        self.script_head = ScriptHeads()

    def _new_connections(self) -> Connections:
        connections = Connections()
        # Closed when the group is dropped (its Redlock gone), not left to the garbage collector;
        # or by a forked child that replaces them: once, never again when the group is dropped
        # (the wake-up pipe's descriptor numbers may belong to other files by then).
        self._dispose = weakref.finalize(self, connections.dispose)
        return connections

    def connections(self) -> Connections:
        """This process's connections (new ones in a forked child, made by the first thread
        that asks while the others wait for them)."""
        connections = self._connections
        if connections.pid == os.getpid():
            return connections
        with self._replacing.held():
            connections = self._connections
            if connections.pid != os.getpid():
                # A forked child: the parent's sockets are closed here (the parent keeps its
                # own), without any lock another thread may have held at the fork.
                self._dispose()
                connections = self._connections = self._new_connections()
        return connections

    def close(self) -> None:
        """Close this process's connections to the servers and stop the members' background
        work; later rounds open and start them again."""
        for node in self.nodes:
            node.close()
        connections = self._connections
        if connections.pid == os.getpid():
            deliver(connections.reactor, connections.close())

    def run(
        self,
        script: Script,
        keys: Sequence[str],
        arguments: Sequence[str | int],
        judge: Judge,
        wait: bool = True,
        every: bool = False,
        grants: bool = False,
        owed_for: float = 0.0,
    ) -> RoundResult:
        """Run ``script`` on every member at once; collect replies until the outcome is known.

        ``judge`` says what each reply means. The outcome is known when a quorum succeeded, when
        one no longer can, or when ``node_timeout`` has passed; with ``every=True`` only when
        every member answered or timed out. With ``wait=False`` the commands are only sent: a
        later round's reader reads their replies and checks them then. ``grants``: the script
        grants a lock, which members with ``wait_replicas`` confirm only once replicas
        acknowledged it. ``owed_for``: the script is a clean-up of keys that may live this many
        seconds; a member that is backed off or gives no reply gets it once it answers again (a
        stalled server runs what it was sent before when it resumes).
        """
        members = Members(self.nodes, self.node_timeout, self.connections(), self.script_head)
        owed_until = time.monotonic() + owed_for if owed_for > 0 else 0.0
        round_ = Round(members, script, keys, arguments, judge, every, grants, owed_until, wait)
        if not wait:
            round_.start()
            return RoundResult([], 0, 0, time.monotonic(), [])
        try:
            round_.start()
            round_.collect()
        except BaseException:
            # Interrupted (a soft time limit, a signal) between sending and deciding: callers
            # release what the round may have taken; the connections keep their order.
            round_.finish()
            raise
        return round_.finish()

    def confirm(self, extension: bool = False) -> None:
        """Before a round that grants a lock (``extension``: extends one): every member makes
        sure that what it knows of its master is current (`LockNode.confirm`)."""
        for node in self.nodes:
            node.confirm(extension)

    def forgive(self, key: str, value: str) -> None:
        """Drop the clean-ups owed for ``value`` at ``key``, as a round is about to set it
        (`Endpoint.forgive`)."""
        encoded = value.encode()
        for node in self.nodes:
            endpoint = endpoint_of(node, key)
            if endpoint is not None:
                endpoint.forgive(encoded)

    def listen_for_releases(self, channel: str) -> contextlib.closing[ReleaseListener]:
        """Subscriptions to ``channel`` (a lock key) on every member that is not backed off, for
        a ``with`` block."""
        return contextlib.closing(ReleaseListener(self, self.connections(), channel))


class ReleaseListener(Waiting):
    """Subscriptions to a lock's release channel on every reachable member, for blocking
    waits."""

    def __init__(self, group: NodeGroup, connections: Connections, channel: str) -> None:
        super().__init__()
        self.connections = connections
        self.channel = channel
        self.notified = False
        self.subscribers: list[Subscriber] = []
        now = time.monotonic()
        lateness: list[float] = []
        for node in group.nodes:
            endpoint = node.endpoint_for(channel)
            if endpoint is None or endpoint.is_backed_off(now):
                continue
            subscriber = connections.subscriber(endpoint)
            if subscriber.listen(channel, self):
                self.subscribers.append(subscriber)
                lateness.append(endpoint.lateness)
        # Subscribed only once the servers confirm: a release before that would go unheard.
        waited = patience(group.node_timeout, lateness, len(lateness))
        deadline = time.monotonic() + waited
        while not all(subscriber.confirmed(channel) for subscriber in self.subscribers):
            self.satisfied = False
            wait(connections.reactor, self, deadline)
            if not self.satisfied and time.monotonic() >= deadline:
                break

    def deliver(self, slot: Slot) -> None:
        if slot.tag == "message":
            self.notified = True
        self.satisfy()

    def close(self) -> None:
        """Drop the subscriptions."""
        for subscriber in self.subscribers:
            subscriber.stop(self.channel, self)
        self.subscribers.clear()

    def wait(self, seconds: float) -> bool:
        """Sleep up to ``seconds``; True as soon as any member announced a release — including
        one announced since the previous wait (an attempt in between must not miss it)."""
        if not self.subscribers:
            time.sleep(max(seconds, 0))
            return False
        reactor = self.connections.reactor
        deadline = time.monotonic() + max(seconds, 0)
        while True:
            with reactor.lock:
                if self.notified:
                    self.notified = False
                    return True
                self.satisfied = False
            if time.monotonic() >= deadline:
                return False
            wait(reactor, self, deadline)
