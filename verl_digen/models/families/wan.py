"""The Wan2.1 family: its registration, its tiny builder and its meta-device trace inputs.

The adapter is :class:`verl_digen.models.wan.WanAdapter`; the shipped configs are
Wan2.1-T2V-14B's (``models/configs/wan``).
"""

from __future__ import annotations

from typing import Any

import torch

from verl_digen.models.family import FamilySpec, TraceLayout
from verl_digen.models.tiny_parts import (
    LATENT_CHANNELS,
    TEXT_WIDTH,
    assemble_pipeline,
    build_t5_tokenizer,
    t5_encoder,
    wan_style_vae,
)

#: The tiny Wan VAE's temporal factor (frames per latent frame after the first).
TINY_SCALE_FACTOR_TEMPORAL = 2


def build_tiny_pipeline(scheduler):
    """A tiny ``WanPipeline``: a UMT5 text encoder, a 2-block video transformer, a causal VAE."""
    from diffusers import AutoencoderKLWan, WanPipeline, WanTransformer3DModel

    tokenizer = build_t5_tokenizer()  # a T5/UMT5 sentencepiece-style Unigram tokenizer
    text = [(tokenizer, t5_encoder(tokenizer, width=TEXT_WIDTH, umt5=True))]
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,  # RoPE splits it (t, h, w) = (4, 4, 4)
        in_channels=LATENT_CHANNELS,
        out_channels=LATENT_CHANNELS,
        text_dim=TEXT_WIDTH,
        freq_dim=32,
        ffn_dim=48,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=64,
    )
    vae = wan_style_vae(AutoencoderKLWan, temporal_downsample=True, scale_factor_temporal=TINY_SCALE_FACTOR_TEMPORAL,
                         scale_factor_spatial=2)
    # scheduler: Wan2.1's UniPC multistep scheduler with flow sigmas (flow_shift 3): its first
    # sigma is 1 - 1e-6, not 1. The RL sampler steps these sigmas with its own Euler / SDE steps.
    return assemble_pipeline(WanPipeline, text, transformer, vae, scheduler)


def text_tokens(max_sequence_length: int | None = None) -> int:
    """UMT5 tokens per prompt (WanPipeline's default unless given)."""
    from verl_digen.models.wan import DEFAULT_MAX_SEQUENCE_LENGTH

    return max_sequence_length or DEFAULT_MAX_SEQUENCE_LENGTH


def trace_inputs(lay: TraceLayout, config: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    """One row of video latents ``[1, C, frames, h, w]`` (the transformer patchifies them)."""
    meta = dict(device="meta", dtype=dtype)
    fp32 = dict(device="meta", dtype=torch.float32)
    return dict(
        hidden_states=torch.empty(1, lay.channels, lay.frames, lay.h, lay.w, **meta),
        timestep=torch.empty(1, **fp32),
        encoder_hidden_states=torch.empty(1, lay.text_tokens, config["text_dim"], **meta),
        return_dict=False,
    )


FAMILY = FamilySpec(
    name="wan",
    adapter="verl_digen.models.wan:WanAdapter",
    pipeline_classes=("WanPipeline",),
    build_tiny_pipeline=build_tiny_pipeline,
    text_tokens=text_tokens,
    trace_inputs=trace_inputs,
)
