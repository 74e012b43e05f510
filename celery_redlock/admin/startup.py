"""What a worker logs about its lock nodes when it starts (`report_lock_nodes`, on
``worker_ready``): an INFO line with every node's state and whether a quorum answers; an ERROR
line without a quorum, and per node that refuses this worker's credentials or ACL (with the
fix); a WARNING per Redis server that several nodes reach. Each node gets PING, ``INFO server``
and one read through the read script, which only an ACL allowing the lock scripts permits.
Nothing is written.
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

CHECK_RESOURCE = "celery-redlock-start-check"  # its (absent) lock key is read: never locked
SHORTEST_TIMEOUT = 1.0  # seconds per node at least: a starting worker is in no hurry


@dataclass(frozen=True)
class NodeCheck:
    """One node at worker start: its identity, or ``denied``: why it refuses this worker."""

    status: NodeStatus
    denied: str | None = None


def report_lock_nodes(sender: Any = None, **_: Any) -> None:
    """``worker_ready`` handler: log the start-up report, when the app has singleton tasks."""
    app = getattr(sender, "app", None)
    if app is None or not any(isinstance(task, SingletonTask) for task in app.tasks.values()):
        return
    try:
        report(app)
    except Exception:  # the report must never keep a worker from starting
        logger.exception("celery_redlock could not check its lock nodes at worker start")


def report(app: Any) -> list[NodeCheck | None]:
    """Check every lock node at once and log the report; each node's check (None: no answer)."""
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
    """Identify the node's servers, then read ``key`` through the read script (EVAL: this checks
    the ACL, not the scripts' cache); a credentials or ACL refusal is ``denied``, anything else
    raises."""
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
    """One server's ``run_id`` and version (``INFO server``; unknown when an ACL denies it)."""
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
    return (
        f"no quorum of lock nodes answers at worker start ({answering} of {total}, "
        f"{quorum} needed): no singleton task can take its lock until {quorum - answering} "
        "more answer (on_unavailable decides what runs do meanwhile). Check that redlock_urls "
        "names the right hosts and ports, that those Redis servers run and that this host can "
        "reach them, and the credentials (redlock_password or the URLs')"
    )
