"""Dress rehearsal of every shipped preset (``configs/``), and of every ``examples/flowgrpo`` script
(test_rehearsal_examples_e2e.py; tests/unit/test_rehearsal_examples.py checks that both files
rehearse everything shipped): each runs as shipped on the tiny real model of its family, on CPU,
changing only what a 2-core machine forces (:func:`rehearsal_overrides`):

- the model's size and dtype: ``digen.model.path`` stays unset (the family's tiny model is built)
  and fp32 (bf16 arithmetic is a GPU path; test_bf16_on_policy covers it);
- the sample size: 32x32 pixels, 5 frames for a video (the size every tiny arch is tested at);
- the denoising steps halved, the SDE window kept in its mode with its range scaled with them;
- the device counts: 2 for a colocated preset (an FSDP preset keeps FSDP over 2 ranks),
  2 rollout + 2 trainer workers for a disaggregated one (still two pools; FSDP over 2 trainer
  ranks), one node (a preset's second node is the same layout again);
- the batch: the fewest whole groups that keep every divisibility rule of the preset
  (micro-batch groups, PPO mini-batches), the group size kept;
- two steps, a checkpoint after each, then a resume from the first that runs the second.

Everything else is the preset's: the prompt cache with its text encoders released, GAP, TCSS
staleness, FSDP, activation checkpointing, LoRA rank, the reward, PPO mini-batches, validation at
the last step (``test_freq``), timeouts. A disaggregated preset resumes with TSP's two-stage
pipeline (``digen.tsp.stages=2``, stage ranges balanced on profiled step costs): not an identity
key of a checkpoint, so the resume accepts it, and one run checks both the resume and the stage
balancing on the preset's settings (a second run each would cost the suite minutes).

What a resume must equal: a colocated (on-policy) preset's resumed second step is the
uninterrupted run's, bit for bit (metrics and weights, as test_checkpoint_e2e.py's resume after a
kill). A one-step-off preset's is not (the uninterrupted run generated step 2 on version 0
weights, the resumed one regenerates it on the checkpoint's, test_checkpoint_e2e's async resume), so
there the restored first step equals the first run's and the second trains each of its groups
once, generated at most one version behind.
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from omegaconf import DictConfig

from runs import QUIET, metrics_lines, timeline_records
from verl_digen.config.compose import compose_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = os.path.join(REPO, "configs")
# configs/ files that are not presets, and presets rehearsed at their shipped size by another test
NOT_REHEARSED_HERE = {
    "digen_base.yaml": "the body every preset composes (veRL's ppo_trainer and the digen defaults), no preset",
    "digen_trainer.yaml": "the main job's default config, already the tiny FLUX on 2 CPU slots: every run of "
                          "tests/helpers/runs.py composes it (test_checkpoint_e2e.py resumes it after a kill)",
    "digits.yaml": "the toy FLUX on 8x8 digits, CPU-sized as shipped: test_digits_preset_e2e.py runs 60 of its "
                   "steps at its shipped size",
}
PRESETS = sorted(f.removesuffix(".yaml") for f in os.listdir(CONFIGS)
                 if f.endswith(".yaml") and f not in NOT_REHEARSED_HERE)
EXACT_KEYS = ("reward_mean", "reward_std", "actor/loss", "actor/grad_norm", "policy_version", "step")
TINY_FRAMES = 5  # a video's frames at the tiny size (runs.SPECS)


def rehearsal_overrides(cfg: DictConfig) -> list[str]:
    """What a 2-core CPU forces on the composed preset ``cfg`` (see the module docstring), as
    Hydra overrides; every other key keeps the preset's value."""
    digen = cfg.digen
    assert digen.model.path is None, "a preset names no model directory: the tiny model stands in for the hub's"
    out = ["digen.model.dtype=fp32", "digen.sampling.height=32", "digen.sampling.width=32"]
    if digen.sampling.num_frames > 1:
        out.append(f"digen.sampling.num_frames={TINY_FRAMES}")
    steps = digen.sampling.num_steps
    tiny_steps = math.ceil(steps / 2)
    out.append(f"digen.sampling.num_steps={tiny_steps}")
    window = digen.sampling.sde_window
    if window.mode != "all":  # the window's range scales with the steps, its size fits in it
        range_end = math.ceil((window.range_end if window.range_end is not None else steps) * tiny_steps / steps)
        out.append(f"digen.sampling.sde_window.range_end={range_end}")
        out.append(f"digen.sampling.sde_window.size={min(window.size, range_end - window.start + 1)}")  # end inclusive
    out += ["trainer.nnodes=1"]
    if digen.placement == "disaggregated":
        out += ["trainer.n_gpus_per_node=4", "digen.pools.rollout.devices=2", "digen.pools.trainer.devices=2",
                "digen.pools.rollout.nodes=null", "digen.pools.trainer.nodes=null"]
    else:
        out.append("trainer.n_gpus_per_node=2")
    batch = digen.batch
    unit = math.lcm(batch.train_micro_batch_groups, batch.groups_per_task, batch.mini_batches_per_step)
    out.append(f"digen.batch.groups_per_step={unit * math.ceil(2 / unit)}")  # 2 groups at least: one per rollout worker
    return out


def rehearsal_config(preset: str, *overrides: str) -> DictConfig:
    """The preset ``preset`` composed with its rehearsal overrides, then ``overrides``."""
    return compose_config([*rehearsal_overrides(compose_config([], config_name=preset)), *overrides],
                          config_name=preset)


def _run(tmp_path, preset: str, name: str, *overrides: str):
    """Two steps of the rehearsed ``preset`` into ``tmp_path / name``, a checkpoint after each
    (under the run's folder) and its final weights; the runs of one test share one prompt cache."""
    from verl_digen.trainer.loop import run_training

    return run_training(rehearsal_config(
        preset, *QUIET, f"digen.prompt_cache.dir={tmp_path / 'prompt_embeds'}", "trainer.total_training_steps=2",
        "trainer.save_freq=1", "digen.save_final_weights=true", f"digen.output_dir={tmp_path / name}",
        f"trainer.default_local_dir={tmp_path / name / 'ck'}", *overrides))


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("preset", PRESETS)
def test_preset_runs_two_steps_as_shipped_and_resumes(preset, shared_ray, tiny_cache, tmp_path):
    straight = _run(tmp_path, preset, "straight")
    assert [m["step"] for m in straight.metrics] == [1, 2]
    disaggregated = "weights_in_sync" in straight.extra
    for m in straight.metrics:  # on-policy where generated and trained on the same weights
        if m["policy_version"] == m["step"] - 1:
            assert m["actor/ratio_mean"] == pytest.approx(1.0, abs=1e-4 if disaggregated else 1e-5)
    first = tmp_path / "straight" / "ck" / "global_step_1"
    resumed = _run(tmp_path, preset, "resumed", "trainer.resume_mode=resume_path", f"trainer.resume_from_path={first}",
                   *(["digen.tsp.stages=2"] if disaggregated else []))
    cfg = rehearsal_config(preset).digen
    assert_resumed_as_planned(straight, resumed, num_steps=cfg.sampling.num_steps, groups=cfg.batch.groups_per_step)


def assert_resumed_as_planned(straight, resumed, *, num_steps: int, groups: int) -> None:
    """``resumed`` (from ``straight``'s first checkpoint, TSP on where disaggregated) is what the
    module docstring says a resume must equal; ``num_steps`` and ``groups``: the rehearsed run's."""
    from safetensors.torch import load_file

    a, b = metrics_lines(straight.output_dir), metrics_lines(resumed.output_dir)
    assert [m["step"] for m in b] == [1, 2]
    assert {k: a[0][k] for k in EXACT_KEYS} == {k: b[0][k] for k in EXACT_KEYS}  # restored, not rerun
    if "weights_in_sync" not in straight.extra:  # on-policy: the resumed step is the uninterrupted one
        assert {k: a[1][k] for k in EXACT_KEYS} == {k: b[1][k] for k in EXACT_KEYS}
        wa, wb = load_file(straight.extra["final_weights"]), load_file(resumed.extra["final_weights"])
        assert wa.keys() == wb.keys()
        for k in wa:
            torch.testing.assert_close(wa[k], wb[k], atol=0, rtol=0, msg=lambda m, k=k: f"{k}: {m}")
        return
    assert resumed.extra["weights_in_sync"] is True
    with open(os.path.join(resumed.output_dir, "tsp_stages.json")) as f:
        bounds = json.load(f)["bounds"]  # stage ranges balanced on the profiled step costs
    assert len(bounds) == 3 and bounds[::2] == [0, num_steps]
    records = timeline_records(resumed.output_dir)
    trained = sorted(g for r in records if r["kind"] == "train" for g in r["groups"])
    assert trained == list(range(groups, 2 * groups))  # the second step's groups, each once
    assert all(0 <= r["step"] - r["version"] <= 1 for r in records if r["kind"] == "generate")
