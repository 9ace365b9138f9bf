"""A pretrained toy generator: FLUX.1's architecture, flow matching on scikit-learn's 8x8 digits.

The tiny models of :mod:`verl_digen.models.tiny` are randomly initialised: they prove the
plumbing, but a random model has nothing to learn towards. This module builds a small
*pretrained* text-to-image model in a few minutes on a CPU, so that RL has something real to
improve: a ``FluxPipeline`` (CLIP + T5 text encoders, an MMDiT ``FluxTransformer2DModel``, an
``AutoencoderKL``, FLUX.1-dev's flow-matching scheduler config) trained on the 1,797 8x8
handwritten digits that ship with scikit-learn, conditioned on captions such as
"a handwritten digit 7".

Choices, and why:

- **Images are 8x8 pixels, the data's own size.** Upscaling would add pixels, not information,
  and would make every step slower.
- **The VAE is trained, on the same data, without spatial compression** (one encoder block: an
  8x8 image is an 8x8 latent with 4 channels, packed 2x2 into 16 tokens of 16 features, as FLUX
  packs its latents). At 8x8 there is nothing to compress, but keeping a real ``AutoencoderKL``
  keeps the pipeline exactly FLUX's (encode -> scale/shift -> flow in latent space -> decode);
  its ``scaling_factor`` / ``shift_factor`` are measured on the data's latents like FLUX.1's.
- **Text encoders are random and frozen.** No pretrained CLIP/T5 exists here; FLUX freezes its
  encoders too, so the transformer learns to read what they produce. Captions come in several
  phrasings (numerals and words); the RL prompts (``builtin:digits``) and the held-out
  validation prompts (``builtin:digits_val``) use different phrasings, all seen in pretraining.
- **Captions are dropped 10% of the time**, so the model also has an unconditional mode (true
  CFG with the empty negative prompt works, as for FLUX.1 fine-tunes trained with dropout).
- **The model and its pretraining budget are small** (a 3-head, width-48 transformer with one
  double- and one single-stream block; 2,000 steps, see :class:`ToyRecipe`): sampled without
  CFG, it draws digit-like shapes of the requested digit about half the time (the
  digit-classifier reward, :mod:`verl_digen.rewards.digits`, gives ~0.45 on the held-out
  prompts); with true CFG 3 it does much better (~0.8). That is where a real pretrained model
  stands before RL: it can do the task, not reliably, and the reward has room to rise
  (``tests/unit/test_toy.py`` checks both). A width-64 model trained the same way already scores
  ~0.74 without CFG, which would leave RL little to show.

Everything is seeded and single-process; torch runs with a fixed number of threads during the
build, so the same recipe gives the same weights on one machine (another CPU's kernels may round
differently). **The package ships the built model** (``verl_digen/models/pretrained/digits-v1``,
1 MB, built on this project's machine with ``python -m verl_digen.models.toy --out DIR`` and the
default :class:`ToyRecipe`, whose ``toy_recipe.json`` it carries): ``ensure_toy`` copies it into
the cache (``$VERL_DIGEN_CACHE/toy/digits-<version>``, like the tiny models) instead of spending
minutes pretraining, and every machine starts RL from the same weights. Without a shipped copy
(a recipe changed, so ``TOY_VERSION`` was bumped) it builds. Either way the model loads through
the same ``from_pretrained`` path as a real checkpoint.

CLI::

    python -m verl_digen.models.toy                  # the cached model (copied or built), print the path
    python -m verl_digen.models.toy --out DIR        # pretrain from the recipe into DIR
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

TOY_VERSION = "v1"  # bump when the recipe or the components change, so stale caches are not reused
TOY_MODELS = ("digits",)

IMAGE_SIZE = 8  # pixels; the data's own resolution
DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")

# Caption phrasings seen in pretraining; "{n}" is the numeral, "{w}" the word. The RL prompt set
# (builtin:digits) uses the first two, validation (builtin:digits_val) the other four.
CAPTION_TEMPLATES = (
    "a handwritten digit {n}",
    "the digit {w} written by hand",
    "the number {w}",
    "a drawing of the number {n}",
    "handwritten {w}",
    "a {n} written by hand",
)
RL_TEMPLATES = CAPTION_TEMPLATES[:2]
VAL_TEMPLATES = CAPTION_TEMPLATES[2:]
# Words the toy tokenizers know as whole tokens (everything else falls back to characters).
TOY_WORDS = tuple(
    dict.fromkeys("a the of by digit number handwritten written hand drawing".split() + list(DIGIT_WORDS))
)
_PROMPT_TOKENS = 12  # CLIP and T5 window; the longest caption is 7 tokens (+ end/pad)
_LATENT_CHANNELS = 4
_TEXT_WIDTH = 32


def captions(digit: int) -> list[str]:
    """Every pretraining caption of ``digit``."""
    return [t.format(n=digit, w=DIGIT_WORDS[digit]) for t in CAPTION_TEMPLATES]


@dataclass(frozen=True)
class ToyRecipe:
    """How the toy model is pretrained. The defaults are what ``ensure_toy`` builds and caches."""

    seed: int = 0
    vae_steps: int = 400
    vae_lr: float = 2e-3
    vae_kl_weight: float = 1e-4
    steps: int = 2000  # transformer (flow-matching) steps
    batch_size: int = 128
    lr: float = 1e-3
    caption_dropout: float = 0.1
    threads: int = 1  # torch threads during the build (fixed: the result must not depend on the machine)


def load_digits_data() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's 8x8 digits (shipped with the package, no download): images ``[N, 8, 8]``
    in [0, 1] (float32) and labels ``[N]`` (int64)."""
    from sklearn.datasets import load_digits

    data = load_digits()
    return (data.images / 16.0).astype(np.float32), data.target.astype(np.int64)


# ---------------------------------------------------------------------- components


def _components():
    """Untrained components, created in a fixed order from the current torch RNG."""
    from diffusers import AutoencoderKL, FluxTransformer2DModel

    from .real_configs import build_scheduler
    from .tiny_parts import build_clip_tokenizer, build_t5_tokenizer, clip_encoder, t5_encoder

    tokenizer = build_clip_tokenizer(_PROMPT_TOKENS, words=TOY_WORDS)
    tokenizer_2 = build_t5_tokenizer(_PROMPT_TOKENS, words=TOY_WORDS)
    text_encoder = clip_encoder(tokenizer, hidden=_TEXT_WIDTH)
    text_encoder_2 = t5_encoder(tokenizer_2, width=_TEXT_WIDTH)
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=4 * _LATENT_CHANNELS,  # packed 2x2 latent patches
        num_layers=1,  # one double-stream (MMDiT) block
        num_single_layers=1,  # one single-stream block
        attention_head_dim=16,
        num_attention_heads=3,  # width 48
        joint_attention_dim=_TEXT_WIDTH,
        pooled_projection_dim=_TEXT_WIDTH,
        guidance_embeds=False,  # not guidance-distilled (like FLUX.1-schnell); true CFG works instead
        axes_dims_rope=(4, 6, 6),  # sums to attention_head_dim
    )
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",),  # one block: no downsampling (8x8 -> 8x8)
        up_block_types=("UpDecoderBlock2D",),
        block_out_channels=(16,),
        layers_per_block=1,
        norm_num_groups=4,
        latent_channels=_LATENT_CHANNELS,
        sample_size=IMAGE_SIZE,
        use_quant_conv=False,  # like FLUX.1's VAE
        use_post_quant_conv=False,
    )
    scheduler = build_scheduler("flux")  # FLUX.1-dev's config
    return dict(
        tokenizer=tokenizer,
        tokenizer_2=tokenizer_2,
        text_encoder=text_encoder,
        text_encoder_2=text_encoder_2,
        transformer=transformer,
        vae=vae,
        scheduler=scheduler,
    )


# ---------------------------------------------------------------------- pretraining


def _to_vae_pixels(images: torch.Tensor) -> torch.Tensor:
    """``[N, 8, 8]`` in [0, 1] -> ``[N, 3, 8, 8]`` in [-1, 1] (grey as RGB)."""
    return (images * 2 - 1).unsqueeze(1).expand(-1, 3, -1, -1).contiguous()


def _train_vae(vae, pixels: torch.Tensor, recipe: ToyRecipe, gen: torch.Generator, log: Callable[[str], None]):
    vae.train()
    opt = torch.optim.Adam(vae.parameters(), lr=recipe.vae_lr)
    for step in range(recipe.vae_steps):
        idx = torch.randint(0, pixels.shape[0], (recipe.batch_size,), generator=gen)
        x = pixels[idx]
        posterior = vae.encode(x).latent_dist
        z = posterior.mean + posterior.std * torch.randn(posterior.mean.shape, generator=gen)
        recon = vae.decode(z).sample
        rec = (recon - x).square().mean()
        kl = posterior.kl().mean() / z[0].numel()
        loss = rec + recipe.vae_kl_weight * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if (step + 1) % max(1, recipe.vae_steps // 4) == 0:
            log(f"vae step {step + 1}/{recipe.vae_steps}: reconstruction mse {rec.item():.4f}, kl {kl.item():.3f}")
    vae.eval()
    for p in vae.parameters():
        p.requires_grad_(False)


def _train_transformer(adapter, latents, labels, recipe, gen, log):
    """Conditional flow matching: ``x_s = (1 - s) x0 + s noise``, target ``noise - x0``; ``s`` from
    the logit-normal density FLUX/SD3 train with."""
    from .base import SampleSpec

    spec = SampleSpec(IMAGE_SIZE, IMAGE_SIZE)
    # Every caption of every digit, plus the empty caption, encoded once (the encoders are frozen).
    table = [c for d in range(10) for c in captions(d)] + [""]
    with torch.no_grad():
        cond = adapter.encode_prompts(table)
    per_digit = len(CAPTION_TEMPLATES)
    transformer = adapter.transformer
    transformer.train()
    params = [p for p in transformer.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=recipe.lr, weight_decay=0.0)
    warmup = max(1, recipe.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, recipe.steps) / recipe.steps))
    )
    n = latents.shape[0]
    running = None
    for step in range(recipe.steps):
        idx = torch.randint(0, n, (recipe.batch_size,), generator=gen)
        x0 = latents[idx]
        template = torch.randint(0, per_digit, (recipe.batch_size,), generator=gen)
        rows = labels[idx] * per_digit + template
        drop = torch.rand(recipe.batch_size, generator=gen) < recipe.caption_dropout
        rows = torch.where(drop, torch.full_like(rows, len(table) - 1), rows)
        sigma = torch.sigmoid(torch.randn(recipe.batch_size, generator=gen))
        noise = torch.randn(x0.shape, generator=gen)
        s = sigma.view(-1, 1, 1)
        xs = (1 - s) * x0 + s * noise
        v = adapter.predict_velocity(xs, sigma, {k: t[rows] for k, t in cond.items()}, spec)
        loss = (v - (noise - x0)).square().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        running = loss.item() if running is None else 0.98 * running + 0.02 * loss.item()
        if (step + 1) % max(1, recipe.steps // 10) == 0:
            log(f"flow step {step + 1}/{recipe.steps}: loss {running:.4f}")
    transformer.eval()


def pretrain_pipeline(recipe: ToyRecipe = ToyRecipe(), *, log: Callable[[str], None] = print):
    """Build and pretrain the toy ``FluxPipeline`` (in memory)."""
    from diffusers import FluxPipeline

    from .base import pack_2x2
    from .flux import FluxAdapter

    threads = torch.get_num_threads()
    torch.set_num_threads(recipe.threads)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(recipe.seed)
            parts = _components()
            gen = torch.Generator().manual_seed(recipe.seed + 1)
            images, labels = load_digits_data()
            pixels = _to_vae_pixels(torch.from_numpy(images))
            t0 = time.time()
            _train_vae(parts["vae"], pixels, recipe, gen, log)
            vae = parts["vae"]
            with torch.no_grad():
                z = vae.encode(pixels).latent_dist.mode()
            # FLUX.1's convention: z_model = (z - shift_factor) * scaling_factor, unit variance.
            shift, scale = z.mean().item(), 1.0 / z.std().item()
            vae.register_to_config(shift_factor=round(shift, 4), scaling_factor=round(scale, 4))
            latents = pack_2x2((z - vae.config.shift_factor) * vae.config.scaling_factor)
            log(f"vae trained in {time.time() - t0:.0f}s; shift_factor {vae.config.shift_factor}, "
                f"scaling_factor {vae.config.scaling_factor}")
            for module in (parts["text_encoder"], parts["text_encoder_2"]):
                module.eval().requires_grad_(False)
            adapter = FluxAdapter(
                transformer=parts["transformer"],
                vae=vae,
                text_encoder=parts["text_encoder"],
                tokenizer=parts["tokenizer"],
                text_encoder_2=parts["text_encoder_2"],
                tokenizer_2=parts["tokenizer_2"],
                scheduler_config=dict(parts["scheduler"].config),
            )
            t0 = time.time()
            _train_transformer(adapter, latents, torch.from_numpy(labels), recipe, gen, log)
            log(f"transformer trained in {time.time() - t0:.0f}s")
    finally:
        torch.set_num_threads(threads)
    return FluxPipeline(**parts)


def build_toy(out_dir: str, recipe: ToyRecipe = ToyRecipe(), *, log: Callable[[str], None] = print) -> str:
    """Pretrain the toy model with ``recipe`` and save it (diffusers format) to ``out_dir``."""
    pipeline = pretrain_pipeline(recipe, log=log)
    os.makedirs(out_dir, exist_ok=True)
    pipeline.save_pretrained(out_dir, safe_serialization=True)
    with open(os.path.join(out_dir, "toy_recipe.json"), "w") as f:
        json.dump({"version": TOY_VERSION, **dataclasses.asdict(recipe)}, f, indent=2)
    return out_dir


def default_cache_dir() -> str:
    """``$VERL_DIGEN_CACHE/toy`` if set, else ``~/.cache/verl_digen/toy``."""
    root = os.environ.get("VERL_DIGEN_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "verl_digen")
    return os.path.join(root, "toy")


# The built toy models the package ships (package data), one directory per name and version.
SHIPPED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pretrained")


def shipped_toy(name: str = "digits") -> str | None:
    """The package's built copy of toy ``name`` at the current ``TOY_VERSION`` (None: not shipped)."""
    path = os.path.join(SHIPPED_DIR, f"{name}-{TOY_VERSION}")
    return path if os.path.isfile(os.path.join(path, "model_index.json")) else None


def ensure_toy(name: str = "digits", cache_dir: str | None = None, *, log: Callable[[str], None] = print) -> str:
    """Path of the cached toy model ``name`` (``<cache>/<name>-<version>``): on first use a copy
    of the shipped model (:func:`shipped_toy`), else built from the default recipe (a few minutes
    on a CPU). Written into a temporary sibling directory and renamed into place, so a concurrent
    caller never sees a half-written model. A copy, not the package's own directory: runs may
    write next to a model (the wheel's may be read-only), and the cache is where Ray workers look."""
    if name not in TOY_MODELS:
        raise ValueError(f"unknown toy model '{name}'; known: {', '.join(TOY_MODELS)}")
    from .tiny import build_cached

    shipped = shipped_toy(name)
    if shipped is not None:
        build, announce = (lambda out: shutil.copytree(shipped, out, dirs_exist_ok=True)), None
    else:
        build = lambda out: build_toy(out, log=log)  # noqa: E731
        announce = lambda final: log(f"[verl-digen] building the toy model '{name}' (once; cached at {final})")  # noqa: E731
    return build_cached(cache_dir or default_cache_dir(), f"{name}-{TOY_VERSION}", build, announce=announce)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m verl_digen.models.toy",
        description="The pretrained toy digits generator (FLUX.1 architecture): print its cached directory, "
                    "or pretrain it again with --out.",
    )
    parser.add_argument("--out", help="pretrain from the recipe into this directory (default: print the cached "
                                      "model, a copy of the one the package ships)")
    parser.add_argument("--seed", type=int, default=ToyRecipe.seed)
    args = parser.parse_args(argv)
    if args.out:
        path = build_toy(args.out, ToyRecipe(seed=args.seed))
    else:
        if args.seed != ToyRecipe.seed:
            parser.error("--seed needs --out (the cache holds the default recipe)")
        path = ensure_toy("digits")
    print(os.path.abspath(path))


if __name__ == "__main__":
    main()
