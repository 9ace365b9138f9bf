"""Turn a composed config into what a run needs, failing before any worker starts.

Each function names the config key at fault: the number of steps, the model directory (or the
tiny model built in its place), the prompt sets, the output directory, and a reachable remote
reward.
"""

from __future__ import annotations

import os
import time
from typing import Any

from verl_digen.config.schema import ConfigError, DigenConfig


def total_steps(trainer_cfg: Any) -> int:
    steps = trainer_cfg.get("total_training_steps")
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ConfigError(f"invalid config: trainer.total_training_steps={steps!r}; must be a positive integer")
    return steps


def resolve_model_path(cfg: DigenConfig) -> str:
    from verl_digen.models.registry import ADAPTERS, detect_arch
    from verl_digen.models.tiny import ensure_tiny

    if cfg.model.path is None:
        if cfg.model.tiny_arch == "digits":  # pretrained once, then cached
            from verl_digen.models.toy import ensure_toy

            return ensure_toy(cfg.model.tiny_arch)
        return ensure_tiny(cfg.model.tiny_arch)
    if not os.path.isdir(cfg.model.path):
        raise FileNotFoundError(f"digen.model.path: model path '{cfg.model.path}' does not exist")
    if cfg.model.arch is not None and cfg.model.arch not in ADAPTERS:
        raise ConfigError(f"invalid config: digen.model.arch={cfg.model.arch!r}; known: {', '.join(sorted(ADAPTERS))}")
    detect_arch(cfg.model.path)  # names a missing model_index.json or an unsupported pipeline
    return os.path.abspath(cfg.model.path)


def resolve_prompts(cfg: DigenConfig, source: str | None = None) -> list[str]:
    from verl_digen.data import builtin_prompts, load_prompts

    key = "digen.data.prompts" if source is None else "digen.validation.prompts"
    source = source or cfg.data.prompts
    try:
        if source.startswith("builtin:"):
            return builtin_prompts(source.split(":", 1)[1])
        return load_prompts(source)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{key}: {e}") from None
    except ValueError as e:
        raise ConfigError(f"invalid config: {key}={source!r}: {e}") from None


def output_dir_for(cfg: DigenConfig, trainer_cfg: Any) -> str:
    if cfg.output_dir:
        path = cfg.output_dir
    else:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path = os.path.join("runs", str(trainer_cfg.project_name), f"{trainer_cfg.experiment_name}-{stamp}")
    os.makedirs(path, exist_ok=True)
    return os.path.abspath(path)


def preflight_reward(cfg: DigenConfig) -> None:
    """Fail before any worker starts when a remote reward (HTTP server, VLM judge) is unreachable."""
    from verl_digen.rewards import build_reward

    specs = [{"name": cfg.reward.name, "kwargs": cfg.reward.kwargs}] + list(cfg.reward.components)
    for spec in specs:
        if spec.get("name") in ("http", "vlm_judge"):
            build_reward(spec["name"], **dict(spec.get("kwargs") or {})).check_reachable()
