"""The HunyuanVideo family: its registration, its tiny builder (with a Llama tokenizer trained in
code) and its meta-device trace inputs.

The adapter is :class:`verl_digen.models.hunyuan_video.HunyuanVideoAdapter`; the shipped configs
are HunyuanVideo's (``models/configs/hunyuan_video``).
"""

from __future__ import annotations

import string
from typing import Any

import torch

from verl_digen.models.family import FamilySpec, TraceLayout
from verl_digen.models.tiny_parts import (
    LATENT_CHANNELS,
    TEXT_WIDTH,
    assemble_pipeline,
    build_clip_tokenizer,
    clip_encoder,
    llm_sizes,
    template_words,
    train_bpe,
)

# HunyuanVideo's Llama-3 chat headers (DEFAULT_PROMPT_TEMPLATE in pipeline_hunyuan_video).
_LLAMA_SPECIAL = ("<unk>", "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                  "<|eot_id|>")


def build_llama_tokenizer(max_length: int = 95 + 16):
    """A Llama tokenizer (sentencepiece-style BPE with byte fallback) with Llama-3 chat headers.

    Prompt words and the words of HunyuanVideo's template are single tokens, so the template
    prefix (with the BOS token) is exactly the 95 tokens the pipeline crops. Pads on the right,
    which HunyuanVideo's transformer assumes (it reads the mask as an effective length)."""
    from tokenizers import pre_tokenizers
    from transformers import LlamaTokenizerFast

    from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE

    words = template_words(DEFAULT_PROMPT_TEMPLATE["template"])
    pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="never", split=True)
    # Words alone (after a special token) and after a space ("\u2581word"); "\n\n" as one token.
    corpus = [*words, " " + " ".join(words), "\n\n"]
    vocab, merges = train_bpe(corpus, pre_tokenizer, list(string.printable.strip()) + ["\u2581", "\n"])
    full = {token: i for i, token in enumerate(_LLAMA_SPECIAL)}
    for byte in range(256):  # byte fallback: any character encodes, nothing is <unk>
        full[f"<0x{byte:02X}>"] = len(full)
    for token in sorted(vocab, key=vocab.get):
        full.setdefault(token, len(full))
    return LlamaTokenizerFast(
        vocab=full,
        merges=merges,
        unk_token="<unk>",
        bos_token="<|begin_of_text|>",
        eos_token="<|end_of_text|>",
        pad_token="<|end_of_text|>",
        add_bos_token=True,
        extra_special_tokens=list(_LLAMA_SPECIAL[3:]),
        model_max_length=max_length,
        padding_side="right",
    )


def build_tiny_pipeline(scheduler):
    """A tiny ``HunyuanVideoPipeline``: Llama + CLIP text encoders, one dual- and one single-stream
    block, a 4x-temporal causal VAE."""
    from diffusers import AutoencoderKLHunyuanVideo, HunyuanVideoPipeline, HunyuanVideoTransformer3DModel
    from transformers import LlamaConfig, LlamaModel

    tokenizer = build_llama_tokenizer()
    # The pipeline always pads CLIP prompts to 77 tokens.
    tokenizer_2 = build_clip_tokenizer(max_length=77)
    text_encoder = LlamaModel(
        LlamaConfig(
            # The pipeline reads the hidden state 2 layers before the last: 3 layers keep that a
            # real layer output rather than the embeddings.
            **llm_sizes(tokenizer, layers=3),
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    )
    clip_hidden = 24  # pooled width; distinct from the LLM width on purpose
    text = [(tokenizer, text_encoder), (tokenizer_2, clip_encoder(tokenizer_2, hidden=clip_hidden))]
    transformer = HunyuanVideoTransformer3DModel(
        in_channels=LATENT_CHANNELS,
        out_channels=LATENT_CHANNELS,
        num_attention_heads=2,
        attention_head_dim=16,
        num_layers=1,  # one dual-stream block
        num_single_layers=1,  # one single-stream block
        num_refiner_layers=1,
        mlp_ratio=2.0,
        patch_size=2,
        patch_size_t=1,
        qk_norm="rms_norm",
        guidance_embeds=True,  # like HunyuanVideo: distilled guidance embedding
        text_embed_dim=TEXT_WIDTH,
        pooled_projection_dim=clip_hidden,
        rope_axes_dim=(4, 6, 6),  # sums to attention_head_dim
    )
    vae = AutoencoderKLHunyuanVideo(
        in_channels=3,
        out_channels=3,
        latent_channels=LATENT_CHANNELS,
        # Three blocks: 2x spatial in the first, 2x temporal in the first two (4x: 5 frames -> 2).
        down_block_types=("HunyuanVideoDownBlock3D",) * 3,
        up_block_types=("HunyuanVideoUpBlock3D",) * 3,
        block_out_channels=(8, 8, 16),
        layers_per_block=1,
        norm_num_groups=4,
        scaling_factor=0.476986,  # HunyuanVideo VAE's value
        spatial_compression_ratio=2,
        temporal_compression_ratio=4,
        mid_block_add_attention=True,
    )
    # scheduler: HunyuanVideo's, shift 7
    return assemble_pipeline(HunyuanVideoPipeline, text, transformer, vae, scheduler)


def text_tokens(max_sequence_length: int | None = None) -> int:
    """Llama tokens per prompt after the template is cropped (HunyuanVideoPipeline's default
    unless given)."""
    from verl_digen.models.hunyuan_video import DEFAULT_MAX_SEQUENCE_LENGTH

    return max_sequence_length or DEFAULT_MAX_SEQUENCE_LENGTH


def trace_inputs(lay: TraceLayout, config: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    """One row of video latents with the text mask, pooled CLIP vector and distilled guidance."""
    meta = dict(device="meta", dtype=dtype)
    fp32 = dict(device="meta", dtype=torch.float32)
    t = lay.text_tokens
    return dict(
        hidden_states=torch.empty(1, lay.channels, lay.frames, lay.h, lay.w, **meta),
        timestep=torch.empty(1, **fp32),
        encoder_hidden_states=torch.empty(1, t, config["text_embed_dim"], **meta),
        encoder_attention_mask=torch.ones(1, t, **meta),
        pooled_projections=torch.empty(1, config["pooled_projection_dim"], **meta),
        guidance=torch.empty(1, **meta),
        return_dict=False,
    )


FAMILY = FamilySpec(
    name="hunyuan_video",
    adapter="verl_digen.models.hunyuan_video:HunyuanVideoAdapter",
    pipeline_classes=("HunyuanVideoPipeline",),
    build_tiny_pipeline=build_tiny_pipeline,
    text_tokens=text_tokens,
    trace_inputs=trace_inputs,
)
