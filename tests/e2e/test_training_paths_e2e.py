"""Training paths at scale, run: FSDP2 over the 2 fused workers of the colocated placement gives
plain data parallelism's update, and the gradients all-reduce in bounded buckets over ranks. The
paths in process: tests/unit/test_training_paths.py."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.e2e
@pytest.mark.slow
def test_colocated_fsdp_gives_the_data_parallel_update(shared_ray, tiny_flux, tmp_path):
    """FSDP2 over the 2 fused workers of the colocated placement (generation and micro-batches
    in lockstep), against plain colocated data parallelism with activation checkpointing: the
    same weights, so both the sharded colocated worker and checkpointing train correctly."""
    from safetensors.torch import load_file

    from runs import run, timeline_records

    common = [
        "trainer.n_gpus_per_node=2", "trainer.total_training_steps=2", "digen.save_final_weights=true",
        "digen.algo.optimizer=sgd", "digen.batch.groups_per_step=2", "digen.batch.group_size=2",
        "digen.sampling.num_steps=3",
    ]
    dp = run(tmp_path, "dp", *common, "digen.model.gradient_checkpointing=true")
    fsdp = run(tmp_path, "fsdp", *common, "digen.fsdp.enable=true")
    assert fsdp.strategy == "colocated+fsdp" and dp.strategy == "colocated"
    a, b = load_file(dp.extra["final_weights"]), load_file(fsdp.extra["final_weights"])
    assert a.keys() == b.keys()
    moved = max(float((a[k] - b[k]).abs().max()) for k in a)
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=1e-5)
    trains = [r for r in timeline_records(fsdp.output_dir) if r["kind"] == "train"]
    assert trains and all(r["worker"] == "fused0,fused1" for r in trains)
    print("colocated DP+checkpointing vs colocated FSDP, max |w diff|:", moved)


@pytest.mark.e2e
def test_gradients_all_reduce_in_bounded_buckets():
    from runs import run_ranks

    results = run_ranks(_bucket_scenario, world=2)
    for r in results.values():
        assert r["equal"] and r["calls"] == 3, r


def _bucket_scenario(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from verl_digen.workers.training import all_reduce_in_buckets

    g = torch.Generator().manual_seed(rank)
    grads = [torch.randn(n, generator=g) for n in (10, 20, 300, 5)]  # 40, 80, 1200, 20 bytes
    expected = [t.clone() for t in grads]
    for t in expected:
        dist.all_reduce(t)
    # 128-byte buckets: [10, 20] packed, 300 alone (larger than a bucket, reduced in place), [5].
    calls = all_reduce_in_buckets(grads, dist.group.WORLD, bucket_bytes=128)
    return {"equal": all(torch.equal(a, b) for a, b in zip(grads, expected)), "calls": calls}
