"""Diffusion model adapters (one module per diffusers architecture), tiny test models and the
pretrained toy digits model (``toy``).

Importing this package is light (torch only): the adapters and the tiny builders, which pull
in diffusers and transformers, are imported on first attribute access.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from .base import Conditioning, DiffusionAdapter, SampleSpec
from .registry import ADAPTERS, PIPELINE_TO_ARCH, detect_arch, load_adapter, register_adapter

if TYPE_CHECKING:  # pragma: no cover
    from .flux import FluxAdapter
    from .hunyuan_video import HunyuanVideoAdapter
    from .qwen_image import QwenImageAdapter
    from .sd3 import SD3Adapter
    from .wan import WanAdapter
    from .tiny import build_tiny, ensure_tiny
    from .toy import build_toy, ensure_toy

_LAZY = {
    "FluxAdapter": "verl_digen.models.flux",
    "SD3Adapter": "verl_digen.models.sd3",
    "QwenImageAdapter": "verl_digen.models.qwen_image",
    "WanAdapter": "verl_digen.models.wan",
    "HunyuanVideoAdapter": "verl_digen.models.hunyuan_video",
    "build_tiny": "verl_digen.models.tiny",
    "ensure_tiny": "verl_digen.models.tiny",
    "build_toy": "verl_digen.models.toy",
    "ensure_toy": "verl_digen.models.toy",
}

__all__ = [
    "ADAPTERS",
    "PIPELINE_TO_ARCH",
    "Conditioning",
    "DiffusionAdapter",
    "FluxAdapter",
    "HunyuanVideoAdapter",
    "QwenImageAdapter",
    "SD3Adapter",
    "WanAdapter",
    "SampleSpec",
    "build_tiny",
    "build_toy",
    "detect_arch",
    "ensure_tiny",
    "ensure_toy",
    "load_adapter",
    "register_adapter",
]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
