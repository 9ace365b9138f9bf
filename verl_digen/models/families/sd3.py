"""The Stable Diffusion 3 family: its registration, its tiny builder and its meta-device trace
inputs.

The adapter is :class:`verl_digen.models.sd3.SD3Adapter`; the shipped configs are SD3.5
Large's (``models/configs/sd3``).
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
    """A tiny ``StableDiffusion3Pipeline``: two CLIPs and a T5, a 2-block MMDiT."""
    from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline

    tokenizer = build_clip_tokenizer()
    tokenizer_2 = build_clip_tokenizer()
    tokenizer_3 = build_t5_tokenizer()
    # Two CLIPs of different widths (like CLIP-L 768 / CLIP-G 1280): their hidden states are
    # concatenated (8 + 16 = 24) and zero-padded to the T5 width (32); pooled 16 + 16 = 32.
    text = [
        (tokenizer, clip_encoder(tokenizer, hidden=8, projection=16, layers=2)),
        (tokenizer_2, clip_encoder(tokenizer_2, hidden=16, projection=16, layers=2)),
        (tokenizer_3, t5_encoder(tokenizer_3)),
    ]
    transformer = SD3Transformer2DModel(
        sample_size=16,  # latent size of a 32x32 image
        patch_size=2,
        in_channels=LATENT_CHANNELS,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=T5_WIDTH,
        caption_projection_dim=32,  # must equal heads * head_dim
        pooled_projection_dim=32,
        out_channels=LATENT_CHANNELS,
        pos_embed_max_size=32,  # room for up to 128x128-pixel images
    )
    vae = image_vae(scaling_factor=1.5305, shift_factor=0.0609)  # SD3 VAE's values
    # scheduler: SD3.5 Large's, shift 3
    return assemble_pipeline(StableDiffusion3Pipeline, text, transformer, vae, scheduler)


def text_tokens(max_sequence_length: int | None = None) -> int:
    """The joint sequence's text tokens: the 77 CLIP tokens plus the T5 ones (the pipeline's
    default unless given)."""
    from verl_digen.models.sd3 import DEFAULT_MAX_SEQUENCE_LENGTH

    return 77 + (max_sequence_length or DEFAULT_MAX_SEQUENCE_LENGTH)


def trace_inputs(lay: TraceLayout, config: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    """One row of unpacked latents (the transformer patchifies them itself)."""
    meta = dict(device="meta", dtype=dtype)
    fp32 = dict(device="meta", dtype=torch.float32)
    return dict(
        hidden_states=torch.empty(1, lay.channels, lay.h, lay.w, **meta),
        timestep=torch.empty(1, **fp32),
        encoder_hidden_states=torch.empty(1, lay.text_tokens, config["joint_attention_dim"], **meta),
        pooled_projections=torch.empty(1, config["pooled_projection_dim"], **meta),
        return_dict=False,
    )


FAMILY = FamilySpec(
    name="sd3",
    adapter="verl_digen.models.sd3:SD3Adapter",
    pipeline_classes=("StableDiffusion3Pipeline",),
    build_tiny_pipeline=build_tiny_pipeline,
    text_tokens=text_tokens,
    max_sequence_length_limit=512,
    trace_inputs=trace_inputs,
)
