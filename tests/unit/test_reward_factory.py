"""Flow-GRPO's reward factories loaded as they are (``digen.reward.name=factory``), and the
built-in rewards that share a Flow-GRPO name giving Flow-GRPO's values.

The factory file here is written for this test in the shape of Flow-GRPO's ``rewards.py``: its
JPEG factories as Flow-GRPO computes them (sizes in kB, ``jpeg_compressibility`` divided by 500,
NumPy arrays and an info dict), a factory that takes the device, one with its own setting and a
per-sample info entry."""

from __future__ import annotations

import pytest
import torch

from verl_digen.config.schema import ConfigError, digen_config_from_dict
from verl_digen.rewards import build_reward, build_reward_from_config

FLOW_GRPO_SHAPED = '''
import io

import numpy as np
import torch
from PIL import Image

def jpeg_incompressibility():
    def _fn(images, prompts, metadata):
        if isinstance(images, torch.Tensor):
            images = (images * 255).round().clamp(0, 255).to(torch.uint8).cpu().numpy()
            images = images.transpose(0, 2, 3, 1)  # NCHW -> NHWC
        images = [Image.fromarray(image) for image in images]
        buffers = [io.BytesIO() for _ in images]
        for image, buffer in zip(images, buffers):
            image.save(buffer, format="JPEG", quality=95)
        sizes = [buffer.tell() / 1000 for buffer in buffers]
        return np.array(sizes), {}

    return _fn


def jpeg_compressibility():
    jpeg_fn = jpeg_incompressibility()

    def _fn(images, prompts, metadata):
        rew, meta = jpeg_fn(images, prompts, metadata)
        return -rew/500, meta

    return _fn


def device_score(device):
    with open(__file__ + ".called", "w") as f:  # what the factory got, for the test to read
        f.write(str(device))

    def _fn(images, prompts, metadata):
        return torch.tensor([len(p) for p in prompts], dtype=torch.float64), {}

    return _fn


def weighted_mean(device, score_dict):
    def _fn(images, prompts, metadata):
        means = images.float().mean(dim=(1, 2, 3))
        return (score_dict["mean"] * means).tolist(), {"mean": means.numpy(), "note": "not a number"}

    return _fn


def not_a_factory():
    return 3
'''

PROMPTS = ["a cat", "a red car", "x"]


@pytest.fixture
def rewards_file(tmp_path):
    path = tmp_path / "rewards.py"
    path.write_text(FLOW_GRPO_SHAPED)
    return str(path)


def _images(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(3, 3, 32, 32, generator=g)


@pytest.mark.parametrize("name", ["jpeg_compressibility", "jpeg_incompressibility"])
def test_our_rewards_of_a_flow_grpo_name_give_flow_grpos_values(rewards_file, name):
    images = _images()
    theirs = build_reward("factory", path=rewards_file, factory=name)(images, PROMPTS)
    ours = build_reward(name)(images, PROMPTS)
    assert torch.equal(ours, theirs), (ours, theirs)


def test_a_factory_that_takes_the_device_gets_the_workers(rewards_file):
    reward = build_reward_from_config({"name": "factory", "kwargs": {"path": rewards_file, "factory": "device_score"}},
                                      device=torch.device("cpu"))
    with open(rewards_file + ".called") as f:
        assert f.read() == "cpu"
    assert reward(_images(), PROMPTS).tolist() == [5.0, 9.0, 1.0]


def test_factory_kwargs_reach_the_factory_and_per_sample_info_is_logged(rewards_file):
    reward = build_reward("factory", path=rewards_file, factory="weighted_mean", factory_kwargs={"score_dict": {"mean": 2.0}},
                          device="cpu")
    images = _images(1)
    means = images.mean(dim=(1, 2, 3))
    torch.testing.assert_close(reward(images, PROMPTS), 2.0 * means)
    extras = reward.take_extras()
    assert set(extras) == {"mean"}  # the note is not a number per sample
    torch.testing.assert_close(extras["mean"], means)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"factory": "nope"}, r"digen.reward.kwargs.factory: .* defines no 'nope'"),
    ({"factory": "jpeg_compressibility", "factory_kwargs": {"x": 1}}, r"takes no \['x'\]"),
    ({"factory": "weighted_mean"}, r"needs \['score_dict'\]"),
    ({"factory": "not_a_factory"}, r"returned int, not the scoring function"),
])
def test_a_factory_that_does_not_fit_is_named(rewards_file, kwargs, message):
    with pytest.raises(ValueError, match=message):
        build_reward("factory", path=rewards_file, device="cpu", **kwargs)


def test_the_jobs_check_before_ray_loads_the_factory_without_calling_it(rewards_file, tmp_path):
    """A factory may load a model: the check before Ray only loads the file and matches the
    arguments (the run builds it where it scores)."""
    import os

    from verl_digen.trainer.resolve import preflight_reward

    cfg = digen_config_from_dict({"reward": {"name": "factory", "kwargs": {"path": rewards_file,
                                                                           "factory": "device_score"}}})
    preflight_reward(cfg)
    assert not os.path.exists(rewards_file + ".called")  # loaded and matched, not called
    bad = digen_config_from_dict({"reward": {"name": "factory", "kwargs": {"path": rewards_file, "factory": "nope"}}})
    with pytest.raises(ConfigError, match="defines no 'nope'"):
        preflight_reward(bad)
