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
