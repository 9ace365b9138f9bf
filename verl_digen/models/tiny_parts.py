"""The parts the tiny model families share: tokenizers built in code and toy-width components.

No machine here can download weights, so every family's tiny builder (``build_tiny_pipeline`` in
``verl_digen/models/families/<family>.py``) constructs its pipeline components at toy width
(tens of thousands of parameters) from these parts, with tokenizers built in code;
:func:`verl_digen.models.tiny.build_tiny` saves the result with ``save_pretrained``.

Sizes: a 32x32 image goes through a VAE with one 2x downsample to 16x16 latents, i.e. 64 image
tokens for the transformer (FLUX packs 2x2 latent patches, SD3 uses patch size 2). Prompts are
16 tokens per text encoder. One transformer forward takes a few milliseconds on one CPU core.

Tokenizers that must match a pipeline's prompt template (Qwen2 byte-level BPE, Llama
sentencepiece-style BPE) are trained in code with the ``tokenizers`` library
(:func:`train_bpe`) on the prompt words and the template's words.

This module imports only the standard library at import time (transformers, diffusers and
tokenizers inside the builders), and nothing of the package: the family modules import it.
"""

from __future__ import annotations

import string

# Shared toy sizes. Text widths are small but distinct where the pipeline pads or concatenates,
# so that shape bugs show up as errors instead of silently lining up.
PROMPT_TOKENS = 16  # CLIP and T5 sequence length (real models: 77 and 256/512)
T5_WIDTH = 32  # T5 d_model == transformer joint_attention_dim
LATENT_CHANNELS = 4  # real FLUX / SD3 VAEs use 16
TEXT_WIDTH = 32  # hidden size of the tiny LLM / UMT5 text encoders (== transformer text dim)


# ---------------------------------------------------------------------- tokenizers


def byte_level_alphabet() -> list[str]:
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
WORDS = (
    "a an the of on in at with and next to by under photo picture image painting drawing render "
    "cat dog bird horse cow fish car bus bike boat house tree flower apple banana cake cup ball cube "
    "person man woman child face table chair sky sea beach mountain city street room "
    "red green blue yellow black white orange purple pink brown gray gold silver "
    "big small bright dark one two three four cute beautiful sitting standing high quality"
).split()


def build_clip_tokenizer(max_length: int = PROMPT_TOKENS, words: tuple[str, ...] | list[str] = WORDS):
    """A CLIP byte-level BPE tokenizer: all 256 byte symbols (alone and word-final), plus merges
    that assemble each word of ``words`` (default ``WORDS``) into one token. Any text tokenizes;
    nothing is unknown."""
    from transformers import CLIPTokenizer

    alphabet = byte_level_alphabet()
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


def build_t5_tokenizer(max_length: int = PROMPT_TOKENS, words: tuple[str, ...] | list[str] = WORDS):
    """A T5 (Unigram, SentencePiece-style) tokenizer: whole words of ``words`` (default ``WORDS``)
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


def clip_encoder(tokenizer, *, hidden: int, projection: int | None = None, layers: int = 1):
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


def t5_encoder(tokenizer, *, width: int = T5_WIDTH, umt5: bool = False):
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


def image_vae(*, scaling_factor: float, shift_factor: float):
    """A 2-D ``AutoencoderKL`` (FLUX, SD3) with one 2x downsample and the given latent scaling."""
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
        latent_channels=LATENT_CHANNELS,
        sample_size=32,
        scaling_factor=scaling_factor,
        shift_factor=shift_factor,
        # FLUX and SD3 VAEs have no quant convs either.
        use_quant_conv=False,
        use_post_quant_conv=False,
    )


def assemble_pipeline(pipeline_cls, text: list[tuple], transformer, vae, scheduler):
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


# ---------------------------------------------------------------------- trained BPE tokenizers
#
# Qwen2 and Llama tokenizers are BPE over whole pre-tokenized words. Rather than hand-writing
# merges (which interfere across words without an end-of-word marker), a BPE model is trained
# with the ``tokenizers`` library on the prompt words until every word is one token. Training
# is deterministic for a given corpus.


def template_words(*texts: str) -> list[str]:
    """The prompt words plus every word of ``texts`` (a pipeline's prompt template), once each."""
    import re

    words = list(WORDS)
    for text in texts:
        words += re.findall(r"[A-Za-z]+", re.sub(r"<\|[a-z_]+\|>", " ", text))
    return list(dict.fromkeys(words))


def train_bpe(corpus: list[str], pre_tokenizer, initial_alphabet: list[str]) -> tuple[dict[str, int], list]:
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


def llm_sizes(tokenizer, *, layers: int) -> dict:
    """Config sizes of the tiny decoder-only text encoders (Qwen2.5-VL's text model, Llama)."""
    return dict(
        vocab_size=len(tokenizer),
        hidden_size=TEXT_WIDTH,
        intermediate_size=2 * TEXT_WIDTH,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
    )


def wan_style_vae(vae_cls, *, temporal_downsample: bool, **kwargs):
    """A Wan-style VAE (``AutoencoderKLWan``, or ``AutoencoderKLQwenImage``: the same design) with
    one 2x spatial downsample: 32x32 pixels -> 16x16 latents (and, with ``temporal_downsample``,
    one causal 2x temporal downsample: 5 frames -> 3 latent frames).

    Per-channel latent mean/std as in the real configs (not all 0 / 1, so the normalisation is
    exercised)."""
    n = LATENT_CHANNELS
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
