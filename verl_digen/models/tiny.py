"""Tiny, randomly initialised diffusers models for tests and CPU demos.

Every model family builds its pipeline at toy width (``build_tiny_pipeline`` in
``verl_digen/models/families/<family>.py``, from the shared parts of
:mod:`verl_digen.models.tiny_parts`); :func:`build_tiny` draws its weights from a seed, gives it
the family's real scheduler and saves it with ``save_pretrained``. The result is an ordinary
diffusers-format directory, loaded back through exactly the adapter code path real checkpoints
use.

Video models (Wan2.1, HunyuanVideo) use the same 2x spatial VAE factor and a causal temporal
factor (Wan 2, HunyuanVideo 4, the smallest its VAE allows): a 5-frame 32x32 clip becomes 3
(Wan) or 2 (HunyuanVideo) latent frames of 16x16. Qwen-Image works like FLUX (packed 2x2 patches).
Their tokenizers (Qwen2 byte-level BPE, Llama sentencepiece-style BPE) are trained in code so
that the template prefix has exactly the length the pipeline crops (34 tokens for Qwen-Image,
95 for HunyuanVideo) and prompts keep all their tokens.

CLI::

    python -m verl_digen.models.tiny --arch flux --out /tmp/tiny-flux
    python -m verl_digen.models.tiny --arch {sd3,qwen_image,wan,hunyuan_video} --out DIR
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from typing import Any, Callable

import torch

from verl_digen.models.families import FAMILY_NAMES, FAMILY_SPECS
from verl_digen.models.real_configs import build_scheduler
from verl_digen.models.tiny_parts import build_clip_tokenizer, build_t5_tokenizer  # noqa: F401  (public here too)

TINY_VERSION = "v2"  # bump when the builders change, so stale caches are not reused
TINY_ARCHS = FAMILY_NAMES  # every registered family has a tiny builder


def _check_arch(arch: str) -> None:
    if arch not in FAMILY_SPECS:
        raise ValueError(f"unknown tiny arch '{arch}'; known: {', '.join(TINY_ARCHS)}")


def build_tiny(arch: str, out_dir: str, *, seed: int = 0) -> str:
    """Build the tiny ``arch`` pipeline with weights drawn from ``seed`` and save it to ``out_dir``.

    Returns ``out_dir``. The same seed always gives the same weights (all modules are created
    under one ``torch.manual_seed``; the global RNG state is restored afterwards).
    """
    _check_arch(arch)
    build = FAMILY_SPECS[arch].build_tiny_pipeline
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        # The family's real scheduler (its shipped scheduler_config.json): every tiny model
        # samples on its real schedule. Building it draws no random numbers.
        pipeline = build(build_scheduler(arch))
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
    _check_arch(arch)
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
