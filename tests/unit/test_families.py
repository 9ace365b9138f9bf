"""One registration per model family (verl_digen/models/families/<family>.py).

Every registered family is complete: an adapter whose arch is the family's, pipeline classes its
shipped configs detect as, a tiny builder, trace inputs its real transformer accepts, a shipped
config folder and presets; and every table that lists families (the adapters, pipeline-class
detection, tiny architectures, shipped configs, the schema's ``tiny_arch``) lists exactly the
registered ones, through the registration. A half-registered family fails here.
"""

from __future__ import annotations

import importlib
import inspect
import os

import pytest
import torch
import yaml

from verl_digen.config.compose import CONFIG_DIR
from verl_digen.config.schema import ConfigError, ModelConfig
from verl_digen.models import ADAPTERS, PIPELINE_TO_ARCH
from verl_digen.models.base import read_model_index
from verl_digen.models.families import FAMILY_NAMES, FAMILY_SPECS, family_spec
from verl_digen.models.family import FamilySpec
from verl_digen.models.real_configs import CONFIG_ROOT, FAMILIES, component_config, config_dir
from verl_digen.models.tiny import TINY_ARCHS

FAMILIES_DIR = os.path.join(os.path.dirname(CONFIG_ROOT), "families")


def _preset_archs() -> dict[str, str]:
    """Preset name -> its ``digen.model.arch`` (presets that name one)."""
    out = {}
    for name in sorted(os.listdir(CONFIG_DIR)):
        if name.endswith(".yaml"):
            with open(os.path.join(CONFIG_DIR, name)) as f:
                arch = (((yaml.safe_load(f) or {}).get("digen") or {}).get("model") or {}).get("arch")
            if arch:
                out[name[: -len(".yaml")]] = arch
    return out


def test_every_family_module_is_registered_and_every_registration_has_its_module():
    modules = {f[: -len(".py")] for f in os.listdir(FAMILIES_DIR) if f.endswith(".py") and f != "__init__.py"}
    assert modules == set(FAMILY_NAMES)
    for name, spec in FAMILY_SPECS.items():
        assert isinstance(spec, FamilySpec) and spec.name == name
        assert importlib.import_module(f"verl_digen.models.families.{name}").FAMILY is spec


def test_every_table_of_families_derives_from_the_registration():
    assert FAMILY_NAMES == ("flux", "sd3", "qwen_image", "wan", "hunyuan_video")  # registration order
    assert TINY_ARCHS == FAMILY_NAMES
    assert FAMILIES == FAMILY_NAMES
    assert tuple(ADAPTERS) == FAMILY_NAMES
    assert PIPELINE_TO_ARCH == {p: s.name for s in FAMILY_SPECS.values() for p in s.pipeline_classes}
    assert sorted(os.listdir(CONFIG_ROOT)) == sorted(FAMILY_NAMES)  # no config folder without a family
    assert set(_preset_archs().values()) <= set(FAMILY_NAMES)  # no preset of an unknown family


def test_the_schema_accepts_every_registered_family_as_a_tiny_arch_and_nothing_else():
    for name in (*FAMILY_NAMES, "digits"):
        ModelConfig(tiny_arch=name).validate("digen.model")
    with pytest.raises(ConfigError, match="valid: flux, sd3, qwen_image, wan, hunyuan_video, digits"):
        ModelConfig(tiny_arch="unet").validate("digen.model")
    with pytest.raises(ValueError, match="unknown model family 'unet'; known: flux, sd3"):
        family_spec("unet")


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_a_registered_family_is_complete(name):
    spec = family_spec(name)
    adapter = ADAPTERS[name]
    assert adapter.arch == name and f"{adapter.__module__}:{adapter.__qualname__}" == spec.adapter
    # Its shipped configs: a pipeline directory its pipeline classes detect as this family.
    root = config_dir(name)
    assert os.path.isfile(os.path.join(root, "model_index.json"))
    assert read_model_index(root)["_class_name"] in spec.pipeline_classes
    assert os.path.isfile(os.path.join(root, "transformer", "config.json"))
    # Presets that run it.
    assert name in _preset_archs().values(), f"no preset in {CONFIG_DIR} sets digen.model.arch={name}"
    # A tiny builder taking the family's real scheduler (test_models.py builds and loads each).
    assert list(inspect.signature(spec.build_tiny_pipeline).parameters) == ["scheduler"]
    assert spec.text_tokens() > 0 and spec.text_tokens(64) in (64, 77 + 64)


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_a_familys_trace_inputs_are_what_its_real_transformer_takes(name):
    """The trace inputs (meta device, small sample) name only arguments of the shipped
    transformer's forward, and every argument it requires."""
    import diffusers

    from verl_digen.memory.trace import TraceShape, _inputs, latent_layout

    video = name in ("wan", "hunyuan_video")
    shape = TraceShape(name, None, "bf16", 128, 192, 9 if video else 1)
    config = component_config(name, "transformer")
    inputs = _inputs(shape, config, torch.bfloat16)
    forward = inspect.signature(getattr(diffusers, config["_class_name"]).forward).parameters
    assert set(inputs) <= set(forward)
    required = {k for k, p in forward.items() if k != "self" and p.default is p.empty and p.kind is not p.VAR_KEYWORD}
    assert required <= set(inputs)
    tensors = [v for v in inputs.values() if isinstance(v, torch.Tensor)]
    assert tensors and all(t.device.type == "meta" for t in tensors)
    assert latent_layout(shape)["tokens"] > 0
