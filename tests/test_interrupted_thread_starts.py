"""A thread start that a signal handler interrupts: the caller gets the handler's exception as
itself, and the thread the library needs runs from the next call on, whether the interrupted one
ran or not.

CPython's ``Thread.start`` registers the new thread, starts it, and undoes the registration if an
exception interrupts it. A handler's exception (Celery's soft time limit) landing right after
the thread started does that undoing either before the new thread registered itself, which then
dies without running its target, or after, when CPython raises a ``KeyError`` of its own. Both
are staged here, deterministically, on the starts a caller makes: the reactor's, the lock
keeper's, a locator's and a Sentinel node's listeners (marked ``topology``).
"""

from __future__ import annotations

import dis
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

import pytest
from redlock_support import wait_until
from topologies import SentinelGroup
from topology_support import lock_managers, unique

from celery_redlock import Redlock
from celery_redlock.lock.keeper import KeptLock, LockKeeper
from celery_redlock.lock.nodes import sentinel
from celery_redlock.lock.nodes.locating import RELOCATE_INTERVAL_SECONDS, Locator
from celery_redlock.testing import RedisNodes

pytestmark = pytest.mark.skipif(
    sys.version_info >= (3, 13), reason="stages CPython 3.10-3.12's Thread.start"
)

START = threading.Thread.start.__code__


class Injected(Exception):
    """Raised inside ``Thread.start`` the way a signal handler's exception is."""


def after_the_new_thread_starts() -> int:
    """The offset of the instruction right after ``Thread.start`` called ``_start_new_thread``:
    where CPython runs pending signal handlers, inside the ``try`` that undoes the start."""
    instructions = list(dis.get_instructions(START))
    for index, instruction in enumerate(instructions):
        if instruction.argval == "_start_new_thread":
            for following, candidate in enumerate(instructions[index:], index):
                if candidate.opname in ("CALL", "CALL_FUNCTION"):
                    return instructions[following + 1].offset
    raise AssertionError("Thread.start no longer calls _start_new_thread")


@contextmanager
def start_interrupted(name: str, thread_dies: bool) -> Iterator[list[str]]:
    """Interrupt the next start of a thread named ``name`` (or starting so) in this thread, right
    after the new thread began, by raising `Injected`. With ``thread_dies`` the start undoes its
    registration before the new thread makes it (the thread then dies without running its
    target); else after (the case CPython reports as a ``KeyError``). Yields the names of the
    threads it interrupted, and of those that died, as ``"died: <name>"``."""
    interrupted: list[str] = []
    died: list[str] = []
    landing = after_the_new_thread_starts()
    limbo_lock: Any = threading._active_limbo_lock  # type: ignore[attr-defined]
    limbo: dict[threading.Thread, threading.Thread] = threading._limbo  # type: ignore[attr-defined]
    holding = False

    def local(frame: FrameType, event: str, argument: Any) -> Callable[..., Any] | None:
        nonlocal holding
        thread = frame.f_locals.get("self")
        if event == "opcode" and thread_dies and not holding and frame.f_lasti < landing:
            # Before the thread exists: it cannot register itself until the start undid it.
            limbo_lock.acquire()
            holding = True
        if event == "opcode" and frame.f_lasti == landing:
            interrupted.append(thread.name)
            if not thread_dies:
                assert wait_until(lambda: thread not in limbo, timeout=5.0)
            raise Injected(f"interrupted the start of {thread.name}")  # unsets the tracing
        return local

    def tracer(frame: FrameType, event: str, argument: Any) -> Callable[..., Any] | None:
        thread = frame.f_locals.get("self")
        if frame.f_code is START and not interrupted and thread.name.startswith(name):
            frame.f_trace_opcodes = True
            return local
        return None

    def record_death(unraisable: Any) -> None:
        died.append(f"died: {unraisable.exc_type.__name__}")

    hook = sys.unraisablehook
    sys.unraisablehook = record_death
    sys.settrace(tracer)
    try:
        yield interrupted
    finally:
        sys.settrace(None)
        if holding:  # the start has undone the registration: the new thread may go on
            limbo_lock.release()
        if thread_dies:
            assert wait_until(lambda: died, timeout=5.0), "the interrupted thread did not die"
        sys.unraisablehook = hook
        interrupted.extend(died)


@pytest.mark.parametrize("thread_dies", [False, True], ids=["thread-runs", "thread-dies"])
def test_a_first_call_interrupted_starting_the_reactor_raises_the_interruption_then_locks(
    three_nodes: RedisNodes, thread_dies: bool
) -> None:
    redlock = Redlock(three_nodes.urls, node_timeout=0.2)
    with (
        start_interrupted("celery-redlock reactor", thread_dies) as interrupted,
        pytest.raises(Injected),
    ):
        redlock.acquire("interrupted-reactor", ttl=5.0)
    assert interrupted[0] == "celery-redlock reactor"
    lock = redlock.acquire("interrupted-reactor", ttl=5.0)
    assert lock is not None, "no lock after the interrupted start"
    assert redlock.release(lock)
    assert interrupted[1:] == (["died: KeyError"] if thread_dies else [])


@pytest.mark.parametrize("thread_dies", [False, True], ids=["thread-runs", "thread-dies"])
def test_a_keep_interrupted_starting_the_keeper_raises_the_interruption_then_extends(
    one_node: RedisNodes, thread_dies: bool
) -> None:
    redlock = Redlock(one_node.urls, node_timeout=0.1)
    keeper = LockKeeper(redlock)
    lost: list[str] = []

    def on_lost(kept: KeptLock) -> None:
        lost.append(kept.lock.key)

    first = redlock.acquire("interrupted-keeper", ttl=0.6)
    assert first is not None
    with (
        start_interrupted("celery-redlock-keeper", thread_dies) as interrupted,
        pytest.raises(Injected),
    ):
        keeper.keep(first, on_lost)
    assert interrupted[0] == "celery-redlock-keeper"
    # The interrupted caller releases its lock; the next run's lock must be extended.
    assert redlock.release(first)
    later = redlock.acquire("kept-after-the-interruption", ttl=0.6)
    assert later is not None
    kept = keeper.keep(later, on_lost)
    with one_node[0].client() as client:
        time.sleep(1.2)  # two ttls: a lock nobody extends is gone by now
        assert client.pttl(later.key) > 0, "the keeper did not extend the next lock"
    keeper.stop(kept)
    assert redlock.release(later)
    assert lost == []
    assert interrupted[1:] == (["died: KeyError"] if thread_dies else [])


@pytest.mark.parametrize("thread_dies", [False, True], ids=["thread-runs", "thread-dies"])
def test_a_relocation_interrupted_starting_its_look_leaves_the_next_call_to_look(
    thread_dies: bool,
) -> None:
    looks: list[float] = []
    locator = Locator("interrupted", lambda: looks.append(time.monotonic()), patience=2.0)
    with (
        start_interrupted("celery-redlock locate", thread_dies) as interrupted,
        pytest.raises(Injected),
    ):
        locator.relocate()
    assert interrupted[0] == "celery-redlock locate interrupted"
    # As after a look that failed: the next one may start once the interval has passed.
    assert wait_until(locator.ensure, timeout=RELOCATE_INTERVAL_SECONDS + 2.0), "no look ran"
    assert looks
    assert interrupted[1:] == (["died: KeyError"] if thread_dies else [])


@pytest.fixture(scope="module")
def sentinel_group() -> Iterator[SentinelGroup]:
    with SentinelGroup(replicas=1, service_name="interrupted") as started:
        yield started


@pytest.mark.topology
@pytest.mark.parametrize("thread_dies", [False, True], ids=["thread-runs", "thread-dies"])
def test_a_call_interrupted_starting_to_listen_to_the_sentinels_leaves_the_next_to_listen(
    sentinel_group: SentinelGroup, thread_dies: bool
) -> None:
    with lock_managers([sentinel_group.url], count=1) as (manager,):
        (node,) = manager.nodes
        assert isinstance(node, sentinel.SentinelNode)
        with (
            start_interrupted("celery-redlock announcements", thread_dies) as interrupted,
            pytest.raises(Injected),
        ):
            manager.acquire(unique("interrupted-listening"), ttl=5.0)
        assert interrupted[0].startswith("celery-redlock announcements")
        resource = unique("listening")
        lock = manager.acquire(resource, ttl=5.0)
        assert lock is not None
        assert manager.release(lock)
        # Every sentinel is listened to, as if nothing had interrupted the first call.
        assert wait_until(node.announcements.heard_all, timeout=5.0)
    assert interrupted[1:] == (["died: KeyError"] if thread_dies else [])
