"""The Celery workload (``--mode celery``): real workers (one prefork, one threads pool) run the
singleton tasks of `celery_app` while a producer thread sends them, on a few keys, with every
duplicate policy; afterwards it waits until every task sent ran or was skipped (or gives up),
and stops the workers."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from celery_redlock.testing import CeleryWorker, RedisServer, wait_for_workers

from .celery_app import POLICIES, app
from .checker import Violation
from .history import HistoryFile, Record, read_history

DRAIN_SECONDS = 90.0
"""How long the run waits, after the last task was sent, for every task to end."""


class CeleryWorkload:
    """Workers and a producer for one run."""

    def __init__(
        self,
        root: Path,
        directory: Path,
        broker: RedisServer,
        urls: Sequence[str],
        keys: Sequence[str],
        seed: int,
        node_timeout: float,
        working_directory: Path,
    ) -> None:
        self.directory = directory
        self.keys = list(keys)
        self.rng = random.Random(seed)
        settings = {
            "broker_url": broker.url,
            "redlock_urls": list(urls),
            "redlock_node_timeout": node_timeout,
        }
        environment = {"ROBUSTNESS_HISTORY": str(directory)}
        self.workers = [
            CeleryWorker(
                "tests.robustness.celery_app:app",
                f"robustness-{pool}",
                pool=pool,
                concurrency=concurrency,
                settings=settings,
                environment=environment,
                python_path=[root],
                working_directory=working_directory,  # the library copy under test comes first
                log_path=directory / f"worker-{pool}.log",
            )
            for pool, concurrency in (("prefork", 2), ("threads", 4))
        ]
        app.conf.broker_url = broker.url
        self.producing = threading.Event()
        self.producer = threading.Thread(target=self._produce, name="producer", daemon=True)
        self.sent: list[str] = []

    @property
    def clients(self) -> Sequence[CeleryWorker]:
        return self.workers

    def start(self) -> None:
        for worker in self.workers:
            worker.start()
        wait_for_workers(app, self.workers, timeout=60)
        self.producing.set()
        self.producer.start()

    def _produce(self) -> None:
        history = HistoryFile(self.directory / "producer.jsonl")
        try:
            while self.producing.is_set():
                policy = self.rng.choice(sorted(POLICIES))
                key = self.rng.choice(self.keys)
                hold = round(self.rng.choice([0.0, self.rng.uniform(0, 0.3)]), 3)
                started = time.monotonic()
                result = POLICIES[policy].apply_async((key, hold))
                record: Record = {"op": "task", "event": "sent", "owner": "producer"}
                record.update(key=f"{policy}:{key}", task_id=result.id)
                record.update(start=started, end=time.monotonic())
                history.add(record)
                self.sent.append(result.id)
                time.sleep(self.rng.uniform(0.01, 0.1))
        finally:
            history.close()

    def finish(self) -> list[Violation]:
        """Stop sending, wait until every task sent ended (ran or skipped), stop the workers;
        a worker that died is a violation."""
        self.producing.clear()
        self.producer.join()
        deadline = time.monotonic() + DRAIN_SECONDS
        while time.monotonic() < deadline and self._unfinished():
            time.sleep(0.5)
        violations = [
            Violation("client-failed", "-", f"{worker.label} exited:\n{worker.log_tail()}")
            for worker in self.workers
            if not worker.is_running
        ]
        for worker in self.workers:
            worker.stop(timeout=30)
        return violations

    def _unfinished(self) -> int:
        ended = {
            record["task_id"]
            for record in read_history(self.directory)
            if record["op"] == "task" and record["event"] in ("ran", "skipped")
        }
        return len(set(self.sent) - ended)
