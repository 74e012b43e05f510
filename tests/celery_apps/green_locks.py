"""Many greenlets sharing one process's lock-node connections, under gevent or eventlet.

Run as a script (by path, so that nothing is imported before the monkey patching)::

    python tests/celery_apps/green_locks.py gevent|eventlet '<JSON: {"urls": [...], ...}>'

It monkey-patches first (``gevent.monkey.patch_all()`` or ``eventlet.monkey_patch()``), then
imports celery_redlock and runs ``greenlets`` green threads (``threading.Thread`` is green once
patched): most take and release locks on keys of their own, the rest contend for one shared key
with ``blocking=True`` (woken by release notifications) and guard a counter with it.

Phases, with the same lock manager (and so the same connections); after each one it prints one
JSON line and, before the next, waits for a line on its standard input (the test freezes or
resumes a node meanwhile):

- ``beside-a-waiter``: one greenlet waits for a held lock (``blocking=True``), so it reads the
  connections, while another takes a free lock once the connections have been idle longer than
  the idle check: two greenlets look at one socket at once;
- ``burst``: first thing in the process, before any connection is made, every greenlet makes
  single-round attempts on keys of its own for ``burst_seconds``; the line counts the outcomes
  (with every node healthy, none may be "unavailable");
- ``load``: the greenlets above; the line says what failed, whether two holders of the shared
  key ever overlapped, and the counter. After the last phase, how many connections each node has
  (this process is their only client).
"""

from __future__ import annotations

import sys

if __name__ == "__main__":
    _MODE = sys.argv[1]
    if _MODE == "gevent":
        from gevent import monkey

        monkey.patch_all()
    elif _MODE == "eventlet":
        import eventlet

        eventlet.monkey_patch()
    else:
        raise SystemExit(f"unknown mode {_MODE!r}: gevent or eventlet")

import itertools
import json
import select
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import redis

from celery_redlock import Redlock
from celery_redlock.lock.outcomes import Acquired

SHARED_RESOURCE = "green-shared"


def is_patched(mode: str) -> bool:
    """True when sockets and threads really are green in this process."""
    if mode == "gevent":
        from gevent import monkey

        return bool(monkey.is_module_patched("socket") and monkey.is_module_patched("threading"))
    from eventlet import patcher

    return bool(patcher.is_monkey_patched("socket") and patcher.is_monkey_patched("thread"))


def connections_to(url: str) -> int:
    """How many clients the server at ``url`` has, this counting connection left out."""
    with redis.Redis.from_url(url, socket_timeout=5) as client:
        own = int(client.client_id())
        return sum(1 for entry in client.client_list() if int(entry["id"]) != own)


def run_at_once(body: Callable[[int, float], None], count: int) -> tuple[int, float]:
    """Run ``body(number, began)`` in ``count`` green threads released together at ``began``
    (``time.monotonic()``); wait for them (a minute at most each). Returns how many still run
    and the seconds they took."""
    start = threading.Event()
    began = [0.0]

    def released(number: int) -> None:
        start.wait()
        body(number, began[0])

    threads = [threading.Thread(target=released, args=(number,)) for number in range(count)]
    for thread in threads:
        thread.start()
    began[0] = time.monotonic()
    start.set()
    for thread in threads:
        thread.join(timeout=60)
    return sum(thread.is_alive() for thread in threads), time.monotonic() - began[0]


def run(mode: str, dlm: Redlock, phase: int, options: dict[str, Any]) -> dict[str, Any]:
    """Run the greenlets of phase ``phase``; their summary."""
    greenlets: int = options.get("greenlets", 200)
    contenders: int = options.get("contenders", 20)
    cycles: int = options.get("cycles", 3)
    errors: list[str] = []
    overlaps: list[str] = []
    inside: list[int] = []
    counter = [0]
    acquired = [0]
    waits: list[float] = []

    def distinct(number: int) -> None:
        for cycle in range(cycles):
            resource = f"green-{phase}-{number}-{cycle}"
            lock = dlm.acquire(resource, ttl=10.0)
            if lock is None:
                errors.append(f"greenlet {number}: {resource} was not acquired")
                continue
            acquired[0] += 1
            if not dlm.release(lock):
                errors.append(f"greenlet {number}: {resource} was not released")

    def contend(number: int) -> None:
        for _ in range(cycles):
            asked = time.monotonic()
            lock = dlm.acquire(SHARED_RESOURCE, ttl=10.0, blocking=True, timeout=30.0)
            waits.append(time.monotonic() - asked)
            if lock is None:
                errors.append(f"contender {number} timed out waiting")
                return
            if inside:
                overlaps.append(f"contender {number} entered while {inside} held the lock")
            inside.append(number)
            seen = counter[0]
            time.sleep(0.001)  # a green sleep: the others run meanwhile
            counter[0] = seen + 1
            inside.remove(number)
            if not dlm.release(lock):
                errors.append(f"contender {number} could not release its lock")

    def body(number: int, began: float) -> None:
        try:
            (contend if number < contenders else distinct)(number)
        except BaseException as error:
            errors.append(f"greenlet {number}: {error!r}")

    hung, elapsed = run_at_once(body, greenlets)
    return {
        "mode": mode,
        "phase": phase,
        "patched": is_patched(mode),
        "has_poll": hasattr(select, "poll"),
        "hung": hung,
        "errors": errors[:20],
        "error_count": len(errors),
        "overlaps": overlaps[:20],
        "counter": counter[0],
        "expected_counter": contenders * cycles,
        "acquired": acquired[0],
        "expected_acquired": (greenlets - contenders) * cycles,
        "seconds": round(elapsed, 3),
        "slowest_wait": round(max(waits, default=0.0), 3),
    }


def burst(mode: str, dlm: Redlock, seconds: float, greenlets: int) -> dict[str, Any]:
    """Every greenlet makes single-round attempts on keys of its own for ``seconds``; how many
    of each outcome there were (a few of each kind of failure, with when it came)."""
    outcomes: Counter[str] = Counter()
    failures: list[str] = []

    def body(number: int, began: float) -> None:
        for cycle in itertools.count():
            if time.monotonic() - began >= seconds:
                return
            outcome = dlm.attempt(f"green-burst-{number}-{cycle}", 10.0, rounds=1)
            outcomes[type(outcome).__name__] += 1
            if isinstance(outcome, Acquired):
                dlm.release(outcome.lock)
            elif len(failures) < 5:
                failures.append(f"{time.monotonic() - began:.3f}s: {outcome!r}")

    hung, _ = run_at_once(body, greenlets)
    return {
        "mode": "burst",
        "patched": is_patched(mode),
        "hung": hung,
        "outcomes": dict(outcomes),
        "failures": failures,
    }


def beside_a_waiter(dlm: Redlock) -> dict[str, Any]:
    """A greenlet takes a free lock while another waits for a held one; what each got."""
    held = dlm.acquire("green-held", ttl=10.0)
    outcomes: dict[str, Any] = {"held": held is not None}

    def wait() -> None:
        try:
            outcomes["waiter"] = dlm.acquire("green-held", ttl=10.0, blocking=True, timeout=1.5)
        except BaseException as error:
            outcomes["waiter"] = repr(error)

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.5)  # the connections are idle longer than the idle check (0.25 s)
    try:
        lock = dlm.acquire("green-free", ttl=10.0)
        outcomes["free"] = lock is not None and dlm.release(lock)
    except BaseException as error:
        outcomes["free"] = repr(error)
    waiter.join(timeout=10)
    outcomes["waiter"] = outcomes.get("waiter") is None  # held all along: no lock, no error
    if held is not None:
        dlm.release(held)
    return {"mode": "beside-a-waiter", "patched": True, **outcomes}


def main(mode: str, options: dict[str, Any]) -> None:
    """Run every phase, printing each one's summary; the last one counts the connections."""
    urls: list[str] = options["urls"]
    dlm = Redlock(urls, retry_count=5, retry_delay=0.01, node_timeout=options["node_timeout"])
    phases: list[str] = options["phases"]
    for number, phase in enumerate(phases):
        if number:
            sys.stdin.readline()
        if phase == "burst":
            summary = burst(mode, dlm, options["burst_seconds"], options.get("greenlets", 200))
        elif phase == "beside-a-waiter":
            summary = beside_a_waiter(dlm)
            summary["patched"] = is_patched(mode)
        else:
            summary = run(mode, dlm, number, options)
        if number == len(phases) - 1:
            summary["connections"] = [connections_to(url) for url in urls]
        print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main(_MODE, json.loads(sys.argv[2]))
