"""The faults a run injects while its workload runs, each a loop in a thread of the runner that
draws its moments and targets from its own seeded random generator and logs what it did.

- ``pause``: SIGSTOP a lock node for 5 ms to 1.5 s, then SIGCONT (a hung server, a VM stall).
- ``kill``: SIGKILL a lock node and restart it empty after the longest ttl (the delayed restart
  README asks of operators).
- ``cut``: every 10-60 ms (``cut_every`` seconds on average when given), ``CLIENT KILL`` the
  clients' connections to one node (a connection cut, often mid-reply).
- ``busy``: two to four processes spinning on the CPUs for 1-4 s (a busy host).
- ``client-pause``: SIGSTOP a client process for 0.1-2.5 s (a GC pause: a holder that outlives its
  lock, which only fencing can catch).
- ``failover``: ``SENTINEL FAILOVER`` of the Sentinel group that is the lock node (``--topology
  sentinel``), every 2-5 s, while long holds are kept alive by extensions.
- ``exception``: not a thread here: the clients raise exceptions inside the library themselves
  (`workload.Faults`).
"""

from __future__ import annotations

import contextlib
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import redis

from celery_redlock.testing import RedisServer
from tests.topologies.sentinel import SentinelGroup

NEMESES = ("pause", "kill", "cut", "busy", "client-pause", "failover", "exception")


@dataclass
class Schedule:
    """What the nemeses did, in order: ``(seconds since the start, nemesis, target, detail)``."""

    started: float
    events: list[tuple[float, str, str, str]] = field(default_factory=list)

    def log(self, nemesis: str, target: str, detail: str = "") -> None:
        self.events.append((time.monotonic() - self.started, nemesis, target, detail))

    def counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for _, nemesis, _, detail in self.events:
            if not detail.startswith("end"):
                counts[nemesis] = counts.get(nemesis, 0) + 1
        return counts


class Pausable(Protocol):
    """A client process the ``client-pause`` nemesis stops and resumes."""

    @property
    def is_running(self) -> bool: ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...


@dataclass
class Targets:
    """What the nemeses act on."""

    nodes: Sequence[RedisServer]
    clients: Sequence[Pausable]
    longest_ttl: float
    sentinel: SentinelGroup | None = None
    cut_every: float = 0.0


class Nemeses:
    """The chosen nemeses, started together, stopped together (every node answering again)."""

    def __init__(self, names: Sequence[str], seed: int, targets: Targets, schedule: Schedule):
        self.names = [name for name in names if name != "exception"]
        self.seed = seed
        self.targets = targets
        self.schedule = schedule
        self.stopping = threading.Event()
        self.threads: list[threading.Thread] = []
        self.node_lock = threading.Lock()  # one fault per node at a time: pause and kill agree

    def start(self) -> None:
        loops: dict[str, Callable[[random.Random], None]] = {
            "pause": self._pause,
            "kill": self._kill,
            "cut": self._cut,
            "busy": self._busy,
            "client-pause": self._client_pause,
            "failover": self._failover,
        }
        for index, name in enumerate(self.names):
            rng = random.Random(self.seed * 7919 + index)
            thread = threading.Thread(target=loops[name], args=(rng,), name=name, daemon=True)
            self.threads.append(thread)
            thread.start()

    def stop(self) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join(timeout=30)
        for node in self.targets.nodes:
            if node.is_paused:
                node.resume()
            if not node.is_running:
                node.start()

    def _sleep(self, seconds: float) -> bool:
        """Wait ``seconds``; False once the run stops."""
        return not self.stopping.wait(seconds)

    def _pause(self, rng: random.Random) -> None:
        while self._sleep(rng.uniform(0.2, 2.0)):
            node = rng.choice(self.targets.nodes)
            with self.node_lock:
                if not node.is_running:
                    continue
                stall = rng.choice([rng.uniform(0.005, 0.1), rng.uniform(0.1, 1.5)])
                self.schedule.log("pause", node.address, f"{stall:.3f}s")
                node.pause()
                self._sleep(stall)
                node.resume()
                self.schedule.log("pause", node.address, "end")

    def _kill(self, rng: random.Random) -> None:
        while self._sleep(rng.uniform(1.0, 5.0)):
            node = rng.choice(self.targets.nodes)
            with self.node_lock:
                self.schedule.log("kill", node.address, "SIGKILL")
                node.kill()
            # Restarted empty only after the longest ttl, also when the run stops meanwhile (the
            # workload goes on for its healthy tail): what it held has expired by then.
            time.sleep(self.targets.longest_ttl + 0.2)
            with self.node_lock:
                node.start()
            self.schedule.log("kill", node.address, "end: restarted empty")

    def _cut(self, rng: random.Random) -> None:
        admins = {
            node.address: redis.Redis(
                host=node.address.rpartition(":")[0],
                port=node.port,
                socket_timeout=0.2,
                socket_connect_timeout=0.2,
            )
            for node in self.targets.nodes
        }
        try:
            every = self.targets.cut_every
            while self._sleep(rng.expovariate(1 / every) if every else rng.uniform(0.01, 0.06)):
                node = rng.choice(self.targets.nodes)
                with contextlib.suppress(redis.RedisError):
                    admins[node.address].client_kill_filter(_type="normal", skipme=True)
                    self.schedule.log("cut", node.address)
        finally:
            for admin in admins.values():
                admin.close()

    def _busy(self, rng: random.Random) -> None:
        while self._sleep(rng.uniform(1.0, 3.0)):
            count = rng.randint(2, 4)
            spinners = [
                subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)
            ]
            self.schedule.log("busy", f"{count} processes")
            try:
                self._sleep(rng.uniform(1.0, 4.0))
            finally:
                for spinner in spinners:
                    spinner.kill()
                    spinner.wait()
            self.schedule.log("busy", f"{count} processes", "end")

    def _client_pause(self, rng: random.Random) -> None:
        while self._sleep(rng.uniform(1.0, 4.0)):
            client = rng.choice(self.targets.clients)
            if not client.is_running:
                continue
            stall = rng.uniform(0.1, 2.5)
            self.schedule.log("client-pause", str(client), f"{stall:.3f}s")
            client.pause()
            try:
                time.sleep(stall)  # not cut short: a stopped client must resume
            finally:
                client.resume()
            self.schedule.log("client-pause", str(client), "end")

    def _failover(self, rng: random.Random) -> None:
        group = self.targets.sentinel
        if group is None:
            raise ValueError("the failover nemesis needs --topology sentinel")
        while self._sleep(rng.uniform(2.0, 5.0)):
            self.schedule.log("failover", group.service_name, "SENTINEL FAILOVER")
            try:
                new = group.failover(timeout=20)
            except RuntimeError as error:  # the sentinels were still busy with the last one
                self.schedule.log("failover", group.service_name, f"end: not done: {error}")
                continue
            self.schedule.log("failover", group.service_name, f"end: master {new.address}")
