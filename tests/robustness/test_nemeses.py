"""The nemeses keep the promises the checker relies on (pure helpers: no servers)."""

from __future__ import annotations

import time

from tests.robustness.nemeses import Nemeses, Schedule, Targets


class FakeNode:
    """A lock node that notes when it was killed and started."""

    address = "127.0.0.1:1"
    port = 1
    is_paused = False

    def __init__(self) -> None:
        self.is_running = True
        self.killed_at = 0.0
        self.started_at = 0.0

    def kill(self) -> None:
        self.is_running, self.killed_at = False, time.monotonic()

    def start(self) -> None:
        self.is_running, self.started_at = True, time.monotonic()


def test_a_killed_node_restarts_empty_only_after_the_longest_ttl_even_when_the_run_stops() -> None:
    # The workload runs on for its healthy tail after the nemeses stop: a node restarted empty
    # at once would grant a second holder while the first still holds the lock elsewhere.
    node = FakeNode()
    targets = Targets(nodes=[node], clients=[], longest_ttl=0.3)  # type: ignore[list-item]
    # Seed 50: its first kill comes after about a second (the loop waits 1-5 s between kills).
    nemeses = Nemeses(["kill"], seed=50, targets=targets, schedule=Schedule(time.monotonic()))
    nemeses.start()
    deadline = time.monotonic() + 10
    while not node.killed_at and time.monotonic() < deadline:
        time.sleep(0.01)
    assert node.killed_at, "the kill nemesis never killed the node"
    nemeses.stop()
    assert node.is_running
    assert node.started_at - node.killed_at >= 0.3 + 0.2
