"""The veRL symbols verl-digen relies on: fail loudly here, not deep in a run, when veRL changes."""

from __future__ import annotations

import importlib.metadata as md
import inspect

import verl
import verl_digen


def test_verl_is_the_pinned_version():
    assert md.version("verl") == verl_digen.VERL_VERSION_PINNED == "0.9.1"


def test_plugin_entry_point_is_installed_and_was_loaded_by_verl():
    import sys

    eps = [ep for ep in md.entry_points(group="verl.plugins") if ep.value == "verl_digen.plugin"]
    assert eps, "the verl.plugins entry point of verl-digen is not installed"
    assert sys.modules["verl_digen.plugin"].LOADED


def test_platform_registry_api():
    from verl.plugin.platform import PlatformBase, PlatformRegistry, get_platform

    assert callable(PlatformRegistry.register) and callable(PlatformRegistry.get)
    assert "cpu" in PlatformRegistry.registered_names()
    from verl_digen.platform.cpu import PlatformCPU

    assert not inspect.isabstract(PlatformCPU) and issubclass(PlatformCPU, PlatformBase)
    assert get_platform().device_name in ("cpu", "cuda")


def test_single_controller_api():
    from verl.single_controller.base import Worker
    from verl.single_controller.base.decorator import Dispatch, register
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

    pool_args = inspect.signature(RayResourcePool.__init__).parameters
    assert {"process_on_nodes", "use_gpu", "max_colocate_count", "name_prefix", "accelerator_type"} <= set(pool_args)
    wg_args = inspect.signature(RayWorkerGroup.__init__).parameters
    assert {"resource_pool", "ray_cls_with_init", "name_prefix"} <= set(wg_args)
    assert isinstance(RayWorkerGroup.workers, property)
    assert hasattr(Dispatch, "ONE_TO_ALL") and callable(register) and callable(RayClassWithInitArgs)
    assert "cuda_visible_devices" in inspect.signature(Worker.__init__).parameters


def test_dataproto_api():
    import numpy as np
    import torch

    d = verl.DataProto.from_dict(tensors={"x": torch.arange(4.0)}, non_tensors={"g": np.arange(4)}, meta_info={})
    part = d.select_idxs([1, 3])
    both = verl.DataProto.concat([part, part])
    assert both.batch["x"].tolist() == [1.0, 3.0, 1.0, 3.0] and both.non_tensor_batch["g"].tolist() == [1, 3, 1, 3]


def test_tracking_and_checkpoint_engine_registry_api():
    from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry
    from verl.utils.tracking import Tracking

    assert {"project_name", "experiment_name", "default_backend", "config"} <= set(
        inspect.signature(Tracking.__init__).parameters
    )
    import verl_digen.sync.checkpoint_engine  # noqa: F401  (registers digen_gloo)

    assert issubclass(CheckpointEngineRegistry.get("digen_gloo"), CheckpointEngine)


def test_trainer_config_keys_we_read_exist():
    from verl_digen.config.compose import compose_config

    cfg = compose_config([])
    for key in ("project_name", "experiment_name", "total_training_steps", "logger", "n_gpus_per_node", "nnodes",
                "default_local_dir", "save_freq", "resume_mode", "resume_from_path", "max_actor_ckpt_to_keep",
                "test_freq"):
        assert key in cfg.trainer, key
