"""TSP and TAG on real worker groups: exactness of the time-step pipeline and of the
time-step training split, and TAG's version rules. The stages in process:
tests/unit/test_tsp_tag.py."""

from __future__ import annotations

import dataclasses
import json

import pytest
import ray
import torch

from verl_digen.config.schema import digen_config_from_dict
from verl_digen.workers.messages import GenerateRequest
from runs import assert_same_final_weights, run, timeline_records
from test_tsp_tag import TENSORS


@pytest.mark.e2e
@pytest.mark.parametrize("stages", [2, 3])
def test_tsp_pipeline_of_worker_processes_matches_one_worker_bitwise(shared_ray, tiny_flux, stages):
    """Stage k runs on rollout worker k (separate processes); the in-flight state travels by Ray."""
    from ray.util.placement_group import remove_placement_group

    from verl_digen.placement.pools import ClusterSpec, build_worker_groups, pool_layout

    digen = {
        "placement": "disaggregated",
        "sampling": {"num_steps": 6, "sde_window": {"mode": "fixed", "start": 1, "size": 3}},
        "pools": {"rollout": {"devices": stages}, "trainer": {"devices": 1}},
        "tsp": {"stages": stages},
    }
    cfg = digen_config_from_dict(digen)
    layout = pool_layout(cfg, ClusterSpec(n_devices_per_node=stages + 1, nnodes=1))
    groups, actors = build_worker_groups(layout, config=cfg, model_path=tiny_flux, use_gpu=False, num_threads=1)
    try:
        rollout = [a for w, a in sorted(actors.items()) if w.pool == "rollout"]
        ray.get([a.init_model.remote() for a in rollout], timeout=300)
        request = GenerateRequest(group_ids=(2, 3), prompts=("a cat", "a dog"), prompt_indices=(0, 1),
                                  metadata=({}, {}), step=1, version=0)
        single = ray.get(rollout[0].generate.remote(request), timeout=300)
        bounds = layout.spec.bounds
        state = None
        for k, actor in enumerate(rollout):
            req = dataclasses.replace(request, denoise=(bounds[k], bounds[k + 1]))
            state = actor.generate.remote(req, *([state] if state is not None else []))
        staged = ray.get(state, timeout=300)
        for key in TENSORS:
            assert torch.equal(single.batch[key], staged.batch[key]), key
    finally:
        for wg in groups.values():
            for a in wg.workers:
                ray.kill(a)
            for pg in wg.resource_pool.pgs or []:
                remove_placement_group(pg)


@pytest.mark.e2e
def test_timestep_split_training_gives_the_sample_split_gradient(shared_ray, tiny_flux, tmp_path):
    common = [
        "digen.placement=disaggregated", "trainer.n_gpus_per_node=3", "digen.pools.rollout.devices=1",
        "digen.pools.trainer.devices=2", "trainer.total_training_steps=1", "digen.save_final_weights=true",
        "digen.gap.enable=true", "digen.algo.optimizer=sgd", "digen.batch.groups_per_step=2",
    ]
    by_sample = run(tmp_path, "sample", *common, "digen.tsp.train_split=sample")
    by_step = run(tmp_path, "timestep", *common, "digen.tsp.train_split=timestep")
    # Same per-step terms, summed in a different order across ranks: float rounding only.
    assert_same_final_weights(by_sample, by_step, atol=1e-7, rtol=1e-5)
    assert len([r for r in timeline_records(by_step.output_dir) if r["kind"] == "train"]) == 4  # 2 micro-batches x 2 ranks


@pytest.mark.e2e
def test_tsp_run_trains_and_keeps_every_invariant(shared_ray, tiny_flux, tmp_path):
    result = run(
        tmp_path, "tsp", "digen.placement=disaggregated", "trainer.n_gpus_per_node=3", "digen.pools.rollout.devices=2",
        "digen.tsp.stages=2", "digen.gap.enable=true", "trainer.total_training_steps=3", "digen.async.max_staleness=1",
        # As every preset: prompts encoded once, then the text encoders released. Stage balancing
        # profiles on a rollout worker, which then holds no encoder for a prompt it never cached.
        "digen.prompt_cache.enable=true", f"digen.prompt_cache.dir={tmp_path / 'prompt_cache'}",
    )
    with open(result.output_dir + "/tsp_stages.json") as f:
        profile = json.load(f)
    steps = len(profile["step_s"])  # every denoising step measured, then cut into 2 stage ranges
    assert steps == 8 and len(profile["bounds"]) == 3 and profile["bounds"][::2] == [0, steps]
    recs = timeline_records(result.output_dir)
    finals = sorted(g for r in recs if r["kind"] == "generate" and r["worker"] == "rollout1" for g in r["groups"])
    assert finals == list(range(12))  # every group went through the last stage once
    trained = sorted(g for r in recs if r["kind"] == "train" for g in r["groups"])
    assert trained == list(range(12))
    by_group: dict[int, set[int]] = {}
    for r in recs:
        if r["kind"] == "generate":
            for g in r["groups"]:
                by_group.setdefault(g, set()).add(r["version"])
    assert all(len(v) == 1 for v in by_group.values())  # one version per trajectory, across stages


@pytest.mark.e2e
def test_tag_groups_carry_the_trainer_version_and_are_trained_once(shared_ray, tiny_flux, tmp_path):
    # A 2-step SDE window of 24 denoising steps makes training cheap next to generation (about 40
    # against 120 ms a group on a quiet machine), so the trainer would idle: TAG should assist.
    # With the default 8 steps (40 against 70 ms) a loaded machine's noise in the measured rates
    # could make assisting look like it does not pay (seen once: no TAG group in 4 steps).
    result = run(
        tmp_path, "tag", "digen.placement=disaggregated", "digen.gap.enable=true", "digen.tag.enable=true",
        "trainer.total_training_steps=4", "digen.sampling.num_steps=24", "digen.sampling.sde_window.mode=fixed",
        "digen.sampling.sde_window.size=2", "digen.batch.groups_per_step=6",
    )
    recs = timeline_records(result.output_dir)
    on_trainer = [r for r in recs if r["kind"] == "generate" and r["worker"].startswith("trainer")]
    assert on_trainer, [m["tag/groups"] for m in result.metrics]
    assert all(r["version"] == r["step"] for r in on_trainer)  # the newest weights, never stale
    trained = sorted(g for r in recs if r["kind"] == "train" for g in r["groups"])
    assert trained == list(range(24))
    assert result.metrics[0]["tag/groups"] == 0  # nothing measured yet at the first step
    assert all("tag/train_per_group" in m for m in result.metrics[1:])


@pytest.mark.e2e
def test_fsdp_trainer_pool_gives_the_data_parallel_update(shared_ray, tiny_flux, tmp_path):
    """FSDP2 (fully_shard, gloo on CPU) over 2 trainer ranks, micro-batches in lockstep, each
    rank on half the samples: same weights as the plain data-parallel trainer, and rollout in sync."""
    common = [
        "digen.placement=disaggregated", "trainer.n_gpus_per_node=3", "digen.pools.rollout.devices=1",
        "digen.pools.trainer.devices=2", "trainer.total_training_steps=2", "digen.save_final_weights=true",
        "digen.gap.enable=true", "digen.algo.optimizer=sgd",
    ]
    dp = run(tmp_path, "dp", *common)
    fsdp = run(tmp_path, "fsdp", *common, "digen.fsdp.enable=true")
    assert fsdp.extra["weights_in_sync"] is True
    assert_same_final_weights(dp, fsdp, atol=1e-6, rtol=1e-5)
    gangs = [r for r in timeline_records(fsdp.output_dir) if r["kind"] == "train"]
    assert all(r["worker"] == "trainer0,trainer1" for r in gangs)


@pytest.mark.e2e
def test_tag_on_fsdp_trainers_generates_in_lockstep_and_gives_the_same_update(shared_ray, tiny_flux, tmp_path):
    """TAG on an FSDP trainer pool (gloo, 2 ranks): each rank generates as many sample slices (its
    forwards all-gather the sharded blocks, in lockstep with the other rank) with the weights it
    trains, and the run ends with the weights of the same run without TAG: the groups are the
    same samples wherever, and in whatever slices, they are generated."""
    common = [
        "digen.placement=disaggregated", "trainer.n_gpus_per_node=3", "digen.pools.rollout.devices=1",
        "digen.pools.trainer.devices=2", "trainer.total_training_steps=3", "digen.save_final_weights=true",
        "digen.gap.enable=true", "digen.algo.optimizer=sgd", "digen.fsdp.enable=true",
        "digen.batch.groups_per_step=6",
    ]
    plain = run(tmp_path, "plain", *common)
    tag = run(tmp_path, "tag", *common, "digen.tag.enable=true", "digen.tag.groups=4")
    assert tag.extra["weights_in_sync"] is True
    assert_same_final_weights(plain, tag, atol=1e-6, rtol=1e-5)
    recs = timeline_records(tag.output_dir)
    on_trainer = [r for r in recs if r["kind"] == "generate" and r["worker"].startswith("trainer")]
    # every group of the share is cut into one equal sample slice per rank (whole calls)
    per_rank = {(s, w): sorted((g, *r["extra"]["samples"]) for r in on_trainer if r["step"] == s and r["worker"] == w
                               for g in r["groups"]) for s in range(3) for w in ("trainer0", "trainer1")}
    for s in range(3):
        last = range(6 * s + 2, 6 * s + 6)  # the step's last 4 groups
        assert per_rank[(s, "trainer0")] == [(g, 0, 2) for g in last], per_rank
        assert per_rank[(s, "trainer1")] == [(g, 2, 4) for g in last], per_rank
    assert all(r["version"] == r["step"] for r in on_trainer)
    assert [m["tag/groups"] for m in tag.metrics] == [4, 4, 4]
    trained = sorted(g for r in recs if r["kind"] == "train" for g in r["groups"])
    assert trained == list(range(18))


@pytest.mark.e2e
def test_tcss_with_tag_generates_the_next_step_ahead_but_the_trainers_share(shared_ray, tiny_flux, tmp_path):
    """The one-step-off pipeline with TAG on FSDP trainers: rollout generates every group of
    step k+1 but the trainers' share with version k while step k trains; the trainers generate
    their share with version k+1 after their optimizer step; every group trains once."""
    result = run(
        tmp_path, "tcss_tag", "digen.placement=disaggregated", "trainer.n_gpus_per_node=3",
        "digen.pools.rollout.devices=1", "digen.pools.trainer.devices=2", "trainer.total_training_steps=3",
        "digen.gap.enable=true", "digen.fsdp.enable=true", "digen.batch.groups_per_step=6",
        "digen.async.max_staleness=1", "digen.tag.enable=true", "digen.tag.groups=2",
    )
    recs = timeline_records(result.output_dir)
    gens = [r for r in recs if r["kind"] == "generate"]
    for step in range(3):
        on_trainer = sorted({g for r in gens if r["step"] == step and r["worker"].startswith("trainer") for g in r["groups"]})
        on_rollout = sorted(g for r in gens if r["step"] == step and r["worker"] == "rollout0" for g in r["groups"])
        assert on_trainer == [6 * step + 4, 6 * step + 5]  # the step's last groups, a slice of each per rank
        assert on_rollout == list(range(6 * step, 6 * step + 4))
        # step 0 has no step before it to be generated during; later steps were, on the old weights
        assert {r["version"] for r in gens if r["step"] == step and r["worker"] == "rollout0"} == {max(step - 1, 0)}
    assert all(r["version"] == r["step"] for r in gens if r["worker"].startswith("trainer"))
    assert max(m["max_staleness_seen"] for m in result.metrics) == 1
    trained = sorted(g for r in recs if r["kind"] == "train" for g in r["groups"])
    assert trained == list(range(18))
