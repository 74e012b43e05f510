"""The timeline picture: one row per lock key, one bar per run, coloured by worker.

Markers show where the duplicates went: a skipped duplicate is a black cross drawn on the run
that held the lock at that moment (that run did the work the duplicate asked for); a retried
duplicate is a hollow circle (the message came back later); a waited duplicate is a dotted line
from the moment it found the lock taken to the moment the release woke it, where its own bar
starts. On a coalescing key the first duplicate during a run becomes the pending run: a purple
diamond and a dotted line to where the release woke it and its bar (edged in purple) starts;
every later duplicate is a purple triangle above the bars with an arrow to the pending run it
merged into.
matplotlib is optional: `draw` raises ImportError without it.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from .tally import Tally

SKIP_POLICIES = ("skip", "redelivered")
COALESCE_COLOUR = "#7d3c98"


def draw(tally: Tally, path: Path, *, t0: float, title: str, subtitle: str = "") -> Path:
    """Write the picture of ``tally`` (times relative to ``t0``) to ``path``; return it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    keys = [key for key in tally.keys if key != "?"]
    rows = {key: index for index, key in enumerate(keys)}
    workers = tally.workers()
    palette = plt.get_cmap("tab10")
    colours = {worker: palette(index % 10) for index, worker in enumerate(workers)}
    counts = tally.counts()

    height = 0.5 * max(len(keys), 1) + 2.6
    figure, axes = plt.subplots(figsize=(15, height), dpi=100)
    figure.subplots_adjust(left=0.17, right=0.845, top=1 - 1.05 / height, bottom=1.15 / height)

    for index in range(len(keys)):
        if index % 2:
            axes.axhspan(index - 0.5, index + 0.5, color="#f3f3f3", zorder=0)

    follow_ups = {wait.id for wait in tally.waits if wait.policy == "coalesce"}
    for run in tally.runs:
        if run.key not in rows:
            continue
        follow_up = run.id in follow_ups
        axes.broken_barh(
            [(run.start - t0, max(run.end - run.start, 0.02))],
            (rows[run.key] - 0.3, 0.6),
            facecolors=colours.get(run.worker, "grey"),
            edgecolors=COALESCE_COLOUR if follow_up else "black",
            linewidth=1.8 if follow_up else 0.6,
            zorder=2.5 if follow_up else 2,
        )

    for wait in tally.waits:
        if wait.key in rows:
            y = rows[wait.key] + 0.38
            axes.plot(
                [wait.start - t0, wait.end - t0],
                [y, y],
                linestyle=":",
                linewidth=1.6,
                color=colours.get(wait.worker, "grey"),
                zorder=3,
            )
            pending = wait.policy == "coalesce"
            axes.plot(
                [wait.start - t0],
                [y],
                marker="D" if pending else ">",
                markersize=5.5 if pending else 6,
                color=COALESCE_COLOUR if pending else colours.get(wait.worker, "grey"),
                markeredgecolor="black",
                markeredgewidth=0.5,
                zorder=4,
            )

    merged: Counter[str] = Counter()  # pending run id -> duplicates merged into it
    for duplicate in tally.duplicates:
        if duplicate.policy != "coalesced" or duplicate.key not in rows:
            continue
        merged[duplicate.holder_id or ""] += 1
        y = rows[duplicate.key]
        x = duplicate.t - t0
        axes.scatter([x], [y - 0.4], marker="v", s=30, color=COALESCE_COLOUR, zorder=6)
        into = tally.runs_by_id.get(duplicate.holder_id or "")
        if into is not None and into.key == duplicate.key:
            axes.annotate(
                "",
                xy=(into.start - t0, y - 0.3),
                xytext=(x, y - 0.4),
                arrowprops={
                    "arrowstyle": "-|>",
                    "color": COALESCE_COLOUR,
                    "linewidth": 0.7,
                    "alpha": 0.75,
                    "shrinkA": 2,
                    "shrinkB": 0,
                    "mutation_scale": 7,
                    "connectionstyle": "arc3,rad=-0.25",
                },
                zorder=5,
            )
    for pending_id, merged_count in merged.items():
        pending_run = tally.runs_by_id.get(pending_id)
        if pending_run is not None and pending_run.key in rows:
            axes.text(
                (pending_run.start + pending_run.end) / 2 - t0,
                rows[pending_run.key],
                f"+{merged_count} merged",
                ha="center",
                va="center",
                fontsize=7.5,
                fontweight="bold",
                color="white",
                clip_on=True,
                zorder=6,
            )

    def scatter(policies: tuple[str, ...], **style: Any) -> None:
        points = [
            (dup.t - t0, rows[dup.key])
            for dup in tally.duplicates
            if dup.policy in policies and dup.key in rows
        ]
        if points:
            xs, ys = zip(*points, strict=True)
            axes.scatter(xs, ys, zorder=5, **style)

    scatter(SKIP_POLICIES, marker="x", s=46, color="black", linewidths=1.6)
    scatter(("retry",), marker="o", s=40, facecolors="white", edgecolors="#c0392b", linewidths=1.5)

    lost_points = [
        (float(event["t"]) - t0, rows[tally.runs_by_id[event["id"]].key])
        for event in tally.lost
        if event.get("id") in tally.runs_by_id and tally.runs_by_id[event["id"]].key in rows
    ]
    if lost_points:
        xs, ys = zip(*lost_points, strict=True)
        axes.scatter(xs, ys, marker="*", s=160, color="red", zorder=6)

    for key, row in rows.items():
        count = counts.get(key)
        if count is None:
            continue
        parts = [f"{count.ran} ran"]
        if count.skipped:
            parts.append(f"{count.skipped} skipped")
        if count.retried:
            parts.append(f"{count.retried} retried")
        if count.waited:
            parts.append(f"{count.waited} waited")
        if count.coalesced:
            parts.append(f"{count.coalesced} coalesced")
        axes.text(
            1.01,
            row,
            ", ".join(parts),
            transform=axes.get_yaxis_transform(),
            va="center",
            fontsize=9,
            color="#333333",
        )

    axes.set_yticks(range(len(keys)))
    axes.set_yticklabels(keys, fontsize=10)
    axes.set_ylim(len(keys) - 0.5, -0.5)
    axes.set_xlim(left=min(0.0, axes.get_xlim()[0]))
    axes.set_xlabel("seconds since the flood of duplicates started")
    axes.grid(axis="x", linestyle="--", linewidth=0.5, alpha=0.6, zorder=1)
    axes.set_axisbelow(True)
    figure.suptitle(title, fontsize=13, fontweight="bold")
    if subtitle:
        axes.set_title(subtitle, fontsize=9.5, color="#444444")

    handles: list[Any] = [
        Patch(facecolor=colours[worker], edgecolor="black", label=f"run on {worker}")
        for worker in workers
    ]
    handles += [
        Line2D([], [], marker="x", linestyle="", color="black", markersize=8, mew=1.6,
               label="skipped duplicate\n(absorbed by the run under it)"),
        Line2D([], [], marker="o", linestyle="", markerfacecolor="white",
               markeredgecolor="#c0392b", markersize=7, mew=1.5,
               label="retried duplicate\n(came back later)"),
        Line2D([], [], marker=">", linestyle=":", color="grey", markeredgecolor="black",
               label="waited duplicate\n(woken by the release)"),
    ]  # fmt: skip
    if merged or any(wait.policy == "coalesce" for wait in tally.waits):
        handles += [
            Line2D([], [], marker="D", linestyle=":", color="grey", markersize=5.5,
                   markerfacecolor=COALESCE_COLOUR, markeredgecolor="black", mew=0.5,
                   label="pending run (coalesce): woken\nby the release (purple edge)"),
            Line2D([], [], marker="v", linestyle="-", color=COALESCE_COLOUR, markersize=6,
                   linewidth=0.8, label="coalesced duplicate\n(arrow: the run it joined)"),
        ]  # fmt: skip
    if lost_points:
        handles.append(
            Line2D([], [], marker="*", linestyle="", color="red", markersize=10, label="lock lost")
        )
    figure.legend(
        handles=handles,
        loc="lower center",
        ncol=min(len(handles), 8),
        fontsize=8.5,
        frameon=False,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    plt.close(figure)
    return path
