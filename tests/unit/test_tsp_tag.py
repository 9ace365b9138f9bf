"""TSP and TAG: the time-step pipeline's stages reproduce single-worker sampling bitwise, in
process. On real worker groups (exactness of the pipeline and of the time-step training split,
and TAG's version rules): tests/e2e/test_tsp_tag_e2e.py."""

from __future__ import annotations

import pickle

import pytest
import torch

from verl_digen.config.schema import digen_config_from_dict
from verl_digen.models.registry import load_adapter
from verl_digen.workers.sampling import GroupRequest, begin_groups, denoise, finish_groups, sample_groups
from verl_digen.workers.worker import sampling_settings

TENSORS = ("latents", "log_probs", "images", "sde_mask", "train_mask")


def _settings(window_size: int = 3):
    cfg = digen_config_from_dict({"sampling": {"num_steps": 6, "sde_window": {"mode": "fixed", "start": 1, "size": window_size}}})
    return sampling_settings(cfg)


@pytest.mark.parametrize("bounds", [(0, 3, 6), (0, 1, 4, 6)], ids=["K2", "K3"])
def test_stages_reproduce_single_worker_sampling_bitwise_in_process(tiny_flux, bounds):
    adapter = load_adapter(tiny_flux)
    settings = _settings()
    groups = (["a cat", "a dog"], [4, 5], [0, 1])
    kw = dict(group_size=2, training_step=3, seed=11, policy_version=0)
    whole = sample_groups(adapter, *groups, settings=settings, **kw)
    state = begin_groups(adapter, GroupRequest(*groups, **kw), settings)
    for end in bounds[1:]:
        state = pickle.loads(pickle.dumps(state))  # what crosses between stage processes
        denoise(adapter, state, settings, end)
    staged = finish_groups(adapter, state, settings)
    for key in TENSORS:
        assert torch.equal(whole.batch[key], staged.batch[key]), key
