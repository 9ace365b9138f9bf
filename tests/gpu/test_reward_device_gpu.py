"""Reward models on a GPU worker's device: a tiny preference model is built on CUDA and scores as on
the CPU (fp32: tight; bf16: bf16's tolerance). The rules on CPU, the meta device standing in for
the GPU, and the tiny checkpoints used here: tests/unit/test_reward_device.py."""

from __future__ import annotations

import pytest
import torch

from verl_digen.config.schema import digen_config_from_dict
from verl_digen.rewards import build_reward_from_config

from runs import quantised_rand
from test_image_reward import checkpoint  # noqa: F401 (a fixture: the tiny ImageReward.pt, for specs)
from test_reward_device import clip_dir, specs  # noqa: F401 (fixtures)
from test_reward_device import _worker, parameter_devices


PROMPTS = ["a red apple", "two dogs playing", "a red apple"]


@pytest.mark.gpu
def test_a_preference_model_scores_on_the_workers_gpu_like_on_cpu(specs):
    """On a GPU worker (compute_device() is CUDA) the reward is built there: the model's
    parameters on CUDA, scores equal to the CPU's (fp32: tight; bf16: bf16's tolerance)."""
    assert torch.cuda.is_available()
    images = quantised_rand(3, 3, 32, 32, seed=1)
    for name in ("pickscore", "imagereward"):
        on_cpu = build_reward_from_config(specs[name], device="cpu")(images, PROMPTS)
        worker = _worker(digen_config_from_dict({"reward": specs[name]}))
        assert worker._build_reward().type == "cuda"
        assert parameter_devices(worker.reward_fn) == {"cuda"}
        torch.testing.assert_close(worker.reward_fn(images, PROMPTS), on_cpu, atol=1e-4, rtol=1e-3)
    bf16 = {"name": "pickscore", "kwargs": dict(specs["pickscore"]["kwargs"], dtype="bfloat16")}
    scores = build_reward_from_config(bf16, device="cuda")(images.cuda(), PROMPTS)
    assert scores.device.type == "cuda"  # scores come back on the images' device
    on_cpu = build_reward_from_config(specs["pickscore"], device="cpu")(images, PROMPTS)
    torch.testing.assert_close(scores.cpu(), on_cpu, atol=3e-2, rtol=3e-2)
