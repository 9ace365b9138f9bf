"""The real models' configs, shipped as package data (no weights).

``verl_digen/models/configs/<family>/`` mirrors a diffusers pipeline directory without its
weights and tokenizers: ``model_index.json``, ``scheduler/scheduler_config.json`` and one
``config.json`` per model component (transformer, VAE, text encoders), as published for

* ``flux``: FLUX.1-dev (FlowMatchEuler, resolution-dependent dynamic shift);
* ``sd3``: Stable Diffusion 3.5 Large (FlowMatchEuler, shift 3);
* ``qwen_image``: Qwen-Image (FlowMatchEuler, exponential dynamic shift, terminal sigma 0.02);
* ``wan``: Wan2.1-T2V-14B (UniPCMultistep with flow sigmas, flow_shift 3: starts at 0.999999);
* ``hunyuan_video``: HunyuanVideo (FlowMatchEuler, shift 7).

Two users: the tiny builds (:func:`verl_digen.models.tiny.build_tiny`) get each family's real
scheduler, so every tiny test runs the real schedule; the memory planner (:mod:`verl_digen.memory`)
builds the real-size modules on the meta device (:func:`build_on_meta`) to count parameters and
trace activations without any weight.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import torch

from verl_digen.models.base import read_json
from verl_digen.models.families import FAMILY_NAMES

FAMILIES = FAMILY_NAMES  # every registered family ships its configs (tests/unit/test_families.py)
CONFIG_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")


def _check_family(family: str) -> None:
    if family not in FAMILIES:
        raise ValueError(f"no shipped configs for model family '{family}'; known: {', '.join(FAMILIES)}")


def config_dir(family: str) -> str:
    """The shipped config directory of ``family`` (a diffusers pipeline layout without weights)."""
    _check_family(family)
    return os.path.join(CONFIG_ROOT, family)


def scheduler_config(family: str) -> dict[str, Any]:
    """The family's real ``scheduler_config.json`` as a dict (``_class_name`` included)."""
    from verl_digen.models.base import load_scheduler_config

    return load_scheduler_config(config_dir(family))


def build_scheduler(family: str):
    """The family's real scheduler (the diffusers class its config names)."""
    import diffusers

    config = scheduler_config(family)
    return getattr(diffusers, config["_class_name"]).from_config(config)


def model_components(family: str, path: str | None = None) -> dict[str, tuple[str, str]]:
    """``{subfolder: (library, class name)}`` of the model components (not tokenizers or the
    scheduler) in ``model_index.json`` of ``path`` (default: the shipped configs)."""
    from verl_digen.models.base import read_model_index

    index = read_model_index(path or config_dir(family))
    out = {}
    for name, entry in index.items():
        if name.startswith("_") or not isinstance(entry, list) or entry[0] is None:
            continue
        if name.startswith("tokenizer") or name == "scheduler":
            continue
        out[name] = (entry[0], entry[1])
    return out


def component_config(family: str, name: str, path: str | None = None) -> dict[str, Any]:
    """The ``<name>/config.json`` of ``path`` (default: the family's shipped configs)."""
    root = config_dir(family) if path is None else path
    file = os.path.join(root, name, "config.json")
    if not os.path.isfile(file):
        raise FileNotFoundError(f"no config for component '{name}' at {file}")
    return read_json(file)


def instantiate(family: str, name: str, *, path: str | None = None) -> torch.nn.Module:
    """Component ``name`` of ``family`` built from its config (random weights), on the current
    default device (``with torch.device(...)``) in the current default dtype."""
    import diffusers
    import transformers

    library, class_name = model_components(family, path)[name]
    config = component_config(family, name, path)
    if library == "diffusers":
        return getattr(diffusers, class_name).from_config(config)
    config_cls = transformers.AutoConfig.for_model(config["model_type"]).__class__
    hf_config = config_cls.from_dict({k: v for k, v in config.items() if k != "model_type"})
    return getattr(transformers, class_name)(hf_config)


def build_on_meta(family: str, name: str, *, path: str | None = None, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """Component ``name`` of ``family`` at real size on the meta device (no memory, no weights),
    in ``dtype``, from the configs of ``path`` (default: the shipped ones)."""
    with torch.device("meta"):
        module = instantiate(family, name, path=path)
    # As from_pretrained(torch_dtype=dtype) does: cast, but keep the modules the class names in
    # _keep_in_fp32_modules (Wan's time embedder, norms and modulation tables) in float32.
    keep = tuple(getattr(module, "_keep_in_fp32_modules", None) or ())
    for param in module.parameters():
        param.data = param.data.to(dtype)
    for buffer_name, buffer in module.named_buffers():
        if buffer.is_floating_point():
            buffer.data = buffer.data.to(dtype)
    if keep and dtype != torch.float32:
        for module_name, sub in module.named_modules():
            if any(part in keep for part in module_name.split(".")):
                for param in sub.parameters(recurse=False):
                    param.data = param.data.float()
    return module


def write_config_dir(family: str, out_dir: str) -> str:
    """Copy the family's shipped configs to ``out_dir`` (a weight-less pipeline directory, e.g.
    for planning memory as if the real model were at ``out_dir``). Returns ``out_dir``."""
    shutil.copytree(config_dir(family), out_dir, dirs_exist_ok=True)
    return out_dir
