"""Where the text encoders run, on a real GPU: a fused worker's prompt-cache warm-up runs its
offloaded text encoders on the GPU. The rules on CPU, with the meta device standing in for the
GPU: tests/unit/test_encoder_placement.py."""

from __future__ import annotations

import pytest
import torch

from verl_digen.models.base import onloaded
from verl_digen.models.prompt_cache import PromptEmbeddingCache
from verl_digen.workers.prompt_warmup import warm_share
from test_encoder_placement import PROMPTS


# ---------------------------------------------------------------------- on a GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_warm_up_on_cuda_runs_offloaded_encoders_on_the_gpu(tiny_dirs, tmp_path):
    """A fused worker's path on a GPU: the tiny FLUX in bf16 on CUDA, its text encoders offloaded
    to the CPU (as init_model does with digen.model.offload_text_encoders=true), its share warmed
    in batches of 2: every encoder forward runs on the GPU, the encoders are back on the CPU
    afterwards, the cached rows are on the CPU and match a fresh GPU encode to bf16 rounding."""
    from verl_digen.models.registry import load_adapter

    adapter = load_adapter(tiny_dirs["flux"], device="cuda", dtype=torch.bfloat16)
    names = tuple(n for n in adapter.text_encoder_names
                  if isinstance(getattr(adapter, n, None), torch.nn.Module))
    seen: list[str] = []
    for n in names:
        getattr(adapter, n).register_forward_pre_hook(
            lambda m, args: seen.append(next(m.parameters()).device.type))
    adapter.offload_to_cpu(adapter.text_encoder_names)
    assert all(next(getattr(adapter, n).parameters()).device.type == "cpu" for n in names)
    cache = PromptEmbeddingCache(adapter, model_key="gpu", cache_dir=str(tmp_path))
    prompts = PROMPTS[:5]
    assert warm_share(cache, prompts, 0, 1, batch_size=2)["encoded"] == 5
    assert seen and set(seen) == {"cuda"}
    assert all(p.device.type == "cpu" for n in names for p in getattr(adapter, n).parameters())
    assert all(v.device.type == "cpu" for v in cache._memory[prompts[0]].values())
    torch.cuda.synchronize()
    with onloaded(adapter, adapter.text_encoder_names):
        fresh = cache._encode_fn(prompts[:2])
    got = cache.encode(prompts[:2])
    for k in fresh:
        assert got[k].device.type == "cuda"
        torch.testing.assert_close(got[k].float(), fresh[k].float(), rtol=2e-2, atol=2e-2)
