"""How a run fails (issue on hardening): a Ray cluster that does not answer, a logger without its
credentials, a driver killed with SIGKILL, a worker failing mid-run. Each says so in a few lines
and leaves nothing running.

The command-line runs are subprocesses with a timeout. Ray state stays private: the stale
``ray_current_cluster`` marker is written under a temporary ``RAY_TMPDIR`` (Ray reads the marker
from ``$RAY_TMPDIR/ray``), never under the machine's /tmp/ray; the SIGKILL test's driver starts
its own local instance there too, and every process it leaves is stopped by PID.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time

import psutil
import pytest
import ray

from runs import QUIET
from verl_digen.config.schema import ConfigError, DigenConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


@pytest.fixture
def ray_tmpdir():
    """A private Ray temp directory (short: Ray's unix sockets live under it), removed afterwards."""
    path = tempfile.mkdtemp(prefix="digen-rt-")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _stale_marker(ray_tmpdir: str) -> tuple[str, str]:
    """``ray_current_cluster`` as ``ray start`` leaves it, naming a port where nothing listens."""
    address = f"127.0.0.1:{_free_port()}"
    os.makedirs(os.path.join(ray_tmpdir, "ray"), exist_ok=True)
    marker = os.path.join(ray_tmpdir, "ray", "ray_current_cluster")
    with open(marker, "w") as f:
        f.write(address)
    return marker, address


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


def test_ray_address_local_starts_a_local_instance_whatever_the_marker_says(ray_tmpdir, monkeypatch):
    from verl_digen.trainer.runtime import ray_target

    marker, address = _stale_marker(ray_tmpdir)
    monkeypatch.setenv("RAY_TMPDIR", ray_tmpdir)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert ray_target(None) == (address, f"the marker file {marker}")  # Ray's own lookup reads the private marker
    assert ray_target("local")[0] is None
    monkeypatch.setenv("RAY_ADDRESS", "local")
    assert ray_target(None)[0] is None


def test_a_ray_address_that_does_not_answer_is_refused_in_seconds(monkeypatch):
    from verl_digen.trainer.runtime import init_ray

    address = f"127.0.0.1:{_free_port()}"
    monkeypatch.setenv("RAY_ADDRESS", address)
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=rf"the Ray cluster at RAY_ADDRESS={address} does not answer .*"
                                          r"RAY_ADDRESS=local to start a local Ray instance"):
        init_ray(1, DigenConfig())
    with pytest.raises(ConfigError, match=rf"ray_kwargs.ray_init.address={address} does not answer"):
        init_ray(1, DigenConfig(), address=address)
    assert time.monotonic() - t0 < 30
    assert not ray.is_initialized()


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


@pytest.fixture
def fresh_wandb(tmp_path, monkeypatch):
    """This process as a fresh one looks to wandb: the job's environment as ``_env`` makes it (no
    W&B setting or credential of this machine; ``NETRC`` and ``WANDB_CONFIG_DIR`` under
    ``tmp_path``), the working directory ``tmp_path``, and no wandb settings singleton or session
    credentials yet (wandb builds its settings once per process and keeps them: a new one is what
    a fresh interpreter, and ``wandb.init`` in it, would build). In process: an interpreter start
    and wandb's import per case cost seconds of the fast lane, and the subprocess is not what is
    tested. Yields the environment to update (through ``monkeypatch``)."""
    from wandb.sdk import wandb_setup
    from wandb.sdk.lib.wbauth import authenticate

    for key in list(os.environ):
        if key == "RAY_ADDRESS" or key.startswith("WANDB_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_settings"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(wandb_setup, "_singleton", None)
    monkeypatch.setattr(authenticate, "_session_auth", None)
    try:
        yield monkeypatch
    finally:
        wandb_setup.teardown()  # the singleton this test built (its asyncio thread); the old one comes back


@pytest.mark.parametrize("setting", ["none", "offline", "disabled", "api_key", "netrc"])
def test_wandb_key_sources_that_let_a_run_start(tmp_path, fresh_wandb, setting):
    """What wandb itself accepts (asked as ``wandb.init`` will, with the settings a fresh process
    builds: wandb caches its settings per process)."""
    from wandb.sdk import wandb_setup

    from verl_digen.trainer.resolve import wandb_key_problem

    if setting in ("offline", "disabled"):
        fresh_wandb.setenv("WANDB_MODE", setting)
    elif setting == "api_key":
        fresh_wandb.setenv("WANDB_API_KEY", "k" * 40)
    elif setting == "netrc":
        host = wandb_setup.singleton().settings.base_url.split("://")[-1]
        (tmp_path / "netrc").write_text(f"machine {host}\n  login user\n  password {'k' * 40}\n")
        (tmp_path / "netrc").chmod(0o600)
        wandb_setup.teardown()  # asked below with settings built afresh, as by another process
    answer = repr(wandb_key_problem())
    if setting == "none":
        assert answer.startswith("'no W&B API key is configured"), answer
    else:
        assert answer == "None", answer


def test_wandb_mode_set_after_wandb_read_its_settings_is_honoured(tmp_path, fresh_wandb):
    """wandb builds its settings once per process; a WANDB_MODE set later (a test's monkeypatch, a
    driver that sets it before main) is what ``wandb.init`` reads, so the check reads it too."""
    from verl_digen.trainer.resolve import wandb_key_problem

    fresh_wandb.setenv("NETRC", str(tmp_path / "no_netrc"))
    fresh_wandb.setenv("WANDB_BASE_URL", "https://api.example.invalid")
    before = wandb_key_problem()  # builds this process's settings, without WANDB_MODE
    fresh_wandb.setenv("WANDB_MODE", "disabled")
    after = wandb_key_problem()
    assert repr(before).startswith("'no W&B API key is configured for https://api.example.invalid"), before
    assert after is None, after


def test_a_logger_whose_package_or_variables_are_missing_is_named(monkeypatch):
    from verl_digen.trainer import resolve

    monkeypatch.setitem(resolve.LOGGER_PACKAGES, "mlflow", "no_such_package_for_this_test")
    with pytest.raises(ConfigError, match=r"trainer.logger has 'mlflow' but the no_such_package_for_this_test "
                                          r"package is not installed"):
        resolve.check_logger_setup(["console", "mlflow"])
    monkeypatch.setitem(resolve.LOGGER_PACKAGES, "vemlp_wandb", "json")  # installed: only the variables are missing
    for key in resolve.LOGGER_ENV["vemlp_wandb"]:
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(ConfigError, match=r"'vemlp_wandb', which reads VOLC_ACCESS_KEY_ID, VOLC_SECRET_ACCESS_KEY, "
                                          r"MLP_TRACKING_REGION"):
        resolve.check_logger_setup(["vemlp_wandb"])
    resolve.check_logger_setup(["console", "file", "tensorboard"])  # nothing to check, and installed


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
