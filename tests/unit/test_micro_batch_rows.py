"""Training passes smaller than a group (``digen.batch.train_micro_batch_rows``, veRL's
``ppo_micro_batch_size_per_gpu`` below ``rollout.n``): the plan's train tasks stay whole groups
(their advantages are the groups'), each rank trains a task in passes of that many rows, and the
mini-batch's update does not depend on the size. The veRL key's translation:
tests/unit/test_verl_keys.py; the memory planner and the planner's printed config:
tests/unit/test_planner.py (its ``train_micro_batch_rows`` case)."""

from __future__ import annotations

import pytest
import torch

from verl_digen.config.schema import ConfigError, digen_config_from_dict

pytestmark = pytest.mark.usefixtures("one_thread")

GROUP, GROUPS = 4, 2  # one mini-batch of two groups of four samples


def _cfg(groups: int = 1, rows: int | None = None, **more):
    batch = {"group_size": GROUP, "groups_per_step": GROUPS, "train_micro_batch_groups": groups,
             "train_micro_batch_rows": rows}
    data = {"batch": batch, "sampling": {"num_steps": 3, "sde_window": {"mode": "fixed", "start": 0, "size": 2}},
            "algo": {"optimizer": "sgd", "lr": 0.5, "weight_decay": 0.0, "max_grad_norm": 1e6}}
    for key, value in more.items():
        data[key] = {**data.get(key, {}), **value}
    return digen_config_from_dict(data)


def test_rows_per_pass_is_one_of_the_rollouts_call_sizes_or_named_with_the_valid_ones():
    from verl_digen.schedule.strategies import call_rows

    assert call_rows(8, 1, 1) == 8  # unset: the largest call, a whole group
    assert [call_rows(8, 1, 1, 1, r) for r in (1, 2, 4, 8)] == [1, 2, 4, 8]
    assert call_rows(8, 1, 2, 1, 2) == 2  # 8 rows over 2 FSDP ranks: 2 calls of 2 rows each
    with pytest.raises(ValueError, match=r"digen.batch.train_micro_batch_rows=3 must be one of 1, 2, 4, 8"):
        call_rows(8, 1, 1, 1, 3)
    # 8 rows cannot be dealt to 2 ranks in whole calls of 8
    with pytest.raises(ValueError, match=r"train_micro_batch_rows=8 must be one of 1, 2, 4:"):
        call_rows(8, 1, 2, 1, 8)


def test_the_config_refuses_rows_that_do_not_make_whole_calls_naming_the_key():
    from verl_digen.workers.worker import sampling_settings

    assert sampling_settings(_cfg(rows=2)).forward_rows == 2  # what every worker trains and samples with
    assert sampling_settings(_cfg()).forward_rows == GROUP
    with pytest.raises(ConfigError, match=r"digen.batch.train_micro_batch_rows.*must be >= 1 and divide "
                                          r"digen.batch.group_size=4"):
        _cfg(rows=3)
    with pytest.raises(ConfigError, match=r"digen.batch.train_micro_batch_rows.*must be >= 1 or null"):
        _cfg(rows=0)
    # disaggregated FSDP over 2 trainers: a micro-batch of one group is 4 rows, 2 calls of 2 per rank
    # at most; 4-row passes would leave one rank without a call
    disaggregated = {"placement": "disaggregated", "fsdp": {"enable": True},
                     "pools": {"rollout": {"devices": 1}, "trainer": {"devices": 2}}}
    assert digen_config_from_dict({**_raw(rows=2), **disaggregated}).pass_rows(0) == 2
    with pytest.raises(ConfigError, match=r"train_micro_batch_rows=4 must be one of 1, 2:"):
        digen_config_from_dict({**_raw(rows=4), **disaggregated})


def _raw(groups: int = 1, rows: int | None = None) -> dict:
    return {"batch": {"group_size": GROUP, "groups_per_step": GROUPS, "train_micro_batch_groups": groups,
                      "train_micro_batch_rows": rows}}


def _sample(path: str, settings):
    from verl_digen.workers.sampling import sample_groups

    from verl_digen.models.registry import load_adapter

    adapter = load_adapter(path)
    return sample_groups(adapter, ["a red apple", "a blue car"], [0, 1], [0, 1], group_size=GROUP,
                         settings=settings, training_step=0, seed=5, policy_version=0)


def _updater(path: str, cfg):
    from verl_digen.config.schema import LoraConfigSpec
    from verl_digen.models.registry import load_adapter
    from verl_digen.workers.training import PolicyUpdater, TrainSettings, add_lora
    from verl_digen.workers.worker import sampling_settings

    adapter = load_adapter(path)
    torch.manual_seed(0)  # the same LoRA initialisation for every micro-batch size
    add_lora(adapter, LoraConfigSpec(rank=4))
    settings = TrainSettings(algo=cfg.algo, sampling=sampling_settings(cfg), lora_only=True,
                             images_per_step=cfg.batch.images_per_optimizer_step)
    return PolicyUpdater(adapter, settings)


REWARDS = {0: torch.tensor([0.1, 0.9, 0.4, 0.2]), 1: torch.tensor([0.7, 0.3, 0.8, 0.6])}


def _task_advantages(groups: tuple[int, ...]) -> torch.Tensor:
    """What the executor hands a train task: its whole groups' rewards normalised within each group
    (``RayExecutor.advantages``), before any split into passes."""
    from verl_digen.algos.advantages import group_advantages

    rows = torch.cat([REWARDS[g] for g in groups])
    ids = torch.cat([torch.full((GROUP,), g, dtype=torch.long) for g in groups])
    return group_advantages(rows, ids)


def _train_mini_batch(path: str, cfg, data) -> tuple[list[torch.Tensor], list[torch.Tensor], list[dict]]:
    """The mini-batch as the plan trains it: tasks of ``train_micro_batch_groups`` whole groups,
    then one optimizer step; the accumulated gradients and the updated weights."""
    from verl_digen.workers.worker import select_groups

    updater = _updater(path, cfg)
    per_task = cfg.batch.train_micro_batch_groups
    metrics = []
    for first in range(0, GROUPS, per_task):
        groups = tuple(range(first, first + per_task))
        metrics.append(updater.train_micro_batch(select_groups((data,), list(groups)), _task_advantages(groups)))
    grads = [p.grad.detach().clone() for p in updater.params]
    updater.optimizer_step(None)
    return grads, [p.detach().clone() for p in updater.params], metrics


def test_a_mini_batchs_update_is_the_same_for_passes_of_2_rows_a_group_or_two_groups(tiny_flux):
    """The loss weighs each row by 1 / the mini-batch's images whatever pass it is in, so passes
    of 2 rows (half a group), one group per task and two groups per task give the same gradient
    and the same SGD step, to float rounding (the passes' transformer calls differ in rows)."""
    from verl_digen.workers.worker import sampling_settings

    data = _sample(tiny_flux, sampling_settings(_cfg()))
    runs = {name: _train_mini_batch(tiny_flux, cfg, data) for name, cfg in
            {"2 rows": _cfg(rows=2), "1 group": _cfg(), "2 groups": _cfg(groups=2)}.items()}
    assert [m["actor/passes"] for m in runs["2 rows"][2]] == [4.0, 4.0]  # 2 trained steps x 2 passes, per task
    assert [m["actor/passes"] for m in runs["1 group"][2]] == [2.0, 2.0]
    assert [m["actor/passes"] for m in runs["2 groups"][2]] == [4.0]  # one task, a 4-row pass per group
    grads, params, _ = runs["1 group"]
    assert max(float(g.abs().max()) for g in grads) > 1e-4  # a real update to compare
    for name in ("2 rows", "2 groups"):
        for a, b in zip(grads, runs[name][0], strict=True):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-9)
        for a, b in zip(params, runs[name][1], strict=True):
            torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-9)


def test_passes_take_rows_of_the_whole_groups_advantages(tiny_flux, monkeypatch):
    """A task of one group trained in 2-row passes: every pass gets 2 rows and their advantages
    are those of the whole group, normalised before the split (not renormalised per pass); an
    FSDP rank's share is whole calls of 2 rows with the same advantages."""
    from verl_digen.workers import training
    from verl_digen.workers.sampling import rank_rows
    from verl_digen.workers.worker import sampling_settings, select_groups

    cfg = _cfg(rows=2)
    data = select_groups((_sample(tiny_flux, sampling_settings(cfg)),), [1])
    updater = _updater(tiny_flux, cfg)
    seen = []
    loss = training.flow_grpo_loss

    def recorded(log_prob, old, adv, **kw):
        seen.append(adv.detach().clone())
        return loss(log_prob, old, adv, **kw)

    monkeypatch.setattr(training, "flow_grpo_loss", recorded)
    whole = _task_advantages((1,))
    updater.train_micro_batch(data, whole)
    assert [len(a) for a in seen] == [2] * 4  # 2 trained steps x 2 passes of 2 rows
    torch.testing.assert_close(torch.cat(seen[:2]), whole.float())  # one step's passes: the group, in order
    assert float(whole.mean()) == pytest.approx(0.0, abs=1e-6)  # normalised over the group of 4 ...
    assert abs(float(seen[0].mean())) > 0.1  # ... so a 2-row pass's own mean is not 0
    # two FSDP ranks of the 2-row calls: rank 0 rows 0, 1 and rank 1 rows 2, 3 of each group
    assert [rank_rows(8, 2, r, 2) for r in (0, 1)] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    two = _task_advantages((0, 1))
    torch.testing.assert_close(two[rank_rows(8, 2, 1, 2)], torch.cat([_task_advantages((0,))[2:], whole[2:]]))


def test_the_cost_model_and_the_memory_plan_charge_the_passes_the_workers_run(tiny_flux):
    """One number for the pass: the rows every worker trains (and samples) a call with, the
    memory plan's training pass and the cost model's passes (and rollout calls) of the spec the
    config fixes; a train task's modelled time is its passes of that many rows."""
    from verl_digen.memory.plan import _training_knobs, job_shape
    from verl_digen.schedule.strategies import StrategySpec
    from verl_digen.sim.cost_model import CostModel, load_catalog
    from verl_digen.sim.costs.phases import _passes
    from verl_digen.workers.worker import sampling_settings

    base = CostModel.from_catalog(load_catalog(), "flux-12b", devices=["H800"], lora=True)
    for rows in (None, 2, 1):
        cfg = _cfg(rows=rows, model={"arch": "flux"})
        spec = StrategySpec(placement="colocated", rollout_workers=1, trainer_workers=1,
                            **{k: v for k, v in cfg.strategy_fields().items() if k not in ("placement", "rollout_workers")})
        costs = base.with_workload(group_size=GROUP, groups_per_step=GROUPS).for_spec(spec)
        forward = sampling_settings(cfg).forward_rows
        assert forward == (rows or GROUP) == costs.workload.call_rows == job_shape(cfg, devices_per_node=1, nnodes=1).pass_samples
        assert list(_passes(GROUP, costs.workload.call_rows)) == [forward] * (GROUP // forward)
        # a trainer that does not fit is told of the key while its passes are above one row
        knobs = _training_knobs(job_shape(cfg, devices_per_node=1, nnodes=1))
        assert any(f"digen.batch.train_micro_batch_rows below {forward}" in k for k in knobs) is (forward > 1)
