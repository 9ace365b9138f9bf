"""The presets in configs/ (shipped inside the wheel): every family x placement (LoRA colocated and
disaggregated, full fine-tuning disaggregated) composes and validates at its real settings, and
shrinks with the ``+smoke=tiny`` overlay. That each one runs, with every setting it ships, is
test_rehearsal.py's."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from verl_digen.config.compose import compose_config
from verl_digen.config.schema import digen_config_from_dict

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
