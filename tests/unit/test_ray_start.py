"""The local Ray instance a job starts, on a busy machine: Ray gives its raylet a fixed 30 s to
register and raises "The current node timed out during startup"; the job tries again (at least
once, then while ``digen.ray_start_timeout_s`` lasts), stopping what the failed attempt left
running, and then stops in one line naming Ray's logs and the key to raise.

``ray.init`` is replaced by a stand-in that raises Ray's own exception: a machine loaded enough
to make a real raylet miss its 30 s cannot be produced on demand in a test, and waiting 30 s per
attempt would cost the suite minutes. The processes a failed attempt leaves are real ones."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest

from verl_digen.trainer import runtime
from verl_digen.trainer.runtime import RayStartError, start_local_ray

# Ray's message, as ray/_private/node.py raises it
TIMED_OUT = Exception("The current node timed out during startup. This could happen because some of the raylet "
                      "failed to startup or the GCS has become overloaded.")


class _Init:
    """A ray.init that times out ``failures`` times, then starts."""

    def __init__(self, failures: int):
        self.failures, self.calls = failures, 0

    def __call__(self) -> None:
        self.calls += 1
        if self.calls <= self.failures:
            raise TIMED_OUT


@pytest.fixture(autouse=True)
def _no_ray_shutdown(monkeypatch):
    import ray

    monkeypatch.setattr(ray, "shutdown", lambda: None)  # no instance runs here to stop


def test_a_node_start_that_times_out_is_tried_again(capsys):
    init = _Init(failures=1)
    start_local_ray(init, timeout_s=120)
    assert init.calls == 2
    assert "did not start within Ray's 30 s" in capsys.readouterr().out


def test_it_is_tried_again_at_least_once_then_stops_in_one_line_naming_logs_and_the_key():
    init = _Init(failures=10)
    with pytest.raises(RayStartError) as stopped:
        start_local_ray(init, timeout_s=0)
    assert init.calls == 2  # once more, although the bound had passed
    message = str(stopped.value)
    assert "\n" not in message
    assert "did not register within Ray's 30 s, 2 times" in message
    assert runtime.ray_logs_dir() in message and "digen.ray_start_timeout_s (now 0 s)" in message


def test_other_ray_errors_pass_as_they_are():
    def init():
        raise ValueError("Invalid resources")

    with pytest.raises(ValueError, match="Invalid resources"):
        start_local_ray(init, timeout_s=120)


def test_a_failed_start_leaves_no_ray_process_of_its_own_behind():
    """What ray.init had started before it raised (its GCS, its raylet: command lines naming files
    under Ray's package) is stopped; children of this process that started before the attempt, or
    that are not Ray's, are left alone."""
    sleep = [sys.executable, "-c", "import time; time.sleep(120)"]
    older = subprocess.Popen([*sleep, "/x/site-packages/ray/_private/log_monitor.py"])
    time.sleep(1.5)
    started: list[subprocess.Popen] = []

    def init():
        started.append(subprocess.Popen([*sleep, "/x/site-packages/ray/core/src/ray/raylet/raylet"]))
        started.append(subprocess.Popen([*sleep, "/x/site-packages/diffusers/other.py"]))
        raise TIMED_OUT

    try:
        with pytest.raises(RayStartError):
            start_local_ray(init, timeout_s=0)
        assert all(p.poll() is not None for p in started[::2])  # each attempt's Ray process: stopped
        assert all(p.poll() is None for p in started[1::2]) and older.poll() is None  # left alone
    finally:
        for p in (older, *started):
            p.kill()
            p.wait()
