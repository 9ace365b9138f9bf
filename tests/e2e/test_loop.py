"""End-to-end runs of the real loop: real veRL worker groups on Ray, tiny diffusers models
loaded with from_pretrained, CPU slots as devices."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from safetensors.torch import load_file

from runs import QUIET, run, timeline_records


# Runs reuse the session's Ray instance (enough logical CPUs for every pool of every test).
pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("tiny_flux", "shared_ray")]


def test_colocated_training_raises_the_brightness_reward(tmp_path, capsys):
    result = run(tmp_path, "coloc", "trainer.total_training_steps=20")
    rewards = [m["reward_mean"] for m in result.metrics]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    # Step-to-step noise of reward_mean at a fixed policy is ~5e-4 on this model.
    assert last - first > 0.01, rewards
    assert "run output: " + result.output_dir in capsys.readouterr().out


def test_every_run_writes_the_metrics_contract(tmp_path):
    result = run(tmp_path, "contract", "trainer.total_training_steps=2")
    with open(os.path.join(result.output_dir, "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f]
    assert [m["step"] for m in lines] == [1, 2]
    required = {
        "step", "reward_mean", "reward_std", "images_per_s", "step_time_s", "policy_version",
        "bubble_fraction", "images_per_device_s", "weight_sync_s", "max_staleness_seen",
    }
    for m in lines:
        assert required <= set(m), required - set(m)
        assert m["images_per_s"] > 0 and 0 <= m["bubble_fraction"] <= 1
    assert [m["policy_version"] for m in lines] == [1, 2]
    assert os.path.getsize(os.path.join(result.output_dir, "gantt.png")) > 0
    recs = timeline_records(result.output_dir)
    for r in recs:
        assert {"worker", "kind", "start", "end", "version", "step", "groups"} <= set(r)
        assert r["end"] >= r["start"] >= 0


DISAGG = ["digen.placement=disaggregated", "digen.pools.rollout.devices=1", "digen.pools.trainer.devices=1"]


def test_gap_step_gives_the_same_weights_as_the_synchronous_step(tmp_path):
    common = DISAGG + ["trainer.total_training_steps=1", "digen.save_final_weights=true", "digen.batch.groups_per_step=4"]
    sync = run(tmp_path, "sync", *common, "digen.gap.enable=false")
    gap = run(tmp_path, "gap", *common, "digen.gap.enable=true")
    a = load_file(sync.extra["final_weights"])
    b = load_file(gap.extra["final_weights"])
    assert a.keys() == b.keys()
    # Same micro-batches, same seeds: only the accumulation order may differ (float rounding).
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=1e-5)
    # The step really trained: weights moved away from the initial LoRA state.
    assert any(not torch.equal(a[k], torch.zeros_like(a[k])) for k in a if "lora_B" in k)


def test_gap_over_two_trainer_ranks_matches_one_trainer_rank(tmp_path):
    common = [
        "digen.placement=disaggregated", "trainer.n_gpus_per_node=3", "digen.pools.rollout.devices=1",
        "trainer.total_training_steps=1", "digen.save_final_weights=true", "digen.gap.enable=true",
        "digen.algo.optimizer=sgd",
    ]
    one = run(tmp_path, "t1", *common, "digen.pools.trainer.devices=1")
    two = run(tmp_path, "t2", *common, "digen.pools.trainer.devices=2")
    a, b = load_file(one.extra["final_weights"]), load_file(two.extra["final_weights"])
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-7, rtol=1e-5)
    # the two trainer ranks met on the port rank 0's store was given by the OS, not veRL's MASTER_PORT
    with open(os.path.join(two.output_dir, "workers.json")) as f:
        trainers = [w for w in json.load(f) if w["role"] == "trainer"]
    ports = {w["rendezvous"] for w in trainers}
    assert len(trainers) == 2 and len(ports) == 1 and next(iter(ports)).startswith("port "), trainers


@pytest.mark.parametrize("lora", [True, False], ids=["lora_only", "full"])
def test_rollout_weights_equal_trainer_weights_after_sync(tmp_path, lora):
    result = run(tmp_path, f"sync_{lora}", *DISAGG, "trainer.total_training_steps=2", f"digen.model.lora.enable={lora}")
    assert result.extra["weights_in_sync"] is True  # sha256 over every synced tensor, bitwise
    syncs = [r for r in timeline_records(result.output_dir) if r["kind"] == "sync"]
    assert [r["version"] for r in syncs] == [1, 2]
    nbytes = syncs[0]["extra"]["bytes"]
    # LoRA-only moves megabytes-class payloads, full moves the whole denoiser.
    assert (nbytes < 100_000) if lora else (nbytes > 250_000)
    # each step's memory peaks per pool (the rollout worker scores too: no reward pool); no device on CPU
    for m in result.metrics:
        assert m["memory/rollout/host_peak_gib"] > 0 and m["memory/trainer/host_peak_gib"] > 0, m
        assert not any(k.startswith("memory/") and "/device_" in k for k in m), m


def _check_tcss_invariants(result, steps: int, groups_per_step: int, bound: int) -> list[int]:
    recs = timeline_records(result.output_dir)
    for kind in ("generate", "reward", "train"):
        seen = sorted(g for r in recs if r["kind"] == kind for g in r["groups"])
        assert seen == list(range(steps * groups_per_step)), f"{kind}: a group was lost or duplicated"
    staleness = []
    for r in recs:
        if r["kind"] == "generate":
            s = r["step"] - r["version"]  # one version per trajectory: recorded once per generate task
            assert 0 <= s <= bound
            staleness.append(s)
    assert all(m["max_staleness_seen"] <= bound for m in result.metrics)
    return staleness


def test_tcss_invariants_over_a_multi_step_run(tmp_path):
    """The schedule's invariants need no real model: the real planner, executor and loop drive
    emulated workers (``digen.emulate.model``), which refuse to generate with a weights version
    they do not hold and report the staleness of what they train (``workers/emulated.py``). The
    real model's side of TCSS (behaviour log-probs, on-policy ratio) is the test below and the
    async resume test of ``test_checkpoint_e2e.py``."""
    result = run(tmp_path, "tcss", *DISAGG, "trainer.total_training_steps=5", "digen.gap.enable=true",
                 "digen.async.max_staleness=1", "digen.emulate.model=flux-12b", "digen.emulate.time_scale=0.002")
    staleness = _check_tcss_invariants(result, 5, 4, bound=1)
    assert 1 in staleness, "one-step-constrained async never used the previous weights"
    assert max(m["max_staleness_seen"] for m in result.metrics) == 1


def test_max_staleness_zero_is_on_policy(tmp_path):
    result = run(tmp_path, "onpolicy", *DISAGG, "trainer.total_training_steps=3", "digen.gap.enable=true")
    staleness = _check_tcss_invariants(result, 3, 4, bound=0)
    assert set(staleness) == {0}
    for m in result.metrics:
        assert m["actor/ratio_mean"] == pytest.approx(1.0, abs=1e-5)


def test_compare_runs_every_mode_and_fills_every_row(tmp_path, capsys):
    from verl_digen.compare import main

    out = tmp_path / "cmp"
    assert main(["--out", str(out), "trainer.total_training_steps=2", *QUIET]) == 0
    rows = json.loads((out / "summary.json").read_text())
    # +tsp needs 2 rollout devices: with 1+1 it is skipped, the others are cumulative.
    assert [r["mode"] for r in rows] == ["colocated", "disaggregated", "+gap", "+tag", "+tcss"]
    for r in rows:
        for key in ("mode", "devices", "images_per_s", "bubble_fraction", "reward_mean_last", "wall_s"):
            assert r[key] is not None
        assert r["devices"] == 2 and r["images_per_s"] > 0 and math.isfinite(r["reward_mean_last"])
        assert 0 <= r["bubble_fraction"] <= 1
    assert (out / "compare.png").stat().st_size > 0
    assert "+tcss" in capsys.readouterr().out


def test_a_validation_past_its_deadline_names_validation_and_the_setting_that_bounds_it():
    """A validation that outlasts ``digen.task_timeout_s`` stops with what ran out and the keys that
    fix it, not Ray's bare GetTimeoutError. A real one that long needs a real-size model and hundreds
    of prompts: an actor whose ``validate`` sleeps past a 1 s deadline stands in for the worker (the
    driver's wait and its message are what is tested)."""
    import time
    from types import SimpleNamespace

    import ray

    from verl_digen.schedule.plan import WorkerId
    from verl_digen.trainer.loop import DigenTrainer

    @ray.remote(num_cpus=0)
    class SlowValidator:
        def validate(self, *args):
            time.sleep(60)

    actor = SlowValidator.remote()
    try:
        trainer = WorkerId("trainer", 0)
        job = SimpleNamespace(output_dir="unused", val_prompts=["a", "b", "c"], val_records=None,
                              cfg=SimpleNamespace(task_timeout_s=1.0))
        fake = SimpleNamespace(job=job, spec=SimpleNamespace(fsdp=False, trainers=[trainer]))
        with pytest.raises(TimeoutError, match=r"validation at step 3 \(3 prompts\) did not finish within "
                                               r"digen\.task_timeout_s=1 s.*data\.val_max_samples"):
            DigenTrainer._validate(fake, {trainer: actor}, 3)
    finally:
        ray.kill(actor)
