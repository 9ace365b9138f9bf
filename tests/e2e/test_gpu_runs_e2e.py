"""The GPU check's disaggregated-run rehearsals (``python -m verl_digen.gpu_check --parts ...
--device cpu --size tiny``, verl_digen/gpu_runs.py) on the CPU: each part in its child process,
its figures and the memory planner's beside them in the report. On a GPU the same parts run at
real size (``bash scripts/gpu_device_run.sh``)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def _check(tmp_path, parts: str, timeout: float = 560) -> dict:
    out = tmp_path / "report.json"
    res = subprocess.run([sys.executable, "-m", "verl_digen.gpu_check", "--out", str(out), "--parts", parts,
                          "--device", "cpu", "--size", "tiny", "--run-timeout", "400"],
                         capture_output=True, text=True, timeout=timeout)
    report = json.loads(out.read_text())
    for name in parts.split(","):
        part = report["parts"][name]
        assert part["ok"], f"{name}: {part.get('error')}\n{part.get('traceback', '')}\n{part.get('child_tail', '')}"
    assert res.returncode == 0 and report["failed"] == []
    return report["parts"]


@pytest.mark.e2e
@pytest.mark.slow
def test_snapshot_order_and_the_full_fine_tune_pass_rehearsed(tmp_path):
    parts = _check(tmp_path, "snapshot_order,full_ft_one_rank")
    snap = parts["snapshot_order"]
    assert snap["bitwise_equal"] and snap["digest_equal"] and snap["buffers_reused"]
    assert all(r["buckets"] >= 4 and r["mismatched_count"] == 0 for r in snap["rounds"])
    ft = parts["full_ft_one_rank"]
    assert ft["lora_rank"] is None and ft["trainable_params"] == ft["transformer_params"]  # every weight trained
    assert ft["rewards_finite"] and ft["train_vs_plan"]["planned_gib"] > 0  # the plan's figure, beside


@pytest.mark.e2e
@pytest.mark.slow
def test_one_rollout_and_one_trainer_worker_sharing_the_devices_rehearsed(tmp_path):
    d = _check(tmp_path, "disaggregated_one_gpu")["disaggregated_one_gpu"]
    assert d["strategy"] == "disaggregated+gap+tcss" and d["policy_versions"] == [1, 2, 3]
    assert d["max_staleness_seen"] == 1 and not d["nonfinite"] and d["checkpoints"] == ["global_step_3"]
    for role in ("rollout", "trainer"):
        assert d["memory"][role]["planned_peak_gib"] > 0 and d["memory"][role]["host_peak_gib"] > 0


@pytest.mark.e2e
@pytest.mark.slow
def test_the_time_step_pipeline_with_the_prompt_cache_and_the_reward_pool_rehearsed(tmp_path):
    parts = _check(tmp_path, "tsp_prompt_cache,reward_pool")
    tsp = parts["tsp_prompt_cache"]
    assert tsp["prompt_cache_files"] > 0 and not tsp["nonfinite"] and len(tsp["loss"]) == 2
    pool = parts["reward_pool"]
    assert len(pool["reward_workers"]) == 1 and pool["scores"]["max_abs_diff_cpu_vs_device"] == 0.0
    assert len(pool["reward_mean"]) == 2 and not pool["nonfinite"]


@pytest.mark.e2e  # loads and saves a model folder (seconds): the real-size part's way to give the job a path
def test_a_flux_adapter_saved_as_a_folder_loads_back_with_the_same_weights(tmp_path):
    import torch

    from verl_digen.gpu_runs import save_flux_folder
    from verl_digen.models.registry import load_adapter
    from verl_digen.models.tiny import ensure_tiny

    src = load_adapter(ensure_tiny("flux"), "flux", device="cpu", dtype=torch.float32)
    with torch.no_grad():
        for p in src.transformer.parameters():  # weights of its own, not the tiny model's
            p.add_(0.5)
    save_flux_folder(src, str(tmp_path / "flux"))
    back = load_adapter(str(tmp_path / "flux"), "flux", device="cpu", dtype=torch.float32)
    a, b = src.transformer.state_dict(), back.transformer.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert src.scheduler_config["shift"] == back.scheduler_config["shift"]
    x, y = src.encode_prompts(["a cat"]), back.encode_prompts(["a cat"])
    assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)  # text encoders and tokenizers too
