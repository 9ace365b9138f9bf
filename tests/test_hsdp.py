"""HSDP (FSDP2 over a 2-D ``("replicate", "shard")`` mesh) for trainer pools that span nodes, and
the gradient reduction dtype: the layout each placement gets, the same training as flat FSDP,
sharded checkpoints that resume bitwise, and what the cost model and memory planner charge.

The rank tests run 4 gloo processes on CPU as 2 "nodes" of 2 (each rank names its node; Ray's
node id in a worker); node membership is interleaved (ranks 0 and 2 on one node) because a pool's
ranks need not fill nodes in rank order.
"""

from __future__ import annotations

import pytest
import torch

from runs import run_ranks
from test_fsdp import TinyDenoiser, full_params, make_data, max_diff, per_sample_loss
from verl_digen.config.schema import ConfigError
from verl_digen.memory.fsdp_layout import (
    choose_layout,
    mesh_shape,
    reduce_buffer_bytes,
    reduce_dtype,
    reduce_traffic,
)

WORLD = 4
N_PER_RANK = 3
# Flat and HSDP sum the same four fp32 gradients in a different order (one ring over four ranks;
# two rings of two, then an all-reduce of the two partial sums), so the sums may differ in their
# last bits (relative 2**-24 ~ 6e-8); after clipping, two AdamW steps at lr 1e-2 move each weight
# (of order 1) by lr x m / sqrt(v), which carries such a difference as ~1e-9, and the weights
# round at ~6e-8 per step: 1e-6 is over 10x what two steps can accumulate, and 1e4 x below a
# wrong reduction (a missing or doubled replica's gradient changes weights by ~1e-2).
FP32_TOL = 1e-6


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


# ---------------------------------------------------------------------- 4 gloo ranks as 2 nodes x 2


_MESHES: dict = {}
MESH_TIMEOUT_S = 1234.0  # the run's planned collective deadline, as the worker passes it


def _group_timeouts(mesh) -> list[float]:
    """Each dimension's process-group timeout, in seconds, as its backend holds it."""
    return [mesh.get_group(d)._get_backend(torch.device("cpu")).options._timeout.total_seconds()
            for d in range(mesh.ndim)]


def _build(layout, seed: int, dtype=torch.float32):
    """A tiny denoiser sharded as the workers shard theirs, over ``layout``'s mesh (built once per
    set of rows: each 2-D mesh is four new process groups)."""
    from verl_digen.workers.fsdp import reduce_torch_dtype, shard_for_training, training_mesh

    if layout.rows not in _MESHES:
        _MESHES[layout.rows] = training_mesh(layout, timeout_s=MESH_TIMEOUT_S)
    torch.manual_seed(seed)
    model = TinyDenoiser().to(dtype)
    shard_for_training(model, mesh=_MESHES[layout.rows], reduce_dtype=reduce_torch_dtype(layout))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train_step(model, opt, rank: int, world: int, step: int) -> float:
    """One optimizer step: each rank's loss is its share of the global batch's mean (the workers'
    sum reduction), the gradient clipped as ``PolicyUpdater.optimizer_step`` does (a norm over
    the mesh: within a replica under HSDP). Returns the norm before clipping."""
    x, y = make_data(N_PER_RANK, seed=100 * step + rank)
    (per_sample_loss(model, x, y).sum() / (N_PER_RANK * world)).backward()
    norm = torch.nn.utils.clip_grad_norm_(list(model.parameters()), 0.05).item()
    opt.step()
    opt.zero_grad()
    return norm


def _full_grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.full_tensor().float() for n, p in model.named_parameters()}


def _scenario_hsdp(rank: int, world: int) -> dict:
    import tempfile
    import time

    import torch.distributed as dist
    from torch.distributed.tensor import Replicate, Shard

    from verl_digen.workers.fsdp import group_layout, stream_full_state
    from verl_digen.workers.sharded_state import load_rank_state, save_rank_state

    start = time.perf_counter()
    node = f"node-{rank % 2}"
    hsdp = group_layout(node, mesh="auto", reduce="auto", lora=False, weights_dtype="fp32")
    flat = group_layout(node, mesh="flat", reduce="auto", lora=False, weights_dtype="fp32")
    out: dict = {"rows": hsdp.rows, "flat_rows": flat.rows, "reduce": hsdp.reduce_dtype}

    # The same two AdamW steps, flat and HSDP.
    a, a_opt = _build(hsdp, seed=0)
    b, b_opt = _build(flat, seed=0)
    w = a.transformer_blocks[0].proj.weight
    out["timeouts"] = _group_timeouts(_MESHES[hsdp.rows])
    out["placements"] = [type(p).__name__ for p in w.placements]
    out["shard_dims"] = [p.dim for p in w.placements if isinstance(p, Shard)]
    out["replicated"] = any(isinstance(p, Replicate) for p in w.placements)
    out["local_rows"] = w.to_local().shape[0]
    norms = [(_train_step(a, a_opt, rank, world, step), _train_step(b, b_opt, rank, world, step)) for step in range(2)]
    out["norms"] = norms
    out["hsdp_vs_flat"] = max_diff(full_params(a), full_params(b))
    streamed = {n: t.clone() for n, t in stream_full_state(a, lora_only=False)}
    whole = a.state_dict()
    out["stream_bitwise"] = sorted(streamed) == sorted(whole) and all(
        torch.equal(streamed[n], whole[n].full_tensor()) for n in whole)

    # A sharded checkpoint of the HSDP ranks after step 2; step 3 straight on, and from the checkpoint.
    box = [tempfile.mkdtemp(prefix="hsdp_ckpt_") if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    kwargs = dict(ema=None, lora_only=False, rank=rank, group=dist.group.WORLD)
    save_rank_state(box[0], module=a, optimizer=a_opt, version=2, **kwargs)
    saved = full_params(a)
    _train_step(a, a_opt, rank, world, 2)
    c, c_opt = _build(hsdp, seed=1)
    load_rank_state(box[0], module=c, optimizer=c_opt, **kwargs)
    _train_step(c, c_opt, rank, world, 2)
    out["resumed_bitwise"] = all(torch.equal(x, y) for x, y in zip(full_params(a).values(), full_params(c).values()))
    d, d_opt = _build(flat, seed=1)  # the same checkpoint resharded onto a flat layout
    load_rank_state(box[0], module=d, optimizer=d_opt, **kwargs)
    out["flat_load_bitwise"] = all(torch.equal(saved[n], t) for n, t in full_params(d).items())

    # bf16 weights: a bf16 reduction (HSDP, auto) against an fp32 one (flat), one backward.
    half = group_layout(node, mesh="auto", reduce="auto", lora=False, weights_dtype="bf16")
    half_fp32 = group_layout(node, mesh="flat", reduce="fp32", lora=False, weights_dtype="bf16")
    out["bf16_reduce"] = half.reduce_dtype
    e, _ = _build(half, seed=0, dtype=torch.bfloat16)
    f, _ = _build(half_fp32, seed=0, dtype=torch.bfloat16)
    policy = e._get_fsdp_state()._fsdp_param_group.mp_policy
    out["policy_reduce"] = str(policy.reduce_dtype)
    for m in (e, f):
        x, y = make_data(N_PER_RANK, seed=rank)
        (per_sample_loss(m, x.bfloat16(), y.bfloat16()).sum() / (N_PER_RANK * world)).backward()
    ge, gf = _full_grads(e), _full_grads(f)
    out["grad_dtype"] = str(next(e.parameters()).grad.dtype)
    out["bf16_rel"] = max(float((ge[n] - gf[n]).abs().max() / gf[n].abs().max().clamp_min(1e-12)) for n in gf)

    # The bf16 full fine-tune's checkpoint (fp32 masters and their AdamW state, workers/training.py
    # MasterWeights) of HSDP ranks reducing in bf16: resumed, the next step is bitwise the same.
    def master_step(model, masters, opt, step):
        x, y = make_data(N_PER_RANK, seed=100 * step + rank)
        (per_sample_loss(model, x.bfloat16(), y.bfloat16()).sum() / (N_PER_RANK * world)).backward()
        masters.accumulate_grads()
        opt.step()
        opt.zero_grad()
        masters.copy_to_model()

    from verl_digen.workers.training import MasterWeights

    e.zero_grad()
    e_masters = MasterWeights(list(e.parameters()), torch.float32)
    e_opt = torch.optim.AdamW(e_masters.masters, lr=1e-2)
    master_step(e, e_masters, e_opt, 0)
    box = [tempfile.mkdtemp(prefix="hsdp_bf16_ckpt_") if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    save_rank_state(box[0], module=e, optimizer=e_opt, version=1, master=e_masters, **kwargs)
    master_step(e, e_masters, e_opt, 1)
    g, _ = _build(half, seed=1, dtype=torch.bfloat16)
    g_masters = MasterWeights(list(g.parameters()), torch.float32)
    g_opt = torch.optim.AdamW(g_masters.masters, lr=1e-2)
    load_rank_state(box[0], module=g, optimizer=g_opt, master=g_masters, **kwargs)
    master_step(g, g_masters, g_opt, 1)
    out["bf16_resumed_bitwise"] = all(torch.equal(x, y) for x, y in zip(full_params(e).values(), full_params(g).values()))
    out["seconds"] = time.perf_counter() - start
    return out


@pytest.fixture(scope="module")
def hsdp_ranks() -> dict:
    return run_ranks(_scenario_hsdp, world=WORLD)


@pytest.mark.e2e
def test_the_mesh_is_one_replica_per_node_sharded_within_it(hsdp_ranks):
    r = hsdp_ranks[0]
    print(f"ranks' scenario: {max(x['seconds'] for x in hsdp_ranks.values()):.1f} s")
    assert r["rows"] == ((0, 2), (1, 3)) and r["flat_rows"] == ((0, 1, 2, 3),)
    assert r["placements"] == ["Replicate", "Shard"] and r["shard_dims"] == [0]
    # both dimensions' subgroups time out at the run's deadline, not the backend's default (NCCL's
    # 10 minutes; split_group and new_group do not inherit the default group's)
    assert all(x["timeouts"] == [MESH_TIMEOUT_S] * 2 for x in hsdp_ranks.values())
    # DIM=5 rows over the 2 ranks of a node: 3 + 2 (flat over 4 would be 2, 2, 1, 0)
    assert sorted(hsdp_ranks[k]["local_rows"] for k in range(WORLD)) == [2, 2, 3, 3]


@pytest.mark.e2e
def test_hsdp_trains_as_flat_fsdp_in_fp32(hsdp_ranks):
    print("max |HSDP - flat| after two steps:", max(r["hsdp_vs_flat"] for r in hsdp_ranks.values()))
    for r in hsdp_ranks.values():
        assert r["reduce"] == "fp32"
        assert r["hsdp_vs_flat"] <= FP32_TOL, r["hsdp_vs_flat"]
        for hsdp_norm, flat_norm in r["norms"]:  # clipping was on (0.05), with the same norm
            assert hsdp_norm > 0.05 and hsdp_norm == pytest.approx(flat_norm, rel=1e-6)
        assert r["stream_bitwise"]


@pytest.mark.e2e
def test_a_sharded_checkpoint_of_hsdp_ranks_resumes_bitwise_and_loads_flat(hsdp_ranks):
    for r in hsdp_ranks.values():
        assert r["resumed_bitwise"]
        assert r["flat_load_bitwise"]
        assert r["bf16_resumed_bitwise"]  # bf16 weights, fp32 masters and AdamW, bf16 reduction


@pytest.mark.e2e
def test_a_bf16_full_fine_tune_reduces_in_bf16_within_bf16_rounding(hsdp_ranks):
    print("max relative |bf16 - fp32 reduction|:", max(r["bf16_rel"] for r in hsdp_ranks.values()))
    for r in hsdp_ranks.values():
        assert r["bf16_reduce"] == "bf16" and r["policy_reduce"] == "torch.bfloat16" and r["grad_dtype"] == "torch.bfloat16"
        # 4 bf16 partial sums (relative rounding 2**-9 each) against one rounding of the fp32 sum
        assert r["bf16_rel"] <= 4 * 2.0**-8, r["bf16_rel"]


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

    configs = os.path.join(os.path.dirname(__file__), "..", "configs")
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


@pytest.mark.e2e
@pytest.mark.slow
def test_the_memory_plan_charges_the_hsdp_state_and_reduce_buffers_of_the_layout():
    """Real-size planning (the model built on the meta device, its passes traced): seconds."""
    from dataclasses import replace

    from verl_digen.memory.plan import _transformer_facts, plan_roles
    from verl_digen.memory.fsdp_layout import DTYPE_BYTES

    costs, cluster, built, _ = _preset_costs(*WHOLE_NODES)
    job = costs.memory_job(cluster)
    assert (job.fsdp, job.fsdp_replicas, job.grad_reduce_bytes) == (8, 2, DTYPE_BYTES["bf16"])
    params, dense, block, _, _ = _transformer_facts(job.family, None, job.dtype, job.lora_targets, job.lora_rank)
    unit = params * block / dense
    trainer = {r.role: r for r in plan_roles(job, 141.0)}["trainer"]
    fp32 = {r.role: r for r in plan_roles(replace(job, grad_reduce_bytes=4), 141.0)}["trainer"]
    extra = fp32.phases["train"]["gradients"] - trainer.phases["train"]["gradients"]
    assert extra == pytest.approx(reduce_buffer_bytes(unit, replicas=2, shard=8, reduce_bytes=4)
                                  - reduce_buffer_bytes(unit, replicas=2, shard=8, reduce_bytes=2))
    flat = {r.role: r for r in plan_roles(replace(job, fsdp=16, fsdp_replicas=1), 141.0)}["trainer"]
    # HSDP holds twice flat's share of the optimizer state (1/8 of it instead of 1/16)
    assert trainer.phases["train"]["optimizer"] == pytest.approx(2 * flat.phases["train"]["optimizer"], rel=1e-6)


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
