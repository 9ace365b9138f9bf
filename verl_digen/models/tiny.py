"""Tiny, randomly initialised diffusers models for tests and CPU demos.

No machine here can download weights, so every architecture gets a builder that constructs
its pipeline components at toy width (tens of thousands of parameters), with tokenizers built
in code, and saves them with ``save_pretrained``. The result is an ordinary diffusers-format
directory, loaded back through exactly the adapter code path real checkpoints use.

Sizes: a 32x32 image goes through a VAE with one 2x downsample to 16x16 latents, i.e. 64 image
tokens for the transformer (FLUX packs 2x2 latent patches, SD3 uses patch size 2). Prompts are
16 tokens per text encoder. One transformer forward takes a few milliseconds on one CPU core.

CLI::

    python -m verl_digen.models.tiny --arch flux --out /tmp/tiny-flux
"""

from __future__ import annotations

import argparse
import os
import shutil
import string
import tempfile

import torch

TINY_VERSION = "v1"  # bump when the builders change, so stale caches are not reused
TINY_ARCHS = ("flux", "sd3")

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


def build_clip_tokenizer(max_length: int = _PROMPT_TOKENS):
    """A CLIP byte-level BPE tokenizer: all 256 byte symbols (alone and word-final), plus merges
    that assemble each word of ``_WORDS`` into one token. Any text tokenizes; nothing is unknown."""
    from transformers import CLIPTokenizer

    alphabet = _byte_level_alphabet()
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    vocab.update({ch + "</w>": len(alphabet) + i for i, ch in enumerate(alphabet)})
    merges: list[tuple[str, str]] = []
    for word in _WORDS:
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


def build_t5_tokenizer(max_length: int = _PROMPT_TOKENS):
    """A T5 (Unigram, SentencePiece-style) tokenizer: whole words of ``_WORDS`` plus printable
    ASCII characters, each with and without the word-start marker. Other characters are ``<unk>``."""
    from transformers import T5TokenizerFast

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -3.0)]
    # Unigram picks the segmentation with the highest total score: a whole word (-0.5) beats
    # spelling it out (at least -1 per character).
    pieces += [("\u2581" + word, -0.5) for word in _WORDS]
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


def _clip_text_config(tokenizer, *, hidden: int, projection: int | None = None, layers: int = 1):
    from transformers import CLIPTextConfig

    return CLIPTextConfig(
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


def _t5_encoder(tokenizer):
    from transformers import T5Config, T5EncoderModel

    config = T5Config(
        vocab_size=len(tokenizer),
        d_model=_T5_WIDTH,
        d_kv=8,
        d_ff=2 * _T5_WIDTH,
        num_layers=1,
        num_heads=4,
        relative_attention_num_buckets=8,
        feed_forward_proj="gated-gelu",  # T5 v1.1, as used by FLUX and SD3
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
    )
    return T5EncoderModel(config)


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


def _flux_pipeline():
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextModel

    tokenizer = build_clip_tokenizer()
    tokenizer_2 = build_t5_tokenizer()
    clip_hidden = 24  # pooled width; distinct from the T5 width on purpose
    text_encoder = CLIPTextModel(_clip_text_config(tokenizer, hidden=clip_hidden))
    text_encoder_2 = _t5_encoder(tokenizer_2)
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
    # FLUX.1-dev's scheduler config (dynamic, resolution-dependent shift).
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )
    return FluxPipeline(
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        transformer=transformer,
    )


def _sd3_pipeline():
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
    from transformers import CLIPTextModelWithProjection

    tokenizer = build_clip_tokenizer()
    tokenizer_2 = build_clip_tokenizer()
    tokenizer_3 = build_t5_tokenizer()
    # Two CLIPs of different widths (like CLIP-L 768 / CLIP-G 1280): their hidden states are
    # concatenated (8 + 16 = 24) and zero-padded to the T5 width (32); pooled 16 + 16 = 32.
    text_encoder = CLIPTextModelWithProjection(_clip_text_config(tokenizer, hidden=8, projection=16, layers=2))
    text_encoder_2 = CLIPTextModelWithProjection(_clip_text_config(tokenizer_2, hidden=16, projection=16, layers=2))
    text_encoder_3 = _t5_encoder(tokenizer_3)
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
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)  # SD3.5's config
    return StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        text_encoder_3=text_encoder_3,
        tokenizer_3=tokenizer_3,
    )


_PIPELINE_BUILDERS = {"flux": _flux_pipeline, "sd3": _sd3_pipeline}


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
    """Path of the cached tiny ``arch`` model (``<cache>/<arch>-v1``), building it on first use.

    The build goes to a temporary sibling directory that is renamed into place, so concurrent
    callers (e.g. several Ray workers) never see a half-written model: the first rename wins
    and the others discard their copy.
    """
    if arch not in _PIPELINE_BUILDERS:
        raise ValueError(f"unknown tiny arch '{arch}'; known: {', '.join(TINY_ARCHS)}")
    cache_dir = cache_dir or default_cache_dir()
    final = os.path.join(cache_dir, f"{arch}-{TINY_VERSION}")
    if os.path.isfile(os.path.join(final, "model_index.json")):
        return final
    os.makedirs(cache_dir, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{arch}-{TINY_VERSION}-", dir=cache_dir)
    try:
        build_tiny(arch, tmp)
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
