"""How a run fails, on the command line: a stale Ray marker (for ``verl_digen.main`` and
``main_ppo``), wandb without its API key, a driver killed with SIGKILL, a job that stops Ray, a
disk full at a checkpoint, a worker failing to start. Each says so in a few lines and leaves
nothing running. The checks made in this process: tests/unit/test_run_failures.py.

The command-line runs are subprocesses with a timeout. Ray state stays private: the stale
``ray_current_cluster`` marker is written under a temporary ``RAY_TMPDIR`` (Ray reads the marker
from ``$RAY_TMPDIR/ray``), never under the machine's /tmp/ray; the SIGKILL test's driver starts
its own local instance there too, and every process it leaves is stopped by PID."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
import ray

from runs import QUIET
from verl_digen.config.schema import DigenConfig
from test_run_failures import ray_tmpdir, _stale_marker  # noqa: F401 (ray_tmpdir: a fixture)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _env(**extra: str) -> dict[str, str]:
    """The job's environment without any Ray address, W&B setting or credential of this machine."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS" and not k.startswith("WANDB_")}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    env.update(extra)
    return env


def _main(tmp_path, *overrides: str, env: dict[str, str], timeout: int = 300) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "verl_digen.main", *QUIET, f"digen.output_dir={tmp_path / 'out'}",
                           *overrides],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)
    return proc, time.monotonic() - t0


# ----------------------------------------------------------------------------- A: a Ray cluster that does not answer


@pytest.mark.e2e
def test_a_stale_ray_marker_stops_the_job_in_seconds_naming_the_file(tmp_path, tiny_flux, ray_tmpdir):
    marker, address = _stale_marker(ray_tmpdir)
    proc, took = _main(tmp_path, "trainer.total_training_steps=1", env=_env(RAY_TMPDIR=ray_tmpdir), timeout=120)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("[verl-digen] error:")]
    assert len(errors) == 1, proc.stderr[-2000:]
    assert f"the Ray cluster at {address} does not answer" in errors[0]
    assert marker in errors[0] and "RAY_ADDRESS=local" in errors[0] and "remove that file" in errors[0]
    assert "Traceback" not in proc.stderr and "Failed to connect to GCS" not in proc.stderr
    assert took < 90, took  # Python, Hydra and the config checks; the probe itself is refused at once


@pytest.mark.e2e
def test_main_ppo_refuses_a_stale_ray_marker_before_starting_ray(tmp_path, tiny_flux, ray_tmpdir):
    marker, address = _stale_marker(ray_tmpdir)
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "verl.trainer.main_ppo", "trainer.v1.trainer_mode=digen",
                           "trainer.total_training_steps=1", "trainer.logger=[console]"],
                          cwd=tmp_path, env=_env(RAY_TMPDIR=ray_tmpdir), capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert f"the Ray cluster at {address} does not answer" in proc.stderr and marker in proc.stderr, proc.stderr[-3000:]
    assert "Failed to connect to GCS" not in proc.stderr
    assert time.monotonic() - t0 < 240


# ----------------------------------------------------------------------------- B: logger credentials


@pytest.mark.e2e
def test_wandb_without_an_api_key_stops_before_ray_naming_the_key(tmp_path, tiny_flux):
    # No key anywhere wandb looks: no WANDB_* variables, a NETRC file that does not exist, empty settings.
    env = _env(NETRC=str(tmp_path / "no_netrc"), WANDB_CONFIG_DIR=str(tmp_path / "wandb_settings"))
    proc, took = _main(tmp_path, "trainer.total_training_steps=1", "trainer.logger=[console,wandb]", env=env,
                       timeout=180)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "trainer.logger has 'wandb' but no W&B API key is configured" in proc.stderr
    assert "WANDB_API_KEY" in proc.stderr and "wandb login" in proc.stderr and "WANDB_MODE=offline" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert "Started a local Ray instance" not in proc.stdout + proc.stderr  # stopped before Ray
    assert not (tmp_path / "out" / "workers.json").exists()
    assert took < 120, took


# ----------------------------------------------------------------------------- C: a SIGKILLed driver


_DRIVER = textwrap.dedent("""
    import ray
    from verl_digen.config.schema import DigenConfig
    from verl_digen.trainer.runtime import init_ray
    init_ray(1, DigenConfig(ray_num_cpus=1))
    ray.get(ray.remote(lambda: 1).remote(), timeout=120)  # a worker process too
    print("ready", flush=True)
    import time
    time.sleep(600)
""")


def _kill_all(procs: list[psutil.Process]) -> None:
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=15)


def _name(p: psutil.Process) -> str:
    try:
        return p.name()
    except psutil.NoSuchProcess:
        return "(gone)"


def _running(procs: list[psutil.Process]) -> list[psutil.Process]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.mark.e2e
def test_a_sigkilled_driver_leaves_no_ray_process_behind(tmp_path, ray_tmpdir):
    """Without the job's reaper the dashboard and runtime-env agents outlived the driver by about
    a minute (they report the raylet's death to the GCS that died with it, 60 s timeout)."""
    driver = subprocess.Popen([sys.executable, "-c", _DRIVER], cwd=tmp_path, stdout=subprocess.PIPE, text=True,
                              env=_env(RAY_TMPDIR=ray_tmpdir), start_new_session=True)
    procs: list[psutil.Process] = []
    try:
        assert driver.stdout.readline().strip() == "ready"
        procs = psutil.Process(driver.pid).children(recursive=True)
        names = {_name(p) for p in procs}
        assert {"gcs_server", "raylet", "ray::DashboardAgent", "ray::RuntimeEnvAgent"} <= names, names
        assert any(p.name() == "python" and "ray_reaper.py" in " ".join(p.cmdline()) for p in procs if _running([p]))
        t0 = time.monotonic()
        driver.send_signal(signal.SIGKILL)
        driver.wait(timeout=30)
        while _running(procs) and time.monotonic() - t0 < 30:
            time.sleep(0.2)
        left = [(p.pid, _name(p)) for p in _running(procs)]
        assert not left, f"alive {time.monotonic() - t0:.0f} s after the driver's SIGKILL: {left}"
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait(timeout=30)
        _kill_all(_running(procs))


@pytest.mark.e2e
def test_a_job_that_stops_ray_stops_its_reaper():
    from verl_digen.trainer import runtime

    assert not ray.is_initialized()
    assert runtime.init_ray(1, DigenConfig(ray_num_cpus=1))
    reaper = runtime._reaper
    try:
        assert reaper is not None and reaper.poll() is None
    finally:
        runtime.release({}, True)
    assert runtime._reaper is None and reaper.poll() == 0 and not ray.is_initialized()


# ----------------------------------------------------------------------------- D: a worker failing mid-run


DISK_FULL_REWARD = '''
import errno, os

import ray

if ray.is_initialized():  # in the Ray worker only (the driver also loads this file, to check it)
    def fsync(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    os.fsync = fsync  # every checkpoint file is fsynced: the trainer rank's save fails as on a full disk


def compute_score(data_source, image, prompt, ground_truth, extra_info):
    return 0.5
'''


@pytest.mark.e2e
def test_a_disk_full_checkpoint_stops_in_a_few_lines_with_the_traceback_in_the_log(tmp_path, tiny_flux):
    """Colocated: the reward runs in the trainer rank's process, so the file above makes that
    rank's checkpoint writes fail with ENOSPC (DCP raises it from every rank). Before, the stop
    message held Ray's traceback of both ranks twice (124 lines)."""
    reward = tmp_path / "disk_full_reward.py"
    reward.write_text(DISK_FULL_REWARD)
    proc, took = _main(tmp_path, f"reward.custom_reward_function.path={reward}", "trainer.total_training_steps=2",
                       "trainer.save_freq=1", f"trainer.default_local_dir={tmp_path / 'ck'}", "digen.task_timeout_s=120",
                       env=_env(), timeout=600)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stderr.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("[verl-digen] run stopped after"))
    message = lines[first:]
    assert len(message) <= 10, "\n".join(message)
    assert "OSError: [Errno 28] No space left on device" in message[0]
    assert "DiffusionWorker.save_checkpoint_shard" in message[0]  # the task that failed
    log = tmp_path / "out" / "error.log"
    assert f"[verl-digen] full traceback: {log}" in message
    assert "Traceback" not in proc.stdout + proc.stderr
    text = log.read_text()
    assert text.count("Traceback (most recent call last)") >= 2  # the step's save and the save at the stop
    assert "sharded_state.py" in text and "No space left on device" in text and "fsync" in text
    assert took < 540


BROKEN_WORKER_REWARD = '''
import ray

if ray.is_initialized():  # fails in the worker that loads it, after the driver's check passed
    raise MemoryError("the reward model does not fit (injected by the test)")


def compute_score(data_source, image, prompt, ground_truth, extra_info):
    return 0.5
'''


@pytest.mark.e2e
def test_a_worker_failing_to_start_stops_in_a_few_lines_with_the_traceback_in_the_log(tmp_path, tiny_flux):
    from runs import run

    from verl_digen.trainer.loop import RunStopped

    reward = tmp_path / "broken_reward.py"
    reward.write_text(BROKEN_WORKER_REWARD)
    with pytest.raises(RunStopped) as info:
        run(tmp_path, "out", f"reward.custom_reward_function.path={reward}", "trainer.total_training_steps=1")
    message = str(info.value).splitlines()
    assert len(message) == 2, message
    assert message[0].startswith("[verl-digen] run failed after 0 completed steps: ")
    assert "the reward model does not fit (injected by the test)" in message[0]
    assert "init_model" in message[0]  # the Ray task that failed
    log = tmp_path / "out" / "error.log"
    assert message[1] == f"[verl-digen] full traceback: {log}"
    assert "broken_reward.py" in log.read_text() and "Traceback (most recent call last)" in log.read_text()
    assert not ray.is_initialized()
