"""The memory planner against a CUDA device: the meta-device activation trace of the real-size
FLUX.1-dev transformer (random weights, no download) vs ``torch.cuda.max_memory_allocated``.
`pytest -m gpu` on a machine with CUDA (CI has none; deselected)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")


def _real_flux_on_cuda():
    """FLUX.1-dev's transformer at its real config in bf16 on the GPU, random weights, with LoRA
    (rank 32 on the attention projections, fp32 adapters on a frozen base) as the presets train it."""
    from peft import LoraConfig

    from verl_digen.models.real_configs import build_on_meta

    model = build_on_meta("flux", "transformer", dtype=torch.bfloat16).to_empty(device="cuda")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    model.requires_grad_(False)
    model.add_adapter(LoraConfig(r=32, lora_alpha=64, init_lora_weights="gaussian", target_modules=list(TARGETS)))
    for name, p in model.named_parameters():
        if "lora_" in name:  # as add_lora keeps them (digen.model.trainable_dtype)
            p.data = p.data.float()
    return model


def _settle() -> None:
    """Before a baseline: what earlier tests of this process left in reference cycles is freed
    now, not during the measured call (which would lower the measured growth)."""
    import gc

    gc.collect()
    torch.cuda.synchronize()


def _cuda_inputs(shape):
    from verl_digen.memory.trace import _inputs
    from verl_digen.models.real_configs import component_config

    meta = _inputs(shape, component_config(shape.family, "transformer"), torch.bfloat16)
    return {k: (torch.randn(v.shape, dtype=v.dtype, device="cuda") if isinstance(v, torch.Tensor) else v)
            for k, v in meta.items()}


@pytest.mark.parametrize("checkpointing", [True, False], ids=["checkpointed", "plain"])
def test_training_activations_of_real_flux_match_the_trace(checkpointing):
    from verl_digen.memory.trace import TraceShape, trace_transformer

    shape = TraceShape("flux", None, "bf16", 512, 512, 1, 32, TARGETS)  # traced with its LoRA, as the planner does
    predicted = trace_transformer(shape).training_bytes(1, checkpointing=checkpointing)
    model = _real_flux_on_cuda()
    if checkpointing:
        model.enable_gradient_checkpointing()
    inputs = _cuda_inputs(shape)
    _settle()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = model(**inputs)[0]
    out.float().square().mean().backward()
    torch.cuda.synchronize()
    lora_grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.grad is not None)
    measured = torch.cuda.max_memory_allocated() - base - lora_grads
    print(f"FLUX 512x512, 1 row, checkpointing={checkpointing}: measured {measured / 2**30:.2f} GiB, "
          f"planned {predicted / 2**30:.2f} GiB")
    if checkpointing:
        # docs/memory.md: the activation term is expected within -20% / +35% of the measurement
        # (planned 0.74 GiB; measured 0.68 on an H100, 0.57 on an H200 in two runs: torch 2.11's
        # attention kernels there keep less for the backward, and the plan stays an over-estimate).
        assert 0.8 * measured <= predicted <= 1.35 * measured
    else:
        # Without checkpointing (no preset trains so) the trace over-counts: on an H100 6.26 GiB
        # measured against 10.1 planned (1.6x); the same saved-tensor accounting run on the real
        # CUDA kernels gives 9.1 GiB, so the gap is what autograd frees before the peak, not the
        # meta device (docs/memory.md, "Measured on a GPU"). Never below the measurement.
        assert measured <= predicted <= 1.7 * measured


def test_rollout_working_set_of_real_flux_matches_the_trace():
    from verl_digen.memory.trace import TraceShape, trace_transformer

    shape = TraceShape("flux", None, "bf16", 512, 512, 1, 32, TARGETS)
    predicted = trace_transformer(shape).inference_bytes(8)
    model = _real_flux_on_cuda()
    inputs = {k: (v.expand(8, *v.shape[1:]).contiguous() if isinstance(v, torch.Tensor) and k not in ("txt_ids", "img_ids")
                  else v) for k, v in _cuda_inputs(shape).items()}
    _settle()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        model(**inputs)
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated() - base
    print(f"FLUX 512x512, 8 rows, no grad: measured {measured / 2**30:.2f} GiB, planned {predicted / 2**30:.2f} GiB")
    assert 0.7 * measured <= predicted <= 1.5 * measured


@pytest.mark.parametrize("preset", ["flux_colocated", "wan_colocated", "hunyuan_video_colocated"])
def test_vae_decode_of_one_call_at_real_size_matches_the_plan(preset):
    """The planner's decode term (``_vae_decode_bytes``: one VAE call of the preset's decode chunk,
    video tiled as the workers tile it) against ``max_memory_allocated`` of the real-size VAE
    (random weights, the shipped config) decoding that call on the GPU, as ``decode_groups`` does:
    no grad, ``vae_decode_chunk`` samples, ``enable_tiling()`` for video."""
    import os

    from omegaconf import OmegaConf

    from verl_digen.config.compose import compose_config
    from verl_digen.config.schema import digen_config_from_dict
    from verl_digen.memory.plan import _vae_decode_bytes, job_shape
    from verl_digen.memory.trace import latent_layout
    from verl_digen.models.registry import ADAPTERS
    from verl_digen.models.real_configs import instantiate
    from verl_digen.memory.plan import trace_shape

    configs = os.path.join(os.path.dirname(__file__), "..", "..", "configs")
    cfg = compose_config([], config_name=preset, config_dir=configs)
    dcfg = digen_config_from_dict(OmegaConf.to_container(cfg.digen, resolve=True))
    job = job_shape(dcfg, devices_per_node=cfg.trainer.n_gpus_per_node, nnodes=1)
    samples = job.groups_per_task * job.group_size
    chunk = samples if job.vae_decode_chunk <= 0 else min(job.vae_decode_chunk, samples)
    planned = _vae_decode_bytes(job, samples)
    dtype = torch.float32 if "vae" in ADAPTERS[job.family].fp32_components else torch.bfloat16
    with torch.device("cuda"):
        vae = instantiate(job.family, "vae").to(dtype).eval().requires_grad_(False)
    if job.num_frames > 1:
        vae.enable_tiling()
    lay = latent_layout(trace_shape(job))
    shape = (chunk, lay["channels"], lay["h"], lay["w"]) if job.num_frames == 1 else (
        chunk, lay["channels"], lay["frames"], lay["h"], lay["w"])
    if job.family == "flux":  # FLUX's VAE decodes the unpacked 16-channel latents
        shape = (chunk, vae.config.latent_channels, job.height // 8, job.width // 8)
    z = torch.randn(shape, device="cuda", dtype=dtype)
    _settle()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        out = vae.decode(z, return_dict=False)[0].float()  # the adapters hand fp32 pixels on
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated() - base
    print(f"{preset}: VAE decode of {chunk} x {tuple(out.shape[1:])}: measured {measured / 2**30:.2f} GiB, "
          f"planned {planned / 2**30:.2f} GiB")
    # Measured on an H200 (memory/plan.py: VAE_WORKING_SET): the planned figure was 7-12% above.
    # An upper estimate: never more than 5% under the measurement, nor 50% over it.
    assert 0.95 * measured <= planned <= 1.5 * measured
