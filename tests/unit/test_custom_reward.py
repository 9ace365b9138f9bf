"""A reward function from a user's file, veRL's ``reward.custom_reward_function``: what it
receives per sample, by keyword (veRL-Omni's uint8 ``solution_image``, a PIL image or frames +
fps, data_source, ground truth, extra_info), coroutine functions, ``{"score": ...}`` results,
``pkg://`` / ``file://`` paths, the batched form, the signature check, and how its errors are
named. How a failing one stops a run: tests/e2e/test_custom_reward_e2e.py."""

from __future__ import annotations

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
    reward = build_reward("custom", path=_write(tmp_path, "def compute_score(**kwargs):\n    return float('nan')\n"))
    with pytest.raises(CustomRewardError, match=r"returned nan for prompt 'x'; expected a finite float"):
        reward(torch.rand(1, 3, 8, 8), ["x"])


@pytest.mark.parametrize("expr", ["np.float32(len(prompt))", "torch.tensor(float(len(prompt)))",
                                  "np.array(len(prompt), dtype=np.int64)", "np.int32(len(prompt))"])
def test_numpy_and_torch_scalars_are_scores(tmp_path, expr):
    source = f"import numpy as np, torch\ndef compute_score(prompt):\n    return {expr}\n"
    reward = build_reward("custom", path=_write(tmp_path, source))
    assert reward(torch.rand(2, 3, 8, 8), ["ab", "abc"]).tolist() == [2.0, 3.0]


@pytest.mark.parametrize("expr", ["np.array([len(p) for p in prompts], dtype=np.float32)",
                                  "torch.tensor([float(len(p)) for p in prompts])",
                                  "tuple(np.float32(len(p)) for p in prompts)"])
def test_the_batched_form_may_return_a_1d_array(tmp_path, expr):
    source = f"import numpy as np, torch\ndef score(prompts, images):\n    return {expr}\n"
    reward = build_reward("custom", path=_write(tmp_path, source), function="score", batched=True)
    assert reward(torch.rand(2, 3, 8, 8), ["ab", "abc"]).tolist() == [2.0, 3.0]


@pytest.mark.parametrize(("expr", "message"), [
    ("np.ones((2, 1), dtype=np.float32)", r"returned an array of shape \(2, 1\); expected one score per sample"),
    ("[True, False]", r"returned True for prompt 'ab'; expected a finite float"),
    ("[np.float32('inf'), 1.0]", r"returned .*inf.* for prompt 'ab'; expected a finite float"),
    ("3.0", r"returned 3.0; expected a list of scores"),
])
def test_batched_results_that_are_not_one_finite_score_per_sample_are_refused(tmp_path, expr, message):
    source = f"import numpy as np\ndef score(prompts):\n    return {expr}\n"
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


# veRL-Omni's scorer signatures (verl_omni/utils/reward_score), written here, called as its
# visual reward manager calls them: by keyword, solution_image a uint8 tensor, coroutines awaited.
OMNI_JPEG = '''
import io
import numpy as np
from PIL import Image

SEEN = []

def compute_score(solution_image):
    SEEN.append(solution_image)
    if solution_image.dim() == 4:  # a video, [3, F, H, W]
        return 0.0
    buf = io.BytesIO()
    Image.fromarray(solution_image.permute(1, 2, 0).numpy()).save(buf, format="JPEG", quality=95)
    return -buf.tell() / 1000 / 500
'''

OMNI_ASYNC_CLIENT = '''
import asyncio

CALLS = []
STARTED = []

async def compute_score(solution_image, ground_truth, server_url, max_retries=2, retry_backoff=0.5, **kwargs):
    STARTED.append(ground_truth)
    # every sample's call is in flight before any answers: they were gathered, not awaited in turn
    while len(STARTED) < kwargs["extra_info"]["expected"]:
        await asyncio.sleep(0.001)
    CALLS.append((server_url, ground_truth, sorted(kwargs)))
    return {"score": float(len(ground_truth)), "latency_ms": 3.0, "answer": "text"}
'''


def test_verl_omnis_scorer_gets_the_uint8_solution_image_by_keyword(tmp_path):
    reward = build_reward("custom", path=_write(tmp_path, OMNI_JPEG))
    images = torch.rand(2, 3, 16, 24)
    scores = reward(images, ["a", "b"])
    seen = reward.fn.__globals__["SEEN"]
    assert [tuple(x.shape) for x in seen] == [(3, 16, 24)] * 2 and seen[0].dtype == torch.uint8
    assert torch.equal(seen[1], (images[1].clamp(0, 1) * 255).round().to(torch.uint8))  # the rollout's pixels
    assert (scores < 0).all()
    # video: [3, F, H, W] (veRL-Omni's scorers' channels-first video), frames in order
    video = torch.rand(1, 3, 5, 8, 8)
    reward(video, ["a"], [{"prompt": "a"}])
    assert tuple(seen[-1].shape) == (3, 5, 8, 8)
    assert torch.equal(seen[-1], (video[0] * 255).round().to(torch.uint8))


def test_a_coroutine_scorer_is_awaited_for_all_samples_at_once_and_its_dict_extras_are_kept(tmp_path):
    reward = build_reward("custom", path=_write(tmp_path, OMNI_ASYNC_CLIENT),
                          reward_kwargs={"server_url": "http://scorer:8000"})
    assert reward.is_async
    records = [{"prompt": p, "ground_truth": t, "extra_info": {"expected": 3}} for p, t in
               [("x", "ab"), ("y", "abc"), ("z", "a")]]
    scores = reward(torch.rand(3, 3, 8, 8), [r["prompt"] for r in records], records)
    assert scores.tolist() == [2.0, 3.0, 1.0]
    calls = reward.fn.__globals__["CALLS"]
    assert {c[0] for c in calls} == {"http://scorer:8000"}  # reward_kwargs by keyword, no clash
    # **kwargs receives every other sample field
    assert calls[0][2] == ["data_source", "extra_info", "fps", "image", "prompt"] or \
        calls[0][2] == ["data_source", "extra_info", "image", "prompt"]
    extras = reward.take_extras()
    assert list(extras) == ["latency_ms"] and extras["latency_ms"].tolist() == [3.0, 3.0, 3.0]  # "answer": text
    assert reward.take_extras() == {}  # handed over once


def test_reward_paths_in_verls_pkg_and_file_forms(tmp_path, monkeypatch):
    package = tmp_path / "my_rewards"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "scorers.py").write_text("def compute_score(prompt):\n    return float(len(prompt))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for path in ("pkg://my_rewards.scorers", "pkg://my_rewards/scorers", f"file://{package / 'scorers.py'}"):
        assert build_reward("custom", path=path)(torch.rand(1, 3, 8, 8), ["abc"]).tolist() == [3.0], path
    with pytest.raises(FileNotFoundError, match=r"reward module 'my_rewards.nope' \(pkg://my_rewards.nope\) is not importable"):
        build_reward("custom", path="pkg://my_rewards.nope")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        build_reward("custom", path=f"file://{tmp_path / 'nope.py'}")


@pytest.mark.parametrize(("source", "kwargs", "message"), [
    ("def compute_score(src, image):\n    return 0.0\n", {}, r"cannot fill parameter 'src'"),
    ("def compute_score(image, server_url):\n    return 0.0\n", {}, r"cannot fill parameter 'server_url'"),
    ("def compute_score(image):\n    return 0.0\n", {"reward_kwargs": {"scale": 2}}, r"reward_kwargs \['scale'\] are not parameters"),
    ("def compute_score(image, **kw):\n    return 0.0\n", {"reward_kwargs": {"prompt": "x"}}, r"reward_kwargs \['prompt'\] name sample fields"),
    ("def compute_score(image, /):\n    return 0.0\n", {}, r"parameter 'image' is positional-only"),
    ("def compute_score(*args):\n    return 0.0\n", {}, r"takes only \*args; reward functions are called by keyword"),
    ("def compute_score(data_sources, images):\n    return [0.0]\n", {"batched": False}, r"cannot fill parameter 'data_sources'"),
])
def test_a_signature_the_call_cannot_fill_is_refused_when_the_reward_is_built(tmp_path, source, kwargs, message):
    with pytest.raises(ValueError, match=message):
        build_reward("custom", path=_write(tmp_path, source), **kwargs)


def test_a_dict_result_needs_a_score(tmp_path):
    reward = build_reward("custom", path=_write(tmp_path, "def compute_score(prompt):\n    return {'value': 1.0}\n"))
    with pytest.raises(CustomRewardError, match=r"returned a dict without 'score' \(\['value'\]\)"):
        reward(torch.rand(1, 3, 8, 8), ["x"])


def test_the_job_checks_the_reward_signature_before_ray_and_keeps_pkg_paths(tmp_path, monkeypatch):
    from runs import run_config

    import ray

    from verl_digen.config.schema import ConfigError
    from verl_digen.trainer.resolve import check_run_config

    bad = _write(tmp_path, "def compute_score(solution_image, server_url):\n    return 0.0\n")
    with pytest.raises(ConfigError, match=r"cannot fill parameter 'server_url'"):
        check_run_config(run_config(tmp_path, "out", f"reward.custom_reward_function.path={bad}"))
    assert not ray.is_initialized()
    good = check_run_config(run_config(tmp_path, "out", f"reward.custom_reward_function.path={bad}",
                                       "+reward.custom_reward_function.reward_kwargs.server_url=http://h:1"))
    assert good.cfg.reward.kwargs["reward_kwargs"] == {"server_url": "http://h:1"}
    (tmp_path / "team_rewards.py").write_text("def compute_score(prompt):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    pkg = check_run_config(run_config(tmp_path, "out", "reward.custom_reward_function.path=pkg://team_rewards"))
    assert pkg.cfg.reward.kwargs["path"] == "pkg://team_rewards"  # not made a file path of the working directory


def test_a_failing_coroutine_is_named_by_its_sample_with_its_own_traceback(tmp_path):
    path = _write(tmp_path, '''
async def compute_score(prompt, ground_truth):
    if ground_truth == "boom":
        return {"oops": 1}["missing"]
    return 0.5
''')
    reward = build_reward("custom", path=path)
    with pytest.raises(CustomRewardError) as info:
        reward(torch.rand(3, 3, 8, 8), ["a", "b", "c"], [{"ground_truth": "x"}, {"ground_truth": "boom"}, {}])
    message = str(info.value)
    assert "failed on sample 1, prompt 'b'" in message
    assert "KeyError: 'missing'" in message and 'return {"oops": 1}["missing"]' in message


@pytest.mark.usefixtures("loopback_no_proxy")
def test_a_client_that_keeps_its_aiohttp_session_on_the_function_works_batch_after_batch(tmp_path):
    """veRL-Omni's HTTP scorer client caches one aiohttp session on ``compute_score``; a session is
    bound to the event loop it was made on. Every batch of a worker awaits on the same loop, as
    veRL's reward loop worker does, so the second batch reuses the first one's session."""
    from test_omni_recipes import HTTP_SCORER_CLIENT

    from verl_digen.rewards.serve import RewardServer

    with RewardServer("brightness", port=0) as srv:
        reward = build_reward("custom", path=_write(tmp_path, HTTP_SCORER_CLIENT), reward_kwargs={"server_url": srv.url})
        records = [{"prompt": "p", "ground_truth": "p"}] * 2
        first = reward(torch.full((2, 3, 8, 8), 0.25), ["p", "p"], records)
        session = reward.fn._session
        second = reward(torch.full((2, 3, 8, 8), 0.75), ["p", "p"], records)  # a fresh loop per call broke this
        assert reward.fn._session is session and not session.closed
    assert first.tolist() == pytest.approx([0.25, 0.25], abs=0.01) and second.tolist() == pytest.approx([0.75] * 2, abs=0.01)


FLAKY = '''
def compute_score(prompt, flaky=False):
    if prompt == "bad":
        raise ConnectionError("scorer unreachable")
    return {"score": float(len(prompt)), "latency_ms": 2.0}
'''


def test_a_reward_that_is_not_required_scores_a_failed_sample_0_and_counts_it(tmp_path, caplog):
    """veRL-Omni's multi-reward entries default to ``required: false``: a failed call adds 0 to the
    weighted sum. Here that failure is also a metric (``failed``) and a logged traceback."""
    path = _write(tmp_path, FLAKY)
    required = build_reward("custom", path=path)
    with pytest.raises(CustomRewardError, match=r"(?s)on sample 1, prompt 'bad'.*scorer unreachable"):
        required(torch.rand(3, 3, 8, 8), ["ok", "bad", "fine"])
    reward = build_reward("custom", path=path, required=False, where="reward.reward_functions.ocr")
    with caplog.at_level("WARNING"):
        scores = reward(torch.rand(3, 3, 8, 8), ["ok", "bad", "fine"])
    assert scores.tolist() == [2.0, 0.0, 4.0]
    extras = reward.take_extras()
    assert extras["failed"].tolist() == [0.0, 1.0, 0.0]
    assert extras["latency_ms"][0] == 2.0 and torch.isnan(extras["latency_ms"][1])
    assert "reward.reward_functions.ocr" in caplog.text and "1 of 3 samples" in caplog.text
    assert "scorer unreachable" in caplog.text


def test_a_weighted_reward_reports_each_component_score_and_extras(tmp_path):
    """veRL-Omni's multi-reward manager logs ``reward/<key>`` and ``reward/<key>/<extra>``."""
    path = _write(tmp_path, FLAKY)
    reward = build_reward("weighted", components=[
        {"name": "custom", "label": "length", "weight": 0.5, "kwargs": {"path": path}},
        {"name": "brightness", "weight": 2.0}])
    images = torch.full((2, 3, 8, 8), 0.5)
    total = reward(images, ["ab", "abcd"])
    extras = reward.take_extras()
    assert extras["length"].tolist() == [2.0, 4.0] and extras["length/latency_ms"].tolist() == [2.0, 2.0]
    assert total.tolist() == pytest.approx((0.5 * extras["length"] + 2.0 * extras["brightness"]).tolist())
    assert reward.take_extras() == {}  # handed over once
