"""Prompt-embedding cache end to end through the real workers: a run with the cache (warmed,
encoders freed) gives the same weights after its first step as a run without. The cache itself:
tests/unit/test_prompt_cache.py."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.e2e
def test_a_run_with_the_prompt_cache_gives_the_same_first_step_update(tmp_path, tiny_flux, shared_ray):
    """End to end through the real workers: cache warmed, encoders freed, same weights after step 1."""
    from safetensors.torch import load_file

    from verl_digen.config.compose import compose_config
    from verl_digen.trainer.loop import run_training

    def run(name, *extra):
        cfg = compose_config(["digen.progress_bar=false", "trainer.logger=[]", "trainer.total_training_steps=1",
                              "digen.save_final_weights=true", f"digen.output_dir={tmp_path / name}", *extra])
        return run_training(cfg)

    plain = run("plain")
    cached = run("cached", "digen.prompt_cache.enable=true", f"digen.prompt_cache.dir={tmp_path / 'pc'}")
    a, b = load_file(plain.extra["final_weights"]), load_file(cached.extra["final_weights"])
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert plain.metrics[0]["reward_mean"] == cached.metrics[0]["reward_mean"]
