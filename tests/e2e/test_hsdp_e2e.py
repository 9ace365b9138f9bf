"""HSDP (FSDP2 over a 2-D ``("replicate", "shard")`` mesh) on ranks: the mesh is one replica per
node sharded within it, it trains as flat FSDP, its sharded checkpoints resume bitwise and load
flat, a bf16 full fine-tune reduces in bf16 within bf16 rounding; and the memory plan charges the
HSDP state and reduce buffers of a real layout. The layouts and the cost model's charges:
tests/unit/test_hsdp.py.

The rank tests run 4 gloo processes on CPU as 2 "nodes" of 2 (each rank names its node; Ray's
node id in a worker); node membership is interleaved (ranks 0 and 2 on one node) because a pool's
ranks need not fill nodes in rank order."""

from __future__ import annotations

import pytest
import torch

from runs import run_ranks
from test_fsdp import TinyDenoiser
from test_fsdp_e2e import full_params, make_data, max_diff, per_sample_loss
from verl_digen.memory.fsdp_layout import reduce_buffer_bytes
from test_hsdp import WHOLE_NODES, _preset_costs

WORLD = 4
N_PER_RANK = 3
# Flat and HSDP sum the same four fp32 gradients in a different order (one ring over four ranks;
# two rings of two, then an all-reduce of the two partial sums), so the sums may differ in their
# last bits (relative 2**-24 ~ 6e-8); after clipping, two AdamW steps at lr 1e-2 move each weight
# (of order 1) by lr x m / sqrt(v), which carries such a difference as ~1e-9, and the weights
# round at ~6e-8 per step: 1e-6 is over 10x what two steps can accumulate, and 1e4 x below a
# wrong reduction (a missing or doubled replica's gradient changes weights by ~1e-2).
FP32_TOL = 1e-6


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
