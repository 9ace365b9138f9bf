"""The Qwen-Image family: its registration, its tiny builder (with a Qwen2 tokenizer trained in
code) and its meta-device trace inputs.

The adapter is :class:`verl_digen.models.qwen_image.QwenImageAdapter`; the shipped configs are
Qwen-Image's (``models/configs/qwen_image``).
"""

from __future__ import annotations

from typing import Any

import torch

from verl_digen.models.family import FamilySpec, TraceLayout
from verl_digen.models.tiny_parts import (
    LATENT_CHANNELS,
    TEXT_WIDTH,
    assemble_pipeline,
    llm_sizes,
    template_words,
    train_bpe,
    wan_style_vae,
)

# The system prompt of Qwen-Image's template (qwen_image.PROMPT_TEMPLATE, from
# QwenImagePipeline.prompt_template_encode); the pipeline drops the template's first 34 tokens
# (up to and including "user\n").
QWEN_IMAGE_SYSTEM_PROMPT = (
    "Describe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:"
)
_QWEN_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                 "<|image_pad|>", "<|video_pad|>")


def build_qwen2_tokenizer(max_length: int = 34 + 32):
    """A Qwen2 byte-level BPE tokenizer (Qwen2.5-VL / Qwen-Image) with the chat special tokens.

    Every prompt word and every word of Qwen-Image's template is one token (with and without
    the leading-space marker), so the template prefix is exactly the 34 tokens the pipeline
    drops. ``max_length`` is the template prefix plus the text tokens kept (32)."""
    from tokenizers import Regex, pre_tokenizers
    from transformers import Qwen2Tokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    words = template_words(QWEN_IMAGE_SYSTEM_PROMPT, "system user assistant")
    pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    corpus = [" " + " ".join(words), "\n".join(words), QWEN_IMAGE_SYSTEM_PROMPT]
    vocab, merges = train_bpe(corpus, pre_tokenizer, pre_tokenizers.ByteLevel.alphabet())
    vocab = dict(sorted(vocab.items(), key=lambda kv: kv[1]))
    for token in _QWEN_SPECIAL:
        vocab[token] = len(vocab)
    return Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        model_max_length=max_length,
        extra_special_tokens=list(_QWEN_SPECIAL[1:]),
    )


def _qwen2_5_vl_encoder(tokenizer):
    """Qwen2.5-VL with a 2-layer text model and a 1-block vision tower (unused for text-to-image)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = tokenizer.convert_tokens_to_ids
    config = Qwen2_5_VLConfig(
        text_config=dict(
            **llm_sizes(tokenizer, layers=2),
            # Multimodal RoPE: sections (t, h, w) sum to head_dim / 2 = 8.
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [2, 3, 3]},
            bos_token_id=None,
            eos_token_id=ids("<|im_end|>"),
            pad_token_id=tokenizer.pad_token_id,
        ),
        vision_config=dict(
            depth=1,
            hidden_size=16,
            intermediate_size=32,
            num_heads=2,
            out_hidden_size=TEXT_WIDTH,
            fullatt_block_indexes=[0],
        ),
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
    )
    return Qwen2_5_VLForConditionalGeneration(config)


def build_tiny_pipeline(scheduler):
    """A tiny ``QwenImagePipeline``: a 2-layer Qwen2.5-VL text model, a 2-block MMDiT."""
    from diffusers import AutoencoderKLQwenImage, QwenImagePipeline, QwenImageTransformer2DModel

    tokenizer = build_qwen2_tokenizer()
    text = [(tokenizer, _qwen2_5_vl_encoder(tokenizer))]
    transformer = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=4 * LATENT_CHANNELS,  # packed 2x2 patches
        out_channels=LATENT_CHANNELS,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=TEXT_WIDTH,
        axes_dims_rope=(4, 6, 6),  # sums to attention_head_dim
    )
    vae = wan_style_vae(AutoencoderKLQwenImage, temporal_downsample=False)  # a one-frame video VAE
    # scheduler: Qwen-Image's (dynamic exponential shift, terminal sigma 0.02)
    return assemble_pipeline(QwenImagePipeline, text, transformer, vae, scheduler)


def text_tokens(max_sequence_length: int | None = None) -> int:
    """Text tokens per prompt after the template is dropped (QwenImagePipeline's default unless
    given; the adapter pads every prompt to it so that batches of different calls concatenate)."""
    from verl_digen.models.qwen_image import DEFAULT_MAX_SEQUENCE_LENGTH

    return max_sequence_length or DEFAULT_MAX_SEQUENCE_LENGTH


def trace_inputs(lay: TraceLayout, config: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    """One row of packed 2x2 latent tokens and the image shape Qwen-Image's RoPE reads."""
    meta = dict(device="meta", dtype=dtype)
    h, w = lay.h, lay.w
    return dict(
        hidden_states=torch.empty(1, (h // 2) * (w // 2), 4 * lay.channels, **meta),
        timestep=torch.empty(1, **meta),
        encoder_hidden_states=torch.empty(1, lay.text_tokens, config["joint_attention_dim"], **meta),
        encoder_hidden_states_mask=None,
        img_shapes=[[(1, h // 2, w // 2)]],
        return_dict=False,
    )


FAMILY = FamilySpec(
    name="qwen_image",
    adapter="verl_digen.models.qwen_image:QwenImageAdapter",
    pipeline_classes=("QwenImagePipeline",),
    build_tiny_pipeline=build_tiny_pipeline,
    text_tokens=text_tokens,
    max_sequence_length_limit=1024,
    trace_inputs=trace_inputs,
)
