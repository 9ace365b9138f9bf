"""The e2e guard (tests/helpers/e2e_guard.py): what counts as starting Ray or a run, and a pytester session
in which an unmarked test that starts one fails while a marked one passes."""

from __future__ import annotations

import os
import sys

import pytest

import e2e_guard
from e2e_guard import ray_or_run_start

PY = sys.executable
INI = "[pytest]\nasyncio_default_fixture_loop_scope = function\n"
RAY_BIN = "/venv/lib/python3.11/site-packages/ray/core/src/ray"


@pytest.mark.parametrize("executable, args", [
    (f"{RAY_BIN}/gcs/gcs_server", [f"{RAY_BIN}/gcs/gcs_server", "--log_dir=/tmp/ray"]),
    (None, [f"{RAY_BIN}/raylet/raylet", "--raylet_socket_name=x"]),
    ("/venv/bin/ray", ["/venv/bin/ray", "start", "--head", "--num-cpus=2"]),
    (PY, [PY, "-m", "verl_digen.main", "trainer.total_training_steps=1"]),
    (PY, [PY, "-m", "verl.trainer.main_ppo", "trainer.v1.trainer_mode=digen"]),
    (PY, [PY, "-c", "import ray; ray.init(num_cpus=1)"]),
    (PY, [PY, "-c", "from verl_digen.trainer.loop import run_training; run_training(cfg)"]),
])
def test_ray_and_runs_are_recognised(executable, args):
    assert ray_or_run_start(executable, args) is not None


@pytest.mark.parametrize("executable, args", [
    (PY, [PY, "-c", "import verl_digen.trainer.loop, verl_digen.main; print(1)"]),  # imports only
    (PY, [PY, "-m", "verl_digen.models.toy"]),
    (PY, [PY, "-m", "pytest", "-q"]),
    ("/venv/bin/ray", ["/venv/bin/ray", "stop", "--force"]),
    (None, "git status"),
])
def test_other_processes_are_not(executable, args):
    assert ray_or_run_start(executable, args) is None


FAKE_DAEMON = """
import os, stat, subprocess

import pytest


def _start_fake_gcs(tmp_path):
    # An executable named like Ray's daemon that exits at once: the guard sees the start.
    path = tmp_path / "gcs_server"
    path.write_text("#!/bin/sh\\nexit 0\\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    subprocess.run([str(path)], check=True)


def test_unmarked_start(tmp_path):
    _start_fake_gcs(tmp_path)


@pytest.mark.e2e
def test_marked_start(tmp_path):
    _start_fake_gcs(tmp_path)


def test_unmarked_plain_process():
    subprocess.run(["true"], check=True)


@pytest.fixture(scope="module")
def module_ray(tmp_path_factory):
    _start_fake_gcs(tmp_path_factory.mktemp("ray"))


def test_unmarked_start_in_a_module_fixture(module_ray):
    pass
"""


def test_the_guard_fails_only_unmarked_tests_that_start_ray(pytester: pytest.Pytester):
    here = os.path.dirname(os.path.abspath(e2e_guard.__file__))
    with open(os.path.join(here, "e2e_guard.py")) as f:
        pytester.makeconftest(f.read())
    pytester.makeini(INI + "markers =\n    e2e: starts Ray or a run\n")
    pytester.makepyfile(test_guarded=FAKE_DAEMON)
    result = pytester.runpytest("-p", "no:cacheprovider")
    # A start in a test fails it; a start in its fixture's setup is an error of that test.
    result.assert_outcomes(passed=2, failed=1, errors=1)
    result.stdout.fnmatch_lines([
        "*ERROR at setup of test_unmarked_start_in_a_module_fixture*",
        "test_guarded.py::test_unmarked_start_in_a_module_fixture started a Ray instance (gcs_server) "
        "without the e2e marker*",
        "*_ test_unmarked_start _*",
        "test_guarded.py::test_unmarked_start started a Ray instance (gcs_server) without the e2e marker*",
    ])
    # The fast lane deselects the marked test and still catches the unmarked ones.
    fast = pytester.runpytest("-p", "no:cacheprovider", "-m", "not e2e")
    fast.assert_outcomes(passed=1, failed=1, errors=1, deselected=1)
    e2e_guard._starts.clear()  # the inner sessions' fake starts, seen by this session's guard too


SLOW_FIXTURE = """
import pytest


@pytest.fixture(scope="session")
def shared_ray():
    raise AssertionError("started: the guard should have stopped the test first")


def test_unmarked_use(shared_ray):
    pass


@pytest.mark.e2e
def test_marked_use(shared_ray):
    pass
"""


def test_the_guard_fails_unmarked_tests_that_ask_for_the_shared_ray_before_it_starts(pytester: pytest.Pytester):
    here = os.path.dirname(os.path.abspath(e2e_guard.__file__))
    with open(os.path.join(here, "e2e_guard.py")) as f:
        pytester.makeconftest(f.read())
    pytester.makeini(INI + "markers =\n    e2e: starts Ray or a run\n")
    pytester.makepyfile(test_ray_use=SLOW_FIXTURE)
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(errors=2)
    result.stdout.fnmatch_lines([
        "*ERROR at setup of test_unmarked_use*",
        "test_ray_use.py::test_unmarked_use needs the shared Ray instance without the e2e marker*",
        "*ERROR at setup of test_marked_use*",
        "*AssertionError: started: the guard should have stopped the test first",
    ])
    assert "started: the guard" not in result.stdout.str().split("ERROR at setup of test_marked_use")[0]


LANES = """
import pytest


@pytest.mark.slow
def test_slow():
    pass


@pytest.mark.gpu
def test_gpu():
    pass


def test_fast():
    pass
"""


@pytest.mark.parametrize(("args", "ran"), [
    ((), {"test_slow", "test_fast"}),  # the plain ``pytest``: no gpu test
    (("-m", "not e2e"), {"test_fast"}),  # the fast lane: no slow test either
    (("-m", "gpu"), {"test_gpu"}),
])
def test_slow_tests_are_e2e_and_gpu_tests_run_only_when_asked_for(pytester: pytest.Pytester, args, ran):
    here = os.path.dirname(os.path.abspath(e2e_guard.__file__))
    with open(os.path.join(here, "e2e_guard.py")) as f:
        pytester.makeconftest(f.read())
    pytester.makeini(INI + "markers =\n    e2e: e2e\n    slow: slow\n    gpu: gpu\n")
    pytester.makepyfile(test_lanes=LANES)
    result = pytester.runpytest("-p", "no:cacheprovider", "-v", *args)
    result.assert_outcomes(passed=len(ran), deselected=3 - len(ran))
    for name in ran:
        result.stdout.fnmatch_lines([f"*::{name} PASSED*"])
