"""Training paths at scale: activation checkpointing in every training path (colocated or
disaggregated, sharded or not) and FSDP2 over the fused workers of the colocated placement. Whole
runs and the ranks' bucketed all-reduce: tests/e2e/test_training_paths_e2e.py."""

from __future__ import annotations

import pytest
import torch

from runs import SPECS

pytestmark = pytest.mark.usefixtures("one_thread")


def _sample_and_updater(path: str, arch: str, *, checkpointing: bool):
    from verl_digen.algos.window import SdeWindowConfig
    from verl_digen.config.schema import AlgoConfig, LoraConfigSpec
    from verl_digen.models.registry import load_adapter
    from verl_digen.workers.fsdp import enable_gradient_checkpointing
    from verl_digen.workers.sampling import SamplingSettings, sample_groups
    from verl_digen.workers.training import PolicyUpdater, TrainSettings, add_lora

    adapter = load_adapter(path)
    add_lora(adapter, LoraConfigSpec(rank=4))
    if checkpointing:
        assert enable_gradient_checkpointing(adapter.transformer)
    settings = SamplingSettings(spec=SPECS[arch], num_steps=2, noise_level=0.7, sde_type="sde",
                                window=SdeWindowConfig(mode="fixed", start=0, size=1), timestep_fraction=1.0)
    data = sample_groups(adapter, ["a cat"], [0], [0], group_size=2, settings=settings, training_step=0, seed=3,
                         policy_version=0)
    updater = PolicyUpdater(adapter, TrainSettings(AlgoConfig(), settings, lora_only=True, images_per_step=2))
    return adapter, data, updater


@pytest.mark.parametrize("arch", ["flux", "sd3", "qwen_image", "wan", "hunyuan_video"])
def test_checkpointed_training_recomputes_blocks_and_gives_the_same_gradients(arch, tiny_dirs):
    from verl_digen.workers.fsdp import block_modules

    grads = {}
    block_calls = {}
    for checkpointing in (False, True):
        adapter, data, updater = _sample_and_updater(tiny_dirs[arch], arch, checkpointing=checkpointing)
        calls = []
        # A pre-hook: checkpoint's recomputation may stop early, before the block returns.
        hook = block_modules(adapter.transformer)[0].register_forward_pre_hook(lambda *a: calls.append(1))
        updater.train_micro_batch(data, torch.tensor([1.0, -1.0]))
        hook.remove()
        grads[checkpointing] = [None if p.grad is None else p.grad.clone() for p in updater.params]
        block_calls[checkpointing] = len(calls)
    # One forward per trained step without checkpointing; the recomputation in backward adds one.
    assert block_calls[True] == 2 * block_calls[False], block_calls
    assert any(g is not None for g in grads[True])
    for a, b in zip(grads[False], grads[True], strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_colocated_fsdp_needs_equal_generation_on_every_fused_worker():
    from verl_digen.schedule.strategies import StrategySpec

    with pytest.raises(ValueError, match="groups_per_step.*colocated FSDP"):
        StrategySpec(placement="colocated", rollout_workers=2, trainer_workers=2, groups_per_step=3, group_size=2, fsdp=True)
    StrategySpec(placement="colocated", rollout_workers=2, trainer_workers=2, groups_per_step=4, group_size=2, fsdp=True)


# ---------------------------------------------------------------------- full fine-tuning in bf16


def _full_ft(path: str, arch: str):
    from verl_digen.algos.window import SdeWindowConfig
    from verl_digen.config.schema import AlgoConfig
    from verl_digen.models.registry import load_adapter
    from verl_digen.workers.sampling import SamplingSettings
    from verl_digen.workers.training import PolicyUpdater, TrainSettings

    adapter = load_adapter(path, dtype=torch.bfloat16)
    settings = SamplingSettings(spec=SPECS[arch], num_steps=2, noise_level=0.7, sde_type="sde",
                                window=SdeWindowConfig(mode="fixed", start=0, size=1), timestep_fraction=1.0,
                                forward_rows=2)
    algo = AlgoConfig(lr=1e-3, kl_beta=0.01)
    updater = PolicyUpdater(adapter, TrainSettings(algo, settings, lora_only=False, images_per_step=2))
    return adapter, settings, updater


def test_bf16_full_fine_tune_trains_fp32_masters_and_stays_on_policy(tiny_flux):
    from verl_digen.workers.sampling import sample_groups

    adapter, settings, updater = _full_ft(tiny_flux, "flux")
    assert updater.master is not None
    assert {p.dtype for p in updater.params} == {torch.bfloat16}
    assert {m.dtype for m in updater.master.masters} == {torch.float32}
    assert {p.dtype for p in updater.reference.parameters()} == {torch.bfloat16}  # the bf16 frozen KL copy
    before = [m.detach().clone() for m in updater.master.masters]
    for step in range(2):
        data = sample_groups(adapter, ["a cat"], [0], [0], group_size=2, settings=settings, training_step=step,
                             seed=3, policy_version=step)
        metrics = updater.train_micro_batch(data, torch.tensor([1.0, -1.0]))
        # Rollout and trainer run the same bf16 weights: on-policy exactly, every step.
        assert metrics["actor/clip_frac"] == 0.0 and abs(metrics["actor/ratio_mean"] - 1.0) <= 1e-6
        assert all(p.grad is None for p in updater.params)  # moved into the fp32 masters
        assert all(m.grad is not None and m.grad.dtype == torch.float32 for m in updater.master.masters)
        updater.optimizer_step(None)
    # The model holds the bf16 rounding of the fp32 masters, which moved.
    assert max(float((m - b).abs().max()) for m, b in zip(updater.master.masters, before)) > 0
    for p, m in zip(updater.params, updater.master.masters):
        assert torch.equal(p, m.to(torch.bfloat16))


def test_bf16_full_fine_tune_masters_and_their_adam_state_go_through_a_sharded_checkpoint(tiny_flux, tmp_path):
    """The checkpoint a trainer rank writes (DCP) holds the fp32 masters and their optimizer
    state; a fresh bf16 model resumed from it has them bitwise and takes their bf16 rounding,
    and gets the EMA and the RNG back as a run without master weights does."""
    from verl_digen.workers.ema import EMA, named_trainable_parameters
    from verl_digen.workers.sampling import sample_groups
    from verl_digen.workers.sharded_state import load_rank_state, save_rank_state

    adapter, settings, updater = _full_ft(tiny_flux, "flux")
    ema = EMA(named_trainable_parameters(adapter.transformer), decay=0.9)
    data = sample_groups(adapter, ["a cat"], [0], [0], group_size=2, settings=settings, training_step=0,
                         seed=3, policy_version=0)
    updater.train_micro_batch(data, torch.tensor([1.0, -1.0]))
    updater.optimizer_step(None)
    ema.update()
    kw = dict(lora_only=False, rank=0, group=None)
    rng = torch.get_rng_state()
    save_rank_state(str(tmp_path), module=adapter.transformer, optimizer=updater.optimizer, version=1,
                    master=updater.master, ema=ema, **kw)
    adapter2, _, fresh = _full_ft(tiny_flux, "flux")
    fresh_ema = EMA(named_trainable_parameters(adapter2.transformer), decay=0.9)
    assert any(not torch.equal(a, b) for a, b in zip(fresh.master.masters, updater.master.masters))
    torch.manual_seed(12345)
    load_rank_state(str(tmp_path), module=adapter2.transformer, optimizer=fresh.optimizer, master=fresh.master,
                    ema=fresh_ema, **kw)
    assert torch.equal(torch.get_rng_state(), rng)
    assert fresh_ema.num_updates == ema.num_updates == 1
    for a, b in zip(fresh.master.masters, updater.master.masters):
        assert torch.equal(a, b) and a.dtype == torch.float32
    for p, m in zip(fresh.params, fresh.master.masters):
        assert torch.equal(p, m.to(torch.bfloat16))
    for a, b in zip(fresh.master.masters, updater.master.masters):
        sa, sb = fresh.optimizer.state[a], updater.optimizer.state[b]
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


# ---------------------------------------------------------------------- configuration


def test_precision_and_memory_keys_are_validated_by_name():
    from verl_digen.config.schema import ConfigError, digen_config_from_dict

    cfg = digen_config_from_dict({})
    assert (cfg.model.dtype, cfg.model.trainable_dtype, cfg.model.gradient_checkpointing) == ("auto", "fp32", "auto")
    assert cfg.model.checkpointing is None  # auto: decided by the memory plan before Ray starts
    for value, decided in [(True, True), ("true", True), (False, False), ("False", False), ("auto", None)]:
        assert digen_config_from_dict({"model": {"gradient_checkpointing": value}}).model.checkpointing is decided
    assert cfg.model.vae_decode_chunk == 0 and cfg.ema.offload is True
    for mapping, key in [
        ({"model": {"dtype": "fp16"}}, "digen.model.dtype"),
        ({"model": {"trainable_dtype": "fp8"}}, "digen.model.trainable_dtype"),
        ({"model": {"vae_decode_chunk": -1}}, "digen.model.vae_decode_chunk"),
        ({"model": {"gradient_checkpointing": "sometimes"}}, "digen.model.gradient_checkpointing"),
        ({"fsdp": {"gradient_checkpointing": True}}, "gradient_checkpointing"),  # moved to digen.model
    ]:
        with pytest.raises((ConfigError, ValueError), match=key):
            digen_config_from_dict(mapping)
    colocated = digen_config_from_dict({"fsdp": {"enable": True}})  # colocated FSDP is legal...
    assert colocated.pass_rows(4) == 1  # 4 samples a micro-batch: one call of one sample per rank
    # ...while the micro-batch deals over the colocated GPUs in whole calls, checked with the cluster
    with pytest.raises(ConfigError, match=r"4 rows do not split evenly over 8 FSDP ranks.*all 8 colocated GPUs"):
        colocated.pass_rows(8)
    with pytest.raises(ConfigError, match="digen.batch.train_micro_batch_groups"):
        digen_config_from_dict({
            "placement": "disaggregated", "fsdp": {"enable": True}, "batch": {"group_size": 3},
            "pools": {"rollout": {"devices": 1}, "trainer": {"devices": 2}},
        })


def test_forward_rows_split_groups_evenly_over_the_fsdp_ranks():
    from verl_digen.workers.sampling import forward_rows, rank_rows

    assert forward_rows(8, 1, 1) == 8  # no FSDP: one transformer call per group
    assert forward_rows(8, 1, 2) == 4 and forward_rows(8, 1, 8) == 1 and forward_rows(8, 2, 8) == 2
    assert forward_rows(6, 2, 4) == 3  # 12 rows: 4 chunks of 3, one per rank
    with pytest.raises(ValueError, match="train_micro_batch_groups"):
        forward_rows(3, 1, 2)
    # Every rank takes whole chunks, as many as the others, and together they cover the batch once.
    parts = [rank_rows(16, 2, r, 4) for r in range(4)]
    assert sorted(i for p in parts for i in p) == list(range(16)) and {len(p) for p in parts} == {4}
    assert parts[1] == [2, 3, 10, 11]


def test_fsdp_full_fine_tune_of_a_mixed_dtype_block_is_refused_by_name(tiny_dirs):
    """Wan keeps its norms and modulation tables in fp32 when loaded in bf16; FSDP2 reduces a
    block's gradients in one dtype, so a bf16 full fine-tune of it under FSDP must stop clearly
    (LoRA trains only fp32 matrices and passes)."""
    from verl_digen.config.schema import digen_config_from_dict
    from verl_digen.models.registry import load_adapter
    from verl_digen.workers.worker import DiffusionWorker

    worker = object.__new__(DiffusionWorker)  # only the check runs: no Ray, no process group
    worker.adapter = load_adapter(tiny_dirs["wan"], dtype=torch.bfloat16)
    worker.cfg = digen_config_from_dict({"model": {"lora": {"enable": False}}, "fsdp": {"enable": True}})
    with pytest.raises(ValueError, match="digen.model.lora.enable=false.*several dtypes"):
        worker._check_fsdp_trainable_dtypes()
    from verl_digen.workers.training import add_lora

    worker.cfg = digen_config_from_dict({"fsdp": {"enable": True}})  # LoRA: only fp32 lora_ tensors train
    add_lora(worker.adapter, worker.cfg.model.lora)
    worker._check_fsdp_trainable_dtypes()
