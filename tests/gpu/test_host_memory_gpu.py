"""Models loaded straight onto a GPU hold about one shard on the host at a time (the process's peak
resident memory grows by far less than the model). The rest of the host memory the planner
counts: tests/unit/test_host_memory.py."""

from __future__ import annotations

import pytest


@pytest.mark.gpu
def test_loading_onto_the_gpu_holds_about_one_shard_on_the_host(tmp_path):
    """What only a GPU shows: a ~400 MB transformer saved in 50 MB shards loads onto the GPU with
    the process's peak resident memory growing by far less than the model (the old loading grew
    by the whole model, and again by a copy on its way to the device)."""
    import torch
    from diffusers import FluxTransformer2DModel

    from verl_digen.models.base import load_component

    model = FluxTransformer2DModel(num_layers=6, num_single_layers=10, attention_head_dim=128, num_attention_heads=4,
                                   joint_attention_dim=512, pooled_projection_dim=256, in_channels=64)
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    assert size > 300e6
    model.save_pretrained(tmp_path / "transformer", max_shard_size="50MB")
    del model
    import gc

    gc.collect()

    def rss_peak_kib() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))

    with open("/proc/self/clear_refs", "w") as f:  # reset VmHWM to the current resident size
        f.write("5")
    before = rss_peak_kib()
    loaded = load_component(FluxTransformer2DModel, str(tmp_path), "transformer", torch.float32, torch.device("cuda"))
    grown = (rss_peak_kib() - before) * 1024
    assert next(loaded.parameters()).device.type == "cuda"
    assert grown < size / 3, (grown, size)
