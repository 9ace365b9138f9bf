"""Every family samples on its real schedule: the shipped real scheduler configs, the tiny models
built with them, and each SDE step's noise against Flow-GRPO's formula (the pure-noise first
step included, which Wan2.1's UniPC schedule starts at 1 - 1e-6 instead of 1).

ODE parity with the diffusers pipelines on these schedules: test_models.py and
test_models_video.py (``test_matches_diffusers_pipeline``)."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from verl_digen.algos.sde import sde_step_with_logprob
from verl_digen.models import load_adapter
from verl_digen.models.real_configs import FAMILIES, build_on_meta, build_scheduler, scheduler_config

from runs import SPECS

pytestmark = pytest.mark.usefixtures("one_thread")

NOISE_LEVEL = 0.7


def flow_grpo_std(sigmas: list[float], j: int, noise_level: float) -> float:
    """Flow-GRPO's noise std of step ``j`` (``sde_step_with_logprob``, sde_type "sde"):
    ``sqrt(s / (1 - s')) * a * sqrt(s - s_next)`` with ``s' = sigmas[1]`` on the pure-noise
    first step (``s`` ~ 1), ``s' = s`` on every other step."""
    s, s_next = sigmas[j], sigmas[j + 1]
    s_den = sigmas[1] if j == 0 else s
    return math.sqrt(s / (1 - s_den)) * noise_level * math.sqrt(s - s_next)


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_model_ships_the_real_scheduler_config(family, tiny_dirs):
    with open(os.path.join(tiny_dirs[family], "scheduler", "scheduler_config.json")) as f:
        tiny = json.load(f)
    real = scheduler_config(family)
    assert tiny["_class_name"] == real["_class_name"]
    assert {k: tiny[k] for k in real if not k.startswith("_")} == {k: v for k, v in real.items() if not k.startswith("_")}


def test_real_schedules_start_at_pure_noise():
    """FlowMatchEuler schedules start at exactly 1; Wan2.1's UniPC one 1e-6 below (diffusers keeps
    its log(alpha) finite), which the SDE step must still treat as the pure-noise step."""
    for family in FAMILIES:
        scheduler = build_scheduler(family)
        kwargs = {"mu": 0.8} if scheduler.config.get("use_dynamic_shifting") else {}
        scheduler.set_timesteps(16, **kwargs)
        first = scheduler.sigmas[0].item()
        if family == "wan":
            assert type(scheduler).__name__ == "UniPCMultistepScheduler"
            assert first == pytest.approx(1 - 1e-6, abs=1e-7) and first < 1
        else:
            assert first == 1.0


@pytest.mark.parametrize("num_steps", [4, 16])
@pytest.mark.parametrize("family", FAMILIES)
def test_sde_std_of_every_step_is_flow_grpo_formula(family, num_steps, adapters):
    """Each step's std on the family's real schedule (as its adapter computes it) equals
    Flow-GRPO's, including the first step's substitution of sigmas[1]."""
    sigmas = adapters[family].sigmas(num_steps, SPECS[family])
    values = [float(s) for s in sigmas]
    assert values[0] > 1 - 1e-5
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 4, generator=generator)
    v = torch.randn(2, 3, 4, generator=generator)
    stds = []
    for j in range(num_steps):
        out = sde_step_with_logprob(
            v, x, sigmas[j].expand(2), sigmas[j + 1].expand(2), noise_level=NOISE_LEVEL, prev_sample=x
        )
        assert out.std.shape == (2, 1, 1)
        expected = flow_grpo_std(values, j, NOISE_LEVEL)
        assert out.std[0].item() == pytest.approx(expected, rel=1e-5), f"step {j}"
        stds.append(out.std[0].item())
    # No blow-up on the first step (Wan's 1 - 1e-6 start gave ~70-100x the second step's std).
    assert stds[0] < 3 * stds[1]


def test_wan_sde_rollout_keeps_latents_at_unit_scale(tiny_dirs):
    """A 16-step SDE rollout of the tiny Wan on its real UniPC schedule: every latent keeps a std
    near 1 (the sigma == 1 guard missing 0.999999 gave ~5000 after the first step)."""
    from verl_digen.algos.window import SdeWindowConfig
    from verl_digen.workers.sampling import SamplingSettings, sample_groups

    adapter = load_adapter(tiny_dirs["wan"])
    settings = SamplingSettings(
        spec=SPECS["wan"], num_steps=16, noise_level=NOISE_LEVEL, sde_type="sde",
        window=SdeWindowConfig(mode="fixed", start=0, size=16), timestep_fraction=1.0,
    )
    data = sample_groups(
        adapter, ["a red apple"], [0], [0], group_size=2, settings=settings, training_step=0, seed=7, policy_version=0
    )
    latents = data.batch["latents"]  # [B, S+1, C, F, h, w]
    stds = [latents[:, j].std().item() for j in range(latents.shape[1])]
    assert max(stds) < 3, stds


def test_real_component_configs_have_the_published_parameter_counts():
    """The shipped transformer configs, built on the meta device, have the published sizes."""
    expected_billions = {"flux": 11.90, "sd3": 8.06, "qwen_image": 20.43, "wan": 14.29, "hunyuan_video": 12.82}
    for family, billions in expected_billions.items():
        transformer = build_on_meta(family, "transformer")
        assert next(transformer.parameters()).is_meta
        count = sum(p.numel() for p in transformer.parameters())
        assert count / 1e9 == pytest.approx(billions, abs=0.01), family
