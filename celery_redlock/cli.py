"""``celery redlock`` (Celery's ``celery.commands`` entry point): `celery_redlock.admin` on the
command line, printed for people or (``--json``) for scripts. Every subcommand exits with status
1 when fewer than a majority of lock nodes answer; no error prints a traceback; lock tokens are
never printed.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import click

from . import admin
from .errors import ConfigurationError, QuorumUnavailable, RedlockError


@dataclass(frozen=True)
class Session:
    """The app from ``celery -A``, and how to print."""

    app: Any
    as_json: bool
    styled: bool

    def emit(self, data: dict[str, Any], human: Callable[[], None]) -> None:
        if self.as_json:
            click.echo(json.dumps(data, indent=2, default=str))
        else:
            human()

    def style(self, text: str, **options: Any) -> str:
        return click.style(text, **options) if self.styled else text

    def echo_unreachable(self, unreachable: Sequence[admin.NodeError]) -> None:
        for node in unreachable:
            click.echo(self.style(f"  unreachable: {node.node} ({node.error})", fg="red"))


Answers = admin.StatusReport | admin.LockListing | admin.ReleaseResult


def fail_without_quorum(answers: Answers, doing: str) -> None:
    if not answers.has_quorum:
        total, unreachable = answers.nodes_total, answers.unreachable
        raise click.ClickException(
            f"only {total - len(unreachable)} of {total} lock nodes answered; a majority "
            f"({answers.quorum}) is needed to {doing}. Unreachable: "
            + "; ".join(f"{node.node} ({node.error})" for node in unreachable)
        )


@contextlib.contextmanager
def session(context: click.Context, as_json: bool) -> Iterator[Session]:
    """The command's `Session`, the library's log lines held back and its errors turned into
    one-line command-line errors."""
    app = getattr(context.obj, "app", None)
    if app is None:
        raise click.UsageError("no Celery app: run this as `celery -A proj redlock ...`")
    logger = logging.getLogger("celery_redlock")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield Session(app, as_json, not getattr(context.obj, "no_color", False))
    except (click.ClickException, click.Abort):
        raise
    except ConfigurationError as error:
        raise click.ClickException(f"invalid celery_redlock configuration: {error}") from error
    except (RedlockError, ValueError) as error:
        raise click.ClickException(str(error)) from error
    except Exception as error:  # an operator gets one line, never a traceback
        reason = " ".join(str(error).split())
        name = type(error).__name__
        raise click.ClickException(f"unexpected {name}: {reason} (please report this)") from error
    finally:
        logger.setLevel(level)


def common_options(command: Callable[..., Any]) -> Callable[..., Any]:
    command = click.option(
        "--timeout",
        type=click.FloatRange(min=0.001),
        metavar="SECONDS",
        default=admin.DEFAULT_TIMEOUT,
        show_default=True,
        help="Seconds to wait for each node (and worker), per command sent.",
    )(command)
    json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON.")
    return click.pass_context(json_option(command))


def echo_record(current: Session, record: admin.LockRecord) -> None:
    click.echo(current.style(record.key, bold=True) + ("" if record.held else "  (NOT held)"))
    if record.legacy_layout:
        click.echo(current.style(f"    layout    {admin.LEGACY_NOTE}", fg="yellow"))
    owner = record.owner
    if owner is None:
        click.echo("    holder    unknown (no owner stored with the lock)")
    else:
        queued = "  (claimed at enqueue)" if owner.queued else ""
        what = f"task      {owner.task}  id {owner.id}  retries {owner.retries}{queued}"
        click.echo(f"    {f'role      {owner.role}' if owner.role else what}")
        since = ""
        if owner.since:
            moment = datetime.datetime.fromtimestamp(owner.since).isoformat(" ", "seconds")
            since = f", since {moment} ({time.time() - owner.since:.1f}s ago)"
        worker = f"worker {owner.worker}, " if owner.worker else ""
        click.echo(f"    holder    {worker}host {owner.host}, pid {owner.pid}{since}")
    if record.worker_answers is not None:
        active = {True: ", task active", False: ", task NOT active", None: ""}[record.task_active]
        click.echo(f"    worker    {'answers' if record.worker_answers else 'silent'}{active}")
    left = "no expiry" if record.time_left is None else f"{record.time_left:.1f}s"
    others = record.nodes_with_other_values
    others_text = f", {others} node(s) with another value" if others else ""
    nodes = f"{record.nodes_holding}/{record.nodes_total}"
    click.echo(f"    left      {left} on {nodes} nodes{others_text}")


@click.group(name="redlock")
def redlock() -> None:
    """Inspect and repair celery_redlock locks: node status, held locks, keys, release, reap."""


@redlock.command()
@common_options
def status(context: click.Context, as_json: bool, timeout: float) -> None:
    """Every lock node: reachable or not, round-trip time, version, and safety warnings."""
    with session(context, as_json) as current:
        report = admin.status_report(current.app, timeout)

    def human() -> None:
        verdict = "OK" if report.has_quorum else "NO QUORUM"
        verdict = current.style(verdict, fg="green" if report.has_quorum else "red", bold=True)
        counts = f"{report.reachable} of {len(report.nodes)} reachable"
        click.echo(f"Lock nodes: {counts}, a majority is {report.quorum}: {verdict}")
        for node in report.nodes:
            up = current.style("up  ", fg="green") if node.reachable else None
            state = up or current.style("DOWN", fg="red", bold=True)
            click.echo(f"  {state} {node.node}  {node.summary()}")
            for unread in node.could_not_read:
                click.echo(current.style(f"       could not read {unread}", fg="yellow"))
        warnings = report.warning_lines()
        if warnings:
            click.echo(current.style("Warnings:", fg="yellow", bold=True))
            click.echo("".join(f"  - {warning}\n" for warning in warnings), nl=False)

    current.emit(report.to_json(), human)
    fail_without_quorum(report, "take any lock")


@redlock.command(name="list")
@click.option("--all", "show_all", is_flag=True, help="Also show keys on a minority of nodes.")
@click.option(
    "--check-workers", is_flag=True, help="Ask each holder's worker whether it runs the task."
)
@common_options
def list_locks(
    context: click.Context, show_all: bool, check_workers: bool, as_json: bool, timeout: float
) -> None:
    """The locks held now (the same value on a majority of nodes): task, holder (worker, host,
    process, task id) and time left."""
    with session(context, as_json) as current:
        listing = admin.lock_listing(current.app, check_workers=check_workers, timeout=timeout)

    def human() -> None:
        counted = f"{len(listing.locks)} lock(s) held" if listing.has_quorum else "Locks unknown"
        click.echo(
            f"{counted} ({listing.reachable} of {listing.nodes_total} lock nodes answered, "
            f"a majority is {listing.quorum})"
        )
        current.echo_unreachable(listing.unreachable)
        for record in [*listing.locks, *(listing.minority if show_all else ())]:
            echo_record(current, record)
        if listing.minority and not show_all:
            click.echo(
                f"{len(listing.minority)} key(s) on a minority of nodes only (not held; they "
                "expire by themselves): --all shows them"
            )

    current.emit(listing.to_json(), human)
    fail_without_quorum(listing, "tell which locks are held")


def parse_call_arguments(texts: Sequence[str]) -> tuple[list[Any], dict[str, Any]]:
    """Command-line words as a call: ``name=value`` a keyword argument, values JSON or text."""
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    for text in texts:
        name, equals, value = text.partition("=")
        if equals and name.isidentifier():
            kwargs[name] = parse_value(value)
        elif kwargs:
            raise click.UsageError(f"positional argument {text!r} after name=value arguments")
        else:
            args.append(parse_value(text))
    return args, kwargs


def parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


@redlock.command(context_settings={"ignore_unknown_options": True})
@click.argument("task_name", metavar="TASK")
@click.argument("words", nargs=-1, metavar="[ARGS]...")
@common_options
def key(
    context: click.Context, task_name: str, words: tuple[str, ...], as_json: bool, timeout: float
) -> None:
    """The Redis key a call of TASK with ARGS would lock, and who holds it now.

    ARGS are JSON when they parse (42, '"x"', '{"a": 1}'), text otherwise; name=value gives a
    keyword argument. Use it to find out why a run was skipped.
    """
    args, kwargs = parse_call_arguments(words)
    with session(context, as_json) as current:
        try:
            call = admin.call_key(current.app, task_name, args, kwargs)
        except TypeError as error:  # raised by a lock_key callable the call does not fit
            raise click.ClickException(str(error)) from error
        keys = admin.keys_of_lock(current.app, call.key)
        listing = admin.lock_listing(current.app, keys, timeout=timeout)
    found = (*listing.locks, *listing.minority, None)[0]
    data = {
        **call.to_json(),
        "held": bool(listing.locks) if listing.has_quorum else None,
        "lock": found.to_json() if found else None,
        "reachable": listing.reachable,
        "nodes_total": listing.nodes_total,
        "unreachable": [node.to_json() for node in listing.unreachable],
    }

    def human() -> None:
        shown = [json.dumps(value) for value in args]
        shown += [f"{name}={json.dumps(value)}" for name, value in kwargs.items()]
        click.echo(f"task      {call.task}({', '.join(shown)})")
        click.echo(f"locks on  {call.basis}\nresource  {call.resource}")
        click.echo(f"key       {current.style(call.key, bold=True)}")
        if not listing.has_quorum:
            click.echo("state     unknown (no majority of lock nodes answered)")
        elif found is None:
            click.echo("state     free (no node has it): a run would take the lock")
        else:
            click.echo(f"state     {found.summary()}")
        current.echo_unreachable(listing.unreachable)

    current.emit(data, human)
    fail_without_quorum(listing, "tell whether the key is held")


@redlock.command()
@click.argument("given_key", metavar="KEY")
@click.option("--force", is_flag=True, help="Required: a forced release is never the default.")
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation (for scripts).")
@common_options
def release(
    context: click.Context, given_key: str, force: bool, yes: bool, as_json: bool, timeout: float
) -> None:
    """Delete the lock KEY (a full key, or a resource without the key prefix) on every node,
    whoever holds it. Only a lock is deleted: a key that is not a lock (a fencing counter,
    completion or schedule records, any other value) is refused and left alone. A holder still
    running is not stopped; `reap` frees only the locks whose holder is proven gone."""
    if not force:
        raise click.UsageError(
            "refusing to release without --force: a forced release lets another run start "
            "while the holder may still be running; check it with `celery redlock list` (or "
            "run `celery redlock reap`, which frees only locks whose holder is proven gone)"
        )
    with session(context, as_json) as current:
        lock_key, _ = admin.resolve_key(current.app, given_key)
        before = admin.lock_listing(current.app, [lock_key], timeout=timeout)
        found = (*before.locks, *before.minority, None)[0]
        if found is not None and not yes:
            click.confirm(
                f"Lock {lock_key} is {found.summary()}.\nDeleting it lets another run start "
                "while this one may still be running. Delete it on every node?",
                abort=True,
                err=True,
            )
        result = admin.force_release(current.app, lock_key, timeout=timeout)

    def human() -> None:
        total = result.nodes_total
        if not result.found and not result.refused:
            reachable = total - len(result.unreachable)
            nowhere = f"is on none of the {reachable} reachable nodes: nothing to release."
            click.echo(f"Lock {result.key} {nowhere}")
        elif not result.found:
            click.echo(f"Nothing released: {result.key} is no lock on any reachable node.")
        else:
            deleted = len(result.deleted_on)
            click.echo(f"Released {result.key}: deleted on {deleted} of {total} nodes.")
            for name in result.still_present_on:
                warning = f"  still present on {name}: the deletion did not reach it"
                click.echo(current.style(warning, fg="red"))
        for line in result.refusal_lines():
            click.echo(current.style(f"  refused: {line}; left alone", fg="red"))
        current.echo_unreachable(result.unreachable)
        if result.unreachable and result.found:
            click.echo("  copies on unreachable nodes expire by their ttl (or run this again)")

    current.emit(result.to_json(), human)
    if result.refused:
        nodes = ", ".join(refusal.node for refusal in result.refused)
        reason = result.refused[0].reason
        raise click.ClickException(f"{result.key} is not a lock: {reason} (on {nodes}); left alone")
    fail_without_quorum(result, "be sure the lock is released")


@redlock.command()
@click.option("--dry-run", is_flag=True, help="Decide, but delete nothing.")
@click.option(
    "--grace",
    type=click.FloatRange(min=0),
    metavar="SECONDS",
    help="How long to watch silent holders' locks [default: redlock_reap_grace].",
)
@click.option("--no-local-check", is_flag=True, help="A process gone from this host is no proof.")
@common_options
def reap(
    context: click.Context, dry_run: bool, grace: float | None, no_local_check: bool, **options: Any
) -> None:
    """Free, by token, only the locks whose holder is proven gone: its process is gone from
    this host, or its worker answers without running it, or its worker stays silent while the
    lock is not extended for the grace period. Every other lock is kept, with the reason."""

    as_json, timeout = options["as_json"], options["timeout"]

    def progress(line: str) -> None:
        if not as_json:
            click.echo(f"{line} to prove their holders gone...", err=True)

    with session(context, as_json) as current:
        try:
            results = admin.reap(
                current.app,
                dry_run,
                grace=grace,
                check_local_processes=not no_local_check,
                timeout=timeout,
                progress=progress,
            )
        except QuorumUnavailable as error:
            raise click.ClickException(f"{error}; nothing was reaped") from error
    freed = [result for result in results if result.action in (admin.FREED, admin.WOULD_FREE)]
    reports = [result.to_json() for result in results]
    data = {"dry_run": dry_run, "freed": len(freed), "results": reports}

    def human() -> None:
        verb = "Would free" if dry_run else "Freed"
        nothing = " (dry run: nothing deleted)" if dry_run else ""
        click.echo(f"{verb} {len(freed)} of {len(results)} held lock(s){nothing}")
        colours = {admin.FREED: "green", admin.WOULD_FREE: "yellow", admin.GONE: "cyan"}
        for result in results:
            action = current.style(f"{result.action:<10}", fg=colours.get(result.action))
            proof = f"proof {result.proof}: " if result.proof else ""
            click.echo(f"  {action} {result.lock.key}  {result.lock.describe()}")
            click.echo(f"             {proof}{result.reason}")

    current.emit(data, human)
