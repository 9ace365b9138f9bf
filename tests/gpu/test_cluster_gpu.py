"""Cluster scale on a GPU node: the accelerator type Ray detects is what a typed pool asks for. The
placement rules: tests/unit/test_cluster.py; typed pools on real raylets: tests/e2e/test_cluster_e2e.py."""

from __future__ import annotations

import tempfile

import pytest
import ray
import torch

from verl_digen.placement.pools import assign_nodes, cluster_nodes


@pytest.mark.gpu
@pytest.mark.e2e
def test_a_gpu_nodes_detected_type_is_what_a_typed_pool_asks_for(tmp_path):
    """On a GPU machine Ray detects the card's type (H100, H200, ...) as ``accelerator_type:<type>``:
    cluster_nodes reads it, and a bundle built as the pools build theirs becomes ready."""
    from ray.util.placement_group import placement_group, remove_placement_group

    from verl_digen.placement.pools import accelerator_resource

    ray.init(num_gpus=1, num_cpus=2, include_dashboard=False, log_to_driver=False,
             _temp_dir=tempfile.mkdtemp(prefix="digen-ray-"))
    try:
        (node,) = cluster_nodes(ray.nodes(), "cuda")
        assert node.devices == 1 and len(node.accelerator_types) == 1, node
        (kind,) = node.accelerator_types
        assert kind in torch.cuda.get_device_name(0)  # "NVIDIA H100 80GB HBM3" -> "H100"
        assert assign_nodes({"rollout": 1}, [node], 1, {"rollout": kind}) == {"rollout": [node.node_id]}
        pg = placement_group([{"CPU": 1, "GPU": 1, accelerator_resource(kind): 1e-4}], strategy="PACK")
        ray.get(pg.ready(), timeout=60)
        remove_placement_group(pg)
    finally:
        ray.shutdown()
