"""Tiny, randomly initialised diffusers models for tests and CPU demos.

No machine here can download weights, so every architecture gets a builder that constructs
its pipeline components at toy width (tens of thousands of parameters), with tokenizers built
in code, and saves them with ``save_pretrained``. The result is an ordinary diffusers-format
directory, loaded back through exactly the adapter code path real checkpoints use.

Sizes: a 32x32 image goes through a VAE with one 2x downsample to 16x16 latents, i.e. 64 image
tokens for the transformer (FLUX packs 2x2 latent patches, SD3 uses patch size 2). Prompts are
16 tokens per text encoder. One transformer forward takes a few milliseconds on one CPU core.

Video models (Wan2.1, HunyuanVideo) use the same 2x spatial VAE factor and a causal temporal
factor (Wan 2, HunyuanVideo 4, the smallest its VAE allows): a 5-frame 32x32 clip becomes 3
(Wan) or 2 (HunyuanVideo) latent frames of 16x16. Qwen-Image works like FLUX (packed 2x2 patches).
Their tokenizers (Qwen2 byte-level BPE, Llama sentencepiece-style BPE) are trained in code with
the ``tokenizers`` library on the prompt words and the pipelines' prompt templates, so that the
template prefix has exactly the length the pipeline crops (34 tokens for Qwen-Image, 95 for
HunyuanVideo) and prompts keep all their tokens.

CLI::

    python -m verl_digen.models.tiny --arch flux --out /tmp/tiny-flux
    python -m verl_digen.models.tiny --arch {sd3,qwen_image,wan,hunyuan_video} --out DIR
"""

from __future__ import annotations

import argparse
import os
import shutil
import string
import tempfile
from typing import Any, Callable

import torch

TINY_VERSION = "v2"  # bump when the builders change, so stale caches are not reused
TINY_ARCHS = ("flux", "sd3", "qwen_image", "wan", "hunyuan_video")

# Shared toy sizes. Text widths are small but distinct where the pipeline pads or concatenates,
# so that shape bugs show up as errors instead of silently lining up.
_PROMPT_TOKENS = 16  # CLIP and T5 sequence length (real models: 77 and 256/512)
_T5_WIDTH = 32  # T5 d_model == transformer joint_attention_dim
_LATENT_CHANNELS = 4  # real FLUX / SD3 VAEs use 16


# ---------------------------------------------------------------------- tokenizers


def _byte_level_alphabet() -> list[str]:
    """The 256 printable stand-ins byte-level BPE uses for raw bytes (GPT-2 / CLIP convention):
    printable Latin-1 bytes map to themselves, the rest to code points from 256 upwards."""
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    chars, next_free = [], 256
    for byte in range(256):
        if byte in printable:
            chars.append(chr(byte))
        else:
            chars.append(chr(next_free))
            next_free += 1
    return chars


# Whole-word tokens for words common in prompts, so typical prompts take a handful of tokens
# instead of one per character (both tokenizers fall back to characters for anything else).
_WORDS = (
    "a an the of on in at with and next to by under photo picture image painting drawing render "
    "cat dog bird horse cow fish car bus bike boat house tree flower apple banana cake cup ball cube "
    "person man woman child face table chair sky sea beach mountain city street room "
    "red green blue yellow black white orange purple pink brown gray gold silver "
    "big small bright dark one two three four cute beautiful sitting standing high quality"
).split()


def build_clip_tokenizer(max_length: int = _PROMPT_TOKENS, words: tuple[str, ...] | list[str] = _WORDS):
    """A CLIP byte-level BPE tokenizer: all 256 byte symbols (alone and word-final), plus merges
    that assemble each word of ``words`` (default ``_WORDS``) into one token. Any text tokenizes;
    nothing is unknown."""
    from transformers import CLIPTokenizer

    alphabet = _byte_level_alphabet()
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    vocab.update({ch + "</w>": len(alphabet) + i for i, ch in enumerate(alphabet)})
    merges: list[tuple[str, str]] = []
    for word in words:
        # Merge from the end of the word: "t</w>" <- "a" + "t</w>" ... "cat</w>" <- "c" + "at</w>".
        # Every merge then has a word-final right side, so the only mergeable pair in a word is
        # its last one and the chains of different words cannot interfere: each listed word
        # always ends up as a single token.
        for i in range(len(word) - 2, -1, -1):
            pair = (word[i], word[i + 1 :] + "</w>")
            if pair not in merges:
                merges.append(pair)
                vocab.setdefault(word[i:] + "</w>", len(vocab))
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=max_length)


def build_t5_tokenizer(max_length: int = _PROMPT_TOKENS, words: tuple[str, ...] | list[str] = _WORDS):
    """A T5 (Unigram, SentencePiece-style) tokenizer: whole words of ``words`` (default ``_WORDS``)
    plus printable ASCII characters, each with and without the word-start marker. Other characters
    are ``<unk>``."""
    from transformers import T5TokenizerFast

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -3.0)]
    # Unigram picks the segmentation with the highest total score: a whole word (-0.5) beats
    # spelling it out (at least -1 per character).
    pieces += [("\u2581" + word, -0.5) for word in words]
    for ch in string.ascii_letters + string.digits + string.punctuation:
        # Prefer the word-initial piece, so "cot" -> "_c o t" like a real SentencePiece model.
        pieces += [("\u2581" + ch, -1.0), (ch, -2.0)]
    # Single-letter words ("a") are also single characters: keep the first (word) entry only.
    unique: dict[str, float] = {}
    for piece, score in pieces:
        unique.setdefault(piece, score)
    pieces = list(unique.items())
    return T5TokenizerFast(vocab=pieces, extra_ids=0, model_max_length=max_length)


# ---------------------------------------------------------------------- components


def _clip_encoder(tokenizer, *, hidden: int, projection: int | None = None, layers: int = 1):
    """A CLIP text encoder: ``CLIPTextModelWithProjection`` when ``projection`` is given (SD3),
    else ``CLIPTextModel`` (FLUX, HunyuanVideo: pooled width == ``hidden``)."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    model_cls = CLIPTextModel if projection is None else CLIPTextModelWithProjection
    config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        projection_dim=projection or hidden,
        num_hidden_layers=layers,
        num_attention_heads=2,
        max_position_embeddings=tokenizer.model_max_length,
        # The pooled vector is read at the first end-of-text token, found by this id.
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return model_cls(config)


def _t5_encoder(tokenizer, *, width: int = _T5_WIDTH, umt5: bool = False):
    """A one-layer T5 v1.1 encoder (FLUX, SD3), or UMT5 (Wan) of the same shape."""
    from transformers import T5Config, T5EncoderModel, UMT5Config, UMT5EncoderModel

    config_cls, model_cls = (UMT5Config, UMT5EncoderModel) if umt5 else (T5Config, T5EncoderModel)
    config = config_cls(
        vocab_size=len(tokenizer),
        d_model=width,
        d_kv=8,
        d_ff=2 * width,
        num_layers=1,
        num_heads=4,
        relative_attention_num_buckets=8,
        feed_forward_proj="gated-gelu",  # T5 v1.1 (and UMT5)
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
    )
    return model_cls(config)


def _vae(*, scaling_factor: float, shift_factor: float):
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        # Two blocks = one 2x downsample: 32x32 pixels -> 16x16 latents.
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(8, 16),
        layers_per_block=1,
        norm_num_groups=4,
        latent_channels=_LATENT_CHANNELS,
        sample_size=32,
        scaling_factor=scaling_factor,
        shift_factor=shift_factor,
        # FLUX and SD3 VAEs have no quant convs either.
        use_quant_conv=False,
        use_post_quant_conv=False,
    )


def _real_scheduler(family: str):
    """The family's real scheduler, from its shipped ``scheduler_config.json``
    (:mod:`verl_digen.models.real_configs`): every tiny model samples on its real schedule."""
    from verl_digen.models.real_configs import build_scheduler

    return build_scheduler(family)


def _pipeline(pipeline_cls, text: list[tuple], transformer, vae, scheduler):
    """``pipeline_cls`` from its components; ``text`` lists the (tokenizer, text encoder) pairs in
    the pipeline's order: ``tokenizer`` / ``text_encoder``, then ``..._2``, ``..._3``.

    Callers build the modules before calling (text encoders, transformer, VAE: the order their
    weights are drawn from the seeded RNG)."""
    components = {}
    for i, (tokenizer, text_encoder) in enumerate(text):
        suffix = "" if i == 0 else f"_{i + 1}"
        components[f"tokenizer{suffix}"] = tokenizer
        components[f"text_encoder{suffix}"] = text_encoder
    return pipeline_cls(transformer=transformer, vae=vae, scheduler=scheduler, **components)


def _flux_pipeline():
    from diffusers import FluxPipeline, FluxTransformer2DModel

    tokenizer = build_clip_tokenizer()
    tokenizer_2 = build_t5_tokenizer()
    clip_hidden = 24  # pooled width; distinct from the T5 width on purpose
    text = [(tokenizer, _clip_encoder(tokenizer, hidden=clip_hidden)), (tokenizer_2, _t5_encoder(tokenizer_2))]
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=4 * _LATENT_CHANNELS,  # packed 2x2 patches
        num_layers=1,  # one double-stream (MMDiT) block
        num_single_layers=1,  # one single-stream block
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=_T5_WIDTH,
        pooled_projection_dim=clip_hidden,
        guidance_embeds=True,  # like FLUX.1-dev, so the distilled-guidance path is exercised
        axes_dims_rope=(4, 6, 6),  # sums to attention_head_dim
    )
    vae = _vae(scaling_factor=0.3611, shift_factor=0.1159)  # FLUX.1 VAE's values
    scheduler = _real_scheduler("flux")  # FLUX.1-dev: dynamic shift (mu 0.5 .. 1.15)
    return _pipeline(FluxPipeline, text, transformer, vae, scheduler)


def _sd3_pipeline():
    from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline

    tokenizer = build_clip_tokenizer()
    tokenizer_2 = build_clip_tokenizer()
    tokenizer_3 = build_t5_tokenizer()
    # Two CLIPs of different widths (like CLIP-L 768 / CLIP-G 1280): their hidden states are
    # concatenated (8 + 16 = 24) and zero-padded to the T5 width (32); pooled 16 + 16 = 32.
    text = [
        (tokenizer, _clip_encoder(tokenizer, hidden=8, projection=16, layers=2)),
        (tokenizer_2, _clip_encoder(tokenizer_2, hidden=16, projection=16, layers=2)),
        (tokenizer_3, _t5_encoder(tokenizer_3)),
    ]
    transformer = SD3Transformer2DModel(
        sample_size=16,  # latent size of a 32x32 image
        patch_size=2,
        in_channels=_LATENT_CHANNELS,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=_T5_WIDTH,
        caption_projection_dim=32,  # must equal heads * head_dim
        pooled_projection_dim=32,
        out_channels=_LATENT_CHANNELS,
        pos_embed_max_size=32,  # room for up to 128x128-pixel images
    )
    vae = _vae(scaling_factor=1.5305, shift_factor=0.0609)  # SD3 VAE's values
    scheduler = _real_scheduler("sd3")  # SD3.5 Large: shift 3
    return _pipeline(StableDiffusion3Pipeline, text, transformer, vae, scheduler)


# ---------------------------------------------------------------------- trained BPE tokenizers
#
# Qwen2 and Llama tokenizers are BPE over whole pre-tokenized words. Rather than hand-writing
# merges (which interfere across words without an end-of-word marker), a BPE model is trained
# with the ``tokenizers`` library on the prompt words until every word is one token. Training
# is deterministic for a given corpus.

# The system prompt of Qwen-Image's template (qwen_image.PROMPT_TEMPLATE, from
# QwenImagePipeline.prompt_template_encode); the pipeline drops the template's first 34 tokens
# (up to and including "user\n").
QWEN_IMAGE_SYSTEM_PROMPT = (
    "Describe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:"
)
_QWEN_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                 "<|image_pad|>", "<|video_pad|>")
# HunyuanVideo's Llama-3 chat headers (DEFAULT_PROMPT_TEMPLATE in pipeline_hunyuan_video).
_LLAMA_SPECIAL = ("<unk>", "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                  "<|eot_id|>")


def _template_words(*texts: str) -> list[str]:
    import re

    words = list(_WORDS)
    for text in texts:
        words += re.findall(r"[A-Za-z]+", re.sub(r"<\|[a-z_]+\|>", " ", text))
    return list(dict.fromkeys(words))


def _train_bpe(corpus: list[str], pre_tokenizer, initial_alphabet: list[str]) -> tuple[dict[str, int], list]:
    """Train a BPE model on ``corpus`` until no pair is left to merge; return (vocab, merges)."""
    import json

    from tokenizers import Tokenizer, models, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizer
    trainer = trainers.BpeTrainer(
        vocab_size=100_000, min_frequency=1, show_progress=False, initial_alphabet=initial_alphabet
    )
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    model = json.loads(tokenizer.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    return model["vocab"], merges


def build_qwen2_tokenizer(max_length: int = 34 + 32):
    """A Qwen2 byte-level BPE tokenizer (Qwen2.5-VL / Qwen-Image) with the chat special tokens.

    Every prompt word and every word of Qwen-Image's template is one token (with and without
    the leading-space marker), so the template prefix is exactly the 34 tokens the pipeline
    drops. ``max_length`` is the template prefix plus the text tokens kept (32)."""
    from tokenizers import Regex, pre_tokenizers
    from transformers import Qwen2Tokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    words = _template_words(QWEN_IMAGE_SYSTEM_PROMPT, "system user assistant")
    pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    corpus = [" " + " ".join(words), "\n".join(words), QWEN_IMAGE_SYSTEM_PROMPT]
    vocab, merges = _train_bpe(corpus, pre_tokenizer, pre_tokenizers.ByteLevel.alphabet())
    vocab = dict(sorted(vocab.items(), key=lambda kv: kv[1]))
    for token in _QWEN_SPECIAL:
        vocab[token] = len(vocab)
    return Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        model_max_length=max_length,
        extra_special_tokens=list(_QWEN_SPECIAL[1:]),
    )


def build_llama_tokenizer(max_length: int = 95 + 16):
    """A Llama tokenizer (sentencepiece-style BPE with byte fallback) with Llama-3 chat headers.

    Prompt words and the words of HunyuanVideo's template are single tokens, so the template
    prefix (with the BOS token) is exactly the 95 tokens the pipeline crops. Pads on the right,
    which HunyuanVideo's transformer assumes (it reads the mask as an effective length)."""
    from tokenizers import pre_tokenizers
    from transformers import LlamaTokenizerFast

    from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE

    words = _template_words(DEFAULT_PROMPT_TEMPLATE["template"])
    pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="never", split=True)
    # Words alone (after a special token) and after a space ("\u2581word"); "\n\n" as one token.
    corpus = [*words, " " + " ".join(words), "\n\n"]
    vocab, merges = _train_bpe(corpus, pre_tokenizer, list(string.printable.strip()) + ["\u2581", "\n"])
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


# ---------------------------------------------------------------------- Qwen-Image, Wan, HunyuanVideo

_TEXT_WIDTH = 32  # hidden size of the tiny LLM / UMT5 text encoders (== transformer text dim)


def _llm_sizes(tokenizer, *, layers: int) -> dict:
    """Config sizes of the tiny decoder-only text encoders (Qwen2.5-VL's text model, Llama)."""
    return dict(
        vocab_size=len(tokenizer),
        hidden_size=_TEXT_WIDTH,
        intermediate_size=2 * _TEXT_WIDTH,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
    )


def _qwen2_5_vl_encoder(tokenizer):
    """Qwen2.5-VL with a 2-layer text model and a 1-block vision tower (unused for text-to-image)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = tokenizer.convert_tokens_to_ids
    config = Qwen2_5_VLConfig(
        text_config=dict(
            **_llm_sizes(tokenizer, layers=2),
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
            out_hidden_size=_TEXT_WIDTH,
            fullatt_block_indexes=[0],
        ),
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
    )
    return Qwen2_5_VLForConditionalGeneration(config)


def _wan_style_vae(vae_cls, *, temporal_downsample: bool, **kwargs):
    """A Wan-style VAE (``AutoencoderKLWan``, or ``AutoencoderKLQwenImage``: the same design) with
    one 2x spatial downsample: 32x32 pixels -> 16x16 latents (and, with ``temporal_downsample``,
    one causal 2x temporal downsample: 5 frames -> 3 latent frames).

    Per-channel latent mean/std as in the real configs (not all 0 / 1, so the normalisation is
    exercised)."""
    n = _LATENT_CHANNELS
    return vae_cls(
        base_dim=8,
        z_dim=n,
        dim_mult=[1, 2],
        num_res_blocks=1,
        attn_scales=[],
        temperal_downsample=[temporal_downsample],
        latents_mean=[round(0.1 * (i - n / 2), 3) for i in range(n)],
        latents_std=[round(1.0 + 0.25 * i, 3) for i in range(n)],
        **kwargs,
    )


def _qwen_image_pipeline():
    from diffusers import AutoencoderKLQwenImage, QwenImagePipeline, QwenImageTransformer2DModel

    tokenizer = build_qwen2_tokenizer()
    text = [(tokenizer, _qwen2_5_vl_encoder(tokenizer))]
    transformer = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=4 * _LATENT_CHANNELS,  # packed 2x2 patches
        out_channels=_LATENT_CHANNELS,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=_TEXT_WIDTH,
        axes_dims_rope=(4, 6, 6),  # sums to attention_head_dim
    )
    vae = _wan_style_vae(AutoencoderKLQwenImage, temporal_downsample=False)  # a one-frame video VAE
    # Qwen-Image's scheduler config (dynamic exponential shift, terminal sigma 0.02).
    scheduler = _real_scheduler("qwen_image")
    return _pipeline(QwenImagePipeline, text, transformer, vae, scheduler)


def _wan_pipeline():
    from diffusers import AutoencoderKLWan, WanPipeline, WanTransformer3DModel

    tokenizer = build_t5_tokenizer()  # a T5/UMT5 sentencepiece-style Unigram tokenizer
    text = [(tokenizer, _t5_encoder(tokenizer, width=_TEXT_WIDTH, umt5=True))]
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,  # RoPE splits it (t, h, w) = (4, 4, 4)
        in_channels=_LATENT_CHANNELS,
        out_channels=_LATENT_CHANNELS,
        text_dim=_TEXT_WIDTH,
        freq_dim=32,
        ffn_dim=48,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=64,
    )
    vae = _wan_style_vae(AutoencoderKLWan, temporal_downsample=True, scale_factor_temporal=2, scale_factor_spatial=2)
    # Wan2.1's UniPC multistep scheduler with flow sigmas (flow_shift 3): its first sigma is
    # 1 - 1e-6, not 1. The RL sampler steps these sigmas with its own Euler / SDE steps.
    scheduler = _real_scheduler("wan")
    return _pipeline(WanPipeline, text, transformer, vae, scheduler)


def _hunyuan_video_pipeline():
    from diffusers import AutoencoderKLHunyuanVideo, HunyuanVideoPipeline, HunyuanVideoTransformer3DModel
    from transformers import LlamaConfig, LlamaModel

    tokenizer = build_llama_tokenizer()
    # The pipeline always pads CLIP prompts to 77 tokens.
    tokenizer_2 = build_clip_tokenizer(max_length=77)
    text_encoder = LlamaModel(
        LlamaConfig(
            # The pipeline reads the hidden state 2 layers before the last: 3 layers keep that a
            # real layer output rather than the embeddings.
            **_llm_sizes(tokenizer, layers=3),
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    )
    clip_hidden = 24  # pooled width; distinct from the LLM width on purpose
    text = [(tokenizer, text_encoder), (tokenizer_2, _clip_encoder(tokenizer_2, hidden=clip_hidden))]
    transformer = HunyuanVideoTransformer3DModel(
        in_channels=_LATENT_CHANNELS,
        out_channels=_LATENT_CHANNELS,
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
        text_embed_dim=_TEXT_WIDTH,
        pooled_projection_dim=clip_hidden,
        rope_axes_dim=(4, 6, 6),  # sums to attention_head_dim
    )
    vae = AutoencoderKLHunyuanVideo(
        in_channels=3,
        out_channels=3,
        latent_channels=_LATENT_CHANNELS,
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
    scheduler = _real_scheduler("hunyuan_video")  # shift 7
    return _pipeline(HunyuanVideoPipeline, text, transformer, vae, scheduler)


_PIPELINE_BUILDERS = {
    "flux": _flux_pipeline,
    "sd3": _sd3_pipeline,
    "qwen_image": _qwen_image_pipeline,
    "wan": _wan_pipeline,
    "hunyuan_video": _hunyuan_video_pipeline,
}


# ---------------------------------------------------------------------- public API


def build_tiny(arch: str, out_dir: str, *, seed: int = 0) -> str:
    """Build the tiny ``arch`` pipeline with weights drawn from ``seed`` and save it to ``out_dir``.

    Returns ``out_dir``. The same seed always gives the same weights (all modules are created
    under one ``torch.manual_seed``; the global RNG state is restored afterwards).
    """
    if arch not in _PIPELINE_BUILDERS:
        raise ValueError(f"unknown tiny arch '{arch}'; known: {', '.join(TINY_ARCHS)}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        pipeline = _PIPELINE_BUILDERS[arch]()
    os.makedirs(out_dir, exist_ok=True)
    pipeline.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def default_cache_dir() -> str:
    """``$VERL_DIGEN_CACHE/tiny`` if set, else ``~/.cache/verl_digen/tiny``."""
    root = os.environ.get("VERL_DIGEN_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "verl_digen")
    return os.path.join(root, "tiny")


def ensure_tiny(arch: str, cache_dir: str | None = None) -> str:
    """Path of the cached tiny ``arch`` model (``<cache>/<arch>-<TINY_VERSION>``), building it on first use.

    The build goes to a temporary sibling directory that is renamed into place, so concurrent
    callers (e.g. several Ray workers) never see a half-written model: the first rename wins
    and the others discard their copy.
    """
    if arch not in _PIPELINE_BUILDERS:
        raise ValueError(f"unknown tiny arch '{arch}'; known: {', '.join(TINY_ARCHS)}")
    return build_cached(cache_dir or default_cache_dir(), f"{arch}-{TINY_VERSION}", lambda out: build_tiny(arch, out))


def build_cached(
    cache_dir: str, stem: str, build: Callable[[str], Any], *, announce: Callable[[str], None] | None = None
) -> str:
    """``<cache_dir>/<stem>``, written by ``build(directory)`` on first use into a temporary
    sibling directory that is renamed into place: concurrent callers (e.g. several Ray workers)
    never see a half-written model; the first rename wins and the others discard their copy.
    ``announce(final)`` is called before a build starts."""
    final = os.path.join(cache_dir, stem)
    if os.path.isfile(os.path.join(final, "model_index.json")):
        return final
    os.makedirs(cache_dir, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{stem}-", dir=cache_dir)
    try:
        if announce is not None:
            announce(final)
        build(tmp)
        try:
            os.replace(tmp, final)
        except OSError:
            # Another process renamed its build into place first (the target is a non-empty dir).
            if not os.path.isfile(os.path.join(final, "model_index.json")):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m verl_digen.models.tiny",
        description="Write a tiny randomly initialised diffusers model directory and print its path.",
    )
    parser.add_argument("--arch", required=True, choices=TINY_ARCHS)
    parser.add_argument("--out", required=True, help="output directory (created if missing)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(os.path.abspath(build_tiny(args.arch, args.out, seed=args.seed)))


if __name__ == "__main__":
    main()
