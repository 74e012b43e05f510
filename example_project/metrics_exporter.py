"""Lock outcomes as Prometheus metrics, from the Celery events of workers run with ``-E``.

Run beside the workers (one exporter per fleet, any pool: prefork children's outcomes arrive
as events like everything else)::

    python -m example_project.metrics_exporter --broker redis://localhost:6379/0 --port 9808

and scrape ``http://host:9808/metrics``. Counters, by task:

- ``redlock_outcomes_total{task, outcome}``: ``acquired``, ``released``, ``extended``, ``lost``,
  ``unavailable``;
- ``redlock_duplicates_total{task, policy}``: runs that did not run now, by why
  (``skip``, ``retry``, ``wait``, ``coalesce``, ``coalesced``, ``redelivered``, ``completed``...);
- ``redlock_wait_seconds{task}``: a histogram of the time a run spent acquiring its lock.

Inside one worker process the `celery_redlock.signals` give the same outcomes without events;
with prefork, count them in every pool process with ``prometheus_client``'s multiprocess mode
(``PROMETHEUS_MULTIPROC_DIR``) instead.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from celery import Celery
from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server

OUTCOMES = ("acquired", "released", "extended", "lost", "unavailable")


class LockMetrics:
    """Prometheus metrics fed by ``redlock-*`` events (`handlers` plugs into an event receiver)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.outcomes = Counter(
            "redlock_outcomes",
            "Lock outcomes of singleton task runs",
            ["task", "outcome"],
            registry=registry,
        )
        self.duplicates = Counter(
            "redlock_duplicates",
            "Runs that did not run now, by the reason (policy)",
            ["task", "policy"],
            registry=registry,
        )
        self.waits = Histogram(
            "redlock_wait_seconds",
            "Seconds a run spent acquiring its lock",
            ["task"],
            registry=registry,
        )

    def handlers(self) -> dict[str, Callable[[dict[str, Any]], None]]:
        """Event type -> handler, for ``app.events.Receiver(handlers=...)``."""
        handlers: dict[str, Callable[[dict[str, Any]], None]] = {
            f"redlock-{outcome}": self._outcome(outcome) for outcome in OUTCOMES
        }
        handlers["redlock-duplicate"] = self._duplicate
        return handlers

    def _outcome(self, outcome: str) -> Callable[[dict[str, Any]], None]:
        def count(event: dict[str, Any]) -> None:
            task = str(event.get("task"))
            self.outcomes.labels(task=task, outcome=outcome).inc()
            if outcome == "acquired" and isinstance(event.get("waited"), (int, float)):
                self.waits.labels(task=task).observe(event["waited"])

        return count

    def _duplicate(self, event: dict[str, Any]) -> None:
        self.duplicates.labels(task=str(event.get("task")), policy=str(event.get("policy"))).inc()


def consume(app: Celery, metrics: LockMetrics, should_stop: Callable[[], bool]) -> None:
    """Feed ``metrics`` from the app's event stream until ``should_stop()`` (checked each second
    without events)."""
    with app.connection_for_read() as connection:
        receiver = app.events.Receiver(connection, handlers=metrics.handlers())
        while not should_stop():
            try:
                for _ in receiver.itercapture(limit=None, timeout=1.0, wakeup=False):
                    if should_stop():
                        return
            except TimeoutError:
                continue


def main() -> None:
    """Serve the metrics of the workers on ``--broker`` over HTTP on ``--port``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--broker", required=True, help="the workers' broker URL")
    parser.add_argument("--port", type=int, default=9808, help="HTTP port for /metrics")
    arguments = parser.parse_args()
    registry = CollectorRegistry()
    metrics = LockMetrics(registry)
    start_http_server(arguments.port, registry=registry)
    app = Celery("metrics_exporter", broker=arguments.broker)
    consume(app, metrics, should_stop=lambda: False)


if __name__ == "__main__":
    main()
