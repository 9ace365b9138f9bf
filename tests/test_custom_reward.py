"""A reward function from a user's file, veRL's ``reward.custom_reward_function``: what it
receives per sample (PIL image or frames + fps, data_source, ground truth, extra_info), the
batched form, and how its errors stop a run."""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest
import torch

from verl_digen.data import load_prompt_records
from verl_digen.rewards import CustomRewardError, build_reward


def _write(tmp_path, source: str) -> str:
    path = tmp_path / "my_reward.py"
    path.write_text(source)
    return str(path)


RECORDING = '''
CALLS = []

def compute_score(data_source, image, prompt, ground_truth, extra_info, fps=None):
    CALLS.append((data_source, image, prompt, ground_truth, extra_info, fps))
    return float(len(prompt))
'''


def _verl_records(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = str(tmp_path / "train.parquet")
    pq.write_table(pa.Table.from_pylist([
        {"data_source": "ocr", "prompt": [{"role": "system", "content": "be brief"},
                                          {"role": "user", "content": "a sign saying hi"}],
         "reward_model": {"style": "rule", "ground_truth": "hi"}, "extra_info": {"index": 0}},
        {"data_source": "ocr", "prompt": [{"role": "system", "content": ""}, {"role": "user", "content": "a sign saying yo"}],
         "reward_model": {"style": "rule", "ground_truth": "yo"}, "extra_info": {"index": 1}},
    ]), path)
    return load_prompt_records(path)


def test_per_sample_function_gets_a_pil_image_and_the_rows_fields(tmp_path):
    from PIL import Image

    records = _verl_records(tmp_path)
    reward = build_reward("custom", path=_write(tmp_path, RECORDING))
    images = torch.rand(2, 3, 16, 24)
    scores = reward(images, [r["prompt"] for r in records], records)
    assert scores.tolist() == [float(len("a sign saying hi")), float(len("a sign saying yo"))]
    calls = reward.fn.__globals__["CALLS"]
    assert [(c[0], c[2], c[3], c[4]) for c in calls] == [
        ("ocr", "a sign saying hi", "hi", {"index": 0}), ("ocr", "a sign saying yo", "yo", {"index": 1})]
    assert isinstance(calls[0][1], Image.Image) and calls[0][1].size == (24, 16) and calls[0][1].mode == "RGB"
    # uint8 pixels as the model produced them (rounded), not a re-rendering
    expected = (images[0].clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
    assert (np.array(calls[0][1]) == expected).all()
    assert calls[0][5] is None  # images get no fps


def test_video_arrives_as_frames_with_fps(tmp_path):
    reward = build_reward("custom", path=_write(tmp_path, RECORDING), fps=24.0)
    reward(torch.rand(1, 3, 5, 8, 8), ["a wave"], [{"prompt": "a wave"}])
    (_, frames, _, _, info, fps), = reward.fn.__globals__["CALLS"]
    assert len(frames) == 5 and frames[0].size == (8, 8)
    assert fps == 24.0 and info["fps"] == 24.0


def test_batched_form_gets_lists_and_returns_one_score_per_sample(tmp_path):
    path = _write(tmp_path, '''
def score_batch(data_sources, images, prompts, ground_truths, extra_infos, scale=1.0):
    assert len(images) == len(prompts) == len(ground_truths) == len(extra_infos) == len(data_sources)
    return [scale * float(t == "hi") for t in ground_truths]
''')
    records = _verl_records(tmp_path)
    reward = build_reward("custom", path=path, function="score_batch", batched=True, reward_kwargs={"scale": 2.0})
    assert reward(torch.rand(2, 3, 8, 8), [r["prompt"] for r in records], records).tolist() == [2.0, 0.0]


def test_an_error_in_the_users_function_carries_its_traceback_and_the_prompt(tmp_path):
    path = _write(tmp_path, '''
def compute_score(data_source, image, prompt, ground_truth, extra_info):
    if "yo" in prompt:
        return {"oops": 1}["missing"]
    return 0.0
''')
    reward = build_reward("custom", path=path)
    with pytest.raises(CustomRewardError) as info:
        reward(torch.rand(2, 3, 8, 8), ["a sign saying hi", "a sign saying yo"])
    message = str(info.value)
    assert "on sample 1, prompt 'a sign saying yo'" in message
    assert "KeyError: 'missing'" in message and 'return {"oops": 1}["missing"]' in message  # the user's own line


def test_a_score_that_is_not_a_finite_number_is_refused(tmp_path):
    reward = build_reward("custom", path=_write(tmp_path, "def compute_score(*args):\n    return float('nan')\n"))
    with pytest.raises(CustomRewardError, match=r"returned nan for prompt 'x'; expected a finite float"):
        reward(torch.rand(1, 3, 8, 8), ["x"])


@pytest.mark.parametrize("expr", ["np.float32(len(prompt))", "torch.tensor(float(len(prompt)))",
                                  "np.array(len(prompt), dtype=np.int64)", "np.int32(len(prompt))"])
def test_numpy_and_torch_scalars_are_scores(tmp_path, expr):
    source = f"import numpy as np, torch\ndef compute_score(source, image, prompt, truth, info):\n    return {expr}\n"
    reward = build_reward("custom", path=_write(tmp_path, source))
    assert reward(torch.rand(2, 3, 8, 8), ["ab", "abc"]).tolist() == [2.0, 3.0]


@pytest.mark.parametrize("expr", ["np.array([len(p) for p in prompts], dtype=np.float32)",
                                  "torch.tensor([float(len(p)) for p in prompts])",
                                  "tuple(np.float32(len(p)) for p in prompts)"])
def test_the_batched_form_may_return_a_1d_array(tmp_path, expr):
    source = f"import numpy as np, torch\ndef score(sources, images, prompts, truths, infos):\n    return {expr}\n"
    reward = build_reward("custom", path=_write(tmp_path, source), function="score", batched=True)
    assert reward(torch.rand(2, 3, 8, 8), ["ab", "abc"]).tolist() == [2.0, 3.0]


@pytest.mark.parametrize(("expr", "message"), [
    ("np.ones((2, 1), dtype=np.float32)", r"returned an array of shape \(2, 1\); expected one score per sample"),
    ("[True, False]", r"returned True for prompt 'ab'; expected a finite float"),
    ("[np.float32('inf'), 1.0]", r"returned .*inf.* for prompt 'ab'; expected a finite float"),
    ("3.0", r"returned 3.0; expected a list of scores"),
])
def test_batched_results_that_are_not_one_finite_score_per_sample_are_refused(tmp_path, expr, message):
    source = f"import numpy as np\ndef score(sources, images, prompts, truths, infos):\n    return {expr}\n"
    reward = build_reward("custom", path=_write(tmp_path, source), function="score", batched=True)
    with pytest.raises(CustomRewardError, match=message):
        reward(torch.rand(2, 3, 8, 8), ["ab", "abc"])


@pytest.mark.parametrize(("key", "value", "message"), [
    ("path", "/no/such_reward.py", r"reward.custom_reward_function.path: reward file '/no/such_reward.py' does not exist"),
    ("function", "nope", r"reward.custom_reward_function.name: .* defines no 'nope'"),
])
def test_a_reward_file_or_function_that_is_not_there_is_named(tmp_path, key, value, message):
    kwargs = {"path": _write(tmp_path, RECORDING), key: value}
    with pytest.raises((FileNotFoundError, ValueError), match=message):
        build_reward("custom", **kwargs)


@pytest.mark.e2e
@pytest.mark.slow
def test_a_failing_reward_stops_the_run_after_a_checkpoint_of_the_completed_steps(tmp_path, tiny_flux):
    from runs import run

    from verl_digen.trainer.loop import RunStopped

    prompts = tmp_path / "prompts.jsonl"
    # Step 1 draws the first four prompts (no shuffle), step 2 the next four, whose ground truth breaks the reward.
    prompts.write_text("".join(json.dumps({"prompt": f"prompt {i}", "ground_truth": "0.5" if i < 4 else "boom"}) + "\n"
                               for i in range(8)))
    path = _write(tmp_path, '''
def compute_score(data_source, image, prompt, ground_truth, extra_info):
    return float(ground_truth)
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
