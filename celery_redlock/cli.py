"""``celery redlock``: inspect and repair the locks of a Celery app from the command line.

Registered through Celery's ``celery.commands`` entry point, so ``celery -A proj redlock ...``
works wherever the package is installed:

- ``status``: every lock node — reachable or not, round-trip time, server version — and warnings
  for settings that weaken the lock's safety (persistence, even node count, replicas, eviction);
- ``list``: the locks held now, with their holder (task, task id, host, process) and time left;
- ``key TASK [ARGS...]``: the key a call would lock, and whether it is held now;
- ``release KEY --force``: delete a stuck lock on every node, after a confirmation.

Every subcommand takes ``--json`` (machine-readable output on stdout) and ``--timeout`` (seconds
per node and command). The nodes are asked in parallel; a node that does not answer is reported,
never fatal. A command exits with status 1 when fewer than a majority of the lock nodes answered.
Lock tokens (the secret part of a stored lock value, which allows releasing it) are never shown.
"""

from __future__ import annotations

import contextlib
import datetime
import difflib
import json
import logging
import re
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import click
import redis
from redis.exceptions import RedisError as RedisClientError
from redis.exceptions import ResponseError

from .errors import RedlockError
from .keys import resource_for_call
from .nodes import Node
from .redlock import FENCE_SUFFIX, Redlock
from .runtime import AppRuntime, describe_owner, parse_owner
from .task import SingletonTask

DEFAULT_TIMEOUT_SECONDS = 1.0
SCAN_BATCH = 500
IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

Answer = TypeVar("Answer")


# -- talking to the nodes -----------------------------------------------------------------------


@dataclass
class NodeAnswer(Generic[Answer]):
    """What one node answered to a question, or why it did not."""

    name: str
    value: Answer | None = None
    error: str | None = None

    @property
    def reachable(self) -> bool:
        """True when the node answered."""
        return self.error is None


def describe_error(error: BaseException) -> str:
    """A one-line description of a connection or command error."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def ask_every_node(
    nodes: Sequence[Node], question: Callable[[redis.Redis], Answer]
) -> list[NodeAnswer[Answer]]:
    """Ask every node ``question`` (a function of a client) at once; answers in node order.

    Each node is bounded by its client's timeouts, so a dead or hung node costs at most a few
    timeouts in total, whatever the number of nodes.
    """

    def ask(node: Node) -> NodeAnswer[Answer]:
        client = node.client()
        try:
            return NodeAnswer(node.name, value=question(client))
        except (RedisClientError, OSError) as error:
            return NodeAnswer(node.name, error=describe_error(error))
        finally:
            with contextlib.suppress(RedisClientError, OSError):
                client.close()

    if not nodes:
        return []
    with ThreadPoolExecutor(max_workers=len(nodes)) as pool:
        return list(pool.map(ask, nodes))


def text_of(value: Any) -> str:
    """A reply as text (replies are bytes; undecodable bytes are replaced)."""
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return str(value)


# -- what the command works with ----------------------------------------------------------------


@dataclass
class Session:
    """The app, its settings, and a `Redlock` over its nodes with this command's timeout."""

    app: Any
    runtime: AppRuntime
    redlock: Redlock
    as_json: bool
    styled: bool

    @property
    def nodes(self) -> list[Node]:
        """The configured lock nodes."""
        return self.redlock.nodes

    @property
    def quorum(self) -> int:
        """How many nodes make a majority."""
        return self.redlock.quorum

    def emit(self, data: dict[str, Any], human: Callable[[], None]) -> None:
        """Print ``data`` as JSON with ``--json``, else run ``human`` to print it for people."""
        if self.as_json:
            click.echo(json.dumps(data, indent=2, default=str))
        else:
            human()

    def style(self, text: str, **options: Any) -> str:
        """``text`` in colour, unless colours are off (``celery --no-color``)."""
        return click.style(text, **options) if self.styled else text


@contextlib.contextmanager
def quiet_library_logs() -> Iterator[None]:
    """Hold back the library's own warnings while a command runs: it reports them itself."""
    logger = logging.getLogger("celery_redlock")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def open_session(context: click.Context, as_json: bool, timeout: float) -> Session:
    """The app from ``celery -A`` (Celery's `CLIContext` in ``context.obj``) and its lock nodes."""
    celery_context = context.obj
    app = getattr(celery_context, "app", None)
    if app is None:
        raise click.UsageError("no Celery app: run this as `celery -A proj redlock ...`")
    try:
        runtime = AppRuntime.for_app(app)
        settings = runtime.settings
        redlock = Redlock(list(settings.urls), node_timeout=timeout, key_prefix=settings.key_prefix)
    except RedlockError as error:
        raise click.ClickException(f"invalid celery_redlock configuration: {error}") from error
    styled = not getattr(celery_context, "no_color", False)
    return Session(app, runtime, redlock, as_json, styled)


def common_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """``--json`` and ``--timeout``, shared by every subcommand."""
    command = click.option(
        "--timeout",
        type=click.FloatRange(min=0.001),
        metavar="SECONDS",
        default=DEFAULT_TIMEOUT_SECONDS,
        show_default=True,
        help="Seconds to wait for each node, per command sent.",
    )(command)
    return click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")(
        command
    )


def fail_without_quorum(session: Session, answers: Sequence[NodeAnswer[Any]], doing: str) -> None:
    """Exit with status 1 (after the output) when fewer than a majority of nodes answered."""
    reachable = sum(answer.reachable for answer in answers)
    if reachable < session.quorum:
        click.echo(
            f"Error: only {reachable} of {len(answers)} lock nodes answered; a majority "
            f"({session.quorum}) is needed to {doing}. Unreachable: "
            + "; ".join(f"{answer.name} ({answer.error})" for answer in answers if answer.error),
            err=True,
        )
        raise SystemExit(1)


def unreachable_json(answers: Sequence[NodeAnswer[Any]]) -> list[dict[str, str | None]]:
    """The nodes that did not answer, with why, for JSON output."""
    return [{"node": answer.name, "error": answer.error} for answer in answers if answer.error]


def echo_unreachable(session: Session, answers: Sequence[NodeAnswer[Any]]) -> None:
    """One line per node that did not answer."""
    for answer in answers:
        if answer.error:
            click.echo(session.style(f"  unreachable: {answer.name} ({answer.error})", fg="red"))


# -- locks as stored on the nodes ---------------------------------------------------------------


@dataclass
class StoredCopy:
    """One node's copy of a lock key: its value (token and owner) and milliseconds to live."""

    value: str
    milliseconds_left: int  # -1: the key has no expiry


@dataclass
class LockView:
    """A lock key as seen across the nodes, token left out.

    ``held`` when the same value is on a majority: that is a lock somebody holds. Otherwise the
    copies are leftovers (a failed acquisition, or a lock whose majority already expired).
    """

    key: str
    resource: str
    owner: dict[str, Any]
    nodes_holding: int
    nodes_total: int
    held: bool
    seconds_left: float | None  # None: no expiry (a key written by something else)
    nodes_with_other_values: int

    def to_json(self) -> dict[str, Any]:
        """The JSON form: no token, only the owner's public description."""
        since = self.owner.get("since")
        held_for = (
            round(time.time() - since, 3) if isinstance(since, (int, float)) and self.held else None
        )
        return {
            "key": self.key,
            "resource": self.resource,
            "held": self.held,
            "task": self.owner.get("task"),
            "task_id": self.owner.get("id"),
            "retries": self.owner.get("retries"),
            "host": self.owner.get("host"),
            "pid": self.owner.get("pid"),
            "since": since,
            "held_for_seconds": held_for,
            "time_left_seconds": self.seconds_left,
            "no_expiry": self.seconds_left is None,
            "nodes_holding": self.nodes_holding,
            "nodes_total": self.nodes_total,
            "nodes_with_other_values": self.nodes_with_other_values,
        }


def merge_copies(
    key: str, resource: str, copies: Sequence[StoredCopy], quorum: int, total: int
) -> LockView:
    """One view of a key from its copies on the nodes (at least one copy)."""
    by_value: dict[str, list[int]] = {}
    for copy in copies:
        by_value.setdefault(copy.value, []).append(copy.milliseconds_left)
    value, left = max(by_value.items(), key=lambda item: len(item[1]))
    holding = len(left)
    held = holding >= quorum
    ordered = sorted(float("inf") if milliseconds < 0 else milliseconds for milliseconds in left)
    # Held while a majority still has it: until the (holding - quorum + 1)-th copy expires.
    ending = ordered[holding - quorum] if held else ordered[-1]
    seconds_left = None if ending == float("inf") else round(ending / 1000, 3)
    return LockView(
        key=key,
        resource=resource,
        owner=parse_owner(value.partition("|")[2]),
        nodes_holding=holding,
        nodes_total=total,
        held=held,
        seconds_left=seconds_left,
        nodes_with_other_values=len(copies) - holding,
    )


def read_copies(client: redis.Redis, keys: Sequence[str]) -> dict[str, StoredCopy]:
    """GET and PTTL of ``keys`` on one node (one pipeline per batch); absent keys left out."""
    found: dict[str, StoredCopy] = {}
    for start in range(0, len(keys), SCAN_BATCH):
        batch = keys[start : start + SCAN_BATCH]
        pipeline = client.pipeline(transaction=False)
        for key in batch:
            pipeline.get(key)
            pipeline.pttl(key)
        replies = pipeline.execute()
        for index, key in enumerate(batch):
            value, milliseconds = replies[2 * index], replies[2 * index + 1]
            if value is not None and milliseconds != -2:
                found[key] = StoredCopy(text_of(value), int(milliseconds))
    return found


def glob_escape(text: str) -> str:
    """``text`` as a literal inside a Redis SCAN MATCH pattern."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


def scan_locks(prefix: str) -> Callable[[redis.Redis], dict[str, StoredCopy]]:
    """A node question: every lock key under ``prefix`` (fencing counters left out)."""

    def question(client: redis.Redis) -> dict[str, StoredCopy]:
        keys = [
            text_of(key)
            for key in client.scan_iter(match=glob_escape(prefix) + "*", count=SCAN_BATCH)
        ]
        return read_copies(client, [key for key in keys if not key.endswith(FENCE_SUFFIX)])

    return question


CopiesAnswer = NodeAnswer[dict[str, StoredCopy]]


def view_key(session: Session, key: str) -> tuple[LockView | None, list[CopiesAnswer]]:
    """The view of one key across the nodes (None if no reachable node has it), and answers."""
    answers = ask_every_node(session.nodes, lambda client: read_copies(client, [key]))
    copies = [answer.value[key] for answer in answers if answer.value and key in answer.value]
    if not copies:
        return None, answers
    resource = key.removeprefix(session.redlock.key_prefix)
    return merge_copies(key, resource, copies, session.quorum, len(session.nodes)), answers


def describe_view(view: LockView) -> str:
    """A one-line human description of a lock: holder, nodes, time left."""
    left = "no expiry" if view.seconds_left is None else f"{view.seconds_left:.1f}s left"
    state = "held" if view.held else "NOT held (on a minority of nodes only)"
    return (
        f"{state} by {describe_owner(view.owner)}, "
        f"on {view.nodes_holding}/{view.nodes_total} nodes, {left}"
    )


# -- the commands -------------------------------------------------------------------------------


@click.group(name="redlock")
def redlock() -> None:
    """Inspect and repair celery_redlock locks: node status, held locks, keys, release."""


# ---- status


@dataclass
class NodeStatus:
    """What ``status`` learned about one node."""

    node: str
    reachable: bool = False
    error: str | None = None
    round_trip_milliseconds: float | None = None
    redis_version: str | None = None
    run_id: str | None = None
    role: str | None = None
    master: str | None = None
    aof_enabled: bool | None = None
    appendfsync: str | None = None
    maxmemory: int | None = None
    maxmemory_policy: str | None = None
    warnings: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """The JSON form (``run_id`` is only used to find duplicate nodes)."""
        return {
            "node": self.node,
            "reachable": self.reachable,
            "error": self.error,
            "round_trip_milliseconds": self.round_trip_milliseconds,
            "redis_version": self.redis_version,
            "role": self.role,
            "master": self.master,
            "aof_enabled": self.aof_enabled,
            "appendfsync": self.appendfsync,
            "maxmemory": self.maxmemory,
            "maxmemory_policy": self.maxmemory_policy,
            "warnings": self.warnings,
        }


def probe_node(client: redis.Redis) -> NodeStatus:
    """PING (round trip measured on an open connection), INFO and CONFIG of one node."""
    status = NodeStatus(node="")
    client.ping()  # connects (and authenticates): not part of the round trip
    started = time.perf_counter()
    client.ping()
    status.round_trip_milliseconds = round((time.perf_counter() - started) * 1000, 3)
    status.reachable = True
    try:
        server = client.info("server")
        status.redis_version = text_of(server.get("redis_version"))
        status.run_id = text_of(server.get("run_id"))
        replication = client.info("replication")
        status.role = text_of(replication.get("role"))
        if "master_host" in replication:
            status.master = f"{replication['master_host']}:{replication.get('master_port')}"
        persistence = client.info("persistence")
        status.aof_enabled = bool(int(persistence.get("aof_enabled", 0)))
        memory = client.info("memory")
        status.maxmemory = int(memory.get("maxmemory", 0))
        status.maxmemory_policy = text_of(memory.get("maxmemory_policy", "unknown"))
    except ResponseError as error:
        status.warnings.append(
            f"INFO is not allowed ({describe_error(error)}): role, persistence and eviction "
            "could not be checked"
        )
    try:
        configured = client.config_get("appendfsync")
        for name, value in configured.items():
            if text_of(name) == "appendfsync":
                status.appendfsync = text_of(value)
    except ResponseError:
        status.appendfsync = None  # CONFIG denied by ACL (or renamed): unknown
    return status


def node_warnings(status: NodeStatus, largest_ttl: float) -> list[str]:
    """The settings of one reachable node that weaken the lock's safety."""
    warnings: list[str] = []
    if status.role is not None and status.role != "master":
        of_master = f" of {status.master}" if status.master else ""
        warnings.append(
            f"role is {status.role}{of_master}: Redlock needs independent masters; a replica "
            "rejects lock writes (read-only), and a failover to it can hand a lock out twice"
        )
    delayed_restart = (
        f"restart a crashed node only after the largest lock ttl ({largest_ttl:g}s) has passed "
        "(delayed restart), or run it with appendonly yes and appendfsync always"
    )
    if status.aof_enabled is False:
        warnings.append(f"no AOF (appendonly no): {delayed_restart}")
    elif status.aof_enabled and status.appendfsync is None:
        warnings.append(
            f"AOF on, appendfsync unknown (CONFIG GET not allowed): unless it is 'always', "
            f"{delayed_restart}"
        )
    elif status.aof_enabled and status.appendfsync != "always":
        warnings.append(
            f"AOF with appendfsync {status.appendfsync} (not 'always'): a crash can lose "
            f"recent locks; {delayed_restart}"
        )
    if status.maxmemory and status.maxmemory_policy not in (None, "noeviction"):
        warnings.append(
            f"maxmemory-policy {status.maxmemory_policy} with maxmemory set: under memory "
            "pressure Redis may evict lock keys (they have a ttl) and hand a lock out twice; "
            "use noeviction on lock nodes"
        )
    return warnings


def largest_lock_ttl(session: Session) -> float:
    """The longest a lock key can live: the ttl setting or any singleton task's ttl or hold."""
    largest = session.runtime.settings.ttl
    with contextlib.suppress(Exception):  # a broken task import must not hide the node status
        session.app.loader.import_default_modules()
    for task in list(session.app.tasks.values()):
        if isinstance(task, SingletonTask):
            with contextlib.suppress(RedlockError):
                plan = task._lock_plan(session.runtime)
                largest = max(largest, plan.ttl, plan.hold)
    return float(largest)


def group_warnings(session: Session, statuses: Sequence[NodeStatus]) -> list[str]:
    """Warnings about the set of nodes as a whole."""
    total = len(statuses)
    warnings: list[str] = []
    if total == 1:
        warnings.append(
            "a single lock node: no fault tolerance; while it is down no lock can be taken, "
            "and a restart without persistence forgets every lock"
        )
    elif total % 2 == 0:
        warnings.append(
            f"{total} lock nodes: an even number tolerates no more failures than {total - 1} "
            f"(a majority of {session.quorum} is needed) while adding a node that can fail; "
            "use an odd number such as 3 or 5"
        )
    by_server: dict[str, list[str]] = {}
    for status in statuses:
        if status.run_id:
            by_server.setdefault(status.run_id, []).append(status.node)
    for names in by_server.values():
        if len(names) > 1:
            warnings.append(
                f"{' and '.join(names)} are the same Redis server (same run_id): the nodes "
                "must be independent, or one crash removes several votes"
            )
    reachable = sum(status.reachable for status in statuses)
    if session.quorum <= reachable < total:
        warnings.append(
            f"{total - reachable} of {total} lock nodes unreachable: locks still work, "
            f"but {reachable - session.quorum + 1} more failure(s) stop them"
        )
    return warnings


@redlock.command()
@common_options
@click.pass_context
def status(context: click.Context, as_json: bool, timeout: float) -> None:
    """Every lock node: reachable or not, round-trip time, version, and safety warnings.

    Exits with status 1 when fewer than a majority of the nodes answer.
    """
    with quiet_library_logs():
        session = open_session(context, as_json, timeout)
        answers = ask_every_node(session.nodes, probe_node)
        largest_ttl = largest_lock_ttl(session)
    statuses: list[NodeStatus] = []
    for answer in answers:
        node_status = answer.value or NodeStatus(node=answer.name, error=answer.error)
        node_status.node = answer.name
        if answer.error is None:
            node_status.warnings.extend(node_warnings(node_status, largest_ttl))
        statuses.append(node_status)
    reachable = sum(node_status.reachable for node_status in statuses)
    has_quorum = reachable >= session.quorum
    overall = group_warnings(session, statuses)
    data = {
        "nodes": [node_status.to_json() for node_status in statuses],
        "configured": len(statuses),
        "reachable": reachable,
        "quorum": session.quorum,
        "has_quorum": has_quorum,
        "largest_lock_ttl_seconds": largest_ttl,
        "warnings": overall,
    }

    def human() -> None:
        verdict = (
            session.style("OK", fg="green", bold=True)
            if has_quorum
            else session.style("NO QUORUM", fg="red", bold=True)
        )
        click.echo(
            f"Lock nodes: {reachable} of {len(statuses)} reachable, a majority is "
            f"{session.quorum}: {verdict}"
        )
        for node_status in statuses:
            if node_status.reachable:
                persistence = {True: "aof on", False: "aof off", None: "aof unknown"}[
                    node_status.aof_enabled
                ]
                if node_status.aof_enabled and node_status.appendfsync:
                    persistence += f" (appendfsync {node_status.appendfsync})"
                click.echo(
                    f"  {session.style('up  ', fg='green')} {node_status.node}  "
                    f"{node_status.round_trip_milliseconds:.2f} ms  "
                    f"redis {node_status.redis_version or '?'}  "
                    f"{node_status.role or 'role ?'}  {persistence}"
                )
            else:
                click.echo(
                    f"  {session.style('DOWN', fg='red', bold=True)} {node_status.node}  "
                    f"unreachable: {node_status.error}"
                )
        # The same warning about several nodes is printed once, naming them all.
        by_warning: dict[str, list[str]] = {}
        for node_status in statuses:
            for warning in node_status.warnings:
                by_warning.setdefault(warning, []).append(node_status.node)
        warnings = [f"{', '.join(names)}: {warning}" for warning, names in by_warning.items()]
        warnings += overall
        if warnings:
            click.echo(session.style("Warnings:", fg="yellow", bold=True))
            for warning in warnings:
                click.echo(f"  - {warning}")

    session.emit(data, human)
    if not has_quorum:
        click.echo(
            f"Error: only {reachable} of {len(statuses)} lock nodes answered; singleton tasks "
            f"cannot take locks until {session.quorum} answer",
            err=True,
        )
        raise SystemExit(1)


# ---- list


@redlock.command(name="list")
@click.option(
    "--all", "show_all", is_flag=True, help="Also show keys present on a minority of nodes only."
)
@common_options
@click.pass_context
def list_locks(context: click.Context, show_all: bool, as_json: bool, timeout: float) -> None:
    """The locks held now: task, holder (host, process, task id) and time left.

    A lock counts as held when the same value is on a majority of nodes. Exits with status 1
    when fewer than a majority of the nodes answer.
    """
    with quiet_library_logs():
        session = open_session(context, as_json, timeout)
        prefix = session.redlock.key_prefix
        answers = ask_every_node(session.nodes, scan_locks(prefix))
    copies: dict[str, list[StoredCopy]] = {}
    for answer in answers:
        for key, copy in (answer.value or {}).items():
            copies.setdefault(key, []).append(copy)
    views = [
        merge_copies(key, key.removeprefix(prefix), key_copies, session.quorum, len(session.nodes))
        for key, key_copies in sorted(copies.items())
    ]
    held = [view for view in views if view.held]
    minority = [view for view in views if not view.held]
    reachable = sum(answer.reachable for answer in answers)
    data = {
        "locks": [view.to_json() for view in held],
        "minority": [view.to_json() for view in minority],
        "reachable": reachable,
        "nodes_total": len(answers),
        "quorum": session.quorum,
        "unreachable": unreachable_json(answers),
    }

    def human() -> None:
        counted = f"{len(held)} lock(s) held" if reachable >= session.quorum else "Locks unknown"
        click.echo(
            f"{counted} ({reachable} of {len(answers)} lock nodes answered, "
            f"a majority is {session.quorum})"
        )
        echo_unreachable(session, answers)
        for view in held + (minority if show_all else []):
            echo_view(session, view)
        if minority and not show_all:
            click.echo(
                f"{len(minority)} key(s) on a minority of nodes only (not held; they expire by "
                "themselves): --all shows them"
            )

    session.emit(data, human)
    fail_without_quorum(session, answers, "tell which locks are held")


def echo_view(session: Session, view: LockView) -> None:
    """A lock for people: its key, then its holder and time left, never its token."""
    owner = view.owner
    click.echo(session.style(view.key, bold=True) + ("" if view.held else "  (NOT held)"))
    if owner:
        click.echo(
            f"    task      {owner.get('task')}  id {owner.get('id')}  "
            f"retries {owner.get('retries')}"
        )
        since = owner.get("since")
        started = ""
        if isinstance(since, (int, float)):
            moment = datetime.datetime.fromtimestamp(since).isoformat(" ", "seconds")
            started = f", since {moment} ({time.time() - since:.1f}s ago)"
        click.echo(f"    holder    host {owner.get('host')}, pid {owner.get('pid')}{started}")
    else:
        click.echo("    holder    unknown (no owner stored with the lock)")
    left = "no expiry" if view.seconds_left is None else f"{view.seconds_left:.1f}s"
    others = (
        f", {view.nodes_with_other_values} node(s) with another value"
        if view.nodes_with_other_values
        else ""
    )
    click.echo(f"    left      {left} on {view.nodes_holding}/{view.nodes_total} nodes{others}")


# ---- key


def parse_call_arguments(texts: Sequence[str]) -> tuple[list[Any], dict[str, Any]]:
    """Command-line words as a call: ``name=value`` is a keyword argument, anything else a
    positional one; values are JSON when they parse (``42``, ``"x"``, ``{"a": 1}``), else text.
    """
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    for text in texts:
        name, equals, value = text.partition("=")
        if equals and IDENTIFIER.match(name):
            kwargs[name] = parse_value(value)
        else:
            if kwargs:
                raise click.UsageError(
                    f"positional argument {text!r} after keyword arguments; put name=value last"
                )
            args.append(parse_value(text))
    return args, kwargs


def parse_value(text: str) -> Any:
    """``text`` as JSON when it is JSON, else as the string itself."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def find_singleton_task(session: Session, name: str) -> SingletonTask:
    """The app's task ``name``, which must be a `SingletonTask` (clear errors otherwise)."""
    with contextlib.suppress(Exception):  # tasks of broken modules are simply not found
        session.app.loader.import_default_modules()
    tasks = session.app.tasks
    task = tasks.get(name)
    singletons = sorted(
        task_name for task_name, value in tasks.items() if isinstance(value, SingletonTask)
    )
    if task is None:
        close = difflib.get_close_matches(name, singletons, n=3)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        known = ", ".join(singletons) or "none"
        raise click.ClickException(
            f"unknown task {name!r}; {hint}singleton tasks of this app: {known}"
        )
    if not isinstance(task, SingletonTask):
        raise click.ClickException(
            f"task {name!r} is not a SingletonTask: it takes no lock (singleton tasks of this "
            f"app: {', '.join(singletons) or 'none'})"
        )
    return task


def lock_basis(task: SingletonTask, session: Session) -> str:
    """What the task's lock key is made of, in words."""
    plan = task._lock_plan(session.runtime)
    if plan.lock_key is not None:
        return (
            f"lock_key template {plan.lock_key!r}"
            if isinstance(plan.lock_key, str)
            else "lock_key callable"
        )
    if plan.lock_args is None:
        return "task name and all arguments"
    if not plan.lock_args:
        return "task name alone (lock_args=())"
    return f"task name and lock_args {', '.join(plan.lock_args)}"


@redlock.command(context_settings={"ignore_unknown_options": True})
@click.argument("task_name", metavar="TASK")
@click.argument("arguments", nargs=-1, metavar="[ARGS]...")
@common_options
@click.pass_context
def key(
    context: click.Context,
    task_name: str,
    arguments: tuple[str, ...],
    as_json: bool,
    timeout: float,
) -> None:
    """The Redis key a call of TASK with ARGS would lock, and who holds it now.

    ARGS are JSON when they parse (42, '"x"', '{"a": 1}'), text otherwise; name=value gives a
    keyword argument. Use it to find out why a run was skipped.
    """
    args, kwargs = parse_call_arguments(arguments)
    with quiet_library_logs():
        session = open_session(context, as_json, timeout)
        task = find_singleton_task(session, task_name)
        try:
            plan = task._lock_plan(session.runtime)
            resource = resource_for_call(
                task.name, task._signature(), args, kwargs, plan.lock_args, plan.lock_key
            )
        except (RedlockError, TypeError, ValueError) as error:
            raise click.ClickException(str(error)) from error
        lock_key = session.redlock.key_for(resource)
        view, answers = view_key(session, lock_key)
    reachable = sum(answer.reachable for answer in answers)
    basis = lock_basis(task, session)
    data = {
        "task": task.name,
        "args": args,
        "kwargs": kwargs,
        "locks_on": basis,
        "resource": resource,
        "key": lock_key,
        "held": bool(view and view.held) if reachable >= session.quorum else None,
        "lock": view.to_json() if view else None,
        "reachable": reachable,
        "nodes_total": len(answers),
        "unreachable": unreachable_json(answers),
    }

    def human() -> None:
        shown = [json.dumps(value) for value in args] + [
            f"{name}={json.dumps(value)}" for name, value in kwargs.items()
        ]
        click.echo(f"task      {task.name}({', '.join(shown)})")
        click.echo(f"locks on  {basis}")
        click.echo(f"resource  {resource}")
        click.echo(f"key       {session.style(lock_key, bold=True)}")
        if reachable < session.quorum:
            click.echo("state     unknown (no majority of lock nodes answered)")
        elif view is None:
            click.echo("state     free (no node has it): a run would take the lock")
        else:
            click.echo(f"state     {describe_view(view)}")
        echo_unreachable(session, answers)

    session.emit(data, human)
    fail_without_quorum(session, answers, "tell whether the key is held")


# ---- release


def resolve_key(session: Session, given: str) -> tuple[str, str]:
    """(key, resource) for a full key or a resource; a full key is the prefixed form."""
    prefix = session.redlock.key_prefix
    if given.endswith(FENCE_SUFFIX):
        raise click.UsageError(
            f"{given!r} is a fencing counter, not a lock; pass the lock key without "
            f"{FENCE_SUFFIX!r}"
        )
    if prefix and given.startswith(prefix):
        return given, given.removeprefix(prefix)
    return session.redlock.key_for(given), given


@redlock.command()
@click.argument("given_key", metavar="KEY")
@click.option("--force", is_flag=True, help="Required: a forced release is never the default.")
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation (for scripts).")
@common_options
@click.pass_context
def release(
    context: click.Context,
    given_key: str,
    force: bool,
    yes: bool,
    as_json: bool,
    timeout: float,
) -> None:
    """Delete the lock KEY on every node, whoever holds it (for stuck locks).

    KEY is the full Redis key (as `list` and `key` print it) or the resource without the key
    prefix. The holder, if still running, is not stopped: another run can start at once.
    """
    if not force:
        raise click.UsageError(
            "refusing to release without --force: a forced release lets another run start "
            "while the holder may still be running; check it with `celery redlock list`, then "
            "run `celery redlock release KEY --force`"
        )
    with quiet_library_logs():
        session = open_session(context, as_json, timeout)
        lock_key, resource = resolve_key(session, given_key)
        before, answers = view_key(session, lock_key)
        had_copy = key_presence(lock_key, answers)
        if before is None:
            deleted_on: list[str] = []
            still_present: list[str] = []
        else:
            if not yes:
                click.confirm(
                    f"Lock {lock_key} is {describe_view(before)}.\n"
                    "Deleting it lets another run start while this one may still be running. "
                    "Delete it on every node?",
                    abort=True,
                    err=True,
                )
            session.redlock.force_release(resource)
            deleted_on, still_present = check_deleted(session, lock_key, had_copy)
    unreachable = [answer for answer in answers if answer.error]
    data = {
        "key": lock_key,
        "resource": resource,
        "found": before is not None,
        "lock": before.to_json() if before else None,
        "deleted": len(deleted_on),
        "deleted_on": deleted_on,
        "still_present_on": still_present,
        "nodes_total": len(answers),
        "unreachable": unreachable_json(answers),
    }

    def human() -> None:
        if before is None:
            click.echo(
                f"Lock {lock_key} is on none of the {len(answers) - len(unreachable)} reachable "
                "nodes: nothing to release."
            )
        else:
            click.echo(
                f"Released {lock_key}: deleted on {len(deleted_on)} of {len(answers)} nodes."
            )
            for name in still_present:
                click.echo(
                    session.style(
                        f"  still present on {name}: the deletion did not reach it", fg="red"
                    )
                )
        echo_unreachable(session, answers)
        if unreachable and before is not None:
            click.echo(
                "  a copy on an unreachable node was not deleted; it expires by its ttl, or run "
                "this again when the node is back"
            )

    session.emit(data, human)
    fail_without_quorum(session, answers, "be sure the lock is released")


def key_presence(lock_key: str, answers: Sequence[CopiesAnswer]) -> dict[str, str]:
    """Node name -> stored value, for the nodes that had the key."""
    return {
        answer.name: answer.value[lock_key].value
        for answer in answers
        if answer.value and lock_key in answer.value
    }


def check_deleted(
    session: Session, lock_key: str, had_copy: dict[str, str]
) -> tuple[list[str], list[str]]:
    """Which of the nodes that had the key no longer have that value, and which still do.

    `Redlock.force_release` stops waiting once a majority confirmed; the other nodes' deletions
    are already on their way, so a copy still seen is looked at again a few times.
    """
    still: dict[str, str] = dict(had_copy)
    for attempt in range(5):
        if attempt:
            time.sleep(0.02 * attempt)
        answers = ask_every_node(session.nodes, lambda client: read_copies(client, [lock_key]))
        for answer in answers:
            if answer.name not in still or answer.error is not None:
                continue
            copy = (answer.value or {}).get(lock_key)
            if copy is None or copy.value != still[answer.name]:
                del still[answer.name]
        if not still:
            break
    deleted = [name for name in had_copy if name not in still]
    return deleted, list(still)
