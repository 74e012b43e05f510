"""What a worker says about its lock nodes when it starts (`report_lock_nodes`, connected to
``worker_ready``, so it comes just before Celery's "ready"):

- one INFO line: every lock node (passwords redacted), up or down and why, how many answer and
  whether they make a quorum;
- an ERROR line when they do not: no singleton task can take its lock until more answer;
- an ERROR line per node that refuses this worker — wrong credentials (``WRONGPASS``,
  ``NOAUTH``) or an ACL that denies the lock commands or keys (``NOPERM``): a configuration
  fault, named with the setting that fixes it, not an outage that passes;
- a WARNING per Redis server that several nodes reach (the same ``run_id``), naming their URLs
  (`celery_redlock.admin.status.same_server_warnings`, as ``celery redlock status`` says it).

Each node is asked what ``celery redlock status`` asks first — PING, then ``INFO server`` for
its ``run_id`` (an ACL that denies INFO only leaves duplicates undetected) — and one read of a
key under the prefix through the read script (`scripts.READ`), which the node's user may run
only where its ACL allows the lock scripts and keys. Nothing is written.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from redis.exceptions import AskError, AuthenticationError, ResponseError

from ..integration.task import SingletonTask
from ..lock import keyspace, scripts
from ..lock.nodes import Endpoint
from ..lock.nodes.cluster import ClusterNode
from ..lock.replies import judge_copy
from ..settings import has_credentials
from .reading import BadReply, LockReader, NodeAnswer, NodeReads, access_fix, read_in_rounds
from .records import NodeStatus
from .status import info_section, merged_status, ping, same_server_warnings, server_version

logger = logging.getLogger(__name__)

CHECK_RESOURCE = "celery-redlock-start-check"
"""The resource whose (absent) lock key the start-up check reads: never locked by anyone."""

SHORTEST_TIMEOUT = 1.0
"""Seconds each node gets at least: a worker starting is not in a hurry, a slow network is."""


@dataclass(frozen=True)
class NodeCheck:
    """One node at worker start: its identity (``run_id``, a cluster's masters in
    ``status.servers``), or ``denied``: why it refuses this worker (credentials, ACL)."""

    status: NodeStatus
    denied: str | None = None


def report_lock_nodes(sender: Any = None, **_: Any) -> None:
    """``worker_ready`` handler: log the start-up report of the worker's app, when it has
    singleton tasks."""
    app = getattr(sender, "app", None)
    if app is None or not any(isinstance(task, SingletonTask) for task in app.tasks.values()):
        return
    try:
        report(app)
    except Exception:  # the report must never keep a worker from starting
        logger.exception("celery_redlock could not check its lock nodes at worker start")


def report(app: Any) -> list[NodeCheck | None]:
    """Ask every lock node of ``app`` at once and log what the worker should know; returns each
    node's check (None where the node did not answer)."""
    with LockReader(app, SHORTEST_TIMEOUT) as reader:
        timeout = max(reader.settings.node_timeout, SHORTEST_TIMEOUT)
        key = keyspace.lock_key(reader.prefix, CHECK_RESOURCE)
        user = reader.settings.username or "default"  # the user of URLs that name none
        answers = reader.ask(lambda reads: check_node(reads, key, user), timeout=timeout)
        urls, quorum = reader.settings.urls, reader.quorum
    checks = [answer.value for answer in answers]
    statuses = [check.status for check in checks if check is not None and check.denied is None]
    answering = len(statuses)
    logger.info("%s", summary_line(answers, answering, quorum))
    for url, answer in zip(urls, answers, strict=True):
        if answer.value is not None and answer.value.denied is not None:
            logger.error("%s", denial_line(answer.node, url, answer.value.denied, answering))
    if answering < quorum:
        logger.error("%s", no_quorum_line(len(answers), answering, quorum))
    for warning in same_server_warnings(statuses):
        logger.warning("lock nodes %s", warning)
    return checks


def check_node(reads: NodeReads, key: str, user: str) -> NodeCheck:
    """Identify the node's servers, then read ``key`` through the read script; an
    authentication or ACL refusal is a `NodeCheck` with ``denied`` (naming the node's ACL
    user: its URL's, else ``user``), anything else that goes wrong raises (the node does not
    answer). The script is sent as EVAL with its source, to the server the node's routing
    names: what this checks is the node's ACL, not the scripts' cache. In a slot that moves,
    the read goes through a round, which follows it."""
    try:
        servers = [identify(reads, server) for server in reads.servers()]
        try:
            reply = reads.call(reads.server_for(key), "EVAL", scripts.READ.source, 1, key)
        except AskError:  # MOVED too
            (reply,) = read_in_rounds(reads, [key])
    except AuthenticationError as error:
        return NodeCheck(NodeStatus(reads.node, reachable=True), denied=str(error).strip())
    except ResponseError as error:
        fix = access_fix(error, user if reads.user == "<user>" else reads.user)
        if fix is None:
            raise
        return NodeCheck(NodeStatus(reads.node, reachable=True), denied=fix)
    if judge_copy(reply) is None:
        raise BadReply("the read script", reply, "a value and its pttl")
    if isinstance(reads.member, ClusterNode):
        return NodeCheck(merged_status(reads.node, servers))
    return NodeCheck(dataclasses.replace(servers[0], node=reads.node))


def identify(reads: NodeReads, server: Endpoint) -> NodeStatus:
    """One server's identity: it answers PING (a denied PING is an answer), and ``INFO
    server`` gives its ``run_id`` and version unless an ACL denies INFO."""
    ping(reads, server)
    try:
        fields = info_section(reads, server, "server")
    except ResponseError as error:
        if access_fix(error, reads.user) is None:
            raise
        return NodeStatus(server.name, reachable=True)
    return NodeStatus(
        server.name,
        reachable=True,
        run_id=fields.get("run_id"),
        redis_version=server_version(fields),
    )


def summary_line(answers: Sequence[NodeAnswer[NodeCheck]], answering: int, quorum: int) -> str:
    """The INFO line: each node and its state, how many answer, whether a quorum does."""
    states = []
    for answer in answers:
        check = answer.value
        if check is None:
            states.append(f"{answer.node} DOWN ({answer.error})")
        elif check.denied is not None:
            states.append(f"{answer.node} REFUSES this worker")
        else:
            states.append(f"{answer.node} up")
    verdict = "a quorum answers" if answering >= quorum else "NO quorum answers"
    return (
        f"lock nodes: {answering} of {len(answers)} answer, {quorum} make a quorum: {verdict}; "
        + ", ".join(states)
    )


def denial_line(node: str, url: str, denied: str, answering: int) -> str:
    """The ERROR line of a node that refuses this worker's credentials or commands."""
    if "NOPERM" in denied or "ACL SETUSER" in denied:
        fix = (
            "grant the node's ACL user the commands and keys of README's ACL SETUSER line "
            "(the user is the one redlock_username or the URL names)"
        )
    elif has_credentials(url):
        fix = "correct the user and password in this node's URL in redlock_urls"
    else:
        fix = "set redlock_password (and redlock_username for an ACL user) to what it expects"
    return (
        f"lock node {node} refuses this worker ({denied}): a configuration fault, not an "
        f"outage; {fix}. Until then it has no vote ({answering} node(s) answer)"
    )


def no_quorum_line(total: int, answering: int, quorum: int) -> str:
    """The ERROR line when fewer than a quorum of nodes answer: what to check."""
    return (
        f"no quorum of lock nodes answers at worker start ({answering} of {total}, "
        f"{quorum} needed): no singleton task can take its lock until {quorum - answering} "
        "more answer (on_unavailable decides what runs do meanwhile). Check that redlock_urls "
        "names the right hosts and ports, that those Redis servers run and that this host can "
        "reach them, and the credentials (redlock_password or the URLs')"
    )
