"""PPO mini-batches on a GPU in bf16: the first mini-batch's ratio is exactly 1 (rollout and trainer
make the same calls), the second trains against the behaviour log-probs. The rules on CPU:
tests/unit/test_mini_batches.py."""

from __future__ import annotations

import pytest
import torch

from test_mini_batches import _two_mini_batches


@pytest.mark.gpu
def test_the_second_mini_batch_trains_against_the_behaviour_log_probs_on_cuda_bf16(tiny_flux):
    """The same on a GPU in bf16 (digen.model.dtype=bfloat16): the first mini-batch's ratio is
    still exactly 1 (rollout and trainer make the same calls), the second's moves."""
    from verl_digen.models.registry import load_adapter

    adapter = load_adapter(tiny_flux, device="cuda", dtype=torch.bfloat16)
    first, second = _two_mini_batches(adapter)
    assert first["actor/ratio_mean"] == 1.0 and first["actor/clip_frac"] == 0.0
    assert second["actor/ratio_mean"] != 1.0 and second["actor/clip_frac"] > 0.0
