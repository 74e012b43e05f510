"""A run whose lock-keeping start or end a signal handler's exception interrupts leaves no lock
behind: nothing goes on extending a lock whose run is over, and the next run of the key runs.

Celery's soft time limit raises in the task's thread wherever CPython runs signal handlers. Here
a trace function raises `Injected` at each such instruction in turn (`signal_can_land`) of what
a run does to start keeping its lock and to end (`Run.hold_while_running`, the keeper's
scheduling, `Run.finish`), in a run called through Celery (``apply``: ``task_postrun`` finishes
what was left) and in a plain call (no signal follows it). Before, an interruption right after
the keeper queued the lock left the lock extended for as long as the process lived.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Sequence
from types import CodeType, FrameType

import pytest
from celery import Celery
from celery_apps.support import make_app
from redlock_support import wait_until
from robustness.interruptions import raising_once, signal_can_land

from celery_redlock import singleton_task
from celery_redlock.integration.run import Run
from celery_redlock.lock.keeper import LockKeeper
from celery_redlock.testing import RedisNodes, RedisServer

pytestmark = pytest.mark.skipif(
    sys.version_info < (3, 11), reason="the trace function reads CPython 3.11's exception table"
)

TTL = 0.5
NODE_TIMEOUT = 0.1
"""The lock's ttl and the node timeout: a lock left to the keeper is extended (set again) about
every 0.13 s."""
OBSERVED = 0.3
"""How long a released lock must stay gone: more than two of the keeper's extension intervals."""

STARTING = (
    Run.hold_while_running.__code__,
    LockKeeper.start.__code__,
    LockKeeper._schedule.__code__,
)
ENDING = (Run.finish.__code__,)


class Injected(Exception):
    """Raised where a signal handler's exception can land."""


def at_landing(landing: int) -> Callable[[FrameType, int | None], bool]:
    """True at the ``landing``-th instruction (from 0, in the order they run) where a signal
    handler's exception can land."""
    seen = -1

    def where(frame: FrameType, previous: int | None) -> bool:
        nonlocal seen
        if not signal_can_land(frame.f_code, previous, frame.f_lasti):
            return False
        seen += 1
        return seen == landing

    return where


pytest_plugins = ["celery_apps.fixtures"]


@pytest.fixture
def app(broker: RedisServer, three_nodes: RedisNodes) -> Celery:
    return make_app(broker, three_nodes, task_always_eager=True, redlock_node_timeout=NODE_TIMEOUT)


def held_on(nodes: RedisNodes, key: str) -> int:
    """On how many of ``nodes`` ``key`` exists now."""
    count = 0
    for server in nodes:
        with server.client() as client:
            count += bool(client.exists(key))
    return count


@pytest.mark.parametrize("call", ["apply", "plain"])
@pytest.mark.parametrize("codes", [STARTING, ENDING], ids=["starting", "ending"])
def test_a_run_interrupted_keeping_or_freeing_its_lock_leaves_no_lock_behind(
    app: Celery, three_nodes: RedisNodes, call: str, codes: Sequence[CodeType]
) -> None:
    ran: list[int] = []

    @singleton_task(app=app, shared=False, lock_ttl=TTL, lock_args=())
    def job(landing: int) -> None:
        ran.append(landing)

    key = job.lock_key_for(0)
    interrupted = []
    for landing in range(200):
        # A plain call's caller gets the interruption.
        with (
            raising_once(codes, at_landing(landing), Injected()) as raised,
            contextlib.suppress(Injected),
        ):
            job.apply(args=(landing,)) if call == "apply" else job(landing)
        if not raised:
            break  # every instruction where a handler's exception can land was tried
        interrupted.append(raised[0])
        # Released at once by the run's end, or within a third of the ttl by the keeper once
        # the run is gone: never extended on.
        assert wait_until(lambda: held_on(three_nodes, key) == 0, timeout=2.0), raised[0]
        assert not wait_until(lambda: held_on(three_nodes, key), timeout=OBSERVED), raised[0]
        # The next run of the key runs.
        job.apply(args=(-1,)) if call == "apply" else job(-1)
        assert ran[-1] == -1, f"the run after an interruption at {raised[0]} was skipped"
    assert len(interrupted) >= 3, interrupted
    print(f"\n{len(interrupted)} interruptions: {', '.join(interrupted)}")
