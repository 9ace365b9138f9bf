"""Training passes smaller than a group in a whole run (``digen.batch.train_micro_batch_rows``):
the workers, the FSDP gang's row chunks and the plan take the key. The passes' equality on one
process: tests/unit/test_micro_batch_rows.py."""

from __future__ import annotations

import pytest


@pytest.mark.e2e
@pytest.mark.slow
def test_a_run_in_one_row_passes_over_fsdp_trainers_gives_the_whole_group_update(shared_ray, tiny_flux, tmp_path):
    """2 rollout workers and 2 FSDP trainers, micro-batches of one group of 4: each rank trains its
    2 rows in one pass (the default) or in two passes of 1 row (and the rollout samples in 1-row
    calls). The metrics count the passes and the final weights equal the default run's to float
    rounding (the calls' rows differ, so the trajectories do too, by rounding; SGD)."""
    from runs import assert_same_final_weights, run

    common = ["digen.placement=disaggregated", "digen.gap.enable=true", "trainer.total_training_steps=2",
              "digen.batch.groups_per_step=2", "digen.batch.group_size=4", "digen.fsdp.enable=true",
              "trainer.n_gpus_per_node=4", "digen.pools.rollout.devices=2", "digen.pools.trainer.devices=2",
              "digen.save_final_weights=true", "digen.algo.optimizer=sgd"]
    whole = run(tmp_path, "whole", *common)
    rows = run(tmp_path, "rows", *common, "digen.batch.train_micro_batch_rows=1")
    passes = {name: [m["actor/passes"] for m in r.metrics if "actor/passes" in m]
              for name, r in (("whole", whole), ("rows", rows))}
    assert passes["whole"] and passes["rows"] == [2 * p for p in passes["whole"]], passes
    norms = [m["actor/grad_norm"] for r in (whole, rows) for m in r.metrics if "actor/grad_norm" in m]
    assert len(norms) == 4 and min(norms) > 0  # two steps each, with something to update
    # measured: 2e-10 apart, weights up to 0.5
    assert_same_final_weights(whole, rows, atol=1e-6, rtol=1e-4)
