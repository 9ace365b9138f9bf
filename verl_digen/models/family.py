"""One registration per model family: :class:`FamilySpec`.

A family (FLUX, SD3, ...) is its adapter (``models/<family>.py``), its family module
(``models/families/<family>.py``: this spec, the tiny builder and the meta-device trace
inputs), its shipped configs (``models/configs/<family>/``) and its presets. Every table
that lists families derives from the specs the family modules define
(:data:`verl_digen.models.families.FAMILY_SPECS`): the adapter registry and pipeline-class
detection (:mod:`verl_digen.models.registry`), the tiny architectures
(:data:`verl_digen.models.tiny.TINY_ARCHS`, the schema's ``digen.model.tiny_arch``), the
shipped configs (:data:`verl_digen.models.real_configs.FAMILIES`) and the memory planner's
trace (:mod:`verl_digen.memory.trace`).

This module is light (no torch, no diffusers): config validation reads the family names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class TraceLayout:
    """One row's sizes for a meta-device transformer forward: latent ``h``, ``w``, ``frames``,
    ``channels`` (from the family's configs and size rules) and ``text_tokens`` per prompt."""

    h: int
    w: int
    frames: int
    channels: int
    text_tokens: int


@dataclass(frozen=True)
class FamilySpec:
    """Everything the package needs to know about a model family, in one place.

    Attributes:
        name: the architecture name (``digen.model.arch``, the config folder's name).
        adapter: the adapter class as ``"package.module:ClassName"`` (imported on first use:
            adapter modules import diffusers, which takes seconds).
        pipeline_classes: the diffusers pipeline names (``model_index.json`` ``_class_name``)
            detected as this family.
        build_tiny_pipeline: ``(scheduler) -> pipeline``: the tiny diffusers pipeline with random
            weights drawn from the caller's seeded RNG, around the family's real scheduler.
        text_tokens: ``(max_sequence_length) -> int``: text tokens per prompt the transformer
            sees when prompts are encoded to ``max_sequence_length`` tokens (None: the
            pipeline's default length; ``digen.model.max_sequence_length``).
        trace_inputs: ``(layout, transformer_config, dtype) -> kwargs``: one row's transformer
            keyword arguments on the meta device, shaped as the adapter's ``_transformer_forward``
            passes them (:class:`TraceLayout`).
        max_sequence_length_limit: the most text tokens the diffusers pipeline accepts
            (``max_sequence_length`` above it is refused there too); None: only the tokenizer's.
    """

    name: str
    adapter: str
    pipeline_classes: tuple[str, ...]
    build_tiny_pipeline: Callable[[Any], Any]
    text_tokens: Callable[[int | None], int]
    trace_inputs: Callable[[TraceLayout, dict[str, Any], Any], dict[str, Any]]
    max_sequence_length_limit: int | None = None

    def __post_init__(self) -> None:
        if ":" not in self.adapter:
            raise ValueError(f"family '{self.name}': adapter must look like 'package.module:ClassName', "
                             f"got '{self.adapter}'")
