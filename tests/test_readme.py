"""Every Python code block of README.md, and of the docs/ pages marked to run, runs as written.

Which blocks: every fenced block whose language is ``python`` in README.md; in ``docs/*.md``
only those right after a line ``<!-- runs -->``. Other languages (``bash``, ``text``: shell
commands, the ACL line, log lines) are not Python and are not run.

How a block runs: in a fresh module namespace, against real ``redis-server`` processes started
for the test, never the Redis a developer may have on port 6379. Before it runs, its text gets one
documented substitution:

- ``redis://localhost:6379/0`` (the broker and result back-end of the examples) becomes a
  harness server's URL;
- ``redis://r1:6379/0``, ``redis://r2:6379/0``, ``redis://r3:6379/0`` (the lock nodes of the
  examples) become the URLs of three harness servers, in that order;
- ``os.environ["REDLOCK_PASSWORD"]`` is set (to a throw-away value) while the block runs.

A block whose first line is ``# file: NAME.py`` is a file of the reader's project: it is also
written, with the same substitution, to a directory on ``sys.path``, so that later blocks can
``from NAME import ...`` as the reader would (the quick start's ``proj.py``). A block that waits
for results (``.get(``) runs beside an embedded worker (threads pool, two threads) of the app its
``# file:`` modules define, as the quick start's ``celery -A proj worker -c 2``. After a block
runs, every Celery app it made has its ``redlock_*`` settings validated, and every task it
defined is built, so lock options are checked (a lazy task is checked at its first use).
"""

from __future__ import annotations

import contextlib
import io
import re
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from celery import _state as celery_state
from celery.app.task import Task
from celery.contrib.testing.worker import start_worker
from celery.local import Proxy

from celery_redlock import RedlockSettings
from celery_redlock.testing import RedisNodes

ROOT = Path(__file__).resolve().parent.parent
RUNS_MARK = "<!-- runs -->"
FENCE = re.compile(r"^```(?P<language>[\w+-]*)[^\n]*\n(?P<code>.*?)^```[ \t]*$", re.S | re.M)
FILE_LINE = re.compile(r"\A# file: (?P<name>\w+)\.py\n")
BROKER_PLACEHOLDER = "redis://localhost:6379/0"
NODE_PLACEHOLDERS = ("redis://r1:6379/0", "redis://r2:6379/0", "redis://r3:6379/0")


@dataclass(frozen=True)
class Block:
    """One Python code block: where it is, and its text as written."""

    document: str
    line: int
    code: str

    @property
    def name(self) -> str:
        return f"{self.document}:{self.line}"

    @property
    def file_module(self) -> str | None:
        """The module name of a ``# file: NAME.py`` block, else None."""
        match = FILE_LINE.match(self.code)
        return match["name"] if match else None


def python_blocks(path: Path, marked_only: bool) -> list[Block]:
    """The ``python`` blocks of one Markdown file (with ``marked_only``: after RUNS_MARK only)."""
    text = path.read_text(encoding="utf-8")
    blocks = []
    for match in FENCE.finditer(text):
        if match["language"] != "python":
            continue
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
        if marked_only and before != RUNS_MARK:
            continue
        line = text.count("\n", 0, match.start()) + 1
        blocks.append(Block(str(path.relative_to(ROOT)), line, match["code"]))
    return blocks


def documented_blocks() -> list[Block]:
    blocks = python_blocks(ROOT / "README.md", marked_only=False)
    for page in sorted((ROOT / "docs").glob("*.md")):
        blocks.extend(python_blocks(page, marked_only=True))
    return blocks


BLOCKS = documented_blocks()


def substitute(code: str, broker: str, nodes: list[str]) -> str:
    """The block with the harness servers' URLs for the placeholders (see the module's text)."""
    code = code.replace(BROKER_PLACEHOLDER, broker)
    for placeholder, url in zip(NODE_PLACEHOLDERS, nodes, strict=True):
        code = code.replace(placeholder, url)
    assert ":6379" not in code, "a Redis URL that is no placeholder would reach a real Redis"
    return code


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[str, list[str]]]:
    """The broker's URL (one harness server) and three lock nodes' URLs, for the module: the
    reader's ``proj`` module is imported once, as in one real process."""
    with RedisNodes(4) as started:
        yield started.urls[3], started.urls[:3]


@pytest.fixture(scope="module")
def project(
    tmp_path_factory: pytest.TempPathFactory, servers: tuple[str, list[str]]
) -> Iterator[dict[str, Path]]:
    """The ``# file:`` blocks of every document, written with the harness URLs and importable.

    Leaves Celery's global state as it found it: the current app, and the shared tasks that
    ``singleton_task`` registers for apps made later (other test modules' apps)."""
    broker, nodes = servers
    directory = tmp_path_factory.mktemp("readme_project")
    files = {}
    for block in BLOCKS:
        if block.file_module:
            path = directory / f"{block.file_module}.py"
            path.write_text(substitute(block.code, broker, nodes), encoding="utf-8")
            files[block.file_module] = path
    previous_app = celery_state.get_current_app()
    finalizers = set(celery_state._on_app_finalizers)
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(directory))
        patch.setenv("REDLOCK_PASSWORD", "readme-test-password")
        for name in files:
            sys.modules.pop(name, None)
        yield files
        for name in files:
            module = sys.modules.pop(name, None)
            app = getattr(module, "app", None)
            if isinstance(app, Celery):
                app.close()
    celery_state._on_app_finalizers.intersection_update(finalizers)
    celery_state._set_current_app(previous_app)


def file_module_apps(files: dict[str, Path]) -> list[Celery]:
    """The Celery apps that the reader's ``# file:`` modules define (imported here)."""
    apps = []
    for name in files:
        module = __import__(name)
        apps.extend(value for value in vars(module).values() if isinstance(value, Celery))
    return apps


def check_definitions(namespace: dict[str, Any]) -> None:
    """Validate the settings of every app the block made, and build every task it defined."""
    for value in list(namespace.values()):
        if isinstance(value, Celery):
            RedlockSettings.from_conf(value.conf)
    for value in list(namespace.values()):
        if isinstance(value, Proxy | Task):
            assert value.name  # builds a lazy task: its lock options are checked now


@pytest.mark.timeout(60)
@pytest.mark.parametrize("block", BLOCKS, ids=[block.name for block in BLOCKS])
def test_block_runs(block: Block, servers: tuple[str, list[str]], project: dict[str, Path]) -> None:
    broker, nodes = servers
    code = substitute(block.code, broker, nodes)
    namespace: dict[str, Any] = {"__name__": f"readme_block_{block.line}"}
    module = types.ModuleType(namespace["__name__"])
    module.__dict__.update(namespace)
    output = io.StringIO()
    with contextlib.ExitStack() as stack:
        if block.file_module:
            # The reader's own file: import it as they would (``celery -A proj``).
            module = __import__(block.file_module)
        else:
            if ".get(" in code:
                for app in file_module_apps(project):
                    stack.enter_context(
                        start_worker(app, pool="threads", concurrency=2, perform_ping_check=False)
                    )
            sys.modules[module.__name__] = module
            stack.callback(sys.modules.pop, module.__name__, None)
            with contextlib.redirect_stdout(output):
                exec(compile(code, block.name, "exec"), module.__dict__)
        check_definitions(module.__dict__)
    if "report 7 2026-11-26" in code and ".get(" in code:
        # The quick start: the first call ran. (Whether the second was skipped depends on it
        # starting within the first's second of sleep: not asserted, a busy host may delay it.)
        assert "report 7 2026-11-26" in output.getvalue()


def test_the_documents_have_blocks_to_run() -> None:
    names = [block.name for block in BLOCKS]
    assert sum(name.startswith("README.md:") for name in names) >= 5, names
    assert any(block.file_module == "proj" for block in BLOCKS), "the quick start's proj.py"
    assert any(name.startswith("docs/") for name in names), "docs/ pages mark blocks to run"
