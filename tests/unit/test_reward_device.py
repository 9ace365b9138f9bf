"""Reward models run on their worker's device (issue 24, item 5).

Every model reward is built through the builder the worker uses
(``build_reward_from_config(spec, device=...)``) and its parameters must sit on the device given:
on CPU the ``meta`` device stands for the worker's GPU (a model moved there keeps no data, so
nothing here needs a GPU). The worker hands its own device to the builder
(``digen.reward.device``: auto / cpu / cuda), and the memory planner charges a reward model's
bytes on exactly the roles and the device where the workers put it. The ``gpu`` test, which
scores with a tiny preference model on CUDA and compares with the CPU scores, is
tests/gpu/test_reward_device_gpu.py."""

from __future__ import annotations

import os

import pytest
import torch
from omegaconf import OmegaConf

from verl_digen.config.compose import compose_config
from verl_digen.config.schema import ConfigError, digen_config_from_dict
from verl_digen.rewards import build_reward_from_config, build_tiny_clip
from verl_digen.rewards.preference import AestheticMLP
from verl_digen.workers import worker as worker_module
from verl_digen.workers.worker import DiffusionWorker, reward_device

from test_image_reward import V_HEADS, checkpoint  # noqa: F401 (a fixture: the tiny ImageReward.pt)

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "..", "configs")


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory) -> str:
    return build_tiny_clip(tmp_path_factory.mktemp("tiny_clip"), seed=3)


@pytest.fixture(scope="module")
def specs(clip_dir, checkpoint, tmp_path_factory) -> dict[str, dict]:  # noqa: F811
    """A config of every reward with a model, on the tiny checkpoints."""
    head = tmp_path_factory.mktemp("aesthetic") / "head.pth"
    torch.save(AestheticMLP(16).state_dict(), head)  # the tiny CLIP's projection dim
    model_dir, bert_dir, _ = checkpoint
    return {
        "pickscore": {"name": "pickscore", "kwargs": {"model_path": clip_dir, "processor_path": clip_dir}},
        "hpsv2": {"name": "hpsv2", "kwargs": {"model_path": clip_dir}},
        "clip_score": {"name": "clip_score", "kwargs": {"model_path": clip_dir}},
        "aesthetic": {"name": "aesthetic", "kwargs": {"head_path": str(head), "clip_path": clip_dir}},
        "imagereward": {"name": "imagereward",
                        "kwargs": {"model_path": model_dir, "tokenizer_path": bert_dir, "vision_heads": V_HEADS}},
    }


def parameter_devices(reward) -> set[str]:
    """The device types of every parameter of every torch module the reward holds (a weighted
    sum: its components')."""
    if hasattr(reward, "components"):
        return set().union(*(parameter_devices(r) for _, r, _ in reward.components))
    modules = [m for m in vars(reward).values() if isinstance(m, torch.nn.Module)]
    return {p.device.type for m in modules for p in m.parameters()}


def gpu_bytes(reward) -> int:
    """Bytes of the reward's parameters that are not on the CPU."""
    if hasattr(reward, "components"):
        return sum(gpu_bytes(r) for _, r, _ in reward.components)
    modules = [m for m in vars(reward).values() if isinstance(m, torch.nn.Module)]
    return sum(p.numel() * p.element_size() for m in modules for p in m.parameters() if p.device.type != "cpu")


@pytest.mark.parametrize("name", ["pickscore", "hpsv2", "clip_score", "aesthetic", "imagereward"])
def test_every_model_reward_is_built_on_the_device_given(specs, name):
    reward = build_reward_from_config(specs[name], device=torch.device("meta"))
    assert parameter_devices(reward) == {"meta"}
    assert reward.device == torch.device("meta")  # where its inputs go too
    assert parameter_devices(build_reward_from_config(specs[name])) == {"cpu"}  # no device: the default


def test_weighted_components_and_the_list_form_get_the_device_and_a_rewards_own_device_wins(specs):
    weighted = {"name": "weighted", "components": [dict(specs["pickscore"], weight=1.0), {"name": "brightness"}]}
    assert parameter_devices(build_reward_from_config(weighted, device="meta")) == {"meta"}
    listed = [dict(specs["clip_score"], weight=0.5), {"name": "jpeg_compressibility", "weight": 0.1}]
    assert parameter_devices(build_reward_from_config(listed, device="meta")) == {"meta"}
    own = {"name": "pickscore", "kwargs": dict(specs["pickscore"]["kwargs"], device="cpu")}
    assert parameter_devices(build_reward_from_config(own, device="meta")) == {"cpu"}
    # rewards without a model take no device: built as before, not refused
    for name in ("brightness", "digit_classifier", "jpeg_compressibility"):
        assert build_reward_from_config(name, device="meta").name == name


def test_reward_device_setting_resolves_against_the_workers_device():
    gpu = torch.device("cuda", 1)
    assert reward_device("auto", gpu) == gpu and reward_device("cuda", gpu) == gpu
    assert reward_device("cpu", gpu) == torch.device("cpu")
    assert reward_device("auto", torch.device("cpu")) == torch.device("cpu")
    with pytest.raises(ConfigError, match="digen.reward.device='cuda'.*no GPU"):
        reward_device("cuda", torch.device("cpu"))
    with pytest.raises(ConfigError, match=r"digen.reward.device=.*auto, cpu, cuda"):
        digen_config_from_dict({"reward": {"name": "brightness", "device": "gpu"}})


def _worker(cfg) -> DiffusionWorker:
    """A worker object with its config only (``_build_reward`` needs nothing else; no Ray)."""
    worker = DiffusionWorker.__new__(DiffusionWorker)
    worker.cfg = cfg
    return worker


def test_the_worker_builds_its_reward_on_its_own_device(specs, monkeypatch):
    cfg = digen_config_from_dict({"reward": specs["pickscore"]})
    # The worker's device as compute_device() reports it: meta stands for the GPU Ray gave it.
    monkeypatch.setattr(worker_module, "compute_device", lambda: torch.device("meta"))
    worker = _worker(cfg)
    assert worker._build_reward() == torch.device("meta")
    assert parameter_devices(worker.reward_fn) == {"meta"}
    on_cpu = _worker(digen_config_from_dict({"reward": dict(specs["pickscore"], device="cpu")}))
    assert on_cpu._build_reward() == torch.device("cpu") and parameter_devices(on_cpu.reward_fn) == {"cpu"}
    monkeypatch.setattr(worker_module, "compute_device", lambda: torch.device("cpu"))
    with pytest.raises(ConfigError, match="digen.reward.device"):
        _worker(digen_config_from_dict({"reward": dict(specs["pickscore"], device="cuda")}))._build_reward()


@pytest.mark.parametrize("setting", ["auto", "cpu"])
@pytest.mark.parametrize("kwargs", [{}, {"dtype": "bfloat16"}, {"device": "cpu"}])
def test_the_planner_charges_the_bytes_the_builder_puts_on_the_gpu(specs, setting, kwargs):
    """``reward_gpu_bytes`` (the planner's charge) against the parameters the worker's builder
    leaves off the CPU, for the same spec and setting, with the real parameter counts swapped
    for the tiny model's."""
    from verl_digen.memory.plan import reward_gpu_bytes

    one = {"name": "pickscore", "kwargs": dict(specs["pickscore"]["kwargs"], **kwargs)}
    weighted = {"name": "weighted", "components": [dict(one, weight=1.0), dict(specs["clip_score"], weight=0.5),
                                                   {"name": "brightness"}]}
    numel = sum(p.numel() for p in build_reward_from_config(specs["clip_score"]).model.parameters())
    counts = {"pickscore": numel, "clip_score": numel}.get
    for spec in (one, weighted):
        built = build_reward_from_config(spec, device=reward_device(setting, torch.device("meta")))
        assert reward_gpu_bytes(spec, setting, lambda name: counts(name, 0)) == gpu_bytes(built)
    assert reward_gpu_bytes(one, setting, lambda name: counts(name, 0)) > 0 or setting == "cpu" or "device" in kwargs


def _plan(name: str, *overrides: str) -> tuple:
    from verl_digen.memory import plan_job

    cfg = compose_config(list(overrides), config_name=name, config_dir=CONFIGS)
    digen = digen_config_from_dict(OmegaConf.to_container(cfg.digen, resolve=True))
    plans = plan_job(digen, devices_per_node=cfg.trainer.n_gpus_per_node, nnodes=1)
    return digen, {p.role: p.phases for p in plans}


@pytest.mark.parametrize("layout", [
    ("sd3_disaggregated",),
    ("sd3_disaggregated", "digen.tag.enable=true"),
    ("sd3_disaggregated", "digen.pools.rollout.devices=3", "digen.pools.reward.devices=1"),
    ("sd3_colocated",),
])
def test_the_planner_charges_the_reward_model_on_the_roles_whose_workers_build_it(layout):
    """Each role's phases hold PickScore's fp32 weights exactly where that role's worker builds
    the reward for training (a reward pool: there only; TAG without a pool: the trainers too)
    and nowhere with digen.reward.device=cpu."""
    from verl_digen.memory.plan import REWARD_MODEL_PARAMS
    from verl_digen.workers.worker import ROLE_CAPABILITIES

    digen, rule = _plan(*layout)
    _, model = _plan(*layout, "digen.reward.name=pickscore")
    _, on_cpu = _plan(*layout, "digen.reward.name=pickscore", "digen.reward.device=cpu")
    worker = _worker(digen)
    for role, phases in model.items():
        caps = ROLE_CAPABILITIES["fused" if role == "colocated" else role]
        builds = worker._scores_in_training(caps)  # the worker's rule for holding the reward model
        added = {p: phases[p]["encoders_vae"] - rule.get(role, {}).get(p, {}).get("encoders_vae", 0) for p in phases}
        expected = int(REWARD_MODEL_PARAMS["pickscore"] * 4) if builds else 0  # fp32 on the GPU
        assert set(added.values()) == {expected}, (role, added)
        assert all(on_cpu[role][p]["encoders_vae"] == rule[role][p]["encoders_vae"] for p in rule.get(role, {})), role


def test_the_reward_server_puts_a_model_reward_on_its_device(specs):
    """``python -m verl_digen.rewards.serve --device auto|cpu|cuda``: auto is the visible GPU,
    else the CPU (here); cuda without a GPU is refused naming the flag; kwargs.device wins."""
    from verl_digen.rewards.serve import reward_kwargs_on_device

    kwargs = specs["clip_score"]["kwargs"]
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert reward_kwargs_on_device("clip_score", kwargs, "auto") == dict(kwargs, device=expected)
    assert reward_kwargs_on_device("clip_score", kwargs, "cpu") == dict(kwargs, device="cpu")
    assert reward_kwargs_on_device("clip_score", dict(kwargs, device="meta"), "cpu")["device"] == "meta"
    assert reward_kwargs_on_device("brightness", {}, "auto") == {}  # no model, no device
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="--device cuda"):
            reward_kwargs_on_device("clip_score", kwargs, "cuda")
