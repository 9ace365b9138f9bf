"""How a run fails (issue on hardening): a Ray cluster that does not answer, a logger without its
credentials. Each says so in a few lines and leaves nothing running. The command-line runs (a
stale Ray marker, wandb without its key, a driver killed with SIGKILL, a full disk, a worker
failing to start): tests/e2e/test_run_failures_e2e.py.

Ray state stays private: the stale ``ray_current_cluster`` marker is written under a temporary
``RAY_TMPDIR`` (Ray reads the marker from ``$RAY_TMPDIR/ray``), never under the machine's /tmp/ray."""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
import time

import pytest
import ray

from verl_digen.config.schema import ConfigError, DigenConfig


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
