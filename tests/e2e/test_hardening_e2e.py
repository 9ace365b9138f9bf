"""Hardening (issue 18) in real runs and processes: resuming from a crafted checkpoint stops before
training (the pickle never runs), a bad config exits 2 from the command line in seconds, and the
Ray instance the job starts listens on loopback only. The rest: tests/unit/test_hardening.py."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import psutil
import pytest
import ray

from runs import QUIET, run_config
from verl_digen.trainer.checkpoint import CheckpointError, checkpoint_at
from test_hardening import _loopback, _Payload, _rewrite_checksums


@pytest.mark.e2e
def test_resuming_from_a_crafted_checkpoint_stops_before_training(tmp_path, tiny_flux):
    from verl_digen.trainer.loop import run_training

    ck = tmp_path / "ck"
    run_training(run_config(tmp_path, "a", "trainer.total_training_steps=1", "trainer.save_freq=1",
                            f"trainer.default_local_dir={ck}"))
    ckpt = checkpoint_at(str(ck / "global_step_1"))
    marker = tmp_path / "pwned"
    # The trainer rank's own file (sharded checkpoints): the rank refuses it, the driver names it.
    with open(os.path.join(ckpt.path, "trainer_rank0.pt"), "wb") as f:
        pickle.dump({"version": 1, "rng": _Payload(str(marker))}, f)
    _rewrite_checksums(ckpt)
    with pytest.raises(CheckpointError, match=r"trainer_rank0\.pt: refused"):
        run_training(run_config(tmp_path, "b", "trainer.total_training_steps=2", f"trainer.default_local_dir={ck}"))
    assert not marker.exists()
    assert not ray.is_initialized()


@pytest.mark.e2e
def test_bad_config_exits_2_from_the_command_line_in_seconds(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "verl_digen.main", *QUIET, "trainer.logger=[nonexistent]",
         f"digen.output_dir={tmp_path / 'x'}"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 2, out.stderr[-2000:]
    assert "trainer.logger" in out.stderr and "Traceback" not in out.stderr


# ----------------------------------------------------------------------------- sockets


def _listening(pid: int) -> list[str]:
    try:
        conns = psutil.Process(pid).net_connections(kind="tcp")
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return []
    return [c.laddr.ip for c in conns if c.status == psutil.CONN_LISTEN]


@pytest.mark.e2e
def test_ray_started_by_the_job_listens_on_loopback_only():
    from verl_digen.config.schema import DigenConfig
    from verl_digen.trainer.runtime import init_ray

    assert not ray.is_initialized()
    assert init_ray(1, DigenConfig(ray_num_cpus=1))
    try:
        ray.get(ray.remote(lambda: 1).remote(), timeout=120)  # a worker process too
        procs = [psutil.Process()] + psutil.Process().children(recursive=True)
        addrs = {(p.name(), ip) for p in procs for ip in _listening(p.pid)}
        assert addrs, "no Ray process listens at all?"
        assert all(_loopback(ip) for _, ip in addrs), sorted(addrs)
    finally:
        ray.shutdown()
