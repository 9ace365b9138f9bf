"""Cluster scale (issue 11): joining an existing Ray cluster, pools placed per node. Placement on
listed nodes and the device checks here; real raylets in tests/e2e/test_cluster_e2e.py, a GPU
node's accelerator type in tests/gpu/test_cluster_gpu.py."""

from __future__ import annotations

import pytest
import ray

from verl_digen.config.schema import ConfigError
from verl_digen.placement.pools import (
    ClusterSpec,
    RayNode,
    assign_nodes,
    check_accelerator_types,
    check_cluster,
    cluster_nodes,
    node_counts,
)
from verl_digen.platform.nodes import PlacementError


# ----------------------------------------------------------------------------- placement


def _nodes(*devices: int) -> list[RayNode]:
    return [RayNode(f"node{i}", d) for i, d in enumerate(devices)]


def test_the_cluster_must_offer_nnodes_times_n_gpus_per_node():
    assert [n.node_id for n in check_cluster(_nodes(8, 8, 8), ClusterSpec(8, 2), "cuda")] == ["node0", "node1"]
    with pytest.raises(ConfigError, match=r"trainer.nnodes=2 x trainer.n_gpus_per_node=8.*1 such node.*node0: 8, node1: 4"):
        check_cluster(_nodes(8, 4), ClusterSpec(8, 2), "cuda")
    with pytest.raises(ConfigError, match="CPU slots"):
        check_cluster(_nodes(1), ClusterSpec(2, 1), "cpu")


def test_device_counts_come_from_the_cluster_resources_of_alive_nodes():
    listed = [{"NodeID": "a", "Alive": True, "Resources": {"CPU": 16.0, "GPU": 8.0}},
              {"NodeID": "b", "Alive": False, "Resources": {"CPU": 16.0, "GPU": 8.0}},
              {"NodeID": "c", "Alive": True, "Resources": {"CPU": 4.0}}]
    assert cluster_nodes(listed, "cuda") == [RayNode("a", 8), RayNode("c", 0)]
    assert cluster_nodes(listed, "cpu") == [RayNode("a", 16), RayNode("c", 4)]


def test_the_trainer_pool_is_packed_on_as_few_nodes_as_possible():
    placed = assign_nodes({"rollout": 6, "trainer": 6, "reward": 4}, _nodes(8, 8), per_node=8)
    assert placed["trainer"] == ["node0"] * 6  # one node: NVLink for its collectives
    every = placed["trainer"] + placed["rollout"] + placed["reward"]
    assert every.count("node0") == every.count("node1") == 8  # the rest anywhere, every device used
    across = assign_nodes({"trainer": 12, "rollout": 4}, _nodes(8, 8), per_node=8)
    assert across["trainer"] == ["node0"] * 8 + ["node1"] * 4


def test_pools_of_any_size_fill_part_of_a_node_and_share_it():
    """10 rollout + 22 trainers on 4 x 8: the trainers fill two nodes and 6 devices of a third,
    whose 2 free devices and the fourth node take the rollout workers; every device is used once."""
    placed = assign_nodes({"rollout": 10, "trainer": 22}, _nodes(8, 8, 8, 8), per_node=8)
    assert placed["trainer"] == ["node0"] * 8 + ["node1"] * 8 + ["node2"] * 6
    assert sorted(placed["rollout"]) == ["node2"] * 2 + ["node3"] * 8
    assert node_counts({"rollout": 10, "trainer": 22}, 8, 4) == {"trainer": (8, 8, 6, 0), "rollout": (0, 0, 2, 8)}
    assert node_counts({"rollout": 3, "trainer": 5, "reward": 1}, 8, 2) == {
        "trainer": (5, 0), "rollout": (0, 3), "reward": (0, 1)}  # each to the node with most free devices
    with pytest.raises(PlacementError, match="need 33 devices but the nodes offer 32"):
        node_counts({"rollout": 11, "trainer": 22}, 8, 4)
    with pytest.raises(ConfigError, match="invalid config: the pools need 33 devices but the nodes offer 32"):
        assign_nodes({"rollout": 11, "trainer": 22}, _nodes(8, 8, 8, 8), per_node=8)


def test_rollout_workers_spread_over_the_free_devices():
    placed = assign_nodes({"rollout": 2, "trainer": 1}, _nodes(2, 2), per_node=2)
    assert placed == {"trainer": ["node0"], "rollout": ["node1", "node0"]}


def _typed(*nodes: tuple[int, str]) -> list[RayNode]:
    return [RayNode(f"node{i}", d, frozenset([t]) if t else frozenset()) for i, (d, t) in enumerate(nodes)]


def test_accelerator_types_come_from_rays_accelerator_type_resources():
    listed = [{"NodeID": "a", "Alive": True, "Resources": {"GPU": 8.0, "accelerator_type:H100": 1.0}},
              {"NodeID": "b", "Alive": True, "Resources": {"GPU": 8.0, "accelerator_type:L40S": 1.0, "L40S": 1.0}},
              {"NodeID": "c", "Alive": True, "Resources": {"CPU": 4.0}}]
    assert [n.accelerator_types for n in cluster_nodes(listed, "cuda")] == [
        frozenset({"H100"}), frozenset({"L40S"}), frozenset()]  # a bare "L40S" resource is not Ray's type


def test_a_typed_pool_goes_only_to_nodes_of_its_type():
    nodes = _typed((4, "H100"), (4, "L40S"), (4, "L40S"))
    placed = assign_nodes({"rollout": 6, "trainer": 4}, nodes, per_node=4, pool_types={"rollout": "L40S"})
    assert sorted(placed["rollout"]) == ["node1"] * 3 + ["node2"] * 3
    assert placed["trainer"] == ["node0"] * 4  # untyped: what the typed pool left
    both = assign_nodes({"rollout": 2, "trainer": 2}, nodes[:2], per_node=4,
                        pool_types={"rollout": "accelerator_type:L40S", "trainer": "H100"})  # Ray's spelling too
    assert both == {"trainer": ["node0"] * 2, "rollout": ["node1"] * 2}
    # without types the trainer would take the first node whatever it is: the sim's rule is unchanged
    assert assign_nodes({"rollout": 4, "trainer": 4}, nodes[:2], per_node=4)["trainer"] == ["node0"] * 4


def test_a_type_no_node_has_is_refused_naming_the_key_and_the_types_there_are():
    nodes = _typed((4, "H100"), (4, "L40S"), (4, None))
    with pytest.raises(ConfigError, match=r"digen.pools.rollout.accelerator_type='A100'; no node .* "
                                          r"'accelerator_type:A100'. Accelerator types of its nodes: H100, L40S"):
        assign_nodes({"rollout": 1, "trainer": 1}, nodes, per_node=4, pool_types={"rollout": "A100"})
    with pytest.raises(ConfigError, match=r"digen.pools.rollout.accelerator_type='L40S': the rollout pool needs 5 "
                                          r"devices of that type but its nodes have 4 free"):
        assign_nodes({"rollout": 5, "trainer": 1}, nodes, per_node=4, pool_types={"rollout": "L40S"})
    with pytest.raises(ConfigError, match="Accelerator types of its nodes: none"):
        check_accelerator_types({"trainer": "H800"}, _nodes(8))


def test_the_nodes_the_job_uses_include_those_of_the_wanted_types():
    nodes = _typed((8, "H100"), (8, "H100"), (8, "L40S"))
    chosen = check_cluster(nodes, ClusterSpec(8, 2), "cuda", frozenset({"L40S"}))
    assert [n.node_id for n in chosen] == ["node2", "node0"]
    assert [n.node_id for n in check_cluster(nodes, ClusterSpec(8, 2), "cuda")] == ["node0", "node1"]


def test_a_typed_pools_bundles_ask_for_rays_resource_name():
    from verl_digen.placement.pools import accelerator_resource, pool_layout
    from verl_digen.config.schema import digen_config_from_dict

    cfg = digen_config_from_dict({"placement": "disaggregated", "pools": {
        "rollout": {"devices": 1, "accelerator_type": "L40S"}, "trainer": {"devices": 1}}})
    layout = pool_layout(cfg, ClusterSpec(2, 1))
    assert layout.accelerator_types == {"rollout": "L40S", "trainer": None}
    assert accelerator_resource("L40S") == accelerator_resource("accelerator_type:L40S") == "accelerator_type:L40S"
    from ray._common.utils import RESOURCE_CONSTRAINT_PREFIX  # Ray's own prefix, as the raylet sets it

    assert accelerator_resource("L40S") == RESOURCE_CONSTRAINT_PREFIX + "L40S"


# ----------------------------------------------------------------------------- device kind


def test_the_device_kind_comes_from_the_cluster_not_the_driver():
    from verl_digen.trainer.runtime import device_kind

    assert device_kind("cuda", 16.0) == "cuda"  # a GPU cluster, whatever the driver's node has
    assert device_kind("cuda", 0.0) == "cpu"  # no GPU anywhere: CPU slots, said once
    assert device_kind("cpu", 16.0) == "cpu"
    with pytest.raises(ConfigError, match=r"trainer.device='tpu'; valid: cuda, cpu"):
        device_kind("tpu", 0.0)


def test_an_unknown_trainer_device_is_refused_before_ray_starts(tmp_path):
    from runs import run_config
    from verl_digen.trainer.loop import DigenTrainer

    with pytest.raises(ConfigError, match=r"trainer.device='npu'"):
        DigenTrainer(run_config(tmp_path, "npu", "trainer.device=npu"))
    assert not ray.is_initialized()
