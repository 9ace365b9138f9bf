"""Bad input stops the job before any worker starts, with an error that names the problem. The
command line's exit status: tests/e2e/test_bad_input_e2e.py."""

from __future__ import annotations

import socket

import pytest

from verl_digen.config.compose import compose_config
from verl_digen.config.schema import ConfigError
from verl_digen.trainer.loop import DigenTrainer


def _trainer(*overrides: str) -> DigenTrainer:
    return DigenTrainer(compose_config(list(overrides)))


def test_missing_model_path_names_the_path(tmp_path):
    missing = tmp_path / "no_such_model"
    with pytest.raises(FileNotFoundError, match="no_such_model"):
        _trainer(f"digen.model.path={missing}")


def test_model_dir_without_model_index_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="model_index.json"):
        _trainer(f"digen.model.path={tmp_path}")


def test_unknown_reward_lists_the_registered_ones():
    with pytest.raises(ConfigError, match=r"digen.reward.name='nope'.*brightness"):
        _trainer("digen.reward.name=nope")


def test_unknown_sde_type_lists_the_valid_ones():
    with pytest.raises(ConfigError, match=r"digen.sampling.sde_type='ode'.*sde, cps, dance_sde"):
        _trainer("digen.sampling.sde_type=ode")


def test_group_size_below_two_is_refused():
    with pytest.raises(ConfigError, match=r"digen.batch.group_size=1"):
        _trainer("digen.batch.group_size=1")


def test_empty_prompt_file_is_named(tmp_path):
    f = tmp_path / "prompts.txt"
    f.write_text("\n  \n")
    with pytest.raises(ValueError, match="prompts.txt.*no prompts"):
        _trainer(f"digen.data.prompts={f}")


def test_unreachable_reward_server_is_named():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/score"
    from verl_digen.rewards.http_client import RewardServerError

    with pytest.raises(RewardServerError, match=f"127.0.0.1:{port}.*unreachable"):
        _trainer("digen.reward.name=http", f"+digen.reward.kwargs.url={url}", "+digen.reward.kwargs.max_retries=2",
                 "+digen.reward.kwargs.backoff_s=0.01")


def test_typo_in_a_digen_key_is_named():
    with pytest.raises(ConfigError, match=r"unknown config key digen.batch.group_szie"):
        _trainer("+digen.batch.group_szie=4")


def test_pools_larger_than_the_cluster_are_refused():
    with pytest.raises(ConfigError, match=r"digen.pools need 3 devices.*trainer.n_gpus_per_node x trainer.nnodes = 2"):
        _trainer("digen.placement=disaggregated", "digen.pools.rollout.devices=2", "digen.pools.trainer.devices=1")


def test_pool_wider_than_a_node_is_refused_when_given_per_node():
    with pytest.raises(ConfigError, match=r"digen.pools.rollout.devices=3 per node \(digen.pools.rollout.nodes=1\) "
                                          r"exceeds trainer.n_gpus_per_node=2"):
        _trainer("digen.placement=disaggregated", "digen.pools.rollout.devices=3", "digen.pools.rollout.nodes=1")


def test_zero_size_pool_is_refused():
    with pytest.raises(ConfigError, match=r"digen.pools.trainer.devices=0"):
        _trainer("digen.placement=disaggregated", "digen.pools.trainer.devices=0")


def test_batch_that_does_not_divide_into_micro_batches_is_refused():
    with pytest.raises(ConfigError, match=r"digen.batch.train_micro_batch_groups=3.*groups_per_step=4"):
        _trainer("digen.batch.train_micro_batch_groups=3")


def test_async_needs_disaggregation():
    with pytest.raises(ConfigError, match=r"digen.async.max_staleness"):
        _trainer("digen.async.max_staleness=1")


def test_staleness_above_one_is_refused():
    with pytest.raises(ConfigError, match=r"digen.async.max_staleness=2"):
        _trainer("digen.placement=disaggregated", "digen.async.max_staleness=2")


def test_null_total_training_steps_counts_epochs_like_verl():
    # veRL's rule: whole batches of the training prompts (32 built-in prompts, 4 per step), times the epochs.
    assert _trainer("trainer.total_training_steps=null", "trainer.total_epochs=3").job.total_steps == 32 // 4 * 3


def test_null_total_training_steps_without_epochs_is_named():
    with pytest.raises(ConfigError, match=r"trainer.total_epochs=0"):
        _trainer("trainer.total_training_steps=null", "trainer.total_epochs=0")


def test_non_positive_total_training_steps_is_named():
    with pytest.raises(ConfigError, match=r"trainer.total_training_steps=0"):
        _trainer("trainer.total_training_steps=0")
