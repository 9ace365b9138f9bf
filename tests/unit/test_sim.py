"""The cost model and the simulator.

- profiles load and document every constant;
- token counts and costs follow the documented formulas;
- the simulator reproduces hand-computed timelines of small plans, with the runner's semantics;
- no simulated schedule beats the zero-bubble bound.

The real Ray executor on emulated devices, which matches the simulator on the same plan:
tests/e2e/test_sim_e2e.py."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import yaml

from verl_digen.schedule.plan import Task, TaskId, TaskKind, WorkerId
from verl_digen.schedule.runner import PlanRunner
from verl_digen.schedule.strategies import StepPlanner, StrategySpec
from verl_digen.sim.cost_model import (
    Cluster,
    CostModel,
    PoolPlacement,
    ProfileError,
    TableCostModel,
    builtin_profile_files,
    load_catalog,
)
from verl_digen.sim.bound import max_throughput
from verl_digen.sim.simulator import SimulatedExecutor, simulate, simulate_plan
from timelines import assert_exclusive

PAPER_MODELS = ("flux-12b", "wan2.1-14b", "hunyuanvideo-13b", "qwen-image-20b")


@pytest.fixture(scope="module")
def catalog():
    return load_catalog()


def _costs(catalog, model="flux-12b", device="H800", **workload):
    return CostModel.from_catalog(catalog, model, devices=[device], **workload)


# ---------------------------------------------------------------------------- profiles


def test_shipped_profiles_cover_the_paper_models_sd35_and_three_device_classes(catalog):
    assert set(PAPER_MODELS) | {"sd3.5-medium", "sd3.5-large"} <= set(catalog.models)
    assert {"H100", "H800", "H200", "A100", "L40S"} <= set(catalog.devices)
    assert {"verl-digen", "verl-omni"} <= set(catalog.systems)
    assert catalog.devices["H800"].peak_tflops == catalog.devices["H100"].peak_tflops == catalog.devices["H200"].peak_tflops == 989.0
    assert catalog.devices["H200"].hbm_gb > catalog.devices["H100"].hbm_gb
    assert catalog.devices["A100"].peak_tflops == 312.0
    assert catalog.devices["H800"].intra_node_gbps < catalog.devices["H100"].intra_node_gbps


def test_every_profile_constant_names_its_source():
    for path in builtin_profile_files():
        with open(path) as f:
            doc = yaml.safe_load(f)
        sections = [(doc.get(s) or {}) for s in ("models", "devices", "systems", "rewards")]
        sections += list((doc.get("overrides") or {}).values())  # calibrated values name their fit
        for entries in sections:
            for name, entry in (entries or {}).items():
                sources = entry.get("sources") or {}
                missing = [k for k in entry if k != "sources" and k not in sources]
                assert not missing, f"{path}: {name} has no source for {missing}"
                assert all(isinstance(v, str) and v.strip() for v in sources.values())


def test_unknown_names_and_keys_are_reported_with_what_is_valid(catalog, tmp_path):
    with pytest.raises(ProfileError, match="unknown model profile 'flux-13b'; known: .*flux-12b"):
        catalog.model("flux-13b")
    with pytest.raises(ProfileError, match="unknown workload keys"):
        CostModel.from_catalog(catalog, "flux-12b", devices=["H800"], resolution=1024)
    bad = tmp_path / "bad.yaml"
    bad.write_text("devices:\n  X:\n    peak_tflops: 1\n    typo_gbps: 3\n")
    with pytest.raises(ProfileError, match="typo_gbps"):
        load_catalog([str(bad)])


# ---------------------------------------------------------------------------- formulas


def test_token_counts_follow_the_documented_latent_packing(catalog):
    assert _costs(catalog, "flux-12b", height=1024, width=1024).tokens() == (4096, 4096 + 512)
    assert _costs(catalog, "flux-12b").tokens() == (45 * 45, 45 * 45 + 512)  # 720^2
    # Wan2.1 480p, 81 frames: (81-1)/4+1 = 21 latent frames of 60x104 latents, patch (1, 2, 2)
    assert _costs(catalog, "wan2.1-14b").tokens() == (21 * 30 * 52, 21 * 30 * 52)  # cross-attended text
    assert _costs(catalog, "hunyuanvideo-13b").tokens()[0] == 16 * 30 * 53
    assert _costs(catalog, "qwen-image-20b").tokens() == (83 * 83, 83 * 83 + 256)


def test_forward_flops_are_two_token_params_per_token_plus_attention(catalog):
    c = _costs(catalog, "flux-12b", height=1024, width=1024)
    m, seq = c.model, 4608
    assert c.forward_flops() == pytest.approx(2 * m.token_params * seq + 4 * m.layers * seq**2 * m.hidden)
    # an MMDiT token meets only its own stream's weights: 12 h^2 per block, a third of Qwen-Image's
    for name in ("flux-12b", "qwen-image-20b", "hunyuanvideo-13b"):
        q = catalog.models[name]
        assert q.token_params == pytest.approx(q.layers * 12 * q.hidden**2, rel=1e-3)
    assert catalog.models["qwen-image-20b"].token_params / catalog.models["qwen-image-20b"].params == pytest.approx(1 / 3, rel=0.01)
    # attention matters at video lengths: a large share of Wan's forward
    w = _costs(catalog, "wan2.1-14b")
    image, _ = w.tokens()
    assert 4 * w.model.layers * image**2 * w.model.hidden / w.forward_flops() > 0.4


def test_generation_scales_with_steps_cfg_and_images(catalog):
    dev = dataclasses.replace(catalog.devices["H800"], mfu_half_tokens=0.0)  # flat efficiency: FLOPs alone
    c = _costs(catalog, "qwen-image-20b")
    no_cfg = c.with_workload(cfg=False)
    assert c.forward_seconds(4, dev) - dev.forward_overhead_s == pytest.approx(2 * (no_cfg.forward_seconds(4, dev) - dev.forward_overhead_s))
    half = c.with_workload(num_steps=8)
    loop = c.generate_seconds(12, dev) - half.generate_seconds(12, dev)
    # each denoising step: the forward and our sampler's measured per-step work (denoise_step_s)
    assert c.system.denoise_step_s > 0
    assert loop == pytest.approx(8 * (c.forward_seconds(12, dev) + c.system.denoise_step_s))
    # a TSP stage pays its own steps; encode at the first stage, decode at the final one
    s0 = c.generate_seconds(12, dev, (0, 8), final=False)
    s1 = c.generate_seconds(12, dev, (8, 16), final=True)
    assert s0 + s1 == pytest.approx(c.generate_seconds(12, dev) + dev.generate_overhead_s)


def test_training_is_three_forwards_per_trained_step_plus_exposed_collectives(catalog):
    c = _costs(catalog, "flux-12b", train_device_batch=1, gradient_checkpointing=False)
    dev = dataclasses.replace(catalog.devices["H800"], mfu_half_tokens=0.0)
    one = Cluster({"trainer": PoolPlacement(1, 1, "H800"), "rollout": PoolPlacement(1, 1, "H800")})
    group = c.train_group(one)
    # at the device's training efficiency (measured on our GPU checks, every system's)
    fwd = c.forward_flops() / (dev.flops * dev.mfu_train * c.system.train_efficiency)
    per_image = c.train_seconds(12, dev, group) / 12
    assert per_image == pytest.approx(c.workload.trained_steps * (3 * fwd + dev.train_pass_overhead_s))
    # a frozen LoRA base skips its weight gradients (linear layers: 2 forwards' worth, attention: 3);
    # activation checkpointing recomputes one forward
    lora = c.with_workload(lora=True)
    assert lora.train_flops() == pytest.approx(2 * c.linear_flops() + 3 * c.attention_flops())
    assert c.with_workload(gradient_checkpointing=True).train_flops_factor == pytest.approx(4.0)


def test_checkpointing_is_decided_per_training_pass_as_the_memory_planner_decides_it(catalog):
    """``gradient_checkpointing`` unset (the profiles' default) is ``auto``: a training pass
    recomputes its forward exactly when the memory planner's rule turns it on for this workload's
    job on this cluster (``memory.plan.decide_job``: some role's training pass, one transformer
    call's samples, does not fit its GPU without it), which is what the run decides."""
    from dataclasses import replace as with_fields

    from verl_digen.memory.plan import plan_roles, training_fits

    one = Cluster({"trainer": PoolPlacement(1, 1, "H800"), "rollout": PoolPlacement(1, 1, "H800")})
    dev = catalog.devices["H800"]
    lora = _costs(catalog, "flux-12b", lora=True)
    assert lora.gradient_checkpointing is None and lora.plans_memory  # auto, the memory planner's
    decided = []
    for rows in (1, 2, 4, 12):
        c = lora.with_workload(call_rows=rows)
        group = c.train_group(one)
        job = c.memory_job(one)
        assert c.pass_batch(dev, group) == rows == job.pass_samples
        fits = training_fits(plan_roles(with_fields(job, checkpointing=False), c.role_gib(one)))
        assert c.checkpointing(dev, group) is job.checkpointing is (not fits)
        decided.append(not fits)
        flops = c.train_flops(not fits)
        compute = c.train_pass_seconds(rows, dev, group) - dev.train_pass_overhead_s
        assert compute == pytest.approx(rows * flops / (dev.flops * c.efficiency(dev, rows * c.tokens()[1], train=True)
                                                        * c.system.train_efficiency))
    # FLUX at 720 x 720: one sample's ~22 GiB fits beside LoRA's state, twelve do not
    assert decided[0] is False and decided[-1] is True
    # a configured value wins
    off = lora.with_workload(call_rows=12, gradient_checkpointing=False)
    assert off.checkpointing(dev, off.train_group(one)) is False and off.memory_job(one).checkpointing is False
    # a fused worker holds the reward model it scores with, in its dtype (fp32: the reward's default)
    fused = Cluster({"fused": PoolPlacement(1, 1, "H800")})
    c = lora.with_workload(call_rows=1)
    (with_reward,) = c.memory_plans(fused)
    (without,) = dataclasses.replace(c, reward=None).memory_plans(fused)
    assert with_reward.role == "colocated" and c.memory_job(fused).reward_bytes == int(4 * c.reward.params)
    assert with_reward.phases["train"]["encoders_vae"] - without.phases["train"]["encoders_vae"] == int(4 * c.reward.params)


def test_the_measured_training_efficiency_is_every_systems(catalog):
    """One calibration basis: the training efficiency measured on our GPU checks (mfu_train, the
    device's) is charged to every system's passes alike, so our pass and veRL-Omni's of the same
    samples cost the same compute; what differs between them is structural (its log-prob
    recompute, offload, ...), not a factor on the kernel. The bound charges that efficiency."""
    ours = _costs(catalog, "flux-12b", train_device_batch=8)
    omni = ours.with_system(catalog.system("verl-omni"))
    assert ours.system.train_efficiency == omni.system.train_efficiency == 1.0
    dev = catalog.devices["H800"]
    one = Cluster({"trainer": PoolPlacement(1, 1, "H800"), "rollout": PoolPlacement(1, 1, "H800")})
    group = ours.train_group(one)
    compute = [m.train_pass_seconds(8, dev, group) - dev.train_pass_overhead_s for m in (ours, omni)]
    assert compute[1] == pytest.approx(compute[0])
    # the recompute is veRL-Omni's structural extra: one forward per trained step
    assert omni.train_seconds(8, dev, group) > ours.train_seconds(8, dev, group)
    # one bound for both: the device's efficiency
    train = [m.device_seconds_per_image(dev)["train"] for m in (ours, omni)]
    assert train[1] == pytest.approx(train[0])
    # and it stays a bound: a pass of 8 samples on one trained step costs at least their share
    assert compute[0] >= 8 * train[0] / ours.workload.trained_steps


def test_fsdp_collectives_grow_with_ranks_and_use_every_nic_across_nodes(catalog):
    c = CostModel.from_catalog(catalog, "flux-12b", devices=["H800", "A100"], train_device_batch=2)
    c = c.with_system(dataclasses.replace(c.system, fsdp_mesh="flat"))  # flat rings (auto: HSDP across nodes)

    def comm(device, n):
        cl = Cluster({"fused": PoolPlacement(n, math.ceil(n / 8), device)})
        return c.fsdp_comm_seconds(catalog.devices[device], c.train_group(cl))

    assert comm("H800", 1) == 0 < comm("H800", 8) < comm("H800", 16) < comm("H800", 32)
    # a ring across nodes crosses on all 8 NICs of a node at once (8 x 50 GB/s), so on H800 NVLink
    # (200 GB/s) stays the bottleneck: crossing nodes costs ring latency, not bandwidth
    h800 = catalog.devices["H800"]
    assert h800.cross_node_gbps == h800.intra_node_gbps == 200
    assert comm("H800", 16) < 1.2 * comm("H800", 8)
    # A100: 8 x 25 GB/s of NICs is less than its 300 GB/s NVLink
    a100 = catalog.devices["A100"]
    assert a100.cross_node_gbps == 8 * a100.inter_node_gbps < a100.intra_node_gbps
    assert comm("A100", 16) > 1.4 * comm("A100", 8)


def test_a_pool_on_part_of_a_node_is_charged_as_the_nodes_it_spans(catalog):
    """A pool of any size: its FSDP collectives and the weight sync cross nodes exactly as a
    uniform pool on as many nodes does; pools that share a node share its NVLink only where the
    sync's sender and every receiver sit on it."""
    c = CostModel.from_catalog(catalog, "flux-12b", devices=["A100"], train_device_batch=2)
    a100 = catalog.devices["A100"]

    def comm(trainer):
        return c.fsdp_comm_seconds(a100, c.train_group(Cluster({"trainer": trainer, "rollout": PoolPlacement(1, 1, "A100")})))

    uneven = PoolPlacement.spread((8, 8, 6, 0), "A100")  # 22 trainers: two nodes and 6 of a third
    assert (uneven.size, uneven.nodes, uneven.node_devices) == (22, 3, [8, 8, 6])
    assert comm(uneven) == pytest.approx(comm(PoolPlacement(22, 3, "A100")))  # as a 22-rank pool on 3 nodes today
    assert comm(uneven) > comm(PoolPlacement.spread((6, 0), "A100")) * 1.3  # NICs, not NVLink
    # sync: trainer 0 on node 0; rollout on nodes 2 and 3 -> over the NIC, rollout beside trainer 0 -> NVLink
    apart = Cluster({"trainer": uneven, "rollout": PoolPlacement.spread((0, 0, 2, 8), "A100")})
    beside = Cluster({"trainer": PoolPlacement.spread((6, 0), "A100"), "rollout": PoolPlacement.spread((2, 0), "A100")})
    split = Cluster({"trainer": PoolPlacement.spread((6, 0), "A100"), "rollout": PoolPlacement.spread((2, 8), "A100")})
    wire = c.sync_bytes / (c.system.nccl_efficiency * 1e9)
    fixed = c.system.sync_fixed_s
    # ours sends what the step streamed out (state_stream_seconds); an always-sharding engine gathers here
    engine = c.with_system(dataclasses.replace(c.system, always_sharded=True))
    assert c.sync_seconds(beside) - fixed == pytest.approx(wire / a100.intra_node_gbps)
    assert engine.sync_seconds(beside) - fixed == pytest.approx(
        wire / a100.intra_node_gbps + c.sync_bytes * 5 / 6 / c.collective_bw(a100, 1))
    assert c.sync_seconds(split) - c.sync_seconds(beside) == pytest.approx(wire / a100.inter_node_gbps - wire / a100.intra_node_gbps)
    assert c.sync_seconds(apart) == pytest.approx(c.sync_seconds(split))  # both over the NIC, nothing gathered
    assert engine.sync_seconds(apart) - c.sync_seconds(apart) > engine.sync_seconds(beside) - c.sync_seconds(beside)  # 22 ranks across nodes
    with pytest.raises(ValueError, match="cannot be"):
        PoolPlacement(22, 2, "A100", on_nodes=(8, 8, 6))


def test_an_hsdp_shard_group_that_straddles_two_nodes_pays_the_network(catalog):
    """HSDP shards over groups of k consecutive ranks: a group inside a node uses NVLink; the
    cost model does not assume it (the planner offers only placements that keep groups inside)."""
    base = CostModel.from_catalog(catalog, "flux-12b", devices=["A100"], train_device_batch=2)
    c = base.with_system(dataclasses.replace(base.system, hsdp_shard=4))

    def group(*on_nodes):
        return c.train_group(Cluster({"fused": PoolPlacement.spread(on_nodes, "A100")}))

    assert (group(8, 8).shard, group(8, 8).shard_nodes, group(8, 8).replicas) == (4, 1, 4)
    assert group(6, 6).shard_nodes == 2  # ranks 4..7 sit on both nodes
    a100 = catalog.devices["A100"]
    assert c.fsdp_comm_seconds(a100, group(6, 6)) > c.fsdp_comm_seconds(a100, group(8, 8))


def test_lora_sync_moves_megabytes_and_full_sync_the_whole_model(catalog):
    full, lora = _costs(catalog, "flux-12b"), _costs(catalog, "flux-12b", lora=True)
    assert full.sync_bytes == pytest.approx(2 * full.model.params)
    assert 1e6 < lora.sync_bytes < 1e9
    cluster = Cluster({"rollout": PoolPlacement(24, 3, "H800"), "trainer": PoolPlacement(8, 1, "H800")})
    assert full.sync_seconds(cluster) > 10 * (lora.sync_seconds(cluster) - lora.system.sync_fixed_s)


def test_colocated_workers_pay_a_switch_each_way(catalog):
    c = _costs(catalog, "flux-12b")
    cluster = Cluster({"fused": PoolPlacement(8, 1, "H800")})
    w = WorkerId("fused", 0)
    train = Task(TaskId.train(0, 0), TaskKind.TRAIN, (w,), 0, groups=(0,), images=12)
    gen = Task(TaskId.generate((0,)), TaskKind.GENERATE, (w,), 0, groups=(0,), images=12)
    assert c.task_seconds(train, w, cluster, switch_from="generate") > c.task_seconds(train, w, cluster, switch_from="train")
    assert c.task_seconds(gen, w, cluster, switch_from="train") > c.task_seconds(gen, w, cluster, switch_from="generate")


def test_memory_rules_out_too_few_trainers_for_full_fine_tuning(catalog):
    """What fits is the memory planner's per-GPU peak of each pool (the run's own check), and a
    pool that does not fit is named with its peak phase, what it holds and the device."""
    # Qwen-Image at 1328 x 1328 decodes a group in one VAE call by default (64.6 GiB); one sample
    # at a time (digen.model.vae_decode_chunk=1) fits
    c = _costs(catalog, "qwen-image-20b", vae_decode_chunk=1)
    w = c.workload

    def fsdp(r: int, t: int) -> CostModel:  # lockstep FSDP over the t trainers (passes: a rank's call rows)
        return c.for_spec(StrategySpec("disaggregated", r, t, w.groups_per_step, w.group_size, gap=True, fsdp=True,
                                       train_micro_batch_groups=2))  # 24 rows: 3 a rank of 8, 12 of 2

    small = Cluster({"rollout": PoolPlacement(14, 2, "H800"), "trainer": PoolPlacement(2, 1, "H800")})
    big = Cluster({"rollout": PoolPlacement(8, 1, "H800"), "trainer": PoolPlacement(8, 1, "H800")})
    (problem,) = fsdp(14, 2).memory_problems(small)
    assert problem.startswith("trainer: training holds") and "2-way sharded" in problem and "one H800" in problem
    (trainer,) = [p for p in fsdp(14, 2).memory_plans(small) if p.role == "trainer"]
    assert f"{trainer.peak_gib:.1f} GiB per GPU" in problem and trainer.peak_gib > trainer.device_gib == 80
    assert fsdp(8, 8).memory_problems(big) == []
    assert all(p.peak_gib <= p.device_gib for p in fsdp(8, 8).memory_plans(big))
    # the default decode of a whole group does not fit a rollout worker: named as such
    whole = _costs(catalog, "qwen-image-20b").for_spec(StrategySpec(
        "disaggregated", 8, 8, w.groups_per_step, w.group_size, gap=True, fsdp=True, train_micro_batch_groups=2))
    assert [p for p in whole.memory_problems(big) if p.startswith("rollout: decoding holds")]
    # without FSDP every trainer holds the whole 20B model's training state: never fits
    unsharded = c.for_spec(StrategySpec("disaggregated", 8, 8, w.groups_per_step, w.group_size, gap=True))
    assert unsharded.train_group(big).shard == 1
    assert any(p.startswith("trainer:") and "unsharded" in p for p in unsharded.memory_problems(big))
    # LoRA's state is small; but a pass is a transformer call (12 samples x 2 CFG rows a rank
    # here), whose checkpointed activations alone exceed a GPU at 1328 x 1328, and fit at 512
    lora = fsdp(14, 2).with_workload(lora=True)
    assert any("activations for a pass of 12 sample(s), checkpointed" in p for p in lora.memory_problems(small))
    assert lora.with_workload(height=512, width=512).memory_problems(small) == []


# ---------------------------------------------------------------------------- hand-computed timelines

TABLE = TableCostModel(seconds={"generate": 3.0, "reward": 1.0, "train": 2.0, "optimizer_step": 0.5, "sync": 0.25})


def _run(spec: StrategySpec, steps: int, costs=TABLE) -> dict[str, tuple[float, float]]:
    planner = StepPlanner(spec)
    for s in range(steps):
        planner.plan_step(s, has_next=s + 1 < steps)
    sim = simulate_plan(planner.plan, costs, Cluster.for_spec(spec, "any"))
    assert_exclusive(sim.timeline)
    return {r.task: (r.start, r.end) for r in sim.timeline.records}


def test_sync_plan_trains_after_the_whole_batch_by_hand():
    # rollout: gen0 [0,3] reward0 [3,4] gen1 [4,7] reward1 [7,8]
    # trainer waits for both rewards: train [8,10] [10,12], optimizer [12,12.5]
    t = _run(StrategySpec("disaggregated", 1, 1, groups_per_step=2, group_size=2), 1)
    assert t["gen:1"] == (4.0, 7.0)
    assert t["train:0:0"] == (8.0, 10.0) and t["train:0:1"] == (10.0, 12.0)
    assert t["opt:0"] == (12.0, 12.5)


def test_gap_plan_streams_groups_into_training_by_hand():
    # step 0: train0 starts when reward0 ends (4), train1 when reward1 ends (8): opt [10, 10.5]
    # sync [10.5, 10.75]; step 1 waits for it: gen2 [10.75, 13.75] ... train [18.75, 20.75], opt [20.75, 21.25]
    t = _run(StrategySpec("disaggregated", 1, 1, groups_per_step=2, group_size=2, gap=True), 2)
    assert t["train:0:0"] == (4.0, 6.0) and t["train:0:1"] == (8.0, 10.0)
    assert t["opt:0"] == (10.0, 10.5) and t["sync:1"] == (10.5, 10.75)
    assert t["gen:2"] == (10.75, 13.75)
    assert t["train:1:1"] == (18.75, 20.75) and t["opt:1"] == (20.75, 21.25)


def test_tcss_is_a_one_step_off_pipeline_by_hand():
    # rollout: step 0 gen0 [0,3] r0 [3,4] gen1 [4,7] r1 [7,8], then the whole of step 1 on
    # version 0 at once: gen2 [8,11] r2 [11,12] gen3 [12,15] r3 [15,16]; only then sync(1):
    # [16, 16.25] (it waits for the rollout worker, opt0 ended at 10.5)
    # trainer: train0:0 [4,6] train0:1 [8,10] opt0 [10,10.5]; it does not wait for the sync:
    # train1:0 as soon as r2 ends [12,14], train1:1 [16,18], opt1 [18,18.5]
    # (on-policy GAP: opt1 ends at 21.25; the drain-only look-ahead at 18.75)
    t = _run(StrategySpec("disaggregated", 1, 1, groups_per_step=2, group_size=2, gap=True, max_staleness=1), 2)
    assert t["gen:2"] == (8.0, 11.0) and t["gen:3"] == (12.0, 15.0)
    assert t["sync:1"] == (16.0, 16.25)
    assert t["train:1:0"] == (12.0, 14.0) and t["train:1:1"] == (16.0, 18.0)
    assert t["opt:1"] == (18.0, 18.5)


def test_the_sync_occupies_only_the_rollout_workers():
    spec = StrategySpec("disaggregated", 2, 2, groups_per_step=4, group_size=2, gap=True, max_staleness=1)
    planner = StepPlanner(spec)
    for s in range(3):
        planner.plan_step(s, has_next=s + 1 < 3)
    syncs = planner.plan.of_kind(TaskKind.SYNC)
    assert len(syncs) == 3 and all({w.pool for w in t.workers} == {"rollout"} and len(t.workers) == 2 for t in syncs)
    # one-step-off: every generate task of step s+1 uses version s and is planned before sync(s+1)
    order = {t.id: i for i, t in enumerate(planner.plan.tasks)}
    for t in planner.plan.of_kind(TaskKind.GENERATE):
        assert t.version == max(t.step - 1, 0)
        assert order[t.id] < order[TaskId.sync(t.step + 1)]
    planner.plan.check(complete_steps=range(3))


def test_colocated_worker_pays_the_switch_on_each_mode_change_by_hand():
    # gen [0,3] r [3,4] gen [4,7] r [7,8]; first train pays the switch: [8, 11], then [11, 13];
    # opt [13, 13.5]; the next step's first generate pays it back: [13.5, 17.5]
    costs = TableCostModel(seconds={"generate": 3.0, "reward": 1.0, "train": 2.0, "optimizer_step": 0.5}, switch=1.0)
    t = _run(StrategySpec("colocated", 1, 1, groups_per_step=2, group_size=2), 2, costs)
    assert t["train:0:0"] == (8.0, 11.0) and t["train:0:1"] == (11.0, 13.0)
    assert t["opt:0"] == (13.0, 13.5)
    assert t["gen:2"] == (13.5, 17.5) and t["gen:3"] == (18.5, 21.5)
    assert t["opt:1"] == (27.5, 28.0)


def test_gang_tasks_last_as_long_as_their_slowest_member():
    costs = TableCostModel(seconds={"generate": 1.0, "reward": 0.0, "train": 1.0, "optimizer_step": 0.5}, switch=2.0)
    spec = StrategySpec("colocated", 2, 2, groups_per_step=2, group_size=1)
    t = _run(spec, 1, costs)
    # each worker: gen [0,1], reward [1,1], train with switch [1,4]; the all-reduce starts together
    assert t["opt:0"] == (4.0, 4.5)


class _ReferenceRunner(PlanRunner):
    """A minimal virtual-clock runner (as tests/unit/test_plans.py's UnitTimeRunner)."""

    def __init__(self, plan, durations):
        super().__init__(plan)
        self.durations, self._t, self._events = durations, 0.0, []

    def now(self):
        return self._t

    def _launch(self, task):
        self._events.append((self._t + self.durations[task.kind.value], task.id))
        self._events.sort()

    def _wait_one(self):
        self._t, tid = self._events.pop(0)
        return tid, None


def test_simulator_runs_plans_with_the_runners_semantics():
    durations = {"generate": 3.0, "reward": 0.5, "train": 2.0, "optimizer_step": 0.3, "sync": 0.2}
    specs = [
        StrategySpec("colocated", 2, 2, groups_per_step=4, group_size=2),
        StrategySpec("disaggregated", 2, 1, groups_per_step=4, group_size=2, gap=True),
        StrategySpec("disaggregated", 2, 2, groups_per_step=8, group_size=2, reward_workers=1, groups_per_task=2,
                     train_micro_batch_groups=2, gap=True),
        StrategySpec("disaggregated", 3, 2, groups_per_step=6, group_size=2, gap=True, max_staleness=1),
    ]
    for spec in specs:
        planner = StepPlanner(spec)
        for s in range(3):
            planner.plan_step(s, has_next=s + 1 < 3)
        ref = _ReferenceRunner(planner.plan, durations)
        ref.run_until(None)
        sim = SimulatedExecutor(planner.plan, TableCostModel(seconds=durations), Cluster.for_spec(spec, "any"))
        sim.run_until(None)
        assert {r.task: (r.start, r.end) for r in sim.timeline.records} == {
            r.task: (r.start, r.end) for r in ref.timeline.records
        }, spec.name


class _ScanCheckingRunner(_ReferenceRunner):
    """Checks, before every launch, the runner's event-driven ``launchable`` against a scan of
    every queue's head (what it replaced): the same tasks, in the same order."""

    def launchable(self):
        got = super().launchable()
        scan, seen = [], set()
        for w in self.plan.workers:
            t = self._head_task(w)
            if (t is None or w in self._busy or t.id in seen or t.id in self.running
                    or not all(d in self.done for d in t.deps)):
                continue
            if all(x not in self._busy and self._head_task(x) is t for x in t.workers):
                scan.append(t)
                seen.add(t.id)
        assert [t.id for t in got] == [t.id for t in scan]
        self.launches += len(got)
        return got


def test_the_runner_launches_what_a_scan_of_every_queue_head_would():
    rng = random.Random(1)
    for _ in range(30):
        spec = _random_spec(rng, rng.randint(2, 6), rng.choice([2, 4, 8]), 2)
        planner = StepPlanner(spec)
        for s in range(3):
            planner.plan_step(s, has_next=s + 1 < 3)
        # durations drawn per kind, some equal: ties make several tasks launchable at once
        durations = {k.value: rng.choice([0.5, 1.0, 1.0, 2.0]) for k in TaskKind}
        runner = _ScanCheckingRunner(planner.plan, durations)
        runner.launches = 0
        runner.run_until(None)
        assert runner.launches == len(planner.plan.tasks) == len(runner.done), spec


# ---------------------------------------------------------------------------- the bound


def _random_spec(rng: random.Random, devices: int, groups: int, group_size: int) -> StrategySpec:
    micro = [k for k in (1, 2, 4) if groups % k == 0]
    if rng.random() < 0.25:
        return StrategySpec("colocated", devices, devices, groups, group_size, groups_per_task=rng.choice(micro),
                            train_micro_batch_groups=rng.choice(micro))
    r = rng.randint(1, devices - 1)
    return StrategySpec(
        "disaggregated", r, devices - r, groups, group_size, groups_per_task=rng.choice(micro),
        train_micro_batch_groups=rng.choice(micro), gap=rng.random() < 0.6, max_staleness=int(rng.random() < 0.5),
    )


def test_no_simulated_schedule_beats_the_zero_bubble_bound(catalog):
    rng = random.Random(0)
    models = sorted(catalog.models)
    for _ in range(40):
        model = rng.choice(models)
        device = rng.choice(["H100", "H800", "A100"])
        devices = rng.choice([2, 4, 8, 12, 16, 24])  # 12, 24 and most splits put two pools on one node
        groups = rng.choice([8, 16])
        costs = CostModel.from_catalog(
            catalog, model, devices=[device], groups_per_step=groups, group_size=rng.choice([2, 4, 8]),
            num_steps=rng.choice([4, 10, 20]), sde_window=rng.choice([0, 2]), lora=rng.random() < 0.5,
            cfg=rng.random() < 0.5, train_device_batch=rng.choice([None, 1]),
        )
        spec = _random_spec(rng, devices, groups, costs.workload.group_size)
        cluster = Cluster.for_spec(spec, device)
        r = simulate(spec, costs, cluster, steps=4, warmup=1)
        assert r.images_per_s <= r.bound_images_per_s * (1 + 1e-9), (model, spec.name, r.summary())
        whole = r.images_per_step * len(r.step_end) / r.step_end[-1]
        assert whole <= r.bound_images_per_s * (1 + 1e-9)
        assert 0.0 <= r.bubble_fraction <= 1.0


def test_no_schedule_beats_the_bound_with_arbitrary_task_costs():
    rng = random.Random(1)
    for _ in range(40):
        per_image = {k: rng.uniform(0.01, 1.0) for k in ("generate", "reward", "train")}
        fixed = {k: rng.uniform(0.0, 0.5) for k in ("generate", "reward", "train", "optimizer_step", "sync")}
        spec = _random_spec(rng, rng.choice([2, 3, 6]), 6, 2)
        costs = TableCostModel(seconds=fixed, per_image=per_image, switch=rng.choice([0.0, 0.3]), group_size=2)
        r = simulate(spec, costs, Cluster.for_spec(spec, "any"), steps=4, warmup=1)
        assert r.images_per_s <= r.bound_images_per_s * (1 + 1e-9), (spec, per_image, fixed)


def test_the_bound_is_a_linear_program_exact_for_one_device_type():
    one = {"a": {"generate": 1.0, "reward": 0.5, "train": 2.0}}
    assert max_throughput({"a": 4}, one) == pytest.approx(4 / 3.5)
    # two types: no split of the phases over them (checked on a grid) does better than the LP
    rng = random.Random(2)
    for _ in range(20):
        sec = {d: {p: rng.uniform(0.1, 2.0) for p in ("g", "r", "t")} for d in ("a", "b")}
        n = {"a": rng.randint(1, 8), "b": rng.randint(1, 8)}
        lp = max_throughput(n, sec)
        grid = 0.0
        for fg in range(11):
            for ft in range(11):
                for fr in (0, 5, 10):
                    f = {"g": fg / 10, "r": fr / 10, "t": ft / 10}
                    la = sum(f[p] * sec["a"][p] for p in f) / n["a"]
                    lb = sum((1 - f[p]) * sec["b"][p] for p in f) / n["b"]
                    grid = max(grid, 1 / max(la, lb))
        assert grid <= lp * (1 + 1e-9)
        assert lp <= grid * 1.25  # and the grid gets near it


def test_no_schedule_beats_the_bound_with_device_types_each_fastest_at_a_different_phase(catalog):
    """Two synthetic device types: GEN generates 5x faster than TRN, TRN trains 5x faster than GEN.
    Putting each phase on its best type beats the former bound (the fastest type's per-image sum
    for every device); no simulated schedule beats the linear program's bound."""
    h800 = catalog.devices["H800"]
    gen = dataclasses.replace(h800, name="GEN", mfu_forward=0.5, mfu_train=0.08, mfu_half_tokens=0.0)
    trn = dataclasses.replace(h800, name="TRN", mfu_forward=0.1, mfu_train=0.4, mfu_half_tokens=0.0)
    base = _costs(catalog, "flux-12b")
    costs = dataclasses.replace(base, devices={"GEN": gen, "TRN": trn})
    rng = random.Random(3)
    beat_old = 0.0
    for _ in range(16):
        groups = rng.choice([8, 16])
        c = costs.with_workload(groups_per_step=groups, group_size=rng.choice([2, 4]), num_steps=rng.choice([4, 8]),
                                sde_window=rng.choice([1, 2, 0]), train_device_batch=1)
        r_n, t_n = rng.choice([2, 4, 6]), rng.choice([2, 4, 8])
        r_dev, t_dev = ("GEN", "TRN") if rng.random() < 0.75 else ("TRN", "GEN")
        spec = StrategySpec("disaggregated", r_n, t_n, groups, c.workload.group_size, gap=rng.random() < 0.8,
                            max_staleness=int(rng.random() < 0.6), groups_per_task=rng.choice([1, 2]))
        cluster = Cluster({"rollout": PoolPlacement(r_n, 1, r_dev), "trainer": PoolPlacement(t_n, 1, t_dev)})
        res = simulate(spec, c, cluster, steps=4, warmup=1)
        assert res.images_per_s <= res.bound_images_per_s * (1 + 1e-9), (spec.name, r_dev, res.summary())
        names = [r_dev] * r_n + [t_dev] * t_n
        old = min(len(names) / sum(c.device_seconds_per_image(c.device(d)).values()) for d in set(names))
        beat_old = max(beat_old, res.images_per_s / old)
    assert beat_old > 1.0  # the former bound was not a bound here


def test_efficiency_grows_with_tokens_per_forward_up_to_the_device_asymptote(catalog):
    dev = catalog.devices["H800"]
    effs = [CostModel.efficiency(dev, t) for t in (256, 1024, 4096, 16384, 65536, 1e7)]
    assert effs == sorted(effs) and effs[-1] <= dev.mfu_forward
    assert CostModel.efficiency(dev, dev.mfu_half_tokens) == pytest.approx(dev.mfu_forward / 2)
    c = _costs(catalog, "qwen-image-20b", height=512, width=512)
    # the same images in forwards of one sample take longer than in one batched forward, but only a
    # little: the curve is the H200's measured one (FLUX.1: one-row calls 1.12x a 24-row call per
    # sample), no longer the steep one fitted to veRL-Omni's engine (2.5x)
    one, batched = c.denoise_seconds(32, dev, batch=1), c.denoise_seconds(32, dev)
    assert batched < one < 1.15 * batched


def test_a_balanced_pipeline_gets_close_to_the_bound(catalog):
    costs = _costs(catalog, "hunyuanvideo-13b", groups_per_step=32)
    gen, train = costs.device_seconds_per_image(catalog.devices["H800"])["generate"], costs.device_seconds_per_image(catalog.devices["H800"])["train"]
    # 8 rollout + 8 trainers match the generate:train ratio (training at our measured efficiency;
    # the bound charges no recomputation, so checkpointing is outside it)
    assert 0.45 < gen / (gen + train) < 0.65
    # a 13B full fine-tune trains only sharded (FSDP in lockstep); its passes are then checkpointed
    # one-sample calls with collectives, which the bound does not charge either
    spec = StrategySpec("disaggregated", 8, 8, 32, costs.workload.group_size, gap=True, max_staleness=1, fsdp=True)
    cluster = Cluster.for_spec(spec, "H800")
    assert costs.for_spec(spec).memory_problems(cluster) == []
    r = simulate(spec, costs, cluster)
    assert 0.7 < r.fraction_of_bound <= 1.0


def test_the_fsdp_state_stream_is_charged_to_every_rank_after_the_optimizer_step_not_to_the_sync(catalog):
    """Under FSDP our trainers stream the full weights out of their shards after each optimizer
    step, all ranks together (workers/fsdp.py: stream_full_state); trainer 0 sends what it kept,
    so the sync gathers nothing. Unsharded trainers stream nothing."""
    c = _costs(catalog, "flux-12b")
    c = c.with_system(dataclasses.replace(c.system, fsdp_mesh="flat"))  # one shard group of 16 (auto: 2 of 8)
    w = c.workload
    spec = StrategySpec("disaggregated", 16, 16, w.groups_per_step, w.group_size, gap=True, fsdp=True,
                        train_micro_batch_groups=4)
    cluster = Cluster.for_spec(spec, "H800")
    sharded, unsharded = c.for_spec(spec), c.for_spec(dataclasses.replace(spec, fsdp=False))
    dev = catalog.devices["H800"]
    group = sharded.train_group(cluster)
    stream = sharded.state_stream_seconds(dev, group)
    assert group.shard == 16 and stream == pytest.approx(
        sharded.sync_bytes * 15 / 16 / sharded.collective_bw(dev, group.shard_nodes))
    # an engine that always shards gathers at the sync instead, and streams nothing at the step
    engine = sharded.with_system(dataclasses.replace(sharded.system, always_sharded=True))
    assert sharded.optimizer_seconds(dev, group) == pytest.approx(engine.optimizer_seconds(dev, group) + stream)
    assert engine.sync_seconds(cluster) == pytest.approx(sharded.sync_seconds(cluster) + stream)
    assert sharded.sync_seconds(cluster) == pytest.approx(unsharded.sync_seconds(cluster))  # no gather in our sync
    assert unsharded.state_stream_seconds(dev, unsharded.train_group(cluster)) == 0.0


def test_a_worker_generating_with_its_sharded_module_pays_each_forwards_all_gather_beyond_its_compute(catalog):
    """Under FSDP a fused worker (or a TAG trainer) generates with its own sharded module: every
    transformer call all-gathers the blocks and frees them after it (workers/fsdp.py), its
    compute hiding part of it (comm_overlap), and there is no generation copy to refresh when it
    switches. A rollout worker holds the whole model: nothing to gather. veRL-Omni's separate
    engine is given a gathered copy at the switch (reload) instead."""
    c = _costs(catalog, "flux-12b")
    c = c.with_system(dataclasses.replace(c.system, fsdp_mesh="flat"))  # one shard group of 32 (auto: 4 of 8)
    w = c.workload
    spec = StrategySpec("colocated", rollout_workers=32, trainer_workers=32, groups_per_step=w.groups_per_step,
                        group_size=w.group_size, fsdp=True, train_micro_batch_groups=8)
    cluster = Cluster.for_spec(spec, "H800")
    cs, dev = c.for_spec(spec), catalog.devices["H800"]
    group = cs.train_group(cluster)
    gather = cs.generation_gather_seconds(dev, cluster, "fused")
    assert group.shard == 32 and gather == cs.fsdp_gather_seconds(dev, group) > 0
    assert cs.generation_gather_seconds(dev, cluster, "rollout") == 0.0
    assert c.for_spec(dataclasses.replace(spec, fsdp=False)).generation_gather_seconds(dev, cluster, "fused") == 0.0
    # each call pays what its compute does not hide: 2 calls of 2 rows and 1 of 1 for 5 samples
    # (every row at the efficiency of the 2-row call, as the compute itself is charged)
    big, overhead = 10.0, dev.forward_overhead_s
    row = (cs.denoise_seconds(2, dev, 2) - overhead) / 2
    hidden = {n: cs.system.comm_overlap * (overhead + n * row) for n in (1, 2)}
    assert cs.denoise_seconds(5, dev, 2, big) - cs.denoise_seconds(5, dev, 2) == pytest.approx(
        2 * (big - hidden[2]) + (big - hidden[1]))
    assert cs.denoise_seconds(5, dev, 2, 1e-6) == cs.denoise_seconds(5, dev, 2)  # a small gather is hidden
    # a generate task on the fused worker is charged it; no reload at the switch for an in-place generator
    fused = WorkerId("fused", 0)
    gen = Task(TaskId.generate((0,)), TaskKind.GENERATE, (fused,), 0, groups=(0,), images=w.group_size)
    assert cs.task_seconds(gen, fused, cluster) == pytest.approx(cs.generate_seconds(
        w.group_size, dev, batch=cs.rollout_batch(cluster, "fused"), gather_s=gather) + cs.system.task_overhead_s)
    assert cs.reload_seconds(dev, group) == 0.0
    omni = cs.with_system(catalog.systems["verl-omni"])
    assert omni.reload_seconds(dev, group) > 0 and omni.generation_gather_seconds(dev, cluster, "fused") == 0.0


def test_the_optimizer_step_is_charged_the_host_snapshot_the_trainer_copies(catalog):
    """Trainer 0 copies each version into its pinned host snapshot (sync/snapshot.py) after the
    optimizer step when it is the weight-sync sender: under FSDP overlapping the state stream's
    gathers, so the step pays the copy beyond the stream; a colocated run copies nothing."""
    c = _costs(catalog, "flux-12b")
    c = c.with_system(dataclasses.replace(c.system, fsdp_mesh="flat"))  # one shard group of 16 (auto: 2 of 8)
    w = c.workload
    spec = StrategySpec("disaggregated", 16, 16, w.groups_per_step, w.group_size, gap=True, fsdp=True,
                        train_micro_batch_groups=4)
    cluster = Cluster.for_spec(spec, "H800")
    dev = catalog.devices["H800"]
    sharded, unsharded = c.for_spec(spec), c.for_spec(dataclasses.replace(spec, fsdp=False))
    copy = sharded.sync_bytes / (dev.host_link_gbps * 1e9)
    stream = sharded.state_stream_seconds(dev, sharded.train_group(cluster))
    assert copy > stream > 0  # PCIe is the slower link: the step pays the copy beyond the stream
    assert sharded.snapshot_seconds(dev, cluster) == pytest.approx(copy - stream)
    assert unsharded.snapshot_seconds(dev, cluster) == pytest.approx(copy)
    engine = sharded.with_system(dataclasses.replace(sharded.system, always_sharded=True))
    assert engine.snapshot_seconds(dev, cluster) == 0.0  # veRL's engine keeps no snapshot
    colocated = StrategySpec("colocated", 16, 16, w.groups_per_step, w.group_size, fsdp=True, train_micro_batch_groups=4)
    fused = c.for_spec(colocated)
    one_pool = Cluster.for_spec(colocated, "H800")
    # colocated, nobody sends: no snapshot and no state stream per step (the worker gathers the
    # state only when it is read: DiffusionWorker.refresh_full_state, tests/unit/test_sync_snapshot.py)
    fused_group = fused.train_group(one_pool)
    assert fused_group.shard == 16 and not fused_group.sends
    assert fused.snapshot_seconds(dev, one_pool) == 0.0 and fused.state_stream_seconds(dev, fused_group) == 0.0
    fused_engine = fused.with_system(dataclasses.replace(fused.system, always_sharded=True))
    assert fused.optimizer_seconds(dev, fused_group) == pytest.approx(fused_engine.optimizer_seconds(dev, fused_group))


def test_trainers_park_the_optimizer_state_exactly_when_that_spares_checkpointing(catalog):
    """``digen.model.optimizer_offload=auto`` as the memory planner decides it for the run
    (``memory.plan.decide_job``, tests/unit/test_memory.py): a disaggregated trainer parks its AdamW
    state exactly when a pass then fits without checkpointing and does not with the state
    resident, and pays the host round trip in its optimizer task; forced either way by the
    workload; fused workers never (their parking is the system's switch)."""
    from dataclasses import replace as with_fields

    from verl_digen.memory.plan import plan_roles, training_fits

    split = Cluster({"trainer": PoolPlacement(4, 1, "H800"), "rollout": PoolPlacement(8, 1, "H800")})
    dev = catalog.devices["H800"]
    full = _costs(catalog, "flux-12b", lora=False).with_workload(call_rows=1, fsdp=True)
    group, job = full.train_group(split), full.memory_job(split)
    gib = full.role_gib(split)
    assert not training_fits(plan_roles(with_fields(job, checkpointing=False, optimizer_offload=False), gib))
    assert training_fits(plan_roles(with_fields(job, checkpointing=False, optimizer_offload=True), gib))
    assert full.optimizer_parked(dev, group) is True and full.checkpointing(dev, group) is False
    assert job.optimizer_offload is True and job.checkpointing is False
    resident = full.with_workload(optimizer_offload=False)
    r_group = resident.train_group(split)
    assert resident.checkpointing(dev, r_group) is True and resident.optimizer_parked(dev, r_group) is False
    trip = 2 * full.optimizer_shard_bytes(group) / (dev.host_link_gbps * 1e9)
    assert full.optimizer_task_seconds(dev, group) == pytest.approx(resident.optimizer_task_seconds(dev, r_group) + trip)
    assert full.optimizer_seconds(dev, group) == pytest.approx(resident.optimizer_seconds(dev, r_group) + trip)
    assert full.train_seconds(12, dev, group) < resident.train_seconds(12, dev, r_group)  # no recomputed forward
    # sharded over 8 trainers the pass fits with the state resident: nothing parked
    eight = Cluster({"trainer": PoolPlacement(8, 1, "H800"), "rollout": PoolPlacement(8, 1, "H800")})
    assert full.optimizer_parked(dev, full.train_group(eight)) is False
    # where even checkpointed passes fit only parked (HunyuanVideo 13B, 4 trainers), parking is what fits
    hy = _costs(catalog, "hunyuanvideo-13b", lora=False).with_workload(call_rows=2, fsdp=True)
    four = Cluster({"trainer": PoolPlacement(4, 1, "H800"), "rollout": PoolPlacement(8, 1, "H800")})
    hj = hy.memory_job(four)
    assert not training_fits(plan_roles(with_fields(hj, checkpointing=True, optimizer_offload=False), hy.role_gib(four)))
    g = hy.train_group(four)
    assert hy.optimizer_parked(dev, g) is True and hy.checkpointing(dev, g) is True and hy.memory_problems(four) == []
    fused = Cluster({"fused": PoolPlacement(16, 2, "H800")})
    assert full.optimizer_parked(dev, full.train_group(fused), "fused") is False


# ---------------------------------------------------------------------------- GAT


def _gat_spec(rollout: int, trainers: int, w, **kw) -> StrategySpec:
    return StrategySpec("disaggregated", rollout, trainers, w.groups_per_step, w.group_size, gap=True, gat=True, **kw)


def test_a_gat_micro_batch_on_a_rollout_worker_costs_a_trainers_plus_the_gradient_send_and_no_switch(catalog):
    """GAT: a rollout worker trains a micro-batch as a trainer would on its device (one
    unsharded rank, the trainers' passes, the run's checkpointing) and sends the LoRA gradients
    (fp32) to trainer 0 over the link between the pools; it switches nothing (no offload, no
    reload), so neither that task nor its next generate pays a switch."""
    lora = _costs(catalog, "flux-12b", lora=True)
    w = lora.workload
    spec = _gat_spec(4, 4, w)
    c = lora.for_spec(spec)
    assert c.workload.gat and not lora.workload.gat
    cluster = Cluster.for_spec(spec, "H800")  # both pools on one node: NVLink
    dev, group = catalog.devices["H800"], c.train_group(cluster)
    assert group.shard == 1 and group.gat_device == "H800"
    images = spec.train_micro_batch_groups * w.group_size
    task = Task(TaskId.train(0, 0), TaskKind.TRAIN, (WorkerId("rollout", 1),), 0, groups=(0,), images=images)
    roll, trainer = WorkerId("rollout", 1), WorkerId("trainer", 0)
    send = 4.0 * c.trainable_params / (dev.intra_node_gbps * 1e9 * c.system.nccl_efficiency)
    assert c.gat_gradient_bytes() == 4.0 * c.trainable_params  # fp32 LoRA gradients: megabytes
    assert c.gat_gradient_send_seconds(cluster) == pytest.approx(send)
    as_trainer = c.task_seconds(task, trainer, cluster, switch_from="train")
    for mode in ("generate", "train", None):
        assert c.task_seconds(task, roll, cluster, switch_from=mode) == pytest.approx(as_trainer + send)
    assert c.mode_of(task, roll) is None and c.mode_of(task, trainer) == "train"
    # on a rollout pool of another device type: a trainer's passes on that device, the trainers' checkpointing
    mixed = CostModel.from_catalog(catalog, "flux-12b", devices=["H800", "A100"], lora=True).for_spec(spec)
    hetero = Cluster({"rollout": PoolPlacement.spread((0, 4), "A100"), "trainer": PoolPlacement.spread((4, 0), "H800")})
    g = mixed.train_group(hetero)
    a100, h800 = catalog.devices["A100"], catalog.devices["H800"]
    ckpt = mixed.checkpointing(h800, g)
    link = min(a100.inter_node_gbps, h800.inter_node_gbps)  # two nodes
    expected = (mixed.train_seconds(images, a100, g, pool="trainer", checkpointing=ckpt)
                + 4.0 * mixed.trainable_params / (link * 1e9 * mixed.system.nccl_efficiency) + mixed.system.task_overhead_s)
    assert mixed.task_seconds(task, roll, hetero, switch_from="generate") == pytest.approx(expected)
    assert expected > mixed.task_seconds(task, trainer, hetero, switch_from="train")  # an A100 trains slower
    # the simulator records no switch on a rollout worker's training or on its next generate
    sim = simulate(spec, lora, cluster, steps=3, warmup=1, gat_micro_batches=4)
    on_rollout = [r for r in sim.timeline.records if r.workers[0].startswith("rollout")]
    assert sum(r.kind == "train" for r in on_rollout) == 3 * 4
    assert not any("switch" in r.extra for r in on_rollout)


def test_gat_rollout_training_that_does_not_fit_turns_checkpointing_on_for_the_run(catalog):
    """The memory planner's rule (tests/unit/test_memory.py), which the cost model asks: with
    ``gradient_checkpointing`` auto, checkpointing is on when any role that trains does not fit a
    pass without it; under GAT that includes the rollout workers (the memory planner's rollout
    ``train`` phase: bf16 model, fp32 adapters and gradients, the reward model they score with,
    the trainers' pass). Here FLUX passes of 2 samples fit an H800 trainer but not an L40S
    rollout worker: on for every pass of the run, the trainers' too; a rollout worker that does not
    fit even checkpointed is a memory problem naming GAT's micro-batch and the L40S."""
    lora = CostModel.from_catalog(catalog, "flux-12b", devices=["H800", "L40S"], lora=True)
    w = lora.workload
    spec = _gat_spec(4, 4, w)
    cluster = Cluster({"rollout": PoolPlacement(4, 1, "L40S"), "trainer": PoolPlacement(4, 1, "H800")})
    h800 = catalog.devices["H800"]
    plain = lora.for_spec(dataclasses.replace(spec, gat=False)).with_workload(call_rows=2)
    gat = lora.for_spec(spec).with_workload(call_rows=2)
    g0, g = plain.train_group(cluster), gat.train_group(cluster)
    assert gat.pass_batch(h800, g) == 2
    (rollout,) = [p for p in gat.memory_plans(cluster) if p.role == "rollout"]
    assert "train" in rollout.phases and rollout.device_gib == 48  # the L40S's
    assert plain.checkpointing(h800, g0) is False  # the trainers alone fit
    assert gat.checkpointing(h800, g) is True and gat.optimizer_parked(h800, g) is False
    assert gat.train_seconds(24, h800, g) > plain.train_seconds(24, h800, g0)  # the recomputed forward
    assert gat.memory_problems(cluster) == []
    # configured off: the rollout workers' pass is a memory problem naming GAT and the device
    off = gat.with_workload(gradient_checkpointing=False)
    (problem,) = off.memory_problems(cluster)
    assert problem.startswith("rollout: training a GAT micro-batch holds") and "without checkpointing" in problem
    assert problem.endswith("more than the 48 GiB of one L40S")
    assert plain.with_workload(gradient_checkpointing=False).memory_problems(cluster) == []


def test_gat_speeds_up_a_trainer_bound_step_and_stays_out_of_a_rollout_bound_one(catalog):
    """GAT's share is decided per step from the rates measured the step before
    (``schedule/elastic.py: decide_gat_share``): with few trainers the rollout workers train some
    of the first mini-batch and the steady step is shorter; with few rollout workers it decides
    no share and the step is the one without GAT."""
    lora = _costs(catalog, "flux-12b", lora=True)
    w = lora.workload

    def run(r: int, t: int, gat: bool):
        spec = StrategySpec("disaggregated", r, t, w.groups_per_step, w.group_size, gap=True, gat=gat)
        return simulate(spec, lora, Cluster.for_spec(spec, "H800"), steps=4, warmup=2)

    with_gat, without = run(12, 4, True), run(12, 4, False)  # trainer-bound
    assert with_gat.step_time_s < 0.8 * without.step_time_s
    assert all(m["gat/micro_batches"] > 0 for m in with_gat.step_metrics[2:])
    assert all("gat/micro_batches" not in m for m in without.step_metrics)
    with_gat, without = run(4, 12, True), run(4, 12, False)  # rollout-bound
    assert all(m["gat/micro_batches"] == 0 for m in with_gat.step_metrics)
    assert with_gat.step_time_s == pytest.approx(without.step_time_s)


def test_a_pickled_cost_model_brings_its_memory_decisions_to_an_equal_cluster(monkeypatch):
    """An emulated worker gets the cost model and the cluster pickled apart: it must find the
    driver's memory decisions (the memory planner traces the real model on the meta device,
    seconds each; 32 workers doing it at once stalled the emulated runs) and make them only for a
    cluster it has not seen."""
    import pickle

    import verl_digen.sim.cost_model as cm
    costs = cm.CostModel.from_catalog(cm.load_catalog(), "flux-12b", devices=["H800"])
    cluster = cm.Cluster({"rollout": cm.PoolPlacement.spread([8, 0], "H800"),
                          "trainer": cm.PoolPlacement.spread([0, 8], "H800")})
    group = costs.train_group(cluster)
    copy, cluster_copy = pickle.loads(pickle.dumps(costs)), pickle.loads(pickle.dumps(cluster))
    made = []
    real = cm.CostModel._memory_job
    monkeypatch.setattr(cm.CostModel, "_memory_job", lambda self, c: made.append(c) or real(self, c))
    assert copy.train_group(cluster_copy) == group and made == []
    other = cm.Cluster({"rollout": cm.PoolPlacement.spread([4, 0], "H800"),
                        "trainer": cm.PoolPlacement.spread([0, 8], "H800")})
    copy.train_group(other)
    assert made == [other]


def test_a_gang_costed_once_per_pool_device_and_mode_is_the_gang_costed_per_worker(catalog):
    """The simulator costs a gang's members of one pool, device type and mode once when the cost
    model says its seconds depend on nothing else of a worker (``alike_by_pool_and_device``): the
    same timeline, to the bit, as costing every member, on a colocated FSDP gang that switches
    modes and a disaggregated run of two device types with TAG trainers generating."""

    class PerWorker(CostModel):
        alike_by_pool_and_device = False

    def per_worker(costs: CostModel) -> CostModel:
        return PerWorker(**{f.name: getattr(costs, f.name) for f in dataclasses.fields(costs) if f.init})

    flux = _costs(catalog, "flux-12b", groups_per_step=8)
    coloc = StrategySpec("colocated", 4, 4, 8, flux.workload.group_size, groups_per_task=2,
                         train_micro_batch_groups=2, fsdp=True)
    mixed = CostModel.from_catalog(catalog, "flux-12b", devices=["H800", "L40S"], lora=True, groups_per_step=8)
    disagg = StrategySpec("disaggregated", 2, 4, 8, mixed.workload.group_size, gap=True, tag=True, max_staleness=1)
    hetero = Cluster({"rollout": PoolPlacement(2, 1, "L40S"), "trainer": PoolPlacement(4, 1, "H800")})
    for spec, costs, cluster in ((coloc, flux, Cluster.for_spec(coloc, "H800")), (disagg, mixed, hetero)):
        costs = costs.for_spec(spec)
        once = simulate(spec, costs, cluster, steps=3, warmup=1)
        each = simulate(spec, per_worker(costs), cluster, steps=3, warmup=1)
        assert [dataclasses.astuple(r) for r in once.timeline.records] == [
            dataclasses.astuple(r) for r in each.timeline.records]
        assert once.step_end == each.step_end
        assert any(len(r.workers) > 1 for r in once.timeline.records)  # gangs were costed
        assert any("switch" in r.extra for r in once.timeline.records)  # workers changed modes
    assert any(r.kind == "generate" and r.workers[0].startswith("trainer") for r in once.timeline.records)  # TAG
