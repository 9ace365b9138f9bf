"""The model families, one module each: every table that lists families derives from here.

Each module defines ``FAMILY``, its :class:`~verl_digen.models.family.FamilySpec` (adapter,
pipeline classes, tiny builder, trace inputs). :data:`FAMILY_SPECS` lists them in registration
order, the order error messages and CLI choices name the families in. Adding a family:
docs/architecture.md, "Adding a model family".

Light to import: the family modules import diffusers and transformers only inside their builders.
"""

from __future__ import annotations

from verl_digen.models.family import FamilySpec
from verl_digen.models.families import flux, hunyuan_video, qwen_image, sd3, wan

FAMILY_SPECS: dict[str, FamilySpec] = {
    module.FAMILY.name: module.FAMILY for module in (flux, sd3, qwen_image, wan, hunyuan_video)
}
FAMILY_NAMES: tuple[str, ...] = tuple(FAMILY_SPECS)


def family_spec(name: str) -> FamilySpec:
    """The registration of family ``name``; a ValueError naming the known ones otherwise."""
    if name not in FAMILY_SPECS:
        raise ValueError(f"unknown model family '{name}'; known: {', '.join(FAMILY_NAMES)}")
    return FAMILY_SPECS[name]
