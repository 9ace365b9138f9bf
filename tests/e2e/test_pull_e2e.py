"""Pulled work units (``digen.units``) on Ray workers: a pulled run gives the round-robin run's
update (pulling changes where work runs, not what it computes), and a pulled plan on emulated
workers charges each task what the simulator charges. The runner's rules in virtual time:
tests/unit/test_pull.py."""

from __future__ import annotations

import pytest

from verl_digen.schedule.strategies import StepPlanner, StrategySpec
from test_pull import tasks_by_text


# ----------------------------------------------------------------------------- a real run


@pytest.mark.e2e
@pytest.mark.slow
def test_a_pulled_run_gives_the_round_robin_update(shared_ray, tiny_flux, tmp_path):
    """2 rollout workers and 2 trainers, one-step-off: generation and rewards pulled by the free
    rollout worker, every micro-batch trained in 2 row slices pulled by the free trainers. The
    samples and rewards are those of the round-robin run (seeded per sample: the same
    trajectories wherever they run; bit for bit while the weights are the initial ones), every group is trained once in two halves, and the final
    weights equal the round-robin run's to float rounding (the all-reduce sums other groupings
    of the same rows; SGD)."""
    from runs import assert_same_final_weights, run, timeline_records

    common = ["digen.placement=disaggregated", "digen.gap.enable=true", "trainer.total_training_steps=3",
              # 2 groups of 4 per micro-batch: 2 row slices of 4 rows keep the round-robin run's
              # 4-row transformer calls (pass_rows), so the samples can be compared bit for bit
              "digen.batch.groups_per_step=4", "digen.batch.train_micro_batch_groups=2",
              "digen.async.max_staleness=1", "trainer.n_gpus_per_node=4",
              "digen.pools.rollout.devices=2", "digen.pools.trainer.devices=2", "digen.save_final_weights=true",
              "digen.algo.optimizer=sgd"]
    plain = run(tmp_path, "round_robin", *common)
    pulled = run(tmp_path, "pulled", *common, "digen.units.pull=true", "digen.units.train_slices=2")
    assert pulled.extra["weights_in_sync"] is True
    assert_same_final_weights(plain, pulled, atol=1e-6, rtol=1e-4)
    # the first two steps sample with the initial weights (one-step-off): the same rewards, bit for
    # bit; the third samples with weights that differ from the round-robin run's by rounding
    for p, q in zip(plain.metrics[:2], pulled.metrics[:2]):
        assert q["reward_mean"] == p["reward_mean"]
    for p, q in zip(plain.metrics, pulled.metrics):
        assert q["reward_mean"] == pytest.approx(p["reward_mean"], rel=1e-5) and q["max_staleness_seen"] <= 1
    recs = timeline_records(pulled.output_dir)
    trains = [r for r in recs if r["kind"] == "train"]
    assert sorted(g for r in trains for g in r["groups"]) == sorted(g for g in range(12) for _ in range(2))
    assert {tuple(r["extra"]["rows"]) for r in trains} == {(0, 2), (1, 2)}
    assert {r["worker"] for r in trains} <= {"trainer0", "trainer1"}
    assert {r["worker"] for r in recs if r["kind"] == "generate"} <= {"rollout0", "rollout1"}


@pytest.mark.e2e
def test_a_pulled_plan_on_emulated_workers_charges_each_task_what_the_simulator_charges(shared_ray):
    """The plan objects the simulator runs are the ones the Ray executor runs: FLUX's cost model
    on 2 + 2 H800, pulled units with row slices, run on emulated workers (each task sleeps for
    the cost model's seconds). Which worker takes a pulled task depends on real timing there,
    so the check is by task: each ran once, on one of its candidates, charged the simulator's
    seconds for it."""
    from verl_digen.emulate import run_emulated_plan
    from verl_digen.sim.cost_model import Cluster, CostModel, load_catalog
    from verl_digen.sim.simulator import simulate_plan

    costs = CostModel.from_catalog(load_catalog(), "flux-12b", devices=["H800"])
    spec = StrategySpec("disaggregated", 2, 2, 8, costs.workload.group_size, gap=True, max_staleness=1,
                        pull=True, train_slices=2, train_micro_batch_groups=2)
    cluster = Cluster.for_spec(spec, "H800")
    c = costs.for_spec(spec)
    planner = StepPlanner(spec)
    for s in range(2):
        planner.plan_step(s, has_next=s == 0)
    sim = simulate_plan(planner.plan, c, cluster)
    # a gang task is charged by each of its workers; a pulled one by the worker that took it
    simulated = sorted((r.kind, tuple(r.groups), r.end - r.start) for r in sim.timeline.records for _ in r.workers)
    gens = [r.end - r.start for r in sim.timeline.records if r.kind == "generate"]
    scale = 0.06 / (sum(gens) / len(gens))
    run = run_emulated_plan(planner.plan, c, cluster, group_size=spec.group_size, time_scale=scale, timeout_s=300)
    charged = sorted(x for charges in run.charges.values() for x in charges)
    assert [(k, g) for k, g, _ in charged] == [(k, g) for k, g, _ in simulated]
    for (k, g, a), (_, _, b) in zip(charged, simulated):
        assert a == pytest.approx(b, rel=1e-9, abs=1e-12), (k, g)
    assert any(r.extra.get("rows") for r in run.timeline.records if r.kind == "train")
    by_text = tasks_by_text(planner.plan)
    for r in run.timeline.records:
        task = by_text[r.task]
        assert len(r.workers) == (1 if task.pulled else len(task.workers))
        assert set(r.workers) <= {str(w) for w in task.workers}
