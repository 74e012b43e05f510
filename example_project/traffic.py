"""The flood of duplicates: who asks for what, when, and through which Celery call.

The plan is random but reproducible (``--seed``) and scales with the demo's length:

- report rebuilds: bursts of 3-4 users asking for the same ``(account, day)`` at the same
  moment (``delay``, ``apply_async`` and a ``group``), sometimes a straggler a moment later;
- catalog imports: double clicks, the second 0.2-0.6 s after the first;
- account syncs: 2-3 calls by task name (``send_task``) from "another service";
- search index refreshes: bursts of 5-8 product saves within a second, each save triggering a
  refresh of its storefront's index (``apply_async`` from the save hook, ``send_task`` from the
  bulk editor). Every trigger carries the burst it belongs to in a message header
  (`example_project.recording.BURST_HEADER`), so the summary can count runs per burst.

The beat job comes on top, from ``celery beat``.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from celery import group

from . import recording, tasks

REPORTS = [
    (17, "2024-06-01"),
    (17, "2024-06-02"),
    (42, "2024-06-01"),
    (99, "2024-06-01"),
    (7, "2024-06-03"),
]
USERS = ["alice", "bob", "carol", "dave", "erin", "frank"]
SOURCES = [
    "https://feeds.example.com/catalog-eu.csv",
    "https://feeds.example.com/catalog-us.csv",
    "https://feeds.example.com/catalog-apac.csv",
]
SYNC_ACCOUNTS = [17, 42, 99]
STOREFRONTS = ["shop-eu", "shop-us"]

SEARCH_BURST_SECONDS = 5.5
"""One burst of saves per storefront every this many seconds of flood: room for the refresh
the burst starts and the one follow-up run that all its other saves collapse into."""


@dataclass(order=True)
class Submission:
    """Calls to make ``at`` seconds after the flood starts; ``send`` publishes them."""

    at: float
    what: str = field(compare=False)
    send: Callable[[], Any] = field(compare=False, repr=False)
    count: int = field(compare=False, default=1)


def key_labels(beat: bool = True) -> list[str]:
    """Every key the demo uses, in display order."""
    label = recording.key_label
    labels = [label(tasks.rebuild_report.name, (a, d), {}) for a, d in REPORTS]
    labels += [label(tasks.import_catalog.name, (url,), {}) for url in SOURCES]
    labels += [label(tasks.sync_account.name, (account,), {}) for account in SYNC_ACCOUNTS]
    labels += [
        label(tasks.refresh_search_index.name, (storefront,), {}) for storefront in STOREFRONTS
    ]
    if beat:
        labels.append(label(tasks.refresh_exchange_rates.name, (), {}))
    return labels


def _spread(rng: random.Random, count: int, window: float) -> list[float]:
    """``count`` moments in ``[0, window]``, one in each equal slice, jittered."""
    width = window / count
    return [index * width + rng.uniform(0.0, width * 0.8) for index in range(count)]


def make_plan(window: float, seed: int) -> list[Submission]:
    """The submissions of a flood lasting about ``window`` seconds, sorted by time."""
    rng = random.Random(seed)
    plan: list[Submission] = []
    window = max(window, 1.0)

    for account, day in REPORTS:
        for at in _spread(rng, max(1, round(window / 8)), window):
            users = rng.sample(USERS, rng.choice((3, 4)))
            if rng.random() < 0.35:  # the same burst as one group
                calls = group([tasks.rebuild_report.s(account, day, requested_by=u) for u in users])
                plan.append(Submission(at, f"group x{len(users)}", calls.apply_async, len(users)))
            else:
                for index, user in enumerate(users):
                    if index % 2:
                        send = _bind(tasks.rebuild_report.delay, account, day, requested_by=user)
                    else:
                        send = _bind(
                            tasks.rebuild_report.apply_async,
                            kwargs={"account_id": account, "day": day, "requested_by": user},
                        )
                    plan.append(Submission(at, "burst", send))
            if rng.random() < 0.5:  # somebody presses "rebuild" again a moment later
                late = rng.choice(USERS)
                plan.append(
                    Submission(
                        at + rng.uniform(0.4, 1.2),
                        "straggler",
                        _bind(tasks.rebuild_report.delay, account, day, late),
                    )
                )

    for url in SOURCES:
        for at in _spread(rng, max(1, round(window / 11)), window):
            plan.append(Submission(at, "click", _bind(tasks.import_catalog.delay, url)))
            plan.append(
                Submission(
                    at + rng.uniform(0.2, 0.6),
                    "double click",
                    _bind(tasks.import_catalog.delay, url),
                )
            )

    for account in SYNC_ACCOUNTS:
        for at in _spread(rng, max(1, round(window / 10)), window):
            for _ in range(rng.choice((2, 3))):
                plan.append(
                    Submission(
                        at + rng.uniform(0.0, 0.3),
                        "send_task",
                        _bind(
                            tasks.app.send_task,
                            tasks.sync_account.name,
                            args=(account,),
                            kwargs={"full": rng.random() < 0.3},
                        ),
                    )
                )

    bursts = max(1, round(window / SEARCH_BURST_SECONDS))
    width = window / bursts
    for position, storefront in enumerate(STOREFRONTS):
        # Storefronts take turns (their bursts mostly do not coincide), with a little jitter
        # only: a burst that began while the previous one still ran would merge into it.
        offset = width * 0.45 * position / max(1, len(STOREFRONTS) - 1)
        for number in range(bursts):
            at = number * width + offset + rng.uniform(0.0, width * 0.15)
            plan += _save_burst(rng, storefront, f"{storefront} #{number + 1}", at)

    plan.sort()
    return plan


def _save_burst(rng: random.Random, storefront: str, burst: str, at: float) -> list[Submission]:
    """An editor saving 5-8 products within a second: one index refresh trigger per save."""
    saves = rng.randint(5, 8)
    span = rng.uniform(0.6, 1.0)  # well inside the refresh the first save starts (1.8-2.6 s)
    gaps = [rng.uniform(0.5, 1.5) for _ in range(saves - 1)]
    moments = [at]
    for gap in gaps:
        moments.append(moments[-1] + span * gap / sum(gaps))
    headers = {recording.BURST_HEADER: burst}
    burst_plan = []
    for moment in moments:
        if rng.random() < 0.25:  # the bulk editor, another service, calls it by name
            send = _bind(
                tasks.app.send_task,
                tasks.refresh_search_index.name,
                args=(storefront,),
                headers=headers,
            )
            what = "save (send_task)"
        else:
            send = _bind(tasks.refresh_search_index.apply_async, (storefront,), headers=headers)
            what = "save"
        burst_plan.append(Submission(moment, what, send))
    return burst_plan


def _bind(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Callable[[], Any]:
    return lambda: function(*args, **kwargs)
