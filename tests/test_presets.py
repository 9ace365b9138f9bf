"""The presets in configs/ (shipped inside the wheel): every family x placement (LoRA colocated and\ndisaggregated, full fine-tuning disaggregated) composes, validates, and (tiny) runs."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from verl_digen.config.compose import compose_config
from verl_digen.config.schema import digen_config_from_dict
from verl_digen.trainer.loop import run_training

FAMILIES = ("flux", "sd3", "qwen_image", "wan", "hunyuan_video")
PLACEMENTS = ("colocated", "disaggregated")


@pytest.mark.parametrize("family,placement", [(f, p) for f in FAMILIES for p in PLACEMENTS + ("full_disaggregated",)
                                              if (f, p) != ("wan", "full_disaggregated")])
def test_preset_composes_and_validates(family, placement):
    cfg = compose_config([], config_name=f"{family}_{placement}")
    digen = digen_config_from_dict(OmegaConf.to_container(cfg.digen, resolve=True))
    assert digen.placement == placement.removeprefix("full_") and digen.model.arch == family
    assert digen.model.lora.enable is not placement.startswith("full_")
    assert cfg.trainer.n_gpus_per_node == 8 and cfg.trainer.save_freq > 0  # real-model settings
    smoke = compose_config(["+smoke=tiny"], config_name=f"{family}_{placement}")
    assert smoke.digen.sampling.height == 32 and smoke.trainer.total_training_steps == 2


@pytest.mark.e2e
@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("family", ("qwen_image", "wan", "hunyuan_video"))
def test_two_step_tiny_run_of_each_new_family(shared_ray, tiny_cache, tmp_path, family, placement):
    overrides = ["+smoke=tiny", "digen.progress_bar=false", f"digen.output_dir={tmp_path / 'run'}"]
    if family in ("wan", "hunyuan_video"):
        overrides.append("digen.sampling.num_frames=5")  # video latents [B, C, F, H, W]
    cfg = compose_config(overrides, config_name=f"{family}_{placement}")
    result = run_training(cfg)
    assert [m["step"] for m in result.metrics] == [1, 2]
    for m in result.metrics:
        assert m["actor/ratio_mean"] == pytest.approx(1.0, abs=1e-4 if placement == "disaggregated" else 1e-5)
    if placement == "disaggregated":
        assert result.extra["weights_in_sync"] is True
