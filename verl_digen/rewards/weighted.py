"""Weighted sum of several rewards."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from verl_digen.rewards.base import RewardFn, _check_inputs, build_reward, check_metadata, register_reward, with_device

__all__ = ["WeightedReward"]

_COMPONENT_KEYS = {"name", "weight", "kwargs", "label"}


@register_reward("weighted")
class WeightedReward(RewardFn):
    """``sum_i weight_i * reward_i(images, prompts)``.

    ``components`` is a sequence whose items are any of

    * ``(reward, weight)`` with ``reward`` a :class:`RewardFn`;
    * ``(label, reward, weight)``;
    * a config mapping ``{"name": ..., "weight": 1.0, "kwargs": {...}, "label": ...}``
      (built with :func:`~verl_digen.rewards.base.build_reward`).

    Each component is labelled by ``label`` if given, else by its reward name; repeated
    labels get a ``_1``, ``_2``, ... suffix. :meth:`score_with_components` returns the
    unweighted per-component scores under those labels.
    """

    # Components do their own video handling (native or per-frame averaging).
    supports_video = True

    def __init__(self, components: Sequence[Any], device: str | None = None) -> None:
        """``device``: where components built from config mappings put their models (see
        :func:`~verl_digen.rewards.base.build_reward_from_config`); None: their defaults."""
        if isinstance(components, (str, Mapping)) or not isinstance(components, Sequence) or not components:
            raise ValueError(f"reward 'weighted': components must be a non-empty list, got {components!r}")
        self.components: list[tuple[str, RewardFn, float]] = []
        used: set[str] = set()
        for index, item in enumerate(components):
            label, reward, weight = _parse_component(index, item, device)
            unique = label
            suffix = 1
            while unique in used:
                unique = f"{label}_{suffix}"
                suffix += 1
            used.add(unique)
            self.components.append((unique, reward, weight))
        self._parts: dict[str, torch.Tensor] = {}
        self.wants_latents = any(reward.wants_latents for _, reward, _ in self.components)  # type: ignore[misc]
        self.reads_prompts = any(reward.reads_prompts for _, reward, _ in self.components)  # type: ignore[misc]

    @property
    def weights(self) -> dict[str, float]:
        """Component label -> weight."""
        return {label: weight for label, _, weight in self.components}

    def score_with_components(
        self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]] | None = None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The weighted sum ``[B]`` and each component's unweighted score ``[B]`` by label.

        ``metadata`` (one prompt record per sample) reaches every component."""
        prompts = _check_inputs(self.name, images, prompts)
        records = check_metadata(self.name, metadata, len(prompts))
        parts = {label: reward(images, prompts, records) for label, reward, _ in self.components}
        total = torch.zeros(images.shape[0], dtype=torch.float32, device=images.device)
        for label, _, weight in self.components:
            total = total + weight * parts[label]
        return total, parts

    def score_images(
        self, images: torch.Tensor, prompts: list[str], metadata: Sequence[Mapping[str, Any]] | None = None
    ) -> torch.Tensor:
        total, self._parts = self.score_with_components(images, prompts, metadata)
        return total

    def give_sample_tensors(self, tensors: Mapping[str, torch.Tensor] | None, validation: bool = False) -> None:
        for _, reward, _ in self.components:
            reward.give_sample_tensors(tensors, validation)

    def take_extras(self) -> dict[str, torch.Tensor]:
        """Each component's unweighted score as ``<label>`` and its extras as ``<label>/<name>``
        (per-step metrics ``reward/<label>``, ``reward/<label>/<name>``: veRL-Omni's multi-reward
        manager's names)."""
        parts, self._parts = self._parts, {}
        extras = {label: v.detach().float().cpu() for label, v in parts.items()}
        extras.update({f"{label}/{k}": v for label, reward, _ in self.components for k, v in reward.take_extras().items()})
        return extras

    def __repr__(self) -> str:
        inner = ", ".join(f"{label}*{weight:g}" for label, _, weight in self.components)
        return f"WeightedReward({inner})"


def _parse_component(index: int, item: Any, device: str | None) -> tuple[str, RewardFn, float]:
    where = f"reward 'weighted': component {index}"
    if isinstance(item, Mapping):
        extra = sorted(set(item) - _COMPONENT_KEYS)
        if extra:
            raise ValueError(f"{where} has unknown key(s) {extra}; allowed keys: {sorted(_COMPONENT_KEYS)}")
        if "name" not in item:
            raise ValueError(f"{where} needs a 'name' key, got keys {sorted(item)}")
        reward = build_reward(item["name"], **with_device(item["name"], dict(item.get("kwargs") or {}), device))
        label = item.get("label") or item["name"]
        weight = item.get("weight", 1.0)
    elif isinstance(item, (tuple, list)) and len(item) == 2:
        reward, weight = item
        label = getattr(reward, "name", type(reward).__name__)
    elif isinstance(item, (tuple, list)) and len(item) == 3:
        label, reward, weight = item
    else:
        raise ValueError(f"{where} must be (reward, weight), (label, reward, weight) or a config mapping, got {item!r}")
    if not isinstance(reward, RewardFn):
        raise ValueError(f"{where}: expected a RewardFn, got {type(reward).__name__}")
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
        raise ValueError(f"{where} ({label!r}): weight must be a finite number, got {weight!r}")
    return str(label), reward, float(weight)
