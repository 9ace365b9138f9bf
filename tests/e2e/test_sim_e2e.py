"""The emulated cluster: the real Ray executor on emulated devices charges each task what the
simulator charges, on the planner's best plan, a GAT plan and the same plan as the simulator's,
and the config switch runs the real loop on sixteen emulated devices. The cost model and the
simulator themselves: tests/unit/test_sim.py."""

from __future__ import annotations

import pytest

from verl_digen.schedule.strategies import StepPlanner, StrategySpec
from verl_digen.sim.cost_model import Cluster, CostModel, TableCostModel
from verl_digen.sim.simulator import simulate_plan
from timelines import assert_exclusive
from test_sim import catalog  # noqa: F401 (a fixture)


# ---------------------------------------------------------------------------- emulated cluster


def _emulated_charges_are_simulated(spec, c, cluster, **plan_kw):
    """Plan two steps of ``spec``, simulate them, run them on emulated workers (the real Ray
    executor; each task sleeps for the cost model's seconds, at a time scale where the mean
    generate task sleeps 60 ms) and check that every worker charged each task the simulator's
    seconds, and that no task ran shorter than that (on the shared Ray instance: callers ask for
    ``shared_ray``). Returns the simulation."""
    from verl_digen.emulate import run_emulated_plan

    planner = StepPlanner(spec)
    for s in range(2):
        planner.plan_step(s, has_next=s + 1 < 2, **plan_kw)
    sim = simulate_plan(planner.plan, c, cluster)
    simulated = {(r.task, tuple(map(str, r.workers))): r.end - r.start for r in sim.timeline.records}
    gens = [r.end - r.start for r in sim.timeline.records if r.kind == "generate"]
    scale = 0.06 / (sum(gens) / len(gens))
    run = run_emulated_plan(planner.plan, c, cluster, group_size=spec.group_size, time_scale=scale, timeout_s=300)
    emulated = {(r.task, tuple(map(str, r.workers))): r.end - r.start for r in run.timeline.records}
    assert set(emulated) == set(simulated)
    # what each worker charged is what the simulator charged it, task by task
    expected: dict[str, list[tuple[str, tuple[int, ...], float]]] = {}
    for r in sorted(sim.timeline.records, key=lambda r: r.start):
        for w in r.workers:
            expected.setdefault(str(w), []).append((r.kind, tuple(r.groups), r.end - r.start))
    for worker, charged in run.charges.items():
        got = sorted(charged)
        want = sorted(expected.get(worker, []))
        assert [(k, g) for k, g, _ in got] == [(k, g) for k, g, _ in want], worker
        for (k, g, a), (_, _, b) in zip(got, want):
            assert a == pytest.approx(b, rel=1e-9, abs=1e-12), (worker, k, g)
    # and no task ran shorter than it was charged: the executor only adds its dispatch overhead
    # (~10-40 ms a task on a quiet 2-core machine, up to ~0.6 s on a loaded one; not asserted:
    # the suite does not assert on wall-clock speed)
    excess = sorted((emulated[k] - d) * scale for k, d in simulated.items())  # real seconds
    assert excess[0] >= -1e-3, excess[:5]
    return sim


@pytest.mark.e2e
@pytest.mark.timeout(400)
def test_the_planners_best_flux_plan_at_32_runs_emulated_charging_each_task_what_the_simulator_charges(catalog, tmp_path,
                                                                                                        shared_ray):
    """FLUX.1 full fine-tuning on 32 H800: the planner's best configuration, planned for two
    steps, runs on 32 emulated devices (the real Ray executor; each task sleeps for the cost
    model's seconds of that strategy, ``CostModel.for_spec``), and every task takes the
    simulator's seconds plus the runtime's dispatch overhead (at a time scale where the mean
    generate task sleeps 60 ms). The memory planner's per-GPU peak of the
    printed configuration, at FLUX.1's real size, fits the H800s."""
    from omegaconf import OmegaConf

    from verl_digen.config.compose import compose_config
    from verl_digen.config.schema import digen_config_from_dict
    from verl_digen.memory import plan_job
    from verl_digen.sim.planner import Inventory, hydra_overrides, search

    costs = CostModel.from_catalog(catalog, "flux-12b", devices=["H800"])
    inv = Inventory({"H800": 32})
    best = search(costs, inv, steps=3, warmup=1).best
    spec, cluster = best.candidate.spec, best.candidate.cluster
    c = costs.for_spec(spec)
    _emulated_charges_are_simulated(spec, c, cluster)

    overrides = hydra_overrides(best.candidate, costs, inv) + [
        "digen.model.arch=flux", "digen.memory.device_type=H800", f"digen.output_dir={tmp_path}"]
    container = OmegaConf.to_container(compose_config(overrides), resolve=True)
    digen = digen_config_from_dict(container["digen"])
    roles = plan_job(digen, devices_per_node=container["trainer"]["n_gpus_per_node"], nnodes=container["trainer"]["nnodes"])
    assert roles and all(p.peak_gib <= p.device_gib for p in roles), [(p.role, p.peak_gib) for p in roles]


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_gat_plan_runs_emulated_charging_each_task_what_the_simulator_charges(catalog, shared_ray):
    """The OCR recipe's LoRA workload (Qwen-Image, a VLM judge) on 8 H800: 6 rollout + 1 trainer
    + 1 reward, GAP + GAT + TCSS, with 4 micro-batches of each step on the rollout workers. On
    emulated workers every task, the rollout workers' micro-batches included (a trainer's passes
    unsharded plus the gradient send, no switch), costs what the simulator charged."""
    from verl_digen.sim.calibrate import load_runs

    run = next(r for r in load_runs() if r.name == "lora-4xH800")
    costs = CostModel.from_catalog(catalog, run.model, devices=["H800"], system="verl-digen", **run.workload)
    w = costs.workload
    spec = StrategySpec("disaggregated", 6, 1, w.groups_per_step, w.group_size, reward_workers=1, gap=True, gat=True,
                        max_staleness=1, train_micro_batch_groups=2, mini_batches=w.mini_batches)
    cluster = Cluster.for_spec(spec, "H800")
    c = costs.for_spec(spec)
    assert c.memory_problems(cluster) == []
    sim = _emulated_charges_are_simulated(spec, c, cluster, gat_micro_batches=4)
    on_rollout = [r for r in sim.timeline.records if r.kind == "train" and str(r.workers[0]).startswith("rollout")]
    assert len(on_rollout) == 8  # 4 a step, each a trainer's micro-batch plus the send
    trainer = next(r for r in sim.timeline.records if r.kind == "train" and str(r.workers[0]) == "trainer0")
    assert on_rollout[0].end - on_rollout[0].start > trainer.end - trainer.start


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_emulated_runtime_matches_the_simulator_on_the_same_plan(shared_ray):
    """8 emulated devices (6 rollout + 2 trainers, GAP + TCSS), tasks of 20-80 modelled ms run at
    5x (0.1-0.4 s): the real Ray executor's makespan is the simulator's plus the runtime's own
    overhead (about 1 ms per task on a quiet 2-core machine). The bound is loose on purpose
    (makespan under twice the simulator's): it is not a speed check but catches an executor that
    serialises what the plan runs in parallel (the 8 lanes run one after another take ~4x)."""
    from verl_digen.emulate import run_emulated_plan

    spec = StrategySpec("disaggregated", 6, 2, groups_per_step=12, group_size=4, gap=True, max_staleness=1)
    costs = TableCostModel(
        seconds={"generate": 0.04, "reward": 0.01, "train": 0.03, "optimizer_step": 0.02, "sync": 0.02},
        per_image={"generate": 0.01, "train": 0.01}, group_size=4,
    )
    planner = StepPlanner(spec)
    for s in range(3):
        planner.plan_step(s, has_next=s + 1 < 3)
    cluster = Cluster.for_spec(spec, "cpu")
    sim = simulate_plan(planner.plan, costs, cluster)
    opt_sim = {r.step: r.end for r in sim.timeline.records if r.kind == "optimizer_step"}

    run = run_emulated_plan(planner.plan, costs, cluster, group_size=4, time_scale=5.0, timeout_s=90)
    planner.plan.check(complete_steps=range(3))
    assert {r.task for r in run.timeline.records} == {str(t.id) for t in planner.plan.tasks}
    assert_exclusive(run.timeline, eps=1e-3)
    end = {r.task: r.end for r in run.timeline.records}
    start = {r.task: r.start for r in run.timeline.records}
    for t in planner.plan.tasks:
        assert all(start[str(t.id)] >= end[str(d)] - 1e-6 for d in t.deps), t.id
    gap = run.opt_end[2] / opt_sim[2] - 1
    assert -0.02 < gap < 1.0, f"emulated {run.opt_end[2]:.3f}s vs simulated {opt_sim[2]:.3f}s"


@pytest.mark.e2e
def test_config_switch_runs_the_real_loop_on_sixteen_emulated_devices(tmp_path, shared_ray):
    """digen.emulate.model: the real planner, executor and loop, workers that sleep (no model)."""
    from verl_digen.config.compose import compose_config
    from verl_digen.trainer.loop import run_training

    cfg = compose_config([
        "digen.progress_bar=false", "trainer.logger=[]", "trainer.total_training_steps=2",
        "digen.placement=disaggregated", "digen.gap.enable=true", "trainer.n_gpus_per_node=8", "trainer.nnodes=2",
        "digen.pools.rollout.devices=8", "digen.pools.trainer.devices=8", "digen.batch.groups_per_step=16",
        "digen.emulate.model=flux-12b", "digen.emulate.time_scale=0.005", f"digen.output_dir={tmp_path / 'emu'}",
    ])
    result = run_training(cfg)
    assert result.devices == 16 and len(result.metrics) == 2
    assert result.extra["weights_in_sync"] is True
    assert all(0 < m["bubble_fraction"] < 1 for m in result.metrics)
