"""Architecture name -> adapter class, and :func:`load_adapter` for a model directory.

The built-in architectures are the model families' registrations
(:mod:`verl_digen.models.families`); :func:`register_adapter` adds an adapter from elsewhere.

Adapter modules import diffusers and transformers, which take seconds; the registry maps names
to ``"module:Class"`` strings and imports a module only when its adapter is asked for, so that
``import verl_digen.models`` (and config validation) stays light.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator, Mapping

import torch

from .base import DiffusionAdapter, read_model_index
from .families import FAMILY_SPECS


class _LazyAdapters(Mapping):
    """A read-only ``{arch: adapter class}`` mapping that imports each class on first access."""

    def __init__(self, targets: dict[str, str]) -> None:
        self._targets = dict(targets)
        self._loaded: dict[str, type[DiffusionAdapter]] = {}

    def __getitem__(self, arch: str) -> type[DiffusionAdapter]:
        if arch not in self._loaded:
            module_name, _, class_name = self._targets[arch].partition(":")
            self._loaded[arch] = getattr(importlib.import_module(module_name), class_name)
        return self._loaded[arch]

    def __iter__(self) -> Iterator[str]:
        return iter(self._targets)

    def __len__(self) -> int:
        return len(self._targets)

    def __repr__(self) -> str:
        return f"ADAPTERS({', '.join(self._targets)})"

    def register(self, arch: str, target: str | type[DiffusionAdapter]) -> None:
        """Add an architecture: ``target`` is an adapter class or a ``"module:Class"`` string."""
        if isinstance(target, str):
            if ":" not in target:
                raise ValueError(f"adapter target must look like 'package.module:ClassName', got '{target}'")
            self._targets[arch] = target
            self._loaded.pop(arch, None)
        else:
            self._targets[arch] = f"{target.__module__}:{target.__qualname__}"
            self._loaded[arch] = target


# arch -> adapter class (imported lazily), from the families' registrations.
ADAPTERS = _LazyAdapters({name: spec.adapter for name, spec in FAMILY_SPECS.items()})

# model_index.json "_class_name" -> arch, for detection.
PIPELINE_TO_ARCH: dict[str, str] = {
    pipeline: name for name, spec in FAMILY_SPECS.items() for pipeline in spec.pipeline_classes
}


def register_adapter(arch: str, target: str | type[DiffusionAdapter], pipeline_classes: tuple[str, ...] = ()) -> None:
    """Make ``arch`` loadable by :func:`load_adapter`; ``pipeline_classes`` are the diffusers
    pipeline names (``model_index.json`` ``_class_name``) that auto-detect to it."""
    ADAPTERS.register(arch, target)
    for name in pipeline_classes:
        PIPELINE_TO_ARCH[name] = arch


def detect_arch(path: str) -> str:
    """The adapter arch for a diffusers directory, from its ``model_index.json`` ``_class_name``."""
    class_name = read_model_index(path).get("_class_name")
    if class_name not in PIPELINE_TO_ARCH:
        known = ", ".join(f"{name} ({arch})" for name, arch in PIPELINE_TO_ARCH.items())
        raise ValueError(
            f"unsupported pipeline class '{class_name}' in {os.path.join(path, 'model_index.json')}; "
            f"supported: {known}"
        )
    return PIPELINE_TO_ARCH[class_name]


def load_adapter(
    path: str,
    arch: str | None = None,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    max_sequence_length: int | None = None,
) -> DiffusionAdapter:
    """Load the model at ``path`` (a local diffusers-format directory) behind its adapter;
    ``max_sequence_length``: text tokens per prompt (None: the pipeline's default).

    ``arch=None`` detects the architecture from ``model_index.json``. When ``arch`` is given it
    must be known, and must agree with the directory's pipeline class when that is a known one.
    """
    if arch is not None and arch not in ADAPTERS:
        # Registration order (built-ins first, then plugins), not alphabetical.
        raise ValueError(f"unknown model arch '{arch}'; known: {', '.join(ADAPTERS)}")
    index = read_model_index(path)  # FileNotFoundError for a missing dir or model_index.json
    if arch is None:
        arch = detect_arch(path)
    else:
        detected = PIPELINE_TO_ARCH.get(index.get("_class_name"))
        if detected is not None and detected != arch:
            raise ValueError(
                f"model arch '{arch}' does not match model path '{path}', which holds a "
                f"{index.get('_class_name')} (arch '{detected}')"
            )
    return ADAPTERS[arch].from_pretrained(path, device=device, dtype=dtype, max_sequence_length=max_sequence_length)
