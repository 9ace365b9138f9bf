"""Each test's lane, and the check that a test file's folder is the lane of every test in it
(tests/unit/test_layout.py).

A test's lane is what its markers select: ``gpu`` (``pytest -m gpu``), else ``e2e`` (an ``e2e`` or
``slow`` marker: ``e2e_guard`` marks every slow test e2e too), else ``unit`` (the fast lane,
``pytest -m "not e2e"``). The markers stay what selects a lane; the folders (``tests/unit``,
``tests/e2e``, ``tests/gpu``) only have to agree with them.

tests/conftest.py records the lane of every test it collects, before ``-m`` deselects any
(:func:`record`); :func:`collected_lanes` reads that record when this session collected every
test file, and otherwise collects the whole suite in a fresh pytest (``pytest
tests/unit/test_layout.py`` alone still checks every file)."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import tempfile

import pytest
from suite_paths import LANES, REPO, TESTS

#: ``{test file, relative to tests/: {test id: its lane}}`` of this session's collection.
COLLECTED = pytest.StashKey[dict]()
#: Where :func:`record` also writes its record as JSON (the fresh pytest of :func:`collected_lanes`).
REPORT_ENV = "DIGEN_TEST_LANES_REPORT"


def lane(item: pytest.Item) -> str:
    """The lane whose ``-m`` expression selects ``item``, from its markers."""
    if item.get_closest_marker("gpu") is not None:
        return "gpu"
    if item.get_closest_marker("e2e") is not None or item.get_closest_marker("slow") is not None:
        return "e2e"
    return "unit"


def record(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Remember the lane of every collected test, by file (written as JSON too where
    ``DIGEN_TEST_LANES_REPORT`` names a file)."""
    files: dict[str, dict[str, str]] = {}
    for item in items:
        path = os.path.relpath(str(item.path), TESTS)
        files.setdefault(path, {})[item.nodeid.split("::", 1)[-1]] = lane(item)
    config.stash[COLLECTED] = files
    report = os.environ.get(REPORT_ENV)
    if report:
        with open(report, "w") as f:
            json.dump(files, f)


def suite_test_files() -> set[str]:
    """Every ``test_*.py`` under tests/, relative to it."""
    return {os.path.relpath(p, TESTS) for p in glob.glob(os.path.join(TESTS, "**", "test_*.py"), recursive=True)}


def collected_lanes(config: pytest.Config) -> dict[str, dict[str, str]]:
    """Every test file's tests and their lanes: this session's record when it collected every test
    file, else a fresh ``pytest --collect-only`` of tests/."""
    files = config.stash.get(COLLECTED, {})
    if set(files) >= suite_test_files():
        return files
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "lanes.json")
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
        env[REPORT_ENV] = report
        proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", TESTS],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"collecting tests/ failed:\n{proc.stdout[-5000:]}{proc.stderr[-3000:]}"
        with open(report) as f:
            return json.load(f)


def misplaced(files: dict[str, dict[str, str]]) -> list[str]:
    """What breaks the layout: a test file outside the lanes' folders, or a test whose lane is not
    its folder's (one line each)."""
    problems = []
    for path, tests in sorted(files.items()):
        folder = path.split(os.sep)[0] if os.sep in path else None
        if folder not in LANES:
            problems.append(f"tests/{path}: a test file outside tests/{{{','.join(LANES)}}}/")
            continue
        for test, its_lane in sorted(tests.items()):
            if its_lane != folder:
                problems.append(f"tests/{path}::{test} is in tests/{folder}/ but its markers put it in the "
                                f"{its_lane} lane (move it to tests/{its_lane}/)")
    return problems
