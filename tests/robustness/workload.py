"""One client process of the lock workload: ``python -m tests.robustness.workload CONFIG INDEX``.

Its threads (the main thread among them) share one `Redlock`, as a worker's do, and loop until
the run's end: draw a key and a ttl, attempt the lock; when it is taken, hold it a random while
(perhaps extending it), make a fenced write to each configured store, release it. Every call is
recorded (`history`). With ``interrupt`` set, exceptions are raised in the main thread while it
is inside the library, as Celery's soft time limit raises them: from a signal handler at random
moments (``signal``) and from a trace function at random lines (``trace``).
"""

from __future__ import annotations

import faulthandler
import json
import os
import random
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

import redis
import sqlalchemy

import celery_redlock
from celery_redlock import Lock, Redlock, RedlockSettings, StaleFence
from celery_redlock.fencing.redis import fenced_set
from celery_redlock.fencing.sql import fenced_upsert
from celery_redlock.lock.outcomes import Acquired, Covered, Held, Unavailable
from celery_redlock.lock.redlock import from_settings

from .history import HistoryFile, Record, token_hash
from .interruptions import InstructionTracer, signal_can_land

PACKAGE_DIRECTORY = str(Path(celery_redlock.__file__).parent)
FRESH_LINE_CHANCE = 0.05
"""The exception nemesis's chance to raise at a line of the library where it never raised."""

STUCK_AFTER = 20.0
"""Seconds past the run's end after which a client counts as stuck: it prints every thread's
stack and exits with status 1."""


class InjectedFault(Exception):
    """Raised inside the library by the exception nemesis."""


@dataclass
class Config:
    """What the runner tells every client (`runner.write_config`)."""

    urls: list[str]
    keys: list[str]
    threads: int
    until: float  # time.monotonic() of the run's end
    seed: int
    history: str
    ttl_range: tuple[float, float]
    node_timeout: float
    wait_replicas: int
    fence_redis: str
    fence_table: str  # a PostgreSQL table of (key, value, fence), or ""
    postgresql: str
    interrupt: list[str]  # "signal", "trace"
    fault_scope: str  # trace faults only in package files under this path[:function]
    interrupt_every: float  # lines (trace) or microseconds (signal) between faults, on average
    long_holds: float  # the share of holds kept for 2-5 ttls, extended as a task's lock is

    @classmethod
    def read(cls, path: str) -> Config:
        data = json.loads(Path(path).read_text())
        data["ttl_range"] = tuple(data["ttl_range"])
        return cls(**data)


class Faults:
    """The exception nemesis of this process: armed only while the main thread is inside a
    library call, so that the workload's own bookkeeping is never interrupted."""

    def __init__(self, config: Config, rng: random.Random, index: int) -> None:
        # Both kinds asked for: half the processes each. In one thread, a signal handler would
        # run inside the trace function too, and raise at any line event, even where no real
        # program's handler can (past a block's clean-up).
        kinds = config.interrupt
        self.kinds = [kinds[index % len(kinds)]] if len(kinds) > 1 else kinds
        path, _, self.function = config.fault_scope.partition(":")
        self.scope = os.path.join(PACKAGE_DIRECTORY, path)
        self.every = config.interrupt_every
        self.rng = rng
        self.armed = False
        self.faulted: set[tuple[CodeType, int]] = set()

    def start(self) -> None:
        if "signal" in self.kinds:
            signal.signal(signal.SIGALRM, self._on_alarm)
            self._next_alarm()
        if "trace" in self.kinds:
            sys.settrace(self._trace)

    def stop(self) -> None:
        self.armed = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        sys.settrace(None)

    def rearm(self) -> None:
        """After an injected fault: a trace function that raised is unset by Python."""
        if "trace" in self.kinds:
            sys.settrace(self._trace)

    def _next_alarm(self) -> None:
        signal.setitimer(signal.ITIMER_REAL, self.rng.expovariate(1e6 / self.every))

    def _on_alarm(self, signum: int, frame: FrameType | None) -> None:
        self._next_alarm()
        if self.armed:
            raise InjectedFault("signal")

    def _trace(self, frame: FrameType, event: str, argument: Any) -> Any:
        code = frame.f_code
        if not code.co_filename.startswith(self.scope):
            return None
        if self.function and code.co_name != self.function:
            return None
        if isinstance(frame.f_trace, InstructionTracer):
            return frame.f_trace  # a generator resumed
        frame.f_trace_opcodes = True  # faults may land before any instruction, not only a line
        return InstructionTracer(self.at_line)

    def at_line(self, frame: FrameType, previous: int | None) -> None:
        """Raise here, at a line event, if it is this line's turn (every line gets its turn
        soon, rarely run ones too: a reconnect's; then faults come at random lines; in one
        function, each line in turn), unless the exception would skip the clean-up of a block
        as no signal handler's can (`signal_can_land`)."""
        if not self.armed or not signal_can_land(frame.f_code, previous, frame.f_lasti):
            return
        location = (frame.f_code, frame.f_lineno)
        chance = 1.0 if self.function else FRESH_LINE_CHANCE
        fresh = location not in self.faulted and self.rng.random() < chance
        if fresh or self.rng.random() * self.every < 1:
            self.faulted.add(location)
            raise InjectedFault(f"line {frame.f_code.co_name}:{frame.f_lineno}")


class Client:
    """One thread's loop; ``faults`` only for the main thread's."""

    def __init__(
        self,
        config: Config,
        redlock: Redlock,
        stores: Stores,
        owner: str,
        faults: Faults | None,
        seed: int,
    ) -> None:
        self.config = config
        self.redlock = redlock
        self.stores = stores
        self.owner = owner
        self.faults = faults
        self.rng = random.Random(seed)
        self.history = HistoryFile(Path(config.history) / f"{owner.replace(':', '-')}.jsonl")

    def run(self) -> None:
        try:
            while time.monotonic() < self.config.until:
                key = self.rng.choice(self.config.keys)
                ttl = round(self.rng.uniform(*self.config.ttl_range), 3)
                lock = self.acquire(key, ttl)
                if lock is not None:
                    self.hold(lock)
                else:
                    time.sleep(self.rng.uniform(0, 0.05))
        finally:
            self.history.close()

    def warm_up(self) -> None:
        """One attempt on each key (released when taken)."""
        for key in self.config.keys:
            lock = self.acquire(key, self.config.ttl_range[1])
            if lock is not None:
                self.release(lock, token_hash(lock.token))

    def call(self, record: Record, function: Any, *arguments: Any) -> Any:
        """Run one library call, recording its start and end; an injected fault or an error is
        recorded in ``record`` and returns None."""
        faults = self.faults
        record["start"] = time.monotonic()
        try:
            if faults is not None:
                faults.armed = True
            result = function(*arguments)
            if faults is not None:
                faults.armed = False
        except InjectedFault:
            if faults is not None:
                faults.armed = False
                faults.rearm()
            record["interrupted"] = True
            result = None
        except Exception as error:  # a bug: the checker reports it
            if faults is not None:
                faults.armed = False
            record["error"] = f"{type(error).__name__}: {error}"
            result = None
        record["end"] = time.monotonic()
        return result

    def acquire(self, key: str, ttl: float) -> Lock | None:
        record: Record = {"op": "acquire", "owner": self.owner, "key": key, "ttl": ttl}
        outcome = self.call(record, self.redlock.attempt, key, ttl, self.owner)
        lock = None
        if "interrupted" in record:
            record["outcome"] = "interrupted"
        elif "error" in record:
            record["outcome"] = "error"
        elif isinstance(outcome, Acquired):
            lock = outcome.lock
            record.update(
                outcome="acquired",
                token=token_hash(lock.token),
                fence=lock.fencing_token,
                valid_until=lock.valid_until,
            )
        elif isinstance(outcome, Held):
            record.update(outcome="held", holder=outcome.holder)
        elif isinstance(outcome, Unavailable):
            record["outcome"] = "unavailable"
        elif isinstance(outcome, Covered):
            record["outcome"] = "covered"
        else:
            record["outcome"] = "contended"
        self.history.add(record)
        return lock

    def hold(self, lock: Lock) -> None:
        token = token_hash(lock.token)
        draw = self.rng.random()
        if draw < self.config.long_holds:
            self.hold_long(lock, token, self.rng.uniform(2 * lock.ttl, 5 * lock.ttl))
        else:
            # Mostly short holds, some longer, a few for most of the validity; some extended.
            longest = 0.05 if draw < 0.7 else 0.3 if draw < 0.95 else 0.8 * lock.validity
            pause = self.rng.uniform(0, min(longest, 0.8 * lock.validity))
            if self.rng.random() < 0.3:
                time.sleep(pause / 2)
                self.extend(lock, token)
                time.sleep(pause / 2)
            else:
                time.sleep(pause)
        for store in self.stores.names:
            self.write(store, lock, token)
        self.release(lock, token)

    def release(self, lock: Lock, token: str) -> None:
        record: Record = {"op": "release", "owner": self.owner, "key": lock.resource}
        record.update(token=token, ttl=lock.ttl)
        released = self.call(record, self.redlock.release, lock)
        record["ok"] = None if "interrupted" in record else bool(released)
        self.history.add(record)

    def hold_long(self, lock: Lock, token: str, seconds: float) -> None:
        """Hold for ``seconds``, extending every third of the ttl, as the keeper extends a
        running task's lock, until an extension fails."""
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            time.sleep(lock.ttl / 3)
            if not self.extend(lock, token):
                return

    def extend(self, lock: Lock, token: str) -> bool:
        record: Record = {"op": "extend", "owner": self.owner, "key": lock.resource}
        record.update(token=token, ttl=lock.ttl)
        extended = self.call(record, self.redlock.extend, lock)
        record["ok"] = None if "interrupted" in record else bool(extended)
        record["valid_until"] = lock.valid_until
        self.history.add(record)
        return bool(record["ok"])

    def write(self, store: str, lock: Lock, token: str) -> None:
        record: Record = {"op": "write", "owner": self.owner, "key": lock.resource}
        record.update(store=store, token=token, fence=lock.fencing_token, stored=None)
        record["start"] = time.monotonic()
        try:
            self.stores.write(store, lock, self.owner)
            record["accepted"] = True
        except StaleFence as refusal:
            record.update(accepted=False, stored=refusal.stored)
        except Exception as error:  # a store that failed: neither written nor refused
            record.update(accepted=None, error=f"{type(error).__name__}: {error}")
        record["end"] = time.monotonic()
        self.history.add(record)


class Stores:
    """The fenced stores of this process: a Redis of application data, a PostgreSQL table."""

    def __init__(self, config: Config) -> None:
        self.names: list[str] = []
        self.redis: redis.Redis | None = None
        self.engine: sqlalchemy.Engine | None = None
        self.table: sqlalchemy.Table | None = None
        if config.fence_redis:
            self.redis = redis.Redis.from_url(config.fence_redis, socket_timeout=5)
            self.names.append("redis")
        if config.fence_table:
            self.engine = sqlalchemy.create_engine(config.postgresql, pool_size=config.threads)
            self.table = fence_table(config.fence_table)
            self.names.append("postgresql")

    def write(self, store: str, lock: Lock, owner: str) -> None:
        if store == "redis":
            assert self.redis is not None
            fenced_set(self.redis, f"data:{lock.resource}", owner, lock)
        else:
            assert self.engine is not None and self.table is not None
            with self.engine.begin() as connection:
                values = {"key": lock.resource, "value": owner}
                fenced_upsert(connection, self.table, values, lock)


def fence_table(name: str) -> sqlalchemy.Table:
    """The PostgreSQL table the workload's fenced writes go to."""
    from celery_redlock.fencing.sql import fence_column

    return sqlalchemy.Table(
        name,
        sqlalchemy.MetaData(),
        sqlalchemy.Column("key", sqlalchemy.Text, primary_key=True),
        sqlalchemy.Column("value", sqlalchemy.Text, nullable=False),
        fence_column(),
    )


def main(config_path: str, index: int) -> None:
    config = Config.read(config_path)
    # A process stuck past the end (every thread waiting for a lock left held) shows where.
    faulthandler.dump_traceback_later(
        max(config.until - time.monotonic(), 0) + STUCK_AFTER, exit=True
    )
    redlock = from_settings(
        RedlockSettings(
            urls=tuple(config.urls),
            node_timeout=config.node_timeout,
            retry_count=1,
            wait_replicas=config.wait_replicas,
        )
    )
    stores = Stores(config)
    rng = random.Random(config.seed * 1000 + index)
    faults = Faults(config, rng, index) if config.interrupt else None
    clients = [
        Client(config, redlock, stores, f"p{index}:t{number}", None, rng.randrange(2**32))
        for number in range(1, config.threads)
    ]
    main_client = Client(config, redlock, stores, f"p{index}:t0", faults, rng.randrange(2**32))
    threads = [threading.Thread(target=client.run, daemon=True) for client in clients]
    if faults is not None:
        faults.start()
    # The main thread opens the connections, as a worker's does at start; then all contend.
    main_client.warm_up()
    for thread in threads:
        thread.start()
    try:
        main_client.run()
    finally:
        if faults is not None:
            faults.stop()
    for thread in threads:
        thread.join()
    redlock.close()
    faulthandler.cancel_dump_traceback_later()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
    sys.stdout.flush()
    os._exit(0)  # threads of the library's I/O, if any, do not hold the exit
