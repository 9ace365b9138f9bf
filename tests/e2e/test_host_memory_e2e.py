"""The allocator's configuration every worker starts with, read by a real pool's actor from its own
environment (with the user's own entries kept), and recorded at load. How it is made:
tests/unit/test_host_memory.py."""

from __future__ import annotations

import os

import pytest

from verl_digen.placement.pools import EXPANDABLE_SEGMENTS


@pytest.mark.e2e
def test_every_worker_process_starts_with_expandable_segments(shared_ray, tiny_flux, monkeypatch):
    """A real pool's actor reads its own environment: the configuration must be there before the
    process's first CUDA allocation, so the worker cannot set it itself. Its load record (the
    run's workers.json) carries what it held at load."""
    import ray
    from ray.util.placement_group import remove_placement_group

    from verl_digen.config.schema import digen_config_from_dict
    from verl_digen.placement.pools import ClusterSpec, build_worker_groups, pool_layout

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:256")
    cfg = digen_config_from_dict({"placement": "colocated"})
    layout = pool_layout(cfg, ClusterSpec(n_devices_per_node=1, nnodes=1))
    groups, actors = build_worker_groups(layout, config=cfg, model_path=tiny_flux, use_gpu=False, num_threads=1)
    try:
        (actor,) = actors.values()
        seen = ray.get(actor.__ray_call__.remote(lambda self: os.environ.get("PYTORCH_CUDA_ALLOC_CONF")), timeout=120)
        assert seen == "max_split_size_mb:256," + EXPANDABLE_SEGMENTS
        record = ray.get(actor.init_model.remote(), timeout=300)
        assert record["memory_at_load"]["host_peak_gib"] > 0.1  # torch, diffusers and the tiny model
    finally:
        for wg in groups.values():
            for w in wg.workers:
                ray.kill(w)
            for pg in wg.resource_pool.pgs:
                remove_placement_group(pg)
