"""The e2e guard: a test that starts Ray or a whole run without the ``e2e`` marker fails, so the
fast lane (``pytest -m "not e2e"``, what a developer runs first) cannot quietly grow slow.

Seen through Python's audit hook on ``subprocess.Popen``: ``ray.init`` starting a local instance
spawns ``gcs_server`` and ``raylet``; ``ray start`` and the entry points that run a job are
commands. A test that only joins a Ray instance another test started is caught by the fast lane
itself, where no e2e test started one. A process group of ranks (``runs.run_ranks``: processes that
run a job's FSDP code) counts too, through :func:`note_start`. Asking for the shared Ray
instance needs the marker too. The ``gpu`` tests are left out unless ``-m`` names them.
tests/conftest.py registers the hooks; they are plain (no fixtures) so that
tests/unit/test_fast_lane.py can load this file alone in a pytester session."""

from __future__ import annotations

import os
import sys

import pytest

#: Executables a starting Ray instance spawns (``ray.init`` without an address, ``ray start``).
RAY_DAEMONS = ("gcs_server", "raylet")
#: Modules whose ``python -m`` runs a whole job (and starts Ray).
RUN_MODULES = ("verl_digen.main", "verl.trainer.main_ppo", "verl_digen.compare", "verl_digen.emulate",
               "verl_digen.profile")
#: What a ``python -c`` program that starts Ray or a run contains.
RUN_CODE = ("ray.init(", "init_ray(", "run_training(")
#: Fixtures only e2e tests may ask for: Ray itself.
E2E_FIXTURES = {"shared_ray": "the shared Ray instance"}


def ray_or_run_start(executable: object, args: object) -> str | None:
    """What a new process starts, if it is Ray or a whole run (else None): a Ray daemon, the
    ``ray start`` CLI, ``python -m`` of an entry point that runs a job, or ``python -c`` code
    calling ``ray.init`` / ``init_ray`` / ``run_training``. ``executable`` and ``args`` as the
    ``subprocess.Popen`` audit event gives them."""
    argv = [args] if isinstance(args, (str, bytes)) else list(args or ())
    argv = [a.decode() if isinstance(a, bytes) else str(a) for a in argv]
    program = os.path.basename(str(executable or (argv[0] if argv else "")))
    if program in RAY_DAEMONS:
        return f"a Ray instance ({program})"
    if program == "ray" and "start" in argv[1:]:
        return "a Ray node (`ray start`)"
    for flag, value in zip(argv, argv[1:]):
        if flag == "-m" and value in RUN_MODULES:
            return f"a run (`python -m {value}`)"
        if flag == "-c" and any(code in value for code in RUN_CODE):
            return "Ray or a run (`python -c` code that starts one)"
    return None


_starts: list[str] = []  # what the running test started (its setup, call and teardown)


def note_start(what: str) -> None:
    """Say that the running test starts ``what``, an e2e thing the audit hook cannot see (the
    ranks of ``runs.run_ranks``: multiprocessing starts them without ``subprocess``)."""
    _starts.append(what)


def _audit(event: str, args: tuple) -> None:
    """Audit hook: note every process start that is Ray or a whole run. Ray starts its
    daemons with ``subprocess.Popen``, so an ``ray.init`` deep in a run is seen too."""
    if event == "subprocess.Popen":
        started = ray_or_run_start(args[0], args[1])
        if started is not None:
            _starts.append(started)


def pytest_configure(config: pytest.Config) -> None:
    sys.addaudithook(_audit)  # cannot be removed; it only appends to _starts


@pytest.hookimpl(tryfirst=True)  # before ``-m`` selects: it sees the e2e marks added here
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every ``slow`` test ``e2e`` too, and deselect the ``gpu`` tests unless the ``-m``
    expression names them (``pytest -m gpu``), so that the plain ``pytest`` and the fast lane
    ``pytest -m "not e2e"`` both leave them out (a ``-m 'not gpu'`` in addopts would be replaced
    by the user's ``-m``)."""
    for item in items:  # a slow test is never in the fast lane
        if item.get_closest_marker("slow") is not None and item.get_closest_marker("e2e") is None:
            item.add_marker(pytest.mark.e2e)
    if "gpu" in (config.option.markexpr or ""):
        return
    kept = [item for item in items if item.get_closest_marker("gpu") is None]
    if len(kept) < len(items):
        config.hook.pytest_deselected(items=[item for item in items if item.get_closest_marker("gpu") is not None])
        items[:] = kept


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Fail a test without the ``e2e`` marker that asks for an e2e fixture, before it is built."""
    slow = [E2E_FIXTURES[name] for name in getattr(item, "fixturenames", ()) if name in E2E_FIXTURES]
    if slow and item.get_closest_marker("e2e") is None:
        pytest.fail(f"{item.nodeid} needs {', '.join(slow)} without the e2e marker: mark it @pytest.mark.e2e",
                    pytrace=False)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    _starts.clear()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """Fail a phase of a test without the ``e2e`` marker that started Ray or a run, so that the
    fast lane cannot quietly grow slow."""
    outcome = yield
    report = outcome.get_result()
    if not _starts or item.get_closest_marker("e2e") is not None:
        return
    started, _starts[:] = sorted(set(_starts)), []
    if report.passed or report.skipped:
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid} started {', '.join(started)} without the e2e marker: "
                           "mark it @pytest.mark.e2e (the fast lane, pytest -m 'not e2e', runs no Ray)")
