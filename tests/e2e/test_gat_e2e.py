"""GAT, generator-assisted training, in real runs on Ray workers, on-policy and one-step-off: the
same final weights as without GAT (with FSDP trainers too), and a share decided from the rates
the run measures. The updater, the plan, the decision and the config rules:
tests/unit/test_gat.py."""

from __future__ import annotations

import pytest


# ----------------------------------------------------------------------------- a real run


@pytest.mark.e2e
@pytest.mark.parametrize("staleness,trainers,mini_batches", [(0, 1, 1), (1, 1, 1), (0, 2, 1), (0, 1, 2)],
                         ids=["on-policy", "one-step-off", "two-trainers", "two-mini-batches"])
def test_a_gat_run_gives_the_trainers_update(shared_ray, tiny_flux, tmp_path, staleness, trainers, mini_batches):
    """1 rollout worker, 2 micro-batches per step, GAT fixed at 1: the rollout worker trains the
    last micro-batch of every step's first mini-batch and trainer 0 adds its gradients (then the
    all-reduce sums the trainers'). With two trainers the second has nothing of its own; with two
    PPO mini-batches the first mini-batch is all GAT's and its optimizer step steps on the rollout's
    gradients alone. The final weights are those of the run without GAT (float rounding: the
    gradient sum's order; SGD), every step trained every group once, and the rollout worker's
    training used the trainers' version."""
    from runs import assert_same_final_weights, run, timeline_records

    common = ["digen.placement=disaggregated", "digen.gap.enable=true", "trainer.total_training_steps=3",
              "digen.batch.groups_per_step=4", "digen.batch.train_micro_batch_groups=2",
              "digen.save_final_weights=true", f"digen.async.max_staleness={staleness}",
              f"trainer.n_gpus_per_node={1 + trainers}", f"digen.pools.trainer.devices={trainers}",
              f"digen.batch.mini_batches_per_step={mini_batches}",
              # SGD: the update is the gradient itself; Adam would amplify the rounding of a
              # near-zero gradient element into a visible difference (see the updater test above)
              "digen.algo.optimizer=sgd"]
    plain = run(tmp_path, "plain", *common)
    gat = run(tmp_path, "gat", *common, "digen.gat.enable=true", "digen.gat.micro_batches=1")
    assert gat.extra["weights_in_sync"] is True
    assert_same_final_weights(plain, gat, atol=1e-6, rtol=1e-4)
    recs = timeline_records(gat.output_dir)
    assisted = [r for r in recs if r["kind"] == "train" and r["worker"] == "rollout0"]
    assert [r["step"] for r in assisted] == [0, 1, 2]
    assert sorted(g for r in recs if r["kind"] == "train" for g in r["groups"]) == list(range(12))
    assert [m["gat/micro_batches"] for m in gat.metrics] == [1.0, 1.0, 1.0]
    for m, p in zip(gat.metrics, plain.metrics):
        assert m["max_staleness_seen"] == p["max_staleness_seen"] <= staleness
        assert m["actor/loss"] == pytest.approx(p["actor/loss"], rel=1e-3, abs=1e-6)


@pytest.mark.e2e
def test_gat_decides_its_share_from_the_rates_it_measures(shared_ray, tiny_flux, tmp_path):
    """digen.gat.micro_batches=auto on a trainer-bound run (every denoising step trained, one
    group per micro-batch, two rollout workers): nothing at the first step (nothing measured),
    then micro-batches on the rollout workers from the rates of the step before, logged as
    ``gat/*``; every group still trained once."""
    from runs import run, timeline_records

    result = run(
        tmp_path, "auto", "digen.placement=disaggregated", "trainer.n_gpus_per_node=3", "digen.pools.rollout.devices=2",
        "digen.gap.enable=true", "digen.gat.enable=true", "trainer.total_training_steps=3",
        "digen.sampling.sde_window.mode=all", "digen.batch.groups_per_step=4", "digen.batch.train_micro_batch_groups=1",
        # training clearly the bottleneck (recomputed blocks, a KL reference forward): a group's
        # training measured 0.38-0.49 s against 0.14 s of generation, where without these it was
        # 0.17-0.23 against 0.13-0.16 and a loaded machine's noise could make GAT not pay (a
        # fresh-clone run of the suite decided 0 at the third step)
        "digen.model.gradient_checkpointing=true", "digen.algo.kl_beta=0.01",
    )
    shares = [m["gat/micro_batches"] for m in result.metrics]
    assert shares[0] == 0 and all(s > 0 for s in shares[1:]), shares
    for m in result.metrics[1:]:
        assert m["gat/predicted_step_s"] < m["gat/predicted_step_s_without"]
        assert m["gat/train_per_group"] > 0 and m["gat/rollout_generate_per_group"] > 0
    recs = timeline_records(result.output_dir)
    on_rollout = [r for r in recs if r["kind"] == "train" and r["worker"].startswith("rollout")]
    assert sorted({r["step"] for r in on_rollout}) == [1, 2]
    assert sorted(g for r in recs if r["kind"] == "train" for g in r["groups"]) == list(range(12))


@pytest.mark.e2e
def test_gat_with_fsdp_trainers_gives_their_update(shared_ray, tiny_flux, tmp_path):
    """FSDP2 over 2 trainer ranks (lockstep micro-batches, gradients reduce-scattered): the
    rollout worker trains one micro-batch unsharded and every rank adds its own shard of those
    gradients. Same final weights as the FSDP run without GAT (SGD, float rounding), rollout in
    sync."""
    from runs import assert_same_final_weights, run, timeline_records

    common = ["digen.placement=disaggregated", "trainer.n_gpus_per_node=3", "digen.pools.rollout.devices=1",
              "digen.pools.trainer.devices=2", "digen.fsdp.enable=true", "digen.gap.enable=true",
              "trainer.total_training_steps=2", "digen.batch.groups_per_step=4", "digen.batch.train_micro_batch_groups=2",
              "digen.save_final_weights=true", "digen.algo.optimizer=sgd"]
    plain = run(tmp_path, "fsdp", *common)
    gat = run(tmp_path, "fsdp_gat", *common, "digen.gat.enable=true", "digen.gat.micro_batches=1")
    assert gat.extra["weights_in_sync"] is True
    assert_same_final_weights(plain, gat, atol=1e-6, rtol=1e-4)
    trains = [r for r in timeline_records(gat.output_dir) if r["kind"] == "train"]
    assert sorted(r["worker"] for r in trains) == ["rollout0", "rollout0", "trainer0,trainer1", "trainer0,trainer1"]
