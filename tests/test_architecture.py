"""The package's shape, checked on every run (the contract checker `.ci/run` runs with the suite):

- no import cycles between celery_redlock's modules — imports inside functions and
  ``TYPE_CHECKING`` blocks included;
- subpackages show the layers (`lock` and its `nodes`, `integration`, `beat`, `admin`,
  `fencing`, `testing`): a module may use the private (underscore) names of a module of its own
  subpackage, never of another's;
- no module over 600 lines (about 500 is the guide), but the nodes layer, whose multiplexed I/O
  is long by nature;
- `Redlock` keeps at most ten public members, all named in README.

Read from the source with `ast`, without importing anything.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = "celery_redlock"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE
# About 500 lines is a guide, never a reason to split one concern; past 600 a module holds two.
LONGEST_MODULE = 600
ALLOWED_LONGER = {"celery_redlock.lock.nodes"}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(ROOT.rglob("*.py"))}


def is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def resolve(name: str, node: ast.ImportFrom) -> str:
    """The absolute module an ``from ... import`` statement in module ``name`` imports from."""
    if node.level == 0:
        return node.module or ""
    base = name.split(".") if is_package(name) else name.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def imports_of(name: str) -> Iterator[tuple[str, str | None, int]]:
    """(module imported, name imported from it or None, line) for every import in ``name``."""
    tree = ast.parse(MODULES[name].read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None, node.lineno
        elif isinstance(node, ast.ImportFrom):
            source = resolve(name, node)
            for alias in node.names:
                yield source, alias.name, node.lineno


def dependencies(name: str) -> set[str]:
    """The package's modules that ``name`` imports (a submodule imported by name included)."""
    found = set()
    for source, imported, _ in imports_of(name):
        if imported is not None and f"{source}.{imported}" in MODULES:
            found.add(f"{source}.{imported}")
        elif source in MODULES:
            found.add(source)
    found.discard(name)
    return found


def test_the_package_has_no_import_cycles() -> None:
    graph = {name: dependencies(name) for name in MODULES}
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(name: str) -> None:
        state[name] = "visiting"
        stack.append(name)
        for target in sorted(graph[name]):
            if state.get(target) == "visiting":
                cycle = [*stack[stack.index(target) :], target]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target)
        stack.pop()
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name)
    print(f"\n{len(graph)} modules, {sum(map(len, graph.values()))} imports, no cycle")


def package_of(name: str) -> str:
    """The (sub)package a module belongs to: a package's own ``__init__`` belongs to it."""
    return name if is_package(name) else name.rpartition(".")[0]


def test_no_private_name_crosses_subpackages() -> None:
    # A subpackage's modules may share its internals; a private name never crosses subpackages.
    offences = []
    for name in MODULES:
        tree = ast.parse(MODULES[name].read_text())
        aliases: dict[str, str] = {}  # local name -> package module it stands for
        for source, imported, line in imports_of(name):
            if not source.startswith(PACKAGE):
                continue
            private = imported is not None and imported.startswith("_")
            if private and not imported.startswith("__") and package_of(source) != package_of(name):
                offences.append(f"{name}:{line} imports {source}.{imported}")
            if imported is not None and f"{source}.{imported}" in MODULES:
                aliases[imported] = f"{source}.{imported}"
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and package_of(aliases[node.value.id]) != package_of(name)
            ):
                offences.append(f"{name}:{node.lineno} uses {aliases[node.value.id]}.{node.attr}")
    assert not offences, "\n".join(offences)


def test_no_module_is_longer_than_its_limit() -> None:
    sizes = {name: len(path.read_text().splitlines()) for name, path in MODULES.items()}
    too_long = {
        name: lines
        for name, lines in sizes.items()
        if lines > LONGEST_MODULE and name not in ALLOWED_LONGER
    }
    assert not too_long, f"modules over {LONGEST_MODULE} lines: {too_long}"


def test_redlock_has_at_most_ten_public_members_all_in_the_readme() -> None:
    # What users call; helpers of one internal caller are module functions of its module.
    from celery_redlock import Redlock

    instance_attributes = {"quorum"}  # set in __init__: not on the class
    members = {name for name in vars(Redlock) if not name.startswith("_")} | instance_attributes
    assert len(members) <= 10, sorted(members)
    readme = (ROOT.parent / "README.md").read_text(encoding="utf-8")
    missing = [name for name in sorted(members) if f"`{name}" not in readme]
    assert missing == [], f"Redlock members README does not name: {missing}"
