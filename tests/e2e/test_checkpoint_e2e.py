"""Checkpoint and resume in real runs: a resume after a kill equals the uninterrupted run (sync and
async), failures (a killed worker, non-finite gradients, a failing reward server, Ctrl-C and
SIGTERM) stop cleanly with a checkpoint, and exports load in diffusers. The checkpoint files
alone: tests/unit/test_checkpoint.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import ray
import torch
from safetensors.torch import load_file

from verl_digen.config.compose import compose_config
from verl_digen.trainer.checkpoint import find_latest
from runs import QUIET, metrics_lines, run_config, shared_ray_driver_env, timeline_records
from verl_digen.trainer.loop import RunStopped, run_training

EXACT_KEYS = ("reward_mean", "reward_std", "actor/loss", "actor/grad_norm", "policy_version", "step")


# ----------------------------------------------------------------------------- runs


def _wait_for(predicate, timeout_s: float):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return False


def _main_cmd(*overrides):
    return [sys.executable, "-m", "verl_digen.main", *QUIET, *overrides]


@pytest.fixture
def no_ray():
    assert not ray.is_initialized()
    yield
    if ray.is_initialized():
        ray.shutdown()


@pytest.mark.e2e
def test_resume_after_a_kill_equals_the_uninterrupted_run(tmp_path, tiny_flux, shared_ray):
    common = ["trainer.total_training_steps=5", "trainer.save_freq=1", "digen.save_final_weights=true"]
    straight = run_training(run_config(tmp_path, "straight", *common, f"trainer.default_local_dir={tmp_path}/ck_a"))

    ck = tmp_path / "ck_b"
    out = tmp_path / "killed"
    proc = subprocess.Popen(
        _main_cmd(*common, f"trainer.default_local_dir={ck}", f"digen.output_dir={out}"),
        start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        assert _wait_for(lambda: (ck / "global_step_2" / "meta.json").exists(), 300), "no checkpoint appeared"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the driver and its Ray processes, mid-run
        proc.wait(timeout=60)
    killed_at = find_latest(str(ck)).step
    assert 2 <= killed_at < 5 or killed_at == 5

    resumed = run_training(run_config(tmp_path, "resumed", *common, f"trainer.default_local_dir={ck}"))
    a, b = load_file(straight.extra["final_weights"]), load_file(resumed.extra["final_weights"])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ma, mb = metrics_lines(straight.output_dir), metrics_lines(resumed.output_dir)
    assert len(ma) == len(mb) == 5
    for x, y in zip(ma, mb):
        assert {k: x[k] for k in EXACT_KEYS} == {k: y[k] for k in EXACT_KEYS}


@pytest.mark.e2e
def test_async_resume_regenerates_in_flight_groups_and_keeps_the_invariants(tmp_path, tiny_flux, shared_ray):
    """Rule: groups generated ahead on stale weights before the checkpoint are not saved; the
    resumed run regenerates them with the checkpoint's weights. Same groups, each trained once.
    And veRL's rule for ``trainer.val_before_train`` on a resume: the weights training resumes
    from are validated first, at their step (here what the first run validated after step 2)."""
    common = ["digen.placement=disaggregated", "digen.gap.enable=true", "digen.async.max_staleness=1",
              "digen.pools.rollout.devices=1", "digen.pools.trainer.devices=1", "trainer.save_freq=1",
              f"trainer.default_local_dir={tmp_path}/ck", "trainer.test_freq=2"]
    first = run_training(run_config(tmp_path, "part1", *common, "trainer.total_training_steps=2"))
    resumed = run_training(run_config(tmp_path, "part2", *common, "trainer.total_training_steps=4",
                                      "trainer.val_before_train=true"))
    validated_at_2 = {k: v for k, v in first.metrics[-1].items() if k.startswith("val/")}
    assert validated_at_2 and resumed.extra["val_before_train"] == validated_at_2
    assert os.path.exists(os.path.join(resumed.output_dir, "val", "val_step000002.png"))
    recs = timeline_records(resumed.output_dir)
    trained = sorted(g for r in recs if r["kind"] == "train" for g in r["groups"])
    assert trained == list(range(8, 16))  # steps 3-4 (groups 8..15), each exactly once
    for r in recs:
        if r["kind"] == "generate":
            assert 0 <= r["step"] - r["version"] <= 1
    assert [m["step"] for m in metrics_lines(resumed.output_dir)] == [1, 2, 3, 4]


@pytest.mark.e2e
def test_killed_worker_stops_the_run_with_its_name_and_the_run_resumes(tmp_path, tiny_flux, no_ray):
    out = tmp_path / "victim"
    ck = tmp_path / "ck"
    common = ["digen.placement=disaggregated", "digen.pools.rollout.devices=1", "digen.pools.trainer.devices=1",
              "trainer.save_freq=1", f"trainer.default_local_dir={ck}", "digen.task_timeout_s=60"]
    killed = {}

    def killer():
        if _wait_for(lambda: (ck / "global_step_1" / "meta.json").exists() and (out / "workers.json").exists(), 300):
            workers = json.loads((out / "workers.json").read_text())
            pid = next(w["pid"] for w in workers if w["worker"] == "rollout0")
            killed["t"] = time.time()
            os.kill(pid, signal.SIGKILL)

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    with pytest.raises(RunStopped) as err:
        run_training(compose_config(QUIET + common + ["trainer.total_training_steps=200", f"digen.output_dir={out}"]))
    stopped = time.time()
    thread.join(timeout=5)
    msg = str(err.value)
    assert "rollout0" in msg and "pool 'rollout'" in msg and "resume_mode=auto" in msg
    assert stopped - killed["t"] < 60  # bounded: no hang
    ray.shutdown()
    done = find_latest(str(ck)).step
    resumed = run_training(compose_config(QUIET + common + [f"trainer.total_training_steps={done + 1}",
                                                             f"digen.output_dir={tmp_path}/after"]))
    assert resumed.metrics[-1]["step"] == done + 1


@pytest.mark.e2e
def test_non_finite_gradients_are_skipped_counted_and_stop_the_run(tmp_path, tiny_flux, shared_ray):
    """NaN gradients are injected (digen.fault_nonfinite_grad_steps): a real blow-up also turns
    the sampled images into NaN, which the reward refuses first, so it cannot isolate this path."""
    with pytest.raises(RunStopped, match="non-finite"):
        run_training(run_config(tmp_path, "nan", "digen.fault_nonfinite_grad_steps=[2,4]", "trainer.total_training_steps=6",
                          "digen.max_nonfinite_steps=1", f"trainer.default_local_dir={tmp_path}/ck",
                          "digen.save_final_weights=false"))
    metrics = metrics_lines(tmp_path / "nan")
    assert [m["actor/skipped_nonfinite"] for m in metrics] == [0.0, 1.0, 0.0, 1.0]
    # A skipped step leaves the weights (and the version count of applied updates) as they were.
    assert [m["policy_version"] for m in metrics] == [1, 2, 3, 4]
    assert find_latest(str(tmp_path / "ck")).step == 4  # a checkpoint to resume from


@pytest.mark.e2e
def test_reward_server_failure_stops_with_a_checkpoint_and_names_the_server(tmp_path, tiny_flux, shared_ray):
    from verl_digen.rewards.serve import RewardServer

    server = RewardServer("brightness", host="127.0.0.1", port=0)
    server.start()
    ck = tmp_path / "ck"

    def stop_server():
        if _wait_for(lambda: (ck / "global_step_1" / "meta.json").exists(), 300):
            server.stop()

    threading.Thread(target=stop_server, daemon=True).start()
    try:
        with pytest.raises(RunStopped) as err:
            run_training(run_config(
                tmp_path, "rs", "digen.reward.name=http", f"+digen.reward.kwargs.url={server.url}",
                "+digen.reward.kwargs.max_retries=2", "+digen.reward.kwargs.backoff_s=0.05",
                "+digen.reward.kwargs.timeout_s=5", "trainer.total_training_steps=200", "trainer.save_freq=1",
                f"trainer.default_local_dir={ck}",
            ))
    finally:
        server.stop()
    assert server.url.split("//")[1].split("/")[0] in str(err.value)
    assert find_latest(str(ck)).step >= 1


@pytest.mark.e2e
@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["sigint", "sigterm"])
def test_ctrl_c_and_sigterm_checkpoint_then_exit(tmp_path, tiny_flux, signum, code, shared_ray):
    """SIGINT (Ctrl-C) and SIGTERM stop the run the same way: a checkpoint of the completed
    steps, a readable message, exit 128 + signal.

    The child starts with SIGINT *ignored*, as a job launched from a non-interactive shell's
    background (``bash -c 'pytest ... &'``, nohup, some schedulers) inherits it: the job installs
    its own SIGINT/SIGTERM handlers while it runs (``trainer.runtime.stop_signals``), so it stops
    however it was launched. The job joins the suite's shared Ray instance (as a job joins a
    running cluster): what a stopped job leaves of a local instance it started is
    test_run_failures_e2e.py's."""
    ck = tmp_path / "ck"
    proc = subprocess.Popen(
        _main_cmd("trainer.total_training_steps=500", "trainer.save_freq=1000", f"trainer.default_local_dir={ck}",
                  f"digen.output_dir={tmp_path / 'int'}"),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, **shared_ray_driver_env(os.getcwd())},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    try:
        assert _wait_for(lambda: (tmp_path / "int" / "metrics.jsonl").exists()
                         and (tmp_path / "int" / "metrics.jsonl").read_text().count("\n") >= 2, 300)
        proc.send_signal(signum)
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == code, out[-2000:]
    assert f"run interrupted after" in out and f"{signal.Signals(signum).name} received" in out, out[-2000:]
    ckpt = find_latest(str(ck))
    assert ckpt is not None and ckpt.step >= 2, out[-2000:]
    ckpt.verify()


@pytest.mark.e2e
def test_exported_lora_loads_with_diffusers_load_lora_weights(tmp_path, tiny_flux, shared_ray):
    from diffusers import FluxPipeline

    from verl_digen.config.schema import LoraConfigSpec
    from verl_digen.export import export_checkpoint
    from verl_digen.models.base import SampleSpec
    from verl_digen.models.registry import load_adapter
    from verl_digen.sync.state import load_trainable_state
    from verl_digen.workers.training import add_lora

    run_training(run_config(tmp_path, "exp", "trainer.total_training_steps=2", "trainer.save_freq=2",
                      f"trainer.default_local_dir={tmp_path}/ck"))
    ckpt = find_latest(str(tmp_path / "ck"))
    out = export_checkpoint(ckpt, str(tmp_path / "lora"))

    ours = load_adapter(tiny_flux)
    add_lora(ours, LoraConfigSpec(**ckpt.meta()["lora"]))
    load_trainable_state(ours.transformer, ckpt.weights(), lora_only=True)
    pipe = FluxPipeline.from_pretrained(tiny_flux)
    base = load_adapter(tiny_flux)
    pipe.load_lora_weights(out)
    theirs = load_adapter(tiny_flux)
    theirs.transformer = pipe.transformer

    spec = SampleSpec(32, 32)
    x = ours.prepare_latents(2, spec, torch.Generator().manual_seed(0))
    cond = ours.encode_prompts(["a cat", "a dog"])
    sigma = torch.full((2,), 0.7)
    with torch.no_grad():
        v_ours, v_theirs, v_base = (a.predict_velocity(x, sigma, cond, spec) for a in (ours, theirs, base))
    torch.testing.assert_close(v_theirs, v_ours, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(v_base, v_ours, atol=1e-5)  # the LoRA actually does something


@pytest.mark.e2e
def test_full_finetune_exports_a_diffusers_directory(tmp_path, tiny_flux, shared_ray):
    from diffusers import FluxPipeline

    from verl_digen.export import export_checkpoint
    from verl_digen.trainer.checkpoint import find_latest as latest

    run_training(run_config(tmp_path, "full", "trainer.total_training_steps=1", "trainer.save_freq=1",
                      "digen.model.lora.enable=false", f"trainer.default_local_dir={tmp_path}/ck"))
    ckpt = latest(str(tmp_path / "ck"))
    out = export_checkpoint(ckpt, str(tmp_path / "full_dir"))
    pipe = FluxPipeline.from_pretrained(out)
    trained = ckpt.weights()
    for k, v in pipe.transformer.state_dict().items():
        assert torch.equal(v, trained[k]), k


@ray.remote(num_cpus=0)
class _Peer:
    """A stand-in for a worker in a collective: the test needs to kill one peer at a chosen
    moment and have the other fail because of it, which a real sync does only by chance."""

    def ping(self) -> str:
        return "ok"

    def sync_send(self, version: int) -> None:
        raise ConnectionError("connection closed by peer")


@pytest.mark.e2e
def test_a_worker_that_died_is_named_even_when_its_peer_fails_first(shared_ray):
    """A rollout worker killed mid-sync: the trainer's send fails too, and that failure may reach
    the driver first. The run must still name the dead worker and its pool."""
    from verl_digen.schedule.plan import Plan, Task, TaskKind, WorkerId
    from verl_digen.trainer.ray_executor import RayPlanExecutor, WorkerFailure

    trainer, rollout = WorkerId("trainer", 0), WorkerId("rollout", 0)
    actors = {trainer: _Peer.remote(), rollout: _Peer.remote()}
    ray.get([a.ping.remote() for a in actors.values()], timeout=120)
    task = Task("s0/sync", TaskKind.SYNC, (trainer, rollout), step=0, version=1)
    executor = RayPlanExecutor(Plan([trainer, rollout], [task]), actors, std_mode="group", timeout_s=60)
    ray.kill(actors[rollout], no_restart=True)
    with pytest.raises(WorkerFailure) as err:
        executor._check_ok(task, actors[trainer].sync_send.remote(1))
    ray.kill(actors[trainer], no_restart=True)  # the shared Ray instance outlives the test
    msg = str(err.value)
    assert "rollout0 (pool 'rollout') died" in msg and "trainer0 (pool" not in msg
    assert "s0/sync" in msg
