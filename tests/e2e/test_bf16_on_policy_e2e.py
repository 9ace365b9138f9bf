"""bf16 on-policy exactness, sharded and in whole runs: the trainer's recomputed log-probs equal the
rollout's behaviour log-probs for every family with the trainer FSDP2-sharded over 2 gloo ranks,
at every step of a short bf16 run, and in a bf16 full fine-tune across a weight sync. How the
exactness is kept, the unsharded case and the helpers used here: tests/unit/test_bf16_on_policy.py."""

from __future__ import annotations

import pytest
import torch

from runs import run_ranks
from test_bf16_on_policy import (
    ADVANTAGES,
    ARCHS,
    GROUP_SIZE,
    GROUPS,
    TOL,
    _bf16_lora_adapter,
    _on_policy,
    _rollout,
    _settings,
    _updater,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def _sharded_scenario(rank: int, world: int) -> dict:
    """Every family: the rollout on an unsharded bf16 copy, the trainer on an FSDP2-sharded one
    (the workers' sharding), each rank on its share of a micro-batch, at 1 and 2 groups per
    micro-batch. Returns each rank's |logp - logp_old| and loss metrics."""
    import os

    from verl_digen.models.tiny import ensure_tiny
    from verl_digen.workers.fsdp import shard_for_training
    from verl_digen.workers.sampling import rank_rows

    cache = os.path.join(os.environ["VERL_DIGEN_CACHE"], "tiny")
    out = {}
    for arch in ARCHS:
        path = ensure_tiny(arch, cache)
        rollout = _bf16_lora_adapter(path)
        trainer = _bf16_lora_adapter(path)
        shard_for_training(trainer.transformer)
        for micro_batch_groups in (1, 2):
            settings = _settings(arch, micro_batch_groups, ranks=world)
            data = _rollout(rollout, settings)
            updater = _updater(trainer, settings)
            rows = micro_batch_groups * GROUP_SIZE
            for start in range(0, len(data), rows):
                mine = [start + i for i in rank_rows(rows, settings.forward_rows, rank, world)]
                result = _on_policy(updater, data.select_idxs(mine), ADVANTAGES[mine])
                out[f"{arch}/mb{micro_batch_groups}/{start}"] = result
            updater.optimizer.zero_grad(set_to_none=True)
    return out


@pytest.mark.e2e
@pytest.mark.slow
def test_fsdp_bf16_recompute_is_exact_for_every_family(tiny_dirs):
    for arch in ARCHS:  # built once here, so that the ranks only load them
        tiny_dirs[arch]
    results = run_ranks(_sharded_scenario, world=2, timeout_s=600)
    assert results[0].keys() == results[1].keys()
    diffs = []
    for rank, per_case in results.items():
        for case, out in per_case.items():
            diffs += out["diffs"]
            assert out["max"] <= TOL, (rank, case, out["max"])
            assert out["clip_frac"] == 0.0 and abs(out["ratio_mean"] - 1.0) <= TOL, (rank, case, out)
    d = torch.tensor(diffs)
    print("FSDP |logp - logp_old| over", d.numel(), "values: max", float(d.max()), "quantiles(.5,.9,.99)",
          torch.quantile(d, torch.tensor([0.5, 0.9, 0.99])).tolist())


RUNS = {
    # SD3 with true CFG, FSDP over 2 trainer ranks (one row per rank and transformer call).
    "sd3-disaggregated-fsdp": [
        "digen.model.tiny_arch=sd3", "digen.sampling.guidance_scale=4.5", "digen.placement=disaggregated",
        "trainer.n_gpus_per_node=3", "digen.pools.rollout.devices=1", "digen.pools.trainer.devices=2",
        "digen.fsdp.enable=true", "digen.gap.enable=true",
    ],
    # HunyuanVideo (batch-size-sensitive kernels), 2 groups per micro-batch, FSDP over the 2
    # fused workers of the colocated placement, activation checkpointing.
    "hunyuan_video-colocated-fsdp": [
        "digen.model.tiny_arch=hunyuan_video", "digen.sampling.num_frames=5", "trainer.n_gpus_per_node=2",
        "digen.batch.train_micro_batch_groups=2", "digen.fsdp.enable=true", "digen.model.gradient_checkpointing=true",
    ],
}


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.parametrize("name", list(RUNS))
def test_short_bf16_run_is_on_policy_at_every_step(name, shared_ray, tiny_dirs, tmp_path):
    from runs import run

    result = run(
        tmp_path, name, "digen.model.dtype=bf16", "trainer.total_training_steps=2", "digen.sampling.num_steps=3",
        "digen.batch.groups_per_step=2", "digen.batch.group_size=2", *RUNS[name],
    )
    assert len(result.metrics) == 2
    for m in result.metrics:
        assert m["max_staleness_seen"] == 0
        assert m["actor/clip_frac"] == 0.0, (name, m["step"], m["actor/clip_frac"])
        assert abs(m["actor/ratio_mean"] - 1.0) <= TOL, (name, m["step"], m["actor/ratio_mean"])


def _full_fine_tune_scenario(rank: int, world: int) -> dict:
    """bf16 full fine-tune of FLUX under FSDP2 (fp32 masters of the local shards, a sharded bf16
    KL reference), two steps: on-policy exactly at each, the rollout taking the streamed sync
    state between them, as a disaggregated run does."""
    import copy
    import os

    from verl_digen.config.schema import AlgoConfig
    from verl_digen.models.registry import load_adapter
    from verl_digen.models.tiny import ensure_tiny
    from verl_digen.sync.state import load_trainable_state
    from verl_digen.workers.fsdp import shard_for_training, stream_full_state
    from verl_digen.workers.sampling import rank_rows
    from verl_digen.workers.training import PolicyUpdater, TrainSettings

    path = ensure_tiny("flux", os.path.join(os.environ["VERL_DIGEN_CACHE"], "tiny"))
    rollout = load_adapter(path, dtype=torch.bfloat16)
    trainer = load_adapter(path, dtype=torch.bfloat16)
    reference = copy.deepcopy(trainer.transformer).requires_grad_(False).eval()
    for module in (trainer.transformer, reference):
        shard_for_training(module)
    settings = _settings("flux", 1, ranks=world)
    updater = PolicyUpdater(
        trainer, TrainSettings(algo=AlgoConfig(lr=1e-3, kl_beta=0.01), sampling=settings, lora_only=False,
                               images_per_step=GROUPS * GROUP_SIZE),
        reference=reference,
    )
    out = {"master_dtypes": sorted({str(m.dtype) for m in updater.master.masters}), "steps": []}
    for step in range(2):
        data = _rollout(rollout, settings)
        for start in range(0, len(data), GROUP_SIZE):
            mine = [start + i for i in rank_rows(GROUP_SIZE, settings.forward_rows, rank, world)]
            result = _on_policy(updater, data.select_idxs(mine), ADVANTAGES[mine])
            out["steps"].append({k: result[k] for k in ("max", "ratio_mean", "clip_frac")})
        updater.optimizer_step(None)
        # The sync state as the trainer streams it (gathered bucket by bucket), loaded as it arrives.
        load_trainable_state(rollout.transformer, dict(stream_full_state(trainer.transformer, lora_only=False)),
                             lora_only=False)
    return out


@pytest.mark.e2e
@pytest.mark.slow
def test_fsdp_bf16_full_fine_tune_stays_on_policy_across_a_sync(tiny_flux):
    results = run_ranks(_full_fine_tune_scenario, world=2, timeout_s=600)
    for rank, out in results.items():
        assert out["master_dtypes"] == ["torch.float32"]
        assert len(out["steps"]) == 4
        for s in out["steps"]:
            assert s["max"] <= TOL and s["clip_frac"] == 0.0 and abs(s["ratio_mean"] - 1.0) <= TOL, (rank, s)
