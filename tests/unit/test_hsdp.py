"""HSDP (FSDP2 over a 2-D ``("replicate", "shard")`` mesh) for trainer pools that span nodes, and
the gradient reduction dtype: the layout each placement gets, and what the cost model and memory
planner charge. The same training as flat FSDP and sharded checkpoints that resume bitwise, on
4 gloo ranks as 2 "nodes" of 2, and the memory plan of a real layout:
tests/e2e/test_hsdp_e2e.py."""

from __future__ import annotations

import pytest

from verl_digen.config.schema import ConfigError
from verl_digen.memory.fsdp_layout import (
    choose_layout,
    mesh_shape,
    reduce_buffer_bytes,
    reduce_dtype,
    reduce_traffic,
)


# ---------------------------------------------------------------------- layout (fast)


def test_two_nodes_give_hsdp_with_one_replica_per_node():
    layout = choose_layout(["a", "b", "a", "b"], mesh="auto", reduce="auto", lora=False, weights_dtype="bf16")
    assert layout.hsdp and (layout.replicas, layout.shard) == (2, 2)
    assert layout.rows == ((0, 2), (1, 3))  # rows are nodes, whatever the rank order
    assert layout.reduce_dtype == "bf16"


def test_one_node_or_uneven_nodes_stay_flat_under_auto():
    one = choose_layout(["a"] * 4, mesh="auto", reduce="auto", lora=False, weights_dtype="bf16")
    assert not one.hsdp and one.rows == ((0, 1, 2, 3),)
    assert mesh_shape([8, 2], "auto") == (1, 10)
    assert mesh_shape([6, 6], "flat") == (1, 12)
    assert mesh_shape([6, 6], "auto") == (2, 6)


def test_forced_hsdp_that_cannot_be_built_names_the_key_and_the_fix():
    with pytest.raises(ConfigError, match=r"digen\.fsdp\.mesh=hsdp.*\[8, 2\] per node.*digen\.pools\.trainer"):
        mesh_shape([8, 2], "hsdp")
    with pytest.raises(ConfigError, match=r"digen\.fsdp\.mesh=hsdp.*one node"):
        mesh_shape([4], "hsdp")
    with pytest.raises(ConfigError, match=r"digen\.fsdp\.mesh='ring'"):
        mesh_shape([4], "ring")


def test_reduce_dtype_is_bf16_only_for_a_bf16_full_fine_tune_and_refused_for_lora():
    assert reduce_dtype("auto", lora=False, weights_dtype="bf16") == "bf16"
    assert reduce_dtype("auto", lora=False, weights_dtype="fp32") == "fp32"
    assert reduce_dtype("auto", lora=True, weights_dtype="bf16") == "fp32"
    assert reduce_dtype("fp32", lora=False, weights_dtype="bf16") == "fp32"
    with pytest.raises(ConfigError, match=r"digen\.fsdp\.reduce_dtype=bf16 with digen\.model\.lora\.enable=true"):
        reduce_dtype("bf16", lora=True, weights_dtype="bf16")


def test_config_validates_the_fsdp_keys():
    from verl_digen.config import digen_config_from_dict

    with pytest.raises(ConfigError, match=r"digen\.fsdp\.mesh='2d'"):
        digen_config_from_dict({"fsdp": {"enable": True, "mesh": "2d"}})
    with pytest.raises(ConfigError, match=r"digen\.fsdp\.reduce_dtype=bf16"):
        digen_config_from_dict({"fsdp": {"enable": True, "reduce_dtype": "bf16"}, "model": {"lora": {"enable": True}}})


def test_a_trainer_pool_that_cannot_be_hsdp_is_refused_before_anything_starts():
    from verl_digen.config import digen_config_from_dict
    from verl_digen.placement.pools import ClusterSpec, pool_layout

    digen = {"placement": "disaggregated", "fsdp": {"enable": True, "mesh": "hsdp"},
             "pools": {"rollout": {"devices": 2}, "trainer": {"devices": 10}},
             "batch": {"group_size": 8, "groups_per_step": 10, "train_micro_batch_groups": 5}}
    cfg = digen_config_from_dict(digen)
    with pytest.raises(ConfigError, match=r"digen\.fsdp\.mesh=hsdp.*\[8, 2\]"):
        pool_layout(cfg, ClusterSpec(n_devices_per_node=8, nnodes=2))
    # the trainer pool packed first on whole nodes: 8 + 8, HSDP 2 x 8
    digen["pools"]["trainer"], digen["batch"]["train_micro_batch_groups"] = {"devices": 16}, 2
    layout = pool_layout(digen_config_from_dict(digen), ClusterSpec(n_devices_per_node=8, nnodes=3))
    assert mesh_shape(layout.pools["trainer"][0], "hsdp") == (2, 8)


def test_reduce_traffic_and_buffers():
    p = 1_000_000
    flat = reduce_traffic(p, replicas=1, shard=12, reduce_bytes=4)
    assert flat.reduce_scatter == pytest.approx(4 * p * 11 / 12) and flat.all_reduce == 0
    hsdp = reduce_traffic(p, replicas=2, shard=6, reduce_bytes=2)
    assert hsdp.reduce_scatter == pytest.approx(2 * p * 5 / 6)
    assert hsdp.all_reduce == pytest.approx(2 * (1 / 2) * 2 * p / 6)
    assert reduce_buffer_bytes(p, replicas=2, shard=6, reduce_bytes=2) == pytest.approx(2 * p * (1 + 1 / 6))
    assert reduce_buffer_bytes(p, replicas=1, shard=1, reduce_bytes=4) == 0


# ---------------------------------------------------------------------- what the planner charges


def _preset_costs(*overrides: str):
    """The cost model of ``qwen_image_full_disaggregated`` (20.4B, full fine-tune, bf16) at real
    size on H100s, the cluster the runtime places it on, the layout its trainer ranks build there
    (the worker's decision, from the nodes they sit on) and the memory planner's layout of the
    same config (``fsdp_layout_of``)."""
    import os

    from omegaconf import OmegaConf

    from verl_digen.config.compose import compose_config
    from verl_digen.config.schema import digen_config_from_dict
    from verl_digen.memory.plan import fsdp_layout_of
    from verl_digen.placement.pools import ClusterSpec, pool_layout
    from verl_digen.sim.cost_model import CostModel, load_catalog
    from verl_digen.workers.emulated import cluster_for_layout

    configs = os.path.join(os.path.dirname(__file__), "..", "..", "configs")
    cfg = compose_config(list(overrides), config_name="qwen_image_full_disaggregated", config_dir=configs)
    digen = digen_config_from_dict(OmegaConf.to_container(cfg.digen, resolve=True))
    layout = pool_layout(digen, ClusterSpec(cfg.trainer.n_gpus_per_node, cfg.trainer.nnodes))
    cluster = cluster_for_layout(layout, "H100")
    costs = CostModel.from_catalog(load_catalog(), "qwen-image-20b", devices=["H100"], lora=False).for_spec(layout.spec)
    nodes = [f"node{i}" for i, n in enumerate(layout.pools["trainer"][0]) for _ in range(n)]
    built = choose_layout(nodes, mesh=digen.fsdp.mesh, reduce=digen.fsdp.reduce_dtype, lora=digen.model.lora.enable,
                          weights_dtype=digen.model.dtype)
    planned = fsdp_layout_of(digen, cfg.trainer.n_gpus_per_node, cfg.trainer.nnodes)
    return costs, cluster, built, planned


WHOLE_NODES = ("trainer.nnodes=3", "digen.pools.trainer.nodes=null", "digen.pools.trainer.devices=16",
               "digen.batch.train_micro_batch_groups=2")  # the trainer pool packed 8 + 8 on two nodes


def test_qwen_image_full_disaggregated_reduces_half_the_bytes_per_pass_at_real_size():
    from dataclasses import replace

    costs, cluster, built, planned = _preset_costs()
    group = costs._plain_train_group(cluster)  # the pool's shape (the memory decisions are the e2e test's)
    moved = costs.fsdp_pass_bytes(group)
    # 12 trainer ranks packed 8 + 4 on the two nodes: not one replica per node, so flat, in bf16
    assert not built.hsdp and built.shard == 12 and built.reduce_dtype == "bf16"
    assert (group.shard, group.hsdp_per_pass) == (12, False) and planned == (1, 12, 2)
    expected = reduce_traffic(costs.trainable_params, replicas=built.replicas, shard=built.shard,
                              reduce_bytes=built.reduce_bytes)
    assert moved["reduce_scatter"] == pytest.approx(expected.reduce_scatter) and moved["all_reduce"] == 0
    fp32 = costs.with_system(replace(costs.system, grad_reduce_dtype="fp32")).fsdp_pass_bytes(group)
    gib = 1 << 30
    assert fp32["reduce_scatter"] / gib == pytest.approx(69.7, abs=0.1)  # 20.4e9 x 4 B x 11/12: before
    assert moved["reduce_scatter"] / gib == pytest.approx(34.8, abs=0.1)  # the same in bf16


def test_a_trainer_pool_of_whole_nodes_is_hsdp_in_the_cost_model():
    from dataclasses import replace

    costs, cluster, built, planned = _preset_costs(*WHOLE_NODES)
    group = costs._plain_train_group(cluster)
    assert built.hsdp and (built.replicas, built.shard) == (2, 8) and planned == (2, 8, 2)
    assert (group.replicas, group.shard, group.shard_nodes, group.hsdp_per_pass) == (2, 8, 1, True)
    moved = costs.fsdp_pass_bytes(group)
    p, gib = costs.trainable_params, 1 << 30
    expected = reduce_traffic(p, replicas=2, shard=8, reduce_bytes=built.reduce_bytes)
    assert moved["reduce_scatter"] == pytest.approx(expected.reduce_scatter)  # within a node, bf16
    assert moved["all_reduce"] == pytest.approx(expected.all_reduce)  # the 1/8 shard across the 2 nodes
    assert moved["all_reduce"] / gib == pytest.approx(2 * p / 8 / gib) and moved["all_reduce"] / gib < 5
    # flat over 16 ranks on 2 nodes: every collective a ring over the network
    flat = costs.with_system(replace(costs.system, fsdp_mesh="flat"))
    flat_group = flat._plain_train_group(cluster)
    assert flat_group.shard_nodes == 2
    dev = costs.device(cluster.placement("trainer").device)
    assert costs.fsdp_comm_seconds(dev, group) < flat.fsdp_comm_seconds(dev, flat_group)


def test_a_job_that_does_not_fit_under_hsdp_names_the_flat_mesh():
    from dataclasses import replace

    from verl_digen.memory.plan import _training_knobs, workload_job

    job = workload_job(family="qwen_image", height=512, width=512, num_frames=1, num_steps=16, cfg_rows=2,
                       group_size=8, groups_per_task=1, micro_batch_samples=16, pass_samples=1, lora=False,
                       lora_rank=32, kl_reference=False, placement="disaggregated", rollout_devices=8,
                       trainer_devices=16, reward_devices=0, fsdp=8, reward_bytes=0, trainers_generate=False,
                       trainers_score=False, rollouts_train=False, fsdp_replicas=2, grad_reduce_bytes=2)
    knobs = " | ".join(_training_knobs(job))
    assert "digen.fsdp.mesh=flat (shards the training state 16 ways instead of HSDP's 8" in knobs
    assert "digen.fsdp.mesh" not in " | ".join(_training_knobs(replace(job, fsdp=16, fsdp_replicas=1)))
