"""The memory planner (python -m verl_digen.memory): real-size per-GPU peaks from the meta device,
every shipped preset fits with 10% headroom, the knobs move the plan the way they should, and the
main job refuses a configuration that cannot fit before Ray starts."""

from __future__ import annotations

import json
import os

import pytest
import torch
from omegaconf import OmegaConf

from verl_digen.config.compose import compose_config
from verl_digen.config.schema import ConfigError, digen_config_from_dict
from verl_digen.memory import MemoryPlanError, plan_job
from verl_digen.memory.__main__ import main as memory_main
from verl_digen.memory.__main__ import plan_preset, preset_names
from verl_digen.memory.plan import GIB
from verl_digen.memory.trace import _measure, _patched_sdpa, _storage_bytes, _storage_key

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "..", "configs")


def _digen(name: str, *overrides: str):
    cfg = compose_config(list(overrides), config_name=name, config_dir=CONFIGS)
    return digen_config_from_dict(OmegaConf.to_container(cfg.digen, resolve=True)), cfg


def _roles(name: str, *overrides: str) -> dict:
    digen, cfg = _digen(name, *overrides)
    return {p.role: p for p in plan_job(digen, devices_per_node=cfg.trainer.n_gpus_per_node, nnodes=1)}


def test_every_shipped_preset_fits_with_ten_percent_headroom():
    names = preset_names(CONFIGS)
    families = ("flux", "sd3", "qwen_image", "wan", "hunyuan_video")
    for family in families:  # a LoRA preset for every family, a full fine-tuning one where it can run
        assert f"{family}_colocated" in names
        # Wan keeps some block parameters in fp32: a bf16 full fine-tune under FSDP2 is refused
        # (one reduce dtype per block), and an fp32 one does not fit the rollout GPUs.
        assert (f"{family}_full_disaggregated" in names) is (family != "wan")
    rows = [row for name in names for row in plan_preset(name, [], CONFIGS)]
    assert {row["role"] for row in rows} == {"colocated", "rollout", "trainer"}
    tight = [(r["preset"], r["role"], r["peak_gib"], r["device_gib"]) for r in rows if r["headroom"] < 0.10]
    assert not tight, tight
    for row in rows:  # the breakdown adds up to the peak
        parts = sum(row[f"{k}_gib"] for k in ("weights", "gradients", "optimizer", "activations", "encoders_vae",
                                             "sync_buffers", "overhead"))
        assert parts == pytest.approx(row["peak_gib"], abs=0.05)


def test_cli_json_rows_and_exit_status(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert memory_main(["--preset", "sd3_disaggregated", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["role"] for r in rows] == ["rollout", "trainer"]
    for r in rows:
        assert r["preset"] == "sd3_disaggregated" and r["device_gib"] == 80.0 and 0 < r["peak_gib"] < 80
    assert "| sd3_disaggregated | trainer |" in capsys.readouterr().out
    # Without activation checkpointing, FSDP or the prompt cache, Wan's trainer does not fit: exit 1.
    off = ["digen.model.gradient_checkpointing=false", "digen.fsdp.enable=false", "digen.prompt_cache.enable=false"]
    assert memory_main(["--preset", "wan_disaggregated", "--json", str(out), *off]) == 1
    trainer = [r for r in json.loads(out.read_text())["rows"] if r["role"] == "trainer"][0]
    assert not trainer["fits"] and trainer["activations_gib"] > 80


def test_plan_follows_the_knobs():
    base = _roles("flux_disaggregated")
    # Checkpointing off: the trainer keeps every block's activations (8 samples of 1536 tokens).
    ckpt = _roles("flux_disaggregated", "digen.model.gradient_checkpointing=false")["trainer"]
    assert ckpt.phase == "train" and ckpt.bytes["activations"] > 8 * 10 * GIB
    # The prompt cache frees the text encoders after warm-up: the warm-up (weights + encoders + a
    # batch of digen.prompt_cache.encode_batch_size prompts) is the rollout's peak; without the
    # cache the encoders (T5-XXL: ~9 GiB bf16) stay in every phase, and there is no warm-up.
    assert base["rollout"].phase == "warm"
    no_cache = _roles("flux_disaggregated", "digen.prompt_cache.enable=false")["rollout"]
    assert no_cache.phase not in ("load", "warm") and no_cache.bytes["encoders_vae"] > 9 * GIB
    # Full fine-tuning with FSDP over 4 trainers: bf16 gradients (until they are folded into the
    # masters'), fp32 master gradients and two AdamW states, sharded 4 ways.
    full = _roles("flux_full_disaggregated")["trainer"]
    params = 11.90e9
    # ... and in backward FSDP2's bf16 reduce buffers of the largest block (memory/fsdp_layout.py)
    from verl_digen.memory.plan import _transformer_facts
    from verl_digen.memory.fsdp_layout import reduce_buffer_bytes

    n, dense, block, _, _ = _transformer_facts("flux", None, "bf16", (), 0)
    reduce = reduce_buffer_bytes(n * block / dense, replicas=1, shard=4, reduce_bytes=2)
    assert full.bytes["gradients"] == pytest.approx(params * (2 + 4) / 4 + reduce, rel=0.01)
    assert full.bytes["optimizer"] == pytest.approx(params * 8 / 4, rel=0.01)
    unsharded = _roles("flux_full_disaggregated", "digen.fsdp.enable=false")["trainer"]
    assert unsharded.bytes["optimizer"] == pytest.approx(4 * full.bytes["optimizer"], rel=1e-6)
    assert base["trainer"].bytes["optimizer"] < 0.5 * GIB  # LoRA: rank-32 adapters only
    # veRL's optimizer_offload: the AdamW state is on the GPU only in the optimizer step, which
    # holds no activations; training passes run without it.
    trainer = _roles("flux_full_disaggregated", "digen.model.optimizer_offload=true")["trainer"]
    assert trainer.phases["train"]["optimizer"] == 0 and trainer.phases["train"]["activations"] > 0
    assert trainer.phases["step"]["optimizer"] == pytest.approx(full.bytes["optimizer"], rel=1e-6)
    assert trainer.phases["step"]["activations"] == 0
    # veRL's param_offload (FSDP2's CPUOffloadPolicy): weights, gradients and AdamW on the host;
    # the GPU holds the blocks being computed and the activations.
    host = _roles("flux_full_disaggregated", "digen.fsdp.param_offload=true")["trainer"]
    # (FSDP2 reduces a block's gradients on the GPU, then moves the shard to the host: its reduce buffers stay)
    assert host.phases["train"]["gradients"] == pytest.approx(reduce) and host.phases["train"]["optimizer"] == 0
    assert host.phases["train"]["weights"] < 0.1 * full.phases["train"]["weights"]
    assert host.phases["train"]["activations"] == full.phases["train"]["activations"]
    # True CFG doubles the rows of every forward (Qwen-Image's [cond; uncond] batch).
    off = "digen.model.gradient_checkpointing=false"
    cfg_on = _roles("qwen_image_disaggregated", off)["trainer"]
    cfg_off = _roles("qwen_image_disaggregated", off, "digen.sampling.guidance_scale=1.0")["trainer"]
    assert cfg_on.bytes["activations"] == pytest.approx(2 * cfg_off.bytes["activations"], rel=1e-6)
    # Shorter prompts (veRL-Omni's Qwen-Image recipe encodes 256 tokens, the pipeline 512): a
    # shorter joint sequence, so fewer activations per pass, measured on the real-size meta model.
    long_text = _roles("qwen_image_disaggregated", off, "digen.model.max_sequence_length=1024")["trainer"]
    short_text = _roles("qwen_image_disaggregated", off, "digen.model.max_sequence_length=256")["trainer"]
    assert short_text.bytes["activations"] < cfg_on.bytes["activations"] < long_text.bytes["activations"]


def test_device_memory_from_type_or_override():
    assert _roles("sd3_colocated", "digen.memory.device_type=H200")["colocated"].device_gib == 141.0
    assert _roles("sd3_colocated", "digen.memory.device_gib=40")["colocated"].device_gib == 40.0
    with pytest.raises(ConfigError, match=r"digen\.memory\.device_type='B300'.*valid: .*H100"):
        _digen("sd3_colocated", "digen.memory.device_type=B300")


def test_saved_tensor_count_is_what_the_autograd_graph_holds():
    """The pack-hook count equals the bytes of the distinct storages the backward graph keeps
    (every node's saved tensors, found by walking the graph), at real width on the meta device."""
    from diffusers import FluxTransformer2DModel

    with torch.device("meta"):
        model = FluxTransformer2DModel(num_layers=1, num_single_layers=1, attention_head_dim=128,
                                       num_attention_heads=24, joint_attention_dim=4096, in_channels=64,
                                       pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=(16, 56, 56))
    model = model.to(torch.bfloat16)
    meta = dict(device="meta", dtype=torch.bfloat16)
    inputs = dict(hidden_states=torch.empty(1, 256, 64, **meta), timestep=torch.empty(1, **meta),
                  guidance=torch.empty(1, device="meta"), pooled_projections=torch.empty(1, 768, **meta),
                  encoder_hidden_states=torch.empty(1, 64, 4096, **meta), txt_ids=torch.empty(64, 3, device="meta"),
                  img_ids=torch.empty(256, 3, device="meta"), return_dict=False)
    counted, _ = _measure(model, inputs)
    frozen = {_storage_key(p) for p in model.parameters()}
    with _patched_sdpa():
        out = model(**inputs)[0]
    held: dict[int, int] = {}
    seen, stack = set(), [out.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        tensors = [getattr(node, a) for a in dir(node) if a.startswith("_saved_")]
        if hasattr(node, "saved_tensors"):
            tensors += list(node.saved_tensors)
        for t in tensors:
            for x in (t if isinstance(t, (tuple, list)) else [t]):
                if isinstance(x, torch.Tensor) and _storage_key(x) not in frozen:
                    held[_storage_key(x)] = _storage_bytes(x)
        stack.extend(fn for fn, _ in node.next_functions)
    assert counted["saved_bytes"] == sum(held.values())
    assert counted["max_block_bytes"] < counted["saved_bytes"]


def test_main_job_refuses_a_job_that_cannot_fit_before_ray_starts(tmp_path):
    import ray

    from verl_digen.models.real_configs import write_config_dir
    from verl_digen.trainer.loop import DigenTrainer

    model = write_config_dir("wan", str(tmp_path / "Wan2.1-T2V-14B"))  # the real configs, no weights
    overrides = [f"digen.model.path={model}", f"digen.output_dir={tmp_path / 'run'}",
                 f"trainer.default_local_dir={tmp_path / 'ckpt'}", "digen.fsdp.enable=false"]
    cfg = compose_config(overrides, config_name="wan_disaggregated", config_dir=CONFIGS)
    assert not ray.is_initialized()
    with pytest.raises(MemoryPlanError) as err:
        DigenTrainer(cfg)
    message = str(err.value)
    assert "trainer (4 GPU(s)) peaks at" in message and "train phase" in message
    assert "digen.fsdp.enable=true" in message and "digen.memory.device_type=H100" in message
    assert not ray.is_initialized()
    # The same job with FSDP (as the preset ships) passes the check.
    fits = compose_config(overrides[:-1], config_name="wan_disaggregated", config_dir=CONFIGS)
    digen = digen_config_from_dict(OmegaConf.to_container(fits.digen, resolve=True))
    roles = plan_job(digen, devices_per_node=8, nnodes=1, model_path=model)
    assert all(p.headroom >= 0.10 for p in roles)


@pytest.mark.parametrize("family", ["flux", "wan", "hunyuan_video"])
def test_two_kept_blocks_extrapolate_to_the_full_stack_exactly(family):
    """Tracing the first 2 blocks of each stack and extrapolating gives what tracing all of them
    gives (here 5 per stack, real width, small sample)."""
    from verl_digen.memory.trace import TraceShape, _inputs
    from verl_digen.models.real_configs import build_on_meta, component_config

    model = build_on_meta(family, "transformer")
    for name, child in list(model.named_children()):
        if isinstance(child, torch.nn.ModuleList):
            setattr(model, name, torch.nn.ModuleList(list(child)[:5]))
    frames = 1 if family == "flux" else 9
    inputs = lambda: _inputs(TraceShape(family, None, "bf16", 128, 192, frames), component_config(family, "transformer"),  # noqa: E731
                             torch.bfloat16)
    full, full_peak = _measure(model, inputs(), keep_blocks=None)
    kept, kept_peak = _measure(model, inputs(), keep_blocks=2)
    assert kept == full and full["saved_bytes"] > 3 * full["max_block_bytes"]
    assert kept_peak == full_peak


def test_lora_on_the_kept_blocks_only_measures_what_lora_on_every_block_measures():
    """The LoRA trace puts adapters only into the blocks it runs (``_measure_as_trained`` cuts the
    stacks first: peft's injection is the slow part): the same accounting and peak as adapters on
    every block of the stack (5 per stack here, real width), and the rest of each stack is
    extrapolated as before."""
    from verl_digen.config.schema import DigenConfig
    from verl_digen.memory.trace import TraceShape, _add_lora_on_meta, _inputs, _measure_as_trained
    from verl_digen.models.real_configs import build_on_meta, component_config

    targets = tuple(DigenConfig().model.lora.target_modules)

    def five_blocks():
        model = build_on_meta("flux", "transformer")
        for name, child in list(model.named_children()):
            if isinstance(child, torch.nn.ModuleList):
                setattr(model, name, torch.nn.ModuleList(list(child)[:5]))
        return model

    inputs = lambda: _inputs(TraceShape("flux", None, "bf16", 128, 192, 1), component_config("flux", "transformer"),  # noqa: E731
                             torch.bfloat16)
    every = five_blocks()
    every.requires_grad_(False)
    _add_lora_on_meta(every, 32, targets)
    assert sum("lora_" in n for n, _ in every.named_parameters()) > 0
    expected = _measure(every, inputs())
    cut = five_blocks()
    measured = _measure_as_trained(cut, inputs(), lora_rank=32, lora_targets=targets)
    assert [len(c) for c in cut.children() if isinstance(c, torch.nn.ModuleList)] == [2, 2]  # adapters on 2 + 2 blocks
    assert measured == expected and measured[0]["saved_bytes"] > 0


def test_training_activations_are_one_pass_and_auto_checkpointing_is_on_only_when_a_pass_does_not_fit(tmp_path, tiny_flux):
    """A micro-batch trains pass by pass (one transformer call's samples, workers/training.py):
    the planner charges one pass's activations, whatever the micro-batch, and
    ``gradient_checkpointing=auto`` turns checkpointing on exactly when a pass would not fit
    without it. The main job applies that decision before any worker starts."""
    from verl_digen.memory import decide_checkpointing
    from verl_digen.memory.plan import job_shape, plan_trace
    from verl_digen.trainer.resolve import check_run_config

    off = "digen.model.gradient_checkpointing=false"
    one = _roles("sd3_disaggregated", off)["trainer"]
    four = _roles("sd3_disaggregated", off, "digen.batch.train_micro_batch_groups=4")["trainer"]
    digen, cfg = _digen("sd3_disaggregated", off)
    job = job_shape(digen, devices_per_node=cfg.trainer.n_gpus_per_node, nnodes=1)
    assert job.pass_samples == digen.batch.group_size  # no FSDP, no split: one call per group
    expected = plan_trace(job).training_bytes(job.cfg_rows * job.pass_samples, checkpointing=False)
    assert one.phases["train"]["activations"] == four.phases["train"]["activations"] == expected

    def decided(*overrides: str) -> bool:
        d, c = _digen("flux_disaggregated", "digen.model.gradient_checkpointing=auto", *overrides)
        return decide_checkpointing(d, devices_per_node=c.trainer.n_gpus_per_node)

    # FLUX at 512 x 512, passes of 8 samples: ~90 GiB of activations without checkpointing.
    assert decided() is True
    assert decided("digen.batch.group_size=2", "digen.batch.groups_per_step=8", "digen.batch.groups_per_task=1") is False
    assert decided("digen.memory.device_gib=1000") is False
    auto_plan = {p.role: p for p in plan_job(_digen("flux_disaggregated", "digen.model.gradient_checkpointing=auto")[0],
                                              devices_per_node=8)}
    assert auto_plan["trainer"].bytes == _roles("flux_disaggregated")["trainer"].bytes  # = the preset's true

    # The main job decides once, before Ray, and hands the decision to every worker: a model
    # directory with weights (the tiny FLUX, planned at its own size: 1.5 GiB of the plan is the
    # fixed CUDA/NCCL allowance, so 1.5 GiB GPUs cannot hold a pass without checkpointing).
    run = [f"digen.model.path={tiny_flux}", f"digen.output_dir={tmp_path / 'run'}", "digen.model.arch=flux",
           f"trainer.default_local_dir={tmp_path / 'ckpt'}", "digen.model.gradient_checkpointing=auto"]
    roomy = check_run_config(compose_config(run + ["digen.memory.device_gib=2"]))
    assert roomy.cfg.model.gradient_checkpointing == "false"
    tight = check_run_config(compose_config(run + ["digen.memory.device_gib=1.5", "digen.memory.check=false"]))
    assert tight.cfg.model.gradient_checkpointing == "true" and tight.cfg.model.checkpointing is True


def test_the_trainer_plan_holds_the_senders_staging_bucket_while_it_trains():
    """Trainer 0 sends the previous version while it trains (one-step-off): the planner charges
    the sender's reused device buffer (sync/transport.py: WeightChannel._on_device, at most one
    bucket) in the training phase, as the code holds it."""
    from verl_digen.sync.transport import DEFAULT_BUCKET_BYTES

    full = _roles("flux_full_disaggregated")["trainer"].phases["train"]
    lora = _roles("flux_disaggregated")["trainer"].phases["train"]
    assert full["sync_buffers"] == DEFAULT_BUCKET_BYTES  # a full model: one whole bucket
    assert 0 < lora["sync_buffers"] < DEFAULT_BUCKET_BYTES  # LoRA: all its factors, less than a bucket


def test_the_senders_sync_phase_holds_the_buckets_its_capture_keeps_on_the_device():
    """FSDP rank 0 captures each version into its host snapshot while the state is gathered
    bucket by bucket: the bucket being copied, the one being gathered and the tensor read ahead
    (sync/snapshot.py; test_sync_snapshot's recorder bounds them by CAPTURE_DEVICE_BUCKETS). The
    plan charges the sender that, a receiver its two (one in flight, one filling)."""
    from verl_digen.sync.buckets import CAPTURE_DEVICE_BUCKETS, DEFAULT_BUCKET_BYTES

    roles = _roles("flux_full_disaggregated")
    assert roles["trainer"].phases["sync"]["sync_buffers"] == CAPTURE_DEVICE_BUCKETS * DEFAULT_BUCKET_BYTES
    assert roles["rollout"].phases["sync"]["sync_buffers"] == 2 * DEFAULT_BUCKET_BYTES


def _storage_total(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors``."""
    seen = {}
    for t in tensors:
        seen.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
    return sum(seen.values())


@pytest.mark.parametrize("kl_beta", [0.0, 0.1])
def test_full_fine_tune_state_is_what_the_trainer_holds(tiny_flux, kl_beta):
    """The planner's trained state of a bf16 full fine-tune (fp32 training) is, term by term, what
    PolicyUpdater holds on a rank after a training pass on the tiny FLUX: the bf16 parameters,
    their bf16 gradients (alive until accumulate_grads), the fp32 masters, their fp32 gradients
    and AdamW's two fp32 states. The train phase charges all of them (no FSDP here: one rank holds
    everything, and the KL reference is on the device during a pass's reference forward)."""
    from types import SimpleNamespace

    from diffusers import FluxTransformer2DModel

    from verl_digen.config.schema import AlgoConfig
    from verl_digen.memory.plan import _transformer_facts, job_shape, trained_state_bytes
    from verl_digen.workers.training import PolicyUpdater, TrainSettings

    model = FluxTransformer2DModel.from_pretrained(os.path.join(tiny_flux, "transformer"), torch_dtype=torch.bfloat16)
    settings = TrainSettings(algo=AlgoConfig(optimizer="adamw", kl_beta=kl_beta), sampling=None, lora_only=False,
                             images_per_step=1, trainable_dtype=torch.float32)
    updater = PolicyUpdater(SimpleNamespace(transformer=model, device=torch.device("cpu")), settings)
    params = list(model.parameters())
    sum(p.float().pow(2).sum() for p in params).backward()  # every parameter gets a gradient
    held = {
        "params": _storage_total(params),
        "grads": _storage_total(p.grad for p in params),  # before accumulate_grads folds them
    }
    assert {p.grad.dtype for p in params} == {torch.bfloat16}
    updater.master.accumulate_grads()
    held["masters"] = _storage_total(updater.master.masters)
    held["master_grads"] = _storage_total(m.grad for m in updater.master.masters)
    updater.optimizer_step(None)  # AdamW's states exist from the first step on
    held["optimizer"] = _storage_total(t for s in updater.optimizer.state.values() for k, t in s.items() if k != "step")

    digen, _ = _digen("flux_full_disaggregated", "digen.fsdp.enable=false", f"digen.model.path={tiny_flux}",
                      f"digen.algo.kl_beta={kl_beta}")
    job = job_shape(digen, devices_per_node=8, nnodes=1, model_path=tiny_flux, checkpointing=True)
    n, dense, _, lora, param_bytes = _transformer_facts(job.family, job.config_path, job.dtype, (), 0)
    planned = trained_state_bytes(job, n, param_bytes, lora)
    assert planned == held
    plan = {p.role: p for p in plan_job(digen, devices_per_node=8, model_path=tiny_flux)}["trainer"]
    train = plan.phases["train"]
    assert train["gradients"] == held["grads"] + held["master_grads"]
    assert train["optimizer"] == held["optimizer"]
    buffers = dense - param_bytes
    reference = _storage_total([*updater.reference.parameters(), *updater.reference.buffers()]) if kl_beta else 0
    assert reference == (dense if kl_beta else 0)  # the reference copy is one dense model
    assert train["weights"] == held["params"] + buffers + held["masters"] + reference
    assert plan.phases["sync"]["weights"] == held["params"] + buffers + held["masters"]  # the reference waits on CPU


def test_trainers_park_the_optimizer_state_exactly_when_that_spares_checkpointing():
    """``digen.model.optimizer_offload=auto`` of a disaggregated run: the trainers keep the
    optimizer state on the host between steps exactly when a training pass then fits without
    activation checkpointing and does not with the state resident (a recomputed forward per
    pass costs far more than a host round trip per step); fused workers always park it. The
    cost model decides by the same rule (tests/unit/test_sim.py)."""
    from verl_digen.memory import decide_checkpointing, decide_optimizer_offload

    def decided(*overrides: str) -> tuple[bool, bool]:
        d, c = _digen("flux_full_disaggregated", "digen.model.gradient_checkpointing=auto", *overrides)
        dev = dict(devices_per_node=c.trainer.n_gpus_per_node, nnodes=c.trainer.nnodes)
        return decide_optimizer_offload(d, **dev), decide_checkpointing(d, **dev)

    # FLUX 12B over 4 trainers: 60 GiB of state per rank; AdamW's 24 of it parked, a pass fits.
    assert decided() == (True, False)
    assert decided("digen.model.optimizer_offload=false") == (False, True)
    # Smaller passes fit next to the resident state: nothing to spare, nothing parked.
    assert decided("digen.sampling.height=256", "digen.sampling.width=256") == (False, False)
    assert decided("digen.model.gradient_checkpointing=true")[0] is False  # fits checkpointed with the state resident
    colocated, c = _digen("flux_full_disaggregated", "digen.placement=colocated", "digen.async.max_staleness=0",
                          "digen.gap.enable=false")
    assert decide_optimizer_offload(colocated, devices_per_node=8) is True


def test_gat_rollout_workers_train_a_pass_and_auto_checkpointing_counts_it():
    """GAT (``digen.gat.enable``): a rollout worker trains micro-batches with the weights it
    generates with, so its role gets a train phase: its resident parts (bf16 model, fp32 LoRA
    adapters, encoders/VAE, the reward model it scores with), the LoRA gradients unsharded, and the
    trainers' one-pass activations; no optimizer state. ``gradient_checkpointing=auto`` asks every
    role that trains, so a rollout pass that does not fit turns it on for the run though the
    trainers' would fit. The cost model decides by the same rule (tests/unit/test_sim.py)."""
    from verl_digen.memory import decide_checkpointing
    from verl_digen.memory.plan import _transformer_facts, job_shape

    small = ("digen.batch.group_size=2", "digen.batch.groups_per_step=8", "digen.batch.groups_per_task=1",
             "digen.reward.name=pickscore")  # passes of 2 samples; a 4 GB (fp32) reward model on the rollout

    def roles(*overrides: str) -> dict:
        return _roles("flux_disaggregated", *small, *overrides)

    off = "digen.model.gradient_checkpointing=false"
    gat, plain = roles("digen.gat.enable=true", off), roles(off)
    assert "train" not in plain["rollout"].phases
    r_train, t_train = gat["rollout"].phases["train"], gat["trainer"].phases["train"]
    d, c = _digen("flux_disaggregated", *small, "digen.gat.enable=true")
    job = job_shape(d, devices_per_node=c.trainer.n_gpus_per_node, nnodes=1)
    assert job.rollouts_train and job.lora and job.fsdp == 1
    lora_params = _transformer_facts(job.family, job.config_path, job.dtype, job.lora_targets, job.lora_rank)[3]
    assert r_train["gradients"] == lora_params * job.trainable_bytes == t_train["gradients"]  # unsharded trainers
    assert r_train["activations"] == t_train["activations"] > 0  # the trainers' pass
    assert r_train["optimizer"] == 0 and r_train["sync_buffers"] == 0
    generate = gat["rollout"].phases["generate"]
    assert r_train["weights"] == generate["weights"] and r_train["encoders_vae"] == generate["encoders_vae"]
    assert r_train["encoders_vae"] - t_train["encoders_vae"] >= 3.9e9  # the reward model
    # A GPU between the two passes: the trainers' fits without checkpointing, the rollout's not.
    gib = (sum(t_train.values()) + sum(r_train.values())) / 2 / GIB
    assert sum(t_train.values()) / GIB < gib < sum(r_train.values()) / GIB

    def decided(*overrides: str) -> bool:
        d, c = _digen("flux_disaggregated", *small, "digen.model.gradient_checkpointing=auto",
                      f"digen.memory.device_gib={gib}", *overrides)
        return decide_checkpointing(d, devices_per_node=c.trainer.n_gpus_per_node)

    assert decided() is False
    assert decided("digen.gat.enable=true") is True
    # with a reward pool the rollout workers do not hold the reward: their pass fits again
    assert decided("digen.gat.enable=true", "digen.pools.rollout.devices=3", "digen.pools.reward.devices=1") is False
    # a rollout worker that does not fit names its training knobs (GAT off among them)
    tight = roles("digen.gat.enable=true", off, f"digen.memory.device_gib={gib}")["rollout"]
    assert tight.phase == "train" and "digen.gat.enable=false (rollout workers then do not train)" in tight.knobs
    assert not any(k.startswith("digen.fsdp") for k in tight.knobs)


def test_a_jobs_plan_is_computed_once_and_every_caller_gets_its_own_copy():
    """``plan_roles`` is a pure function of the job and the GPU sizes, computed once per pair
    (a planner search asks for each about six times): the copy a caller gets is equal to a fresh
    computation, with a GPU size given as one number or per role, and changing it changes no later
    answer."""
    from dataclasses import replace

    from verl_digen.memory.plan import _plan_roles, _planned, job_shape, plan_roles

    job = job_shape(_digen("flux_full_disaggregated")[0], devices_per_node=8, nnodes=1)
    for gib in (80.0, {"rollout": 80.0, "trainer": 140.0}):
        first = plan_roles(job, gib)
        hits = _planned.cache_info().hits
        assert first == _plan_roles(job, gib)
        first[0].bytes["weights"] = -1
        first[0].knobs.append("changed by a caller")
        first[0].phases.clear()
        second = plan_roles(job, gib)
        assert second == _plan_roles(job, gib) and second[0].bytes["weights"] > 0
        assert _planned.cache_info().hits == hits + 1  # the second answer was the first one's, copied
    other = replace(job, checkpointing=not job.checkpointing)
    assert plan_roles(other, 80.0) == _plan_roles(other, 80.0) != plan_roles(job, 80.0)


def test_a_config_file_is_read_once_per_version_and_parsed_afresh_for_each_caller(tmp_path):
    from verl_digen.models.base import _file_text, read_json

    file = tmp_path / "config.json"
    file.write_text('{"num_layers": 19, "axes": [16, 56, 56]}')
    first = read_json(str(file))
    first["axes"].append(0)  # a caller's own copy
    reads = _file_text.cache_info().misses
    assert read_json(str(file)) == {"num_layers": 19, "axes": [16, 56, 56]}
    assert _file_text.cache_info().misses == reads  # not read again
    file.write_text('{"num_layers": 57, "axes": [16, 56, 56]}')  # edited, the same size
    os.utime(file, ns=(1, 1))  # another mtime, even on a coarse clock
    assert read_json(str(file))["num_layers"] == 57


def test_each_rank_is_charged_a_communicator_per_process_group_it_joins():
    """Trainer 0 of a disaggregated run joins the trainer group and the weight channel (two NCCL
    communicators), a rollout worker the channel only, a fused worker its group only; every phase
    adds the CUDA context and the allocator's reserve above what the phase allocates. A gloo weight
    channel holds no device buffers."""
    from verl_digen.memory.plan import CONTEXT_BYTES, NCCL_COMMUNICATOR_BYTES, RESERVE_FRACTION

    def communicators(plan) -> set[float]:
        out = set()
        for parts in plan.phases.values():
            allocated = sum(v for k, v in parts.items() if k != "overhead")
            out.add((parts["overhead"] - CONTEXT_BYTES - int(RESERVE_FRACTION * allocated)) / NCCL_COMMUNICATOR_BYTES)
        return out

    nccl = _roles("sd3_disaggregated")
    assert communicators(nccl["trainer"]) == {2} and communicators(nccl["rollout"]) == {1}
    assert communicators(_roles("sd3_colocated")["colocated"]) == {1}
    gloo = _roles("sd3_disaggregated", "digen.sync.backend=gloo")
    assert communicators(gloo["trainer"]) == {1} and communicators(gloo["rollout"]) == {0}


def test_hsdp_ranks_hold_a_communicator_per_mesh_dimension_that_is_not_the_whole_world():
    """torch's DeviceMesh reuses the default group for a dimension over every rank and creates a
    group for each other one: flat FSDP one communicator, HSDP (replicas x shard) three."""
    from verl_digen.memory.plan import mesh_communicators, nccl_communicators

    assert mesh_communicators((8,), 8) == 1 and mesh_communicators((), 8) == 1
    assert mesh_communicators((2, 4), 8) == 3
    from verl_digen.memory.plan import job_shape

    digen, cfg = _digen("qwen_image_full_disaggregated")  # 12 trainers: 8 on node 0, 4 on node 1
    flat = job_shape(digen, devices_per_node=8, nnodes=2)
    assert (flat.fsdp_replicas, flat.fsdp) == (1, 12) and nccl_communicators(flat, "trainer") == 2
    # 16 trainers filling 2 of 3 nodes: digen.fsdp.mesh=auto shards within a node, replicates across
    hsdp, _ = _digen("qwen_image_full_disaggregated", "trainer.nnodes=3", "digen.pools.trainer.devices=8",
                     "digen.pools.trainer.nodes=2", "digen.batch.train_micro_batch_groups=2")
    job = job_shape(hsdp, devices_per_node=8, nnodes=3)
    assert (job.fsdp_replicas, job.fsdp) == (2, 8) and nccl_communicators(job, "trainer") == 3 + 1  # + the channel


def test_every_shipped_preset_fits_a_nodes_default_host_ram_at_load():
    """Host RAM per node at load (what each worker of the node holds: a shard of what it loads,
    what stays on the host by design, trainer 0's snapshot) is within digen.memory.host_gib's
    default for every preset; no worker holds more than one shard of a model it loads."""
    from verl_digen.config.schema import DigenConfig
    from verl_digen.memory.plan import LOAD_SHARD_BYTES, host_plan

    default = DigenConfig().memory.host_gib
    for name in preset_names(CONFIGS):
        digen, cfg = _digen(name)
        nodes = host_plan(digen, devices_per_node=cfg.trainer.n_gpus_per_node, nnodes=cfg.trainer.nnodes)
        assert len(nodes) == cfg.trainer.nnodes
        for node in nodes:
            workers = sum(node.workers.values())
            assert node.total_gib <= default, (name, node)
            assert 0 < node.parts["loading shard"] <= workers * LOAD_SHARD_BYTES, (name, node)


def test_host_ram_counts_the_trainers_offloads_and_trainer_zeros_snapshot():
    from verl_digen.memory.plan import _encoder_and_vae_bytes, _transformer_facts, host_plan, job_shape

    digen, cfg = _digen("flux_full_disaggregated")
    (node,) = host_plan(digen, devices_per_node=8, nnodes=1)
    job = job_shape(digen, devices_per_node=8, nnodes=1)
    encoders, vae = _encoder_and_vae_bytes(job)
    _params, dense, *_ = _transformer_facts(job.family, job.config_path, job.dtype, job.lora_targets, job.lora_rank)
    assert node.workers == {"rollout": 4, "trainer": 4}
    assert node.parts["encoders/VAE on host"] == 4 * (encoders + vae)  # trainers keep both on CPU
    assert node.parts["sync snapshot"] == dense  # trainer 0 only: the full model it sends


def test_a_job_whose_node_lacks_host_ram_is_refused_naming_the_key():
    from verl_digen.memory import check_job_memory

    digen, cfg = _digen("flux_full_disaggregated", "digen.memory.host_gib=64")
    with pytest.raises(MemoryPlanError) as err:
        check_job_memory(digen, devices_per_node=8, nnodes=1)
    assert "digen.memory.host_gib=64" in str(err.value) and "sync snapshot" in str(err.value)
    with pytest.raises(ConfigError, match="digen.memory.host_gib"):
        _digen("flux_full_disaggregated", "digen.memory.host_gib=0")
