"""A reward function from a user's file that fails mid-run (veRL-Omni's scorer shape: a coroutine
answering a dict) stops the run after a checkpoint of the completed steps. What such a function
receives and how its errors are named: tests/unit/test_custom_reward.py."""

from __future__ import annotations

import json
import os
import re

import pytest

from test_custom_reward import _write


@pytest.mark.e2e
@pytest.mark.slow
def test_a_failing_reward_stops_the_run_after_a_checkpoint_of_the_completed_steps(tmp_path, tiny_flux):
    from runs import run

    from verl_digen.trainer.loop import RunStopped

    prompts = tmp_path / "prompts.jsonl"
    # Step 1 draws the first four prompts (no shuffle), step 2 the next four, whose ground truth breaks the reward.
    prompts.write_text("".join(json.dumps({"prompt": f"prompt {i}", "ground_truth": "0.5" if i < 4 else "boom"}) + "\n"
                               for i in range(8)))
    # veRL-Omni's scorer shape: a coroutine taking its keyword set, answering a dict
    path = _write(tmp_path, '''
async def compute_score(data_source, solution_image, ground_truth, extra_info, **kwargs):
    assert solution_image.dtype.is_floating_point is False and solution_image.shape[0] == 3
    return {"score": float(ground_truth), "doubled": 2 * float(ground_truth), "note": "strings are not metrics"}
''')
    ckpt = tmp_path / "ckpt"
    with pytest.raises(RunStopped) as info:
        run(tmp_path, "out", f"digen.model.path={tiny_flux}", f"data.train_files={prompts}", "data.shuffle=false",
            f"reward.custom_reward_function.path={path}", "trainer.total_training_steps=3",
            f"trainer.default_local_dir={ckpt}")
    message = str(info.value)
    assert "after 1 completed steps" in message
    assert "could not convert string to float: 'boom'" in message  # the user's traceback
    assert re.search(r"prompt 'prompt [4-7]'", message)  # the sample it failed on (whichever group came first)
    assert os.path.isdir(ckpt / "global_step_1") and not os.path.exists(ckpt / "global_step_2")
    with open(tmp_path / "out" / "metrics.jsonl") as f:
        first = json.loads(f.readline())
    assert first["reward_mean"] == pytest.approx(0.5) and first["reward/doubled"] == pytest.approx(1.0)
    assert not any("note" in k for k in first)


@pytest.mark.e2e
@pytest.mark.slow
def test_veRL_Omnis_output_type_latent_hands_a_run_s_final_latents_to_the_reward(tmp_path, tiny_sd3):
    """A DRM-style function (veRL-Omni's latent client's inputs) in a whole run: every sample's
    final latents reach it through the rollout's record and the reward worker, as veRL-Omni hands
    them with ``pipeline.output_type=latent``. What it receives, unit by unit:
    tests/unit/test_reward_omni_inputs.py."""
    from runs import run

    from verl_digen.config.omni_keys import plain_overrides

    prompts = tmp_path / "val.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"prompt {i}"}) + "\n" for i in range(2)))
    path = _write(tmp_path, '''
import torch

async def compute_score(solution_image, extra_info, **kwargs):
    latents = extra_info.get("latents_clean")
    assert isinstance(latents, torch.Tensor) and latents.dtype == torch.float32 and latents.dim() == 3
    # output_type=latent: the latents are the solution_image; validation's both: uint8 pixels
    assert solution_image is latents or (solution_image.dtype == torch.uint8 and solution_image.shape[0] == 3)
    embeds = extra_info.get("prompt_embeds")
    return {"score": float(latents.abs().mean()), "rank": float(latents.dim()),
            "embeds_rank": float(embeds.dim()) if embeds is not None else -1.0}
''')
    result = run(tmp_path, "out", f"digen.model.path={tiny_sd3}", f"reward.custom_reward_function.path={path}",
                 "trainer.total_training_steps=1", f"data.val_files={prompts}", "trainer.test_freq=1",
                 *plain_overrides(["actor_rollout_ref.rollout.pipeline.output_type=latent",
                                   "actor_rollout_ref.rollout.val_kwargs.pipeline.output_type=both"]))
    assert result is not None
    with open(tmp_path / "out" / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    first = next(r for r in rows if "reward_mean" in r)
    assert any(r.get("val/reward_mean", 0) > 0 for r in rows), rows  # validation scored its latents too
    assert first["reward/rank"] == 3.0 and first["reward_mean"] > 0
    assert first["reward/embeds_rank"] == 2.0  # [T, D] per sample (no prompt cache: the record carries them)
