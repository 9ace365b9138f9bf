"""The FLUX.1 family: its registration, its tiny builder and its meta-device trace inputs.

The adapter is :class:`verl_digen.models.flux.FluxAdapter`; the shipped configs are FLUX.1-dev's
(``models/configs/flux``).
"""

from __future__ import annotations

from typing import Any

import torch

from verl_digen.models.family import FamilySpec, TraceLayout
from verl_digen.models.tiny_parts import (
    LATENT_CHANNELS,
    T5_WIDTH,
    assemble_pipeline,
    build_clip_tokenizer,
    build_t5_tokenizer,
    clip_encoder,
    image_vae,
    t5_encoder,
)


def build_tiny_pipeline(scheduler):
    """A tiny ``FluxPipeline``: CLIP + T5 text encoders, one double- and one single-stream block."""
    from diffusers import FluxPipeline, FluxTransformer2DModel

    tokenizer = build_clip_tokenizer()
    tokenizer_2 = build_t5_tokenizer()
    clip_hidden = 24  # pooled width; distinct from the T5 width on purpose
    text = [(tokenizer, clip_encoder(tokenizer, hidden=clip_hidden)), (tokenizer_2, t5_encoder(tokenizer_2))]
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=4 * LATENT_CHANNELS,  # packed 2x2 patches
        num_layers=1,  # one double-stream (MMDiT) block
        num_single_layers=1,  # one single-stream block
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=T5_WIDTH,
        pooled_projection_dim=clip_hidden,
        guidance_embeds=True,  # like FLUX.1-dev, so the distilled-guidance path is exercised
        axes_dims_rope=(4, 6, 6),  # sums to attention_head_dim
    )
    vae = image_vae(scaling_factor=0.3611, shift_factor=0.1159)  # FLUX.1 VAE's values
    # scheduler: FLUX.1-dev's, dynamic shift (mu 0.5 .. 1.15)
    return assemble_pipeline(FluxPipeline, text, transformer, vae, scheduler)


def text_tokens(max_sequence_length: int | None = None) -> int:
    """T5 tokens per prompt (FluxPipeline's default unless given)."""
    from verl_digen.models.flux import DEFAULT_MAX_SEQUENCE_LENGTH

    return max_sequence_length or DEFAULT_MAX_SEQUENCE_LENGTH


def trace_inputs(lay: TraceLayout, config: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    """One row of packed 2x2 latent tokens, with the text ids and image ids of FLUX's RoPE."""
    meta = dict(device="meta", dtype=dtype)
    fp32 = dict(device="meta", dtype=torch.float32)
    t = lay.text_tokens
    length = (lay.h // 2) * (lay.w // 2)
    return dict(
        hidden_states=torch.empty(1, length, 4 * lay.channels, **meta),
        timestep=torch.empty(1, **meta),
        guidance=torch.empty(1, **fp32) if config.get("guidance_embeds") else None,
        pooled_projections=torch.empty(1, config["pooled_projection_dim"], **meta),
        encoder_hidden_states=torch.empty(1, t, config["joint_attention_dim"], **meta),
        txt_ids=torch.empty(t, 3, **fp32),
        img_ids=torch.empty(length, 3, **fp32),
        return_dict=False,
    )


FAMILY = FamilySpec(
    name="flux",
    adapter="verl_digen.models.flux:FluxAdapter",
    pipeline_classes=("FluxPipeline",),
    build_tiny_pipeline=build_tiny_pipeline,
    text_tokens=text_tokens,
    max_sequence_length_limit=512,
    trace_inputs=trace_inputs,
)
