"""Per-GPU peak memory of every role of a job, at real size, before anything is loaded.

A role (``rollout``, ``trainer``, ``reward``, or ``colocated``: rollout and trainer on the same
GPUs) goes through phases; its peak is the largest phase, broken into

* ``weights``: the transformer (sharded with FSDP, plus FSDP's all-gather buffers), LoRA
  adapters, a full fine-tune's KL reference and an on-GPU EMA;
* ``gradients`` and ``optimizer``: the trainable parameters' gradients and AdamW's two states;
* ``activations``: training (saved for backward, measured on the meta device, see
  :mod:`verl_digen.memory.trace`), or rollout (the no-grad working set, the trajectory's latents,
  the VAE's decode);
* ``encoders_vae``: text encoders (resident on generating roles unless the prompt cache released
  them or ``digen.model.offload_text_encoders`` keeps them on CPU: then only in the phases that
  encode, ``warm`` and ``encode``) and the VAE weights, plus a model reward's weights;
* ``sync_buffers``: weight-sync buckets in flight (disaggregated);
* ``overhead``: what the allocator never reports as allocated: the CUDA context and cuBLAS
  workspaces, the buffers of each NCCL communicator the role's rank holds (one per process group
  it joins: :func:`nccl_communicators`), and the caching allocator's reserve above the phase's
  allocated bytes (:data:`RESERVE_FRACTION`).

Host RAM is planned too (:func:`host_plan`): what each worker holds on the host at load, summed
over the workers of each node, against ``digen.memory.host_gib``.

Parameter bytes come from the family's configs built on the meta device (the model directory's
own configs when it has them, else the shipped real ones). Every assumption about what the
workers keep is stated where it is computed; docs/memory.md collects them with the expected error.
"""

from __future__ import annotations

import copy
import functools
import math
import os
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from verl_digen.config.schema import ConfigError, DigenConfig
from verl_digen.platform.devices import device_memory_gib
from verl_digen.sync.buckets import CAPTURE_DEVICE_BUCKETS, DEFAULT_BUCKET_BYTES
from verl_digen.memory.fsdp_layout import reduce_buffer_bytes

GIB = 1 << 30
# CUDA context (~0.5 GiB on an H100 with CUDA's lazy module loading) and cuBLAS workspaces (a few
# MiB per stream): an allowance, the first half of the fixed 1.5 GiB planned before the
# communicators were counted.
CONTEXT_BYTES = int(0.5 * GIB)
# One NCCL communicator's device buffers: NCCL_BUFFSIZE (4 MiB, NCCL's default) per protocol
# (Simple; LL128 ~4.5 MiB; LL 256 KiB) per peer connection per channel, for ring and tree, over
# up to 32 channels on NVLink: ~0.6 GiB, plus NVLS buffers on NVSwitch nodes (NCCL's
# documentation of NCCL_NVLS_ENABLE warns they take "a significant amount of GPU memory"). An
# allowance of 1 GiB each, the other part of the 1.5 GiB that used to cover every rank whatever
# it joined; trainer 0 of a disaggregated run holds two (its group and the weight channel).
NCCL_COMMUNICATOR_BYTES = int(1.0 * GIB)
# What the caching allocator reserves above what tensors hold, as a fraction of the phase's
# allocated bytes. Workers run with expandable segments (placement/pools.py: worker_env), which
# grow one mapping per stream in 2 MiB pages instead of caching fixed segments that a later,
# differently sized allocation cannot reuse; what remains is page rounding and the small pool's
# 2 MiB blocks. An allowance, not a measurement: gpu_check records max_memory_reserved next to
# max_memory_allocated for every phase, the figure to set this from.
RESERVE_FRACTION = 0.05
# Live full-resolution feature maps (of the decoder's widest full-resolution layer) at a VAE
# decode's peak, per VAE class: measured on an H200 (torch 2.11, diffusers 0.42.1) at each
# preset's decode call, random weights from the shipped configs (tests/gpu/test_memory_gpu.py::
# test_vae_decode_of_one_call_at_real_size_matches_the_plan; docs/results_gpu.md):
# FLUX's AutoencoderKL, 8 images 512 x 512: 4.03 GiB = 8.0 maps; Wan's, 1 x 33 frames 480 x 832
# tiled: 1.58 GiB = 15.2; HunyuanVideo's, 1 x 33 frames 544 x 960 tiled: 3.64 GiB = 13.0 (the
# decoded fp32 pixels taken off first). The planned figures are 7-12% above these; the estimate
# of 4 maps before was 2-3x low. One shape per class: other shapes scale by the formula.
VAE_WORKING_SET = {"AutoencoderKL": 9, "AutoencoderKLWan": 17, "AutoencoderKLHunyuanVideo": 14}
VAE_WORKING_SET_DEFAULT = 17  # a class not measured (Qwen-Image's Wan-style VAE): the largest measured
VIDEO_TILE = 256  # diffusers' video VAE tiling: 256x256-pixel tiles (tile_sample_min_height/width)
HUNYUAN_TILE_FRAMES = 16  # AutoencoderKLHunyuanVideo's tile_sample_min_num_frames
# Model-backed rewards: parameters, held on the scoring worker's GPU in the reward's dtype
# (reward_gpu_bytes). Rule-based, remote (http, vlm_judge), scikit-learn (digit_classifier)
# and onnxruntime (ocr) rewards hold no GPU memory.
REWARD_MODEL_PARAMS = {
    "pickscore": 0.99e9,  # CLIP ViT-H/14
    "hpsv2": 0.99e9,  # CLIP ViT-H/14
    "clip_score": 0.43e9,  # CLIP ViT-L/14
    "aesthetic": 0.43e9,  # CLIP ViT-L/14 + MLP head
    "imagereward": 0.45e9,  # BLIP
}
CATEGORIES = ("weights", "gradients", "optimizer", "activations", "encoders_vae", "sync_buffers", "overhead")


class MemoryPlanError(ConfigError):
    """A role of the job would not fit in its GPUs' memory; the message says which knob to turn."""


# ---------------------------------------------------------------------- devices


def device_gib(cfg: DigenConfig) -> float:
    """The memory of one GPU of the job: ``digen.memory.device_gib``, else its device type's."""
    if cfg.memory.device_gib is not None:
        return float(cfg.memory.device_gib)
    return device_memory_gib()[cfg.memory.device_type]


# ---------------------------------------------------------------------- model sizes


def _dtype_name(name: str) -> str:
    """``auto`` plans for the GPU (bf16)."""
    return "fp32" if name == "fp32" else "bf16"


def _bytes_per(name: str) -> int:
    return 4 if _dtype_name(name) == "fp32" else 2


def fsdp_layout_of(cfg: DigenConfig, devices_per_node: int, nnodes: int) -> tuple[int, int, int]:
    """``(replicas, shard, reduce bytes per trained parameter)`` of the training ranks of ``cfg`` on
    ``nnodes`` x ``devices_per_node`` GPUs, as the workers decide it (memory/fsdp_layout.py) from
    the nodes the runtime places them on (platform/nodes.py ``node_counts``); ``(1, 1, 4)``
    without FSDP."""
    from verl_digen.platform.nodes import PlacementError, node_counts
    from verl_digen.memory.fsdp_layout import DTYPE_BYTES, mesh_shape, reduce_dtype

    ranks = cfg.fsdp_ranks(devices_per_node * nnodes)
    if ranks <= 1 and not cfg.fsdp.enable:
        return 1, 1, 4
    if cfg.placement == "disaggregated":
        pools = {"rollout": cfg.pools.rollout.world_size, "trainer": ranks}
        if cfg.pools.reward.devices:
            pools["reward"] = cfg.pools.reward.world_size
        try:
            on_nodes = list(node_counts(pools, devices_per_node, nnodes)["trainer"])
        except PlacementError:  # pools larger than the cluster: the cluster check names them; one node here
            on_nodes = [ranks]
    else:
        on_nodes = [devices_per_node] * nnodes
    replicas, shard = mesh_shape(on_nodes, cfg.fsdp.mesh)
    lora = cfg.model.lora.enable
    reduce = reduce_dtype(cfg.fsdp.reduce_dtype, lora=lora, weights_dtype=_dtype_name(cfg.model.dtype))
    return replicas, shard, DTYPE_BYTES[reduce]


@functools.lru_cache(maxsize=128)
def _component_bytes(family: str, config_path: str | None, name: str, dtype: str) -> int:
    from verl_digen.memory.trace import module_bytes, torch_dtype
    from verl_digen.models.real_configs import build_on_meta

    return module_bytes(build_on_meta(family, name, path=config_path, dtype=torch_dtype(dtype)))


@functools.lru_cache(maxsize=32)
def _transformer_facts(family: str, config_path: str | None, dtype: str, lora_targets: tuple[str, ...], rank: int):
    """(parameters, bytes at ``dtype``, largest block's bytes, LoRA parameters, parameter bytes at
    ``dtype``: the parameters alone, without buffers; a diffusers model keeps some in fp32)."""
    params, dense, block, param_bytes, linears = _transformer_sizes(family, config_path, dtype)
    lora = 0
    for name, in_features, out_features in linears:
        # peft's matching: a target names the module or the tail of its dotted name
        if any(name == t or name.endswith("." + t) for t in lora_targets):
            lora += rank * (in_features + out_features)
    return params, dense, block, lora, param_bytes


@functools.lru_cache(maxsize=16)
def _transformer_sizes(family: str, config_path: str | None, dtype: str):
    """What :func:`_transformer_facts` reads of the model built on the meta device: (parameters,
    bytes at ``dtype``, largest block's bytes, parameter bytes at ``dtype``, (name, in, out) of
    every ``torch.nn.Linear`` in ``named_modules`` order). Apart from the LoRA settings, which only
    select among the linears: one build per model and dtype, whatever the LoRA targets and rank
    (jobs of one model differ in them), the same figures as building it for each."""
    import torch

    from verl_digen.memory.trace import largest_block_bytes, module_bytes, torch_dtype
    from verl_digen.models.real_configs import build_on_meta

    model = build_on_meta(family, "transformer", path=config_path, dtype=torch_dtype(dtype))
    params = sum(p.numel() for p in model.parameters())
    linears = tuple((name, module.in_features, module.out_features) for name, module in model.named_modules()
                    if isinstance(module, torch.nn.Linear))
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return params, module_bytes(model), largest_block_bytes(model), param_bytes, linears


def reward_gpu_bytes(spec: dict[str, Any], device: str = "auto", params_of: Any = None) -> int:
    """GPU bytes the reward of ``spec`` (``RewardConfig.as_spec()``) holds on a GPU worker that
    builds it: each model's parameters in its ``kwargs.dtype`` (float32 by default), where it
    runs on the GPU. As :func:`verl_digen.rewards.build_reward_from_config` places it: a
    reward's ``kwargs.device`` wins, a weighted sum's reaches its components, else ``device``
    (``digen.reward.device``: ``auto`` / ``cuda``: the worker's GPU; ``cpu``: none).
    ``params_of``: parameters per reward name (default :data:`REWARD_MODEL_PARAMS`)."""
    params_of = params_of or (lambda name: REWARD_MODEL_PARAMS.get(name, 0.0))
    kwargs = spec.get("kwargs") or {}
    where = str(kwargs["device"] if "device" in kwargs else device)  # the reward's own kwargs win
    if spec.get("name") == "weighted":
        return sum(reward_gpu_bytes(c, where, params_of) for c in spec.get("components") or kwargs.get("components", []))
    if where.startswith("cpu"):
        return 0
    dtype = str(kwargs.get("dtype", "float32"))
    return int(params_of(str(spec.get("name"))) * _REWARD_DTYPE_BYTES.get(dtype, 4))


_REWARD_DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2, "float64": 8, "double": 8}


# ---------------------------------------------------------------------- the job


@dataclass
class RolePlan:
    """One role's peak per GPU: its phase and the bytes of each category at that phase."""

    role: str
    devices: int
    phase: str
    bytes: dict[str, int]
    device_gib: float
    knobs: list[str] = field(default_factory=list)  # what to turn when it does not fit
    # Every phase of the role (the peak is one of them): phase -> category -> bytes.
    phases: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def peak_bytes(self) -> int:
        return sum(self.bytes.values())

    @property
    def peak_gib(self) -> float:
        return self.peak_bytes / GIB

    @property
    def headroom(self) -> float:
        """Fraction of the device left free at the peak (negative: does not fit)."""
        return 1.0 - self.peak_gib / self.device_gib

    def row(self, preset: str | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"preset": preset, "role": self.role, "devices": self.devices, "phase": self.phase,
                               "peak_gib": round(self.peak_gib, 2), "device_gib": self.device_gib,
                               "headroom": round(self.headroom, 3), "fits": self.peak_gib <= self.device_gib}
        out.update({f"{k}_gib": round(v / GIB, 2) for k, v in self.bytes.items()})
        return out


@dataclass(frozen=True)
class JobShape:
    """Everything of a job the planner reads, resolved (sizes in bytes, counts per GPU)."""

    family: str
    config_path: str | None
    dtype: str
    trainable_bytes: int
    lora: bool
    lora_targets: tuple[str, ...]
    lora_rank: int
    height: int
    width: int
    num_frames: int
    num_steps: int
    cfg_rows: int  # forward rows per sample: 2 with true CFG ([cond; uncond] in one forward)
    group_size: int
    groups_per_task: int
    micro_batch_samples: int
    pass_samples: int  # samples per training pass on one rank (one transformer call, schedule.strategies.pass_rows)
    placement: str
    devices: int  # colocated: all GPUs; else unused
    rollout_devices: int
    trainer_devices: int
    reward_devices: int
    fsdp: int  # FSDP degree (1: none)
    checkpointing: bool  # decided (digen.model.gradient_checkpointing=auto: decide_checkpointing)
    prompt_cache_releases: bool
    encoders_offloaded: bool  # generating roles keep the text encoders on CPU between encodes (decide_encoder_offload)
    warm_batch: int  # prompts per encoder call of the prompt-cache warm-up (0: no warm-up)
    optimizer_states: int  # AdamW: 2, SGD: 0
    ema_on_gpu: bool
    kl_reference: bool  # a full fine-tune with a KL term keeps a frozen copy
    vae_decode_chunk: int
    trainers_generate: bool
    reward_bytes: int  # per GPU of a worker that scores (reward_gpu_bytes)
    trainers_score: bool  # trainers generate under TAG with no reward pool: they build the reward too
    rollouts_train: bool  # GAT: rollout workers train micro-batches too (disaggregated, digen.gat.enable)
    max_sequence_length: int | None = None  # text tokens per prompt (None: the pipeline's default)
    # FSDP's layout beyond its degree (memory/fsdp_layout.py, the workers' decision): replicas of
    # an HSDP mesh (1: flat; ``fsdp`` is then the shard group's size) and the bytes per trained
    # parameter of the gradient reduction (digen.fsdp.reduce_dtype).
    fsdp_replicas: int = 1
    grad_reduce_bytes: int = 4
    optimizer_offload: bool = False  # the optimizer state on the host except in the optimizer step
    param_offload: bool = False  # FSDP2's CPUOffloadPolicy: parameter shards, gradients, optimizer on the host
    fsdp_enabled: bool = False  # digen.fsdp.enable: trainers join a process group even alone (FSDP2's mesh)
    sync_nccl: bool = True  # the weight channel is NCCL (digen.sync.backend auto on GPUs, or nccl)
    ema_on_host: bool = False  # an EMA kept in host memory (digen.ema.offload)


def model_config_path(path: str | None) -> str | None:
    """The model directory whose configs to plan with, or None for the family's shipped ones
    (no path, or a path that does not exist on this machine)."""
    if path and os.path.isfile(os.path.join(path, "model_index.json")) and os.path.isfile(
        os.path.join(path, "transformer", "config.json")
    ):
        return os.path.abspath(path)
    return None


def job_shape(cfg: DigenConfig, *, devices_per_node: int, nnodes: int, model_path: str | None = None,
              checkpointing: bool | None = None, encoders_offloaded: bool | None = None,
              optimizer_offload: bool | None = None) -> JobShape:
    """Resolve ``cfg`` on a cluster of ``nnodes`` x ``devices_per_node`` GPUs; ``checkpointing``
    overrides ``digen.model.gradient_checkpointing`` (an ``auto`` left undecided plans without),
    ``encoders_offloaded`` ``digen.model.offload_text_encoders`` (undecided: resident, as the
    workers then keep them), ``optimizer_offload`` ``digen.model.optimizer_offload`` (None: as
    ``cfg`` says; an ``auto`` of a disaggregated run left undecided keeps the state resident)."""

    config_path = model_config_path(model_path if model_path is not None else cfg.model.path)
    family = cfg.model.arch
    if family is None and config_path is not None:
        from verl_digen.models.registry import detect_arch

        family = detect_arch(config_path)
    if family is None:
        raise ConfigError("invalid config: digen.model.arch=None; the memory plan needs the model family "
                          "(set digen.model.arch or a digen.model.path with a model_index.json)")
    devices = devices_per_node * nnodes
    disaggregated = cfg.placement == "disaggregated"
    trainer_devices = cfg.pools.trainer.world_size if disaggregated else devices
    fsdp_replicas, fsdp, grad_reduce_bytes = fsdp_layout_of(cfg, devices_per_node, nnodes)
    lora = cfg.model.lora.enable
    if checkpointing is None:
        checkpointing = bool(cfg.model.checkpointing)
    if encoders_offloaded is None:
        encoders_offloaded = bool(cfg.model.encoders_offloaded)
    return JobShape(
        family=family,
        config_path=config_path,
        dtype=_dtype_name(cfg.model.dtype),
        trainable_bytes=_bytes_per(cfg.model.trainable_dtype),
        lora=lora,
        lora_targets=tuple(cfg.model.lora.target_modules),
        lora_rank=cfg.model.lora.rank,
        height=cfg.sampling.height,
        width=cfg.sampling.width,
        num_frames=cfg.sampling.num_frames,
        num_steps=cfg.sampling.num_steps,
        cfg_rows=2 if cfg.sampling.guidance_scale > 1.0 else 1,
        group_size=cfg.batch.group_size,
        groups_per_task=cfg.batch.groups_per_task,
        micro_batch_samples=cfg.batch.train_micro_batch_groups * cfg.batch.group_size,
        pass_samples=cfg.pass_rows(devices),
        placement=cfg.placement,
        devices=devices,
        rollout_devices=cfg.pools.rollout.world_size if disaggregated else devices,
        trainer_devices=trainer_devices,
        reward_devices=cfg.pools.reward.world_size if disaggregated else 0,
        fsdp=fsdp,
        fsdp_replicas=fsdp_replicas,
        grad_reduce_bytes=grad_reduce_bytes,
        checkpointing=checkpointing,
        prompt_cache_releases=cfg.prompt_cache.enable and cfg.prompt_cache.release_encoders,
        encoders_offloaded=encoders_offloaded,
        warm_batch=cfg.prompt_cache.encode_batch_size if cfg.prompt_cache.enable else 0,
        optimizer_states=2 if cfg.algo.optimizer == "adamw" else 0,
        ema_on_gpu=cfg.ema.enable and not cfg.ema.offload,
        kl_reference=cfg.algo.kl_beta > 0 and not lora,
        vae_decode_chunk=cfg.model.vae_decode_chunk,
        trainers_generate=disaggregated and cfg.tag.enable,
        reward_bytes=reward_gpu_bytes(cfg.reward.as_spec(), cfg.reward.device),
        # the worker's rule (DiffusionWorker._generates_without_reward_pool)
        trainers_score=disaggregated and cfg.tag.enable and cfg.pools.reward.devices == 0,
        rollouts_train=disaggregated and cfg.gat.enable,
        max_sequence_length=cfg.model.max_sequence_length,
        optimizer_offload=cfg.optimizer_offloaded if optimizer_offload is None else optimizer_offload,
        param_offload=cfg.fsdp.param_offload,
        fsdp_enabled=cfg.fsdp.enable,
        sync_nccl=cfg.sync.backend != "gloo",
        ema_on_host=cfg.ema.enable and cfg.ema.offload,
    )


def workload_job(*, family: str, height: int, width: int, num_frames: int, num_steps: int, cfg_rows: int,
                 group_size: int, groups_per_task: int, micro_batch_samples: int, pass_samples: int, lora: bool,
                 lora_rank: int, kl_reference: bool, placement: str, rollout_devices: int, trainer_devices: int,
                 reward_devices: int, fsdp: int, reward_bytes: int, trainers_generate: bool, trainers_score: bool,
                 rollouts_train: bool, vae_decode_chunk: int | None = None, devices: int | None = None,
                 fsdp_replicas: int = 1, grad_reduce_bytes: int = 4) -> JobShape:
    """The job of a workload on a cluster, for a caller without a composed config (the
    simulator's planner: ``sim.cost_model.CostModel.memory_job``): what the arguments say, every
    other setting at the config's default (:class:`DigenConfig`: weights in bf16, trained state in
    its ``trainable_dtype``, AdamW, the default LoRA targets, no prompt cache, no EMA on the GPU,
    whole-batch VAE decodes, the pipeline's text length, no FSDP host offload), the memory
    decisions left to :func:`decide_job`. ``placement`` colocated: ``rollout_devices`` is every GPU.
    ``vae_decode_chunk``: ``digen.model.vae_decode_chunk`` (None: the default, the whole call);
    ``devices``: the cluster's GPUs (None: ``rollout_devices``); ``fsdp_replicas`` and
    ``grad_reduce_bytes``: :class:`JobShape`'s (the caller's FSDP layout; ``fsdp`` its shard size)."""
    d = DigenConfig()
    colocated = placement == "colocated"
    return JobShape(
        family=family, config_path=None, dtype=_dtype_name(d.model.dtype), trainable_bytes=_bytes_per(d.model.trainable_dtype),
        lora=lora, lora_targets=tuple(d.model.lora.target_modules), lora_rank=lora_rank, height=height, width=width,
        num_frames=num_frames, num_steps=num_steps, cfg_rows=cfg_rows, group_size=group_size,
        groups_per_task=groups_per_task, micro_batch_samples=micro_batch_samples, pass_samples=pass_samples,
        placement=placement, devices=rollout_devices if devices is None else devices, rollout_devices=rollout_devices,
        trainer_devices=rollout_devices if colocated else trainer_devices, reward_devices=0 if colocated else reward_devices,
        fsdp=fsdp, fsdp_replicas=fsdp_replicas, grad_reduce_bytes=grad_reduce_bytes,
        checkpointing=False, prompt_cache_releases=d.prompt_cache.enable and d.prompt_cache.release_encoders,
        encoders_offloaded=False, warm_batch=d.prompt_cache.encode_batch_size if d.prompt_cache.enable else 0,
        optimizer_states=2 if d.algo.optimizer == "adamw" else 0, ema_on_gpu=d.ema.enable and not d.ema.offload,
        kl_reference=kl_reference and not lora,
        vae_decode_chunk=d.model.vae_decode_chunk if vae_decode_chunk is None else vae_decode_chunk,
        trainers_generate=not colocated and trainers_generate, reward_bytes=reward_bytes,
        trainers_score=not colocated and trainers_score, rollouts_train=not colocated and rollouts_train,
        max_sequence_length=d.model.max_sequence_length, param_offload=d.fsdp.param_offload, fsdp_enabled=fsdp > 1,
        sync_nccl=d.sync.backend != "gloo", ema_on_host=d.ema.enable and d.ema.offload,
    )


# ---------------------------------------------------------------------- components of a role


def _encoder_and_vae_bytes(job: JobShape) -> tuple[int, int]:
    """(text encoders, VAE) weight bytes, in the dtypes the adapter loads them in."""
    from verl_digen.models.real_configs import model_components
    from verl_digen.models.registry import ADAPTERS

    fp32_parts = ADAPTERS[job.family].fp32_components
    encoders = vae = 0
    for name in model_components(job.family, job.config_path):
        if name == "transformer":
            continue
        dtype = "fp32" if name in fp32_parts else job.dtype
        size = _component_bytes(job.family, job.config_path, name, dtype)
        if name == "vae":
            vae += size
        else:
            encoders += size
    return encoders, vae


def _encoder_activation_bytes(job: JobShape, prompts: int | None = None) -> int:
    """One encode call of ``prompts`` prompts (default: a task's prompts and the negative one):
    batch x tokens x the widest layer's width, twice (input and output of the layer), at the
    encoders' dtype. Small next to the weights; an estimate."""
    from verl_digen.memory.trace import text_tokens
    from verl_digen.models.real_configs import component_config, model_components

    widest = 0
    for name in model_components(job.family, job.config_path):
        if not name.startswith("text_encoder"):
            continue
        c = component_config(job.family, name, job.config_path)
        c = c.get("text_config", c)
        widest = max(widest, int(c.get("intermediate_size") or c.get("d_ff") or 0), 4 * int(c.get("hidden_size") or c.get("d_model") or 0))
    if prompts is None:
        prompts = job.groups_per_task + 1
    return 2 * prompts * text_tokens(job.family, job.max_sequence_length) * widest * _bytes_per(job.dtype)


def _vae_decode_bytes(job: JobShape, samples: int) -> int:
    """Peak of one VAE decode call of ``samples`` samples (``vae_decode_chunk`` of them at a
    time): ``VAE_WORKING_SET[vae class]`` full-resolution feature maps of the decoder's widest
    full-resolution layer, over the frames decoded together (a video VAE decodes in 256-pixel
    tiles; Wan / Qwen-Image's causal VAE one latent frame, i.e. 4 frames, at a time), plus the
    decoded fp32 pixels of the call."""
    from verl_digen.models.real_configs import component_config, model_components
    from verl_digen.models.registry import ADAPTERS

    chunk = samples if job.vae_decode_chunk <= 0 else min(job.vae_decode_chunk, samples)
    vae_class = model_components(job.family, job.config_path)["vae"][1]
    vae = component_config(job.family, "vae", job.config_path)
    vae_bytes = 4 if "vae" in ADAPTERS[job.family].fp32_components or job.dtype == "fp32" else 2
    if "block_out_channels" in vae:
        channels = int(vae["block_out_channels"][0])
    else:  # Wan-style VAE
        channels = int(vae["base_dim"]) * int(vae["dim_mult"][0])
    h, w, frames = job.height, job.width, job.num_frames
    if frames > 1:
        h, w = min(h, VIDEO_TILE), min(w, VIDEO_TILE)
        if vae_class == "AutoencoderKLHunyuanVideo":  # the VAE's tiling, whichever family uses it
            frames = min(frames, HUNYUAN_TILE_FRAMES + 1)
        else:
            frames = min(frames, int(vae.get("scale_factor_temporal", 4)))
    maps = VAE_WORKING_SET.get(vae_class, VAE_WORKING_SET_DEFAULT)
    features = maps * chunk * channels * h * w * frames * vae_bytes
    pixels = chunk * 3 * job.num_frames * job.height * job.width * 4
    return features + pixels


def trace_shape(job: JobShape):
    """What the memory trace measures for ``job`` (:class:`~verl_digen.memory.trace.TraceShape`):
    the one place a job becomes a trace shape. LoRA jobs are traced as they train (frozen base,
    fp32 adapters): what autograd keeps differs."""
    from verl_digen.memory.trace import TraceShape

    lora = (job.lora_rank, tuple(job.lora_targets)) if job.lora else (0, ())
    return TraceShape(job.family, job.config_path, job.dtype, job.height, job.width, job.num_frames, *lora,
                      max_sequence_length=job.max_sequence_length)


def plan_trace(job: JobShape):
    """The transformer's activation trace of ``job`` (cached per trace shape)."""
    from verl_digen.memory.trace import trace_transformer

    return trace_transformer(trace_shape(job))


def _latent_bytes(job: JobShape) -> int:
    """fp32 latents of one sample."""
    from verl_digen.memory.trace import latent_layout

    lay = latent_layout(trace_shape(job))
    return 4 * lay["channels"] * lay["frames"] * lay["h"] * lay["w"]


def mesh_communicators(mesh_shape: tuple[int, ...], world_size: int) -> int:
    """NCCL communicators one rank of a training mesh holds: the default group's (which the
    trainer group is: workers/worker.py ``_join_trainer_group``), and one per mesh dimension
    that does not span every rank (torch's ``DeviceMesh`` reuses the default group only for a
    dimension over the whole world; each other dimension is a group of its own, of which a rank
    joins one). A 1-D FSDP mesh: 1; an HSDP mesh (replicate, shard) of two or more of each: 3."""
    return 1 + sum(1 for size in (mesh_shape or (world_size,)) if size != world_size)


def nccl_communicators(job: JobShape, role: str) -> int:
    """NCCL communicators the rank of ``role`` that holds the most holds, as the workers create
    them: a training rank the trainer group when its pool has more than one rank or FSDP
    (:func:`mesh_communicators` of its mesh: ``(replicas, shard)`` under HSDP, else 1-D over the
    group, workers/fsdp.py ``training_mesh``); trainer 0 and every rollout worker of a
    disaggregated run the weight channel (trainer/runtime.py ``open_weight_channel``) when it is
    NCCL; a GAT rollout worker trains without a group; a reward worker joins none."""
    trains = role in ("colocated", "trainer")
    ranks = job.devices if role == "colocated" else job.trainer_devices
    mesh = (job.fsdp_replicas, job.fsdp) if job.fsdp_replicas > 1 else ()
    count = mesh_communicators(mesh, ranks) if trains and (ranks > 1 or job.fsdp_enabled) else 0
    if role in ("trainer", "rollout") and job.sync_nccl:
        count += 1
    return count


def overhead_bytes(job: JobShape, role: str, allocated: int) -> int:
    """The ``overhead`` of a phase of ``role`` whose tensors hold ``allocated`` bytes: CUDA
    context, the rank's NCCL communicators, and the allocator's reserve above ``allocated``."""
    return CONTEXT_BYTES + nccl_communicators(job, role) * NCCL_COMMUNICATOR_BYTES + int(RESERVE_FRACTION * allocated)


class _RoleBuilder:
    """The phases of one role, as dicts of category -> bytes."""

    def __init__(self, job: JobShape, role: str, devices: int, gib: float | Mapping[str, float]) -> None:
        self.job, self.role, self.devices, self.gib = job, role, devices, role_gib(gib, role)
        self.phases: dict[str, dict[str, int]] = {}

    def add(self, phase: str, **parts: int) -> None:
        bytes_ = {k: 0 for k in CATEGORIES}
        for k, v in parts.items():
            bytes_[k] += int(v)
        bytes_["overhead"] = overhead_bytes(self.job, self.role, sum(bytes_.values()))
        self.phases[phase] = bytes_

    def plan(self, train_knobs: list[str], rollout_knobs: list[str]) -> RolePlan:
        """The peak phase; its knobs first (generation's for generate/decode, training's else)."""
        phase, bytes_ = max(self.phases.items(), key=lambda kv: sum(kv[1].values()))
        first, then = (rollout_knobs, train_knobs) if phase in ("generate", "decode") else (train_knobs, rollout_knobs)
        knobs = list(dict.fromkeys(first + then))
        return RolePlan(role=self.role, devices=self.devices, phase=phase, bytes=bytes_, device_gib=self.gib,
                        knobs=knobs, phases={name: dict(b) for name, b in self.phases.items()})


def trained_state_bytes(job: JobShape, params: int, param_bytes: int, lora_params: int) -> dict[str, float]:
    """Bytes one trainer rank holds of the trained model outside activations, term by term as
    ``workers/training.py`` keeps it (FSDP shards every term ``job.fsdp`` ways; a LoRA adapter's
    weights are charged whole, its gradients and optimizer states sharded):

    * ``params``: the model's own parameters in the dtypes they were loaded in (``param_bytes``;
      with LoRA, plus the adapters in the trainable dtype);
    * ``masters``: a full fine-tune whose parameters are not all in the trainable dtype (bf16
      weights, fp32 training) keeps trainable-dtype copies of every parameter
      (``MasterWeights``), next to the model's own, which rollout and trainer compute with;
    * ``grads``: the gradients backward writes into the trained parameters: the model's own
      dtypes for a full fine-tune, alive until ``MasterWeights.accumulate_grads`` folds each into
      its master's gradient and frees it (after every pass's backward);
    * ``master_grads``: the masters' gradients, accumulated over the step until the optimizer step;
    * ``optimizer``: AdamW's two states (SGD: none) per trained parameter, trainable dtype."""
    f, tb = job.fsdp, job.trainable_bytes
    if job.lora:
        trained = lora_params * tb
        return dict(params=param_bytes / f + trained, masters=0, grads=trained / f, master_grads=0,
                    optimizer=job.optimizer_states * trained / f)
    masters = params * tb if param_bytes != params * tb else 0  # PolicyUpdater: some parameter not in tb
    return dict(params=param_bytes / f, masters=masters / f, grads=param_bytes / f, master_grads=masters / f,
                optimizer=job.optimizer_states * params * tb / f)


def role_gib(gib: float | Mapping[str, float], role: str) -> float:
    """The GiB of one GPU of ``role``: ``gib`` itself, or its entry for the role (a cluster whose
    pools have different device types; a fused worker is ``colocated``)."""
    return float(gib) if isinstance(gib, (int, float)) else float(gib[role])


def plan_roles(job: JobShape, gib: float | Mapping[str, float]) -> list[RolePlan]:
    """Every role's peak per GPU for ``job`` on GPUs of ``gib`` GiB (one number for every role,
    or a GiB per role name: ``colocated``, ``rollout``, ``trainer``, ``reward``). The caller's own
    copies: it may change them."""
    return copy.deepcopy(list(_planned(job, _gib_key(gib))))


def _gib_key(gib: float | Mapping[str, float]) -> float | tuple[tuple[str, float], ...]:
    return float(gib) if isinstance(gib, (int, float)) else tuple(sorted((k, float(v)) for k, v in gib.items()))


@functools.lru_cache(maxsize=4096)
def _planned(job: JobShape, gib: float | tuple[tuple[str, float], ...]) -> tuple[RolePlan, ...]:
    """:func:`plan_roles`, computed once per (job, GPU sizes) and shared read-only: a planner search
    plans the same few thousand jobs about six times each (``decide_job`` tries each decision
    first), and a plan is a pure function of the job, its model's configs (read once per model:
    :func:`_transformer_facts`) and the GPU sizes. Callers here only read; :func:`plan_roles`
    hands out copies."""
    return tuple(_plan_roles(job, gib if isinstance(gib, float) else dict(gib)))


def _plan_roles(job: JobShape, gib: float | Mapping[str, float]) -> list[RolePlan]:
    params, dense_bytes, block_bytes, lora_params, param_bytes = _transformer_facts(
        job.family, job.config_path, job.dtype, job.lora_targets, job.lora_rank
    )
    encoders, vae = _encoder_and_vae_bytes(job)
    trace = plan_trace(job)
    tb = job.trainable_bytes
    f = job.fsdp
    reward = job.reward_bytes

    state = trained_state_bytes(job, params, param_bytes, lora_params)
    if job.param_offload:  # FSDP2's CPUOffloadPolicy: every sharded tensor of training waits on the host
        state = {k: 0 for k in state}
    grads = state["grads"] + state["master_grads"]
    # FSDP2's reduction of one unit's gradients in backward (memory/fsdp_layout.py
    # reduce_buffer_bytes, in the job's reduce dtype): the largest block's trained parameters,
    # its share of the model's (LoRA: of the adapters').
    unit_trained = (lora_params if job.lora else params) * block_bytes / max(dense_bytes, 1)
    reduce_buffers = reduce_buffer_bytes(unit_trained, replicas=job.fsdp_replicas, shard=f,
                                         reduce_bytes=job.grad_reduce_bytes) if f * job.fsdp_replicas > 1 else 0
    # With optimizer_offload the state is on the GPU only in the optimizer step (PolicyUpdater
    # park_optimizer / unpark_optimizer): its own phase, with the gradients and no activations.
    step_optimizer = state["optimizer"]
    optimizer = 0 if job.optimizer_offload else step_optimizer
    ema = (lora_params if job.lora else params) * 4 / f if job.ema_on_gpu else 0
    # Trainer weights: the model's own (sharded with FSDP, its buffers too) and a full fine-tune's
    # masters; with FSDP each rank all-gathers one block ahead of the one it computes (2 blocks
    # unsharded).
    gather = 2 * block_bytes if (f > 1 or job.param_offload) else 0  # offloaded: copied in a unit ahead too
    train_weights = state["params"] + (dense_bytes - param_bytes) / f + state["masters"] + gather
    # A full fine-tune's frozen KL reference: sharded like the policy under FSDP (built from its
    # shards, workers/worker.py); without FSDP it waits in pinned host memory and is on the GPU for each
    # micro-batch's reference forwards (PolicyUpdater._reference_means), so training alone carries it.
    kl_ref = dense_bytes / f if (job.kl_reference and f > 1 and not job.param_offload) else 0
    kl_ref_in_training = dense_bytes if (job.kl_reference and f == 1) else 0
    encoders_resident = 0 if job.prompt_cache_releases else encoders
    # Generating roles (colocated, rollout): resident unless offloaded (workers/worker.py
    # offloaded_parts); offloaded ones visit the GPU only while a generate call encodes.
    gen_encoders = 0 if job.encoders_offloaded else encoders_resident
    # One training pass: a transformer call's samples (both CFG branches) on one rank; the
    # micro-batch trains pass after pass (workers/training.py), so no more is alive at once.
    train_rows = job.cfg_rows * job.pass_samples
    train_acts = trace.training_bytes(train_rows, checkpointing=job.checkpointing)

    # Rollout: one generate call of groups_per_task groups; its trajectory (fp32 latents and
    # log-probs) is recorded on the device and read back once (workers/sampling.py: _DeviceRecord).
    # Each denoising step runs the transformer in calls of pass_samples samples, the training
    # passes' calls (workers/sampling.py: velocity_in_chunks), so one call's working set is alive
    # at a time, next to the fp32 velocities of the calls before it (one latent per sample).
    samples = job.groups_per_task * job.group_size
    trajectory = samples * (job.num_steps + 1) * _latent_bytes(job) + samples * job.num_steps * 4
    call = min(job.pass_samples, samples)
    chunks = samples * _latent_bytes(job) if call < samples else 0
    rollout_acts = trace.inference_bytes(call * job.cfg_rows) + chunks + trajectory
    decode = _vae_decode_bytes(job, samples)
    rollout_weights = dense_bytes + (lora_params * tb if job.lora else 0)
    sync_state = lora_params * tb if job.lora else dense_bytes
    sync = min(sync_state, 2 * DEFAULT_BUCKET_BYTES)  # one bucket in flight, one filling
    load_encoders = _encoder_activation_bytes(job)
    encode = dict(encoders_vae=encoders, activations=load_encoders)  # an offloaded encode call's extra
    # The prompt-cache warm-up (after init_model, before the first optimizer step: no optimizer
    # state yet): the encoders on the GPU, warm_batch prompts per call.
    warm = dict(encoders_vae=encoders, activations=_encoder_activation_bytes(job, job.warm_batch))

    train_knobs = _training_knobs(job)
    rollout_knobs = _rollout_knobs(job)
    plans = []
    if job.placement == "colocated":
        b = _RoleBuilder(job, "colocated", job.devices, gib)
        resident = dict(weights=train_weights + ema + kl_ref, optimizer=optimizer, encoders_vae=gen_encoders + vae + reward)
        # Loading: the dense model in its dtype on every GPU before FSDP shards it.
        b.add("load", weights=dense_bytes, encoders_vae=encoders + vae + reward, activations=load_encoders)
        _add_encode_phases(b, job, resident, warm, encode, gen_encoders)
        b.add("generate", activations=rollout_acts, **resident)
        b.add("decode", activations=decode, **resident)
        b.add("train", gradients=grads + reduce_buffers, activations=train_acts, **dict(resident, weights=resident["weights"] + kl_ref_in_training))
        if job.optimizer_offload:
            b.add("step", gradients=grads, **dict(resident, optimizer=step_optimizer))
        plans.append(b.plan(train_knobs, rollout_knobs))
        return plans

    reward_on_rollout = reward if job.reward_devices == 0 else 0
    r = _RoleBuilder(job, "rollout", job.rollout_devices, gib)
    r_resident = dict(weights=rollout_weights, encoders_vae=gen_encoders + vae + reward_on_rollout)
    r.add("load", weights=rollout_weights, encoders_vae=encoders + vae + reward_on_rollout, activations=load_encoders)
    _add_encode_phases(r, job, r_resident, warm, encode, gen_encoders)
    r.add("generate", activations=rollout_acts, **r_resident)
    r.add("decode", activations=decode, **r_resident)
    r.add("sync", sync_buffers=sync, **r_resident)
    if job.rollouts_train:
        # GAT: a rollout worker trains micro-batches with the weights it generates with (nothing
        # offloaded, nothing switched): its resident parts, the LoRA gradients (unsharded, it trains
        # alone; no optimizer state: trainer 0 steps) and one pass's activations, the trainers'
        # pass with the run's checkpointing (workers/training.py). No sync is in flight: it trains
        # only on the version the last sync brought.
        rollout_grads = lora_params * tb if job.lora else param_bytes
        r.add("train", gradients=rollout_grads, activations=train_acts, **r_resident)
    plans.append(r.plan(_gat_knobs(train_knobs) if job.rollouts_train else [], rollout_knobs))

    t = _RoleBuilder(job, "trainer", job.trainer_devices, gib)
    reward_on_trainer = reward if job.trainers_score else 0
    # Trainers keep the text encoders and the VAE on CPU between uses (workers/worker.py:
    # ROLE_CAPABILITIES["trainer"].offloads, moved out after loading); on the GPU only while a TAG
    # generate call encodes and decodes (both charged there). Validation on a trainer is not planned.
    t_resident = dict(weights=train_weights + ema + kl_ref, optimizer=optimizer, encoders_vae=reward_on_trainer)
    t_generating = dict(t_resident, encoders_vae=t_resident["encoders_vae"] + encoders_resident + vae)
    t.add("load", weights=dense_bytes, encoders_vae=encoders + vae + reward_on_trainer, activations=load_encoders)
    # trainer 0 sends the last version from its host snapshot while training goes on, through one
    # reused device buffer of a flat bucket (sync/transport.py: WeightChannel._on_device)
    staging = min(sync_state, DEFAULT_BUCKET_BYTES)
    t.add("train", gradients=grads + reduce_buffers, activations=train_acts, sync_buffers=staging,
          **dict(t_resident, weights=t_resident["weights"] + kl_ref_in_training))
    if job.optimizer_offload:
        t.add("step", gradients=grads, sync_buffers=staging, **dict(t_resident, optimizer=step_optimizer))
    # the sender's capture of a version into its host snapshot (FSDP: gathered bucket by bucket)
    t.add("sync", sync_buffers=min(sync_state, CAPTURE_DEVICE_BUCKETS * DEFAULT_BUCKET_BYTES), **t_resident)
    if job.trainers_generate:
        t.add("generate", activations=rollout_acts, **t_generating)
        t.add("decode", activations=decode, **t_generating)
    plans.append(t.plan(train_knobs, rollout_knobs if job.trainers_generate else []))

    if job.reward_devices > 0:
        w = _RoleBuilder(job, "reward", job.reward_devices, gib)
        w.add("score", encoders_vae=reward)
        plans.append(w.plan(["a smaller reward model"], []))
    return plans


def _add_encode_phases(b: _RoleBuilder, job: JobShape, resident: dict[str, int], warm: dict[str, int],
                       encode: dict[str, int], resident_encoders: int) -> None:
    """A generating role's phases with its text encoders on the GPU beyond ``resident``: the
    prompt-cache warm-up (``warm``: resident encoders counted once), and with offloaded encoders
    that the cache does not release, each generate call's encode (``encode``)."""
    if job.warm_batch:
        parts = {k: v for k, v in resident.items() if k != "optimizer"}
        parts["encoders_vae"] = parts["encoders_vae"] - resident_encoders + warm["encoders_vae"]
        b.add("warm", activations=warm["activations"], **parts)
    if job.encoders_offloaded and not job.prompt_cache_releases:
        parts = dict(resident)
        parts["encoders_vae"] = parts["encoders_vae"] + encode["encoders_vae"]
        b.add("encode", activations=encode["activations"], **parts)


def _training_knobs(job: JobShape) -> list[str]:
    knobs = []
    if not job.checkpointing:
        knobs.append("digen.model.gradient_checkpointing=true")
    if job.pass_samples > 1:
        knobs.append(f"smaller training passes: a pass is one transformer call of {job.pass_samples} sample(s) "
                     f"(digen.batch.train_micro_batch_rows below {job.pass_samples}, a smaller digen.batch.group_size, "
                     "or FSDP over more ranks)")
    if job.fsdp == 1:
        knobs.append("digen.fsdp.enable=true (shards weights, gradients and optimizer; splits micro-batches)")
    elif job.fsdp_replicas > 1:  # HSDP shards within a node: flat FSDP shards over every rank
        knobs.append(f"digen.fsdp.mesh=flat (shards the training state {job.fsdp * job.fsdp_replicas} ways instead of "
                     f"HSDP's {job.fsdp}, at the price of collectives across nodes)")
    else:
        knobs.append("more trainer GPUs (digen.pools.trainer.devices) for a larger FSDP degree")
    if not job.lora:
        knobs.append("digen.model.lora.enable=true")
    if job.dtype == "fp32":
        knobs.append("digen.model.dtype=bf16")
    if not job.prompt_cache_releases:
        knobs.append("digen.prompt_cache.enable=true (frees the text encoders)")
    return knobs


def _gat_knobs(train_knobs: list[str]) -> list[str]:
    """A GAT rollout worker's training knobs: the trainers' but FSDP (a rollout worker trains
    its micro-batches unsharded whatever the trainers do), and turning GAT off."""
    return [k for k in train_knobs if not k.startswith(("digen.fsdp", "more trainer GPUs"))] + [
        "digen.gat.enable=false (rollout workers then do not train)"]


def _rollout_knobs(job: JobShape) -> list[str]:
    knobs = []
    if job.groups_per_task > 1:
        knobs.append("a smaller digen.batch.groups_per_task")
    if job.vae_decode_chunk == 0 or job.vae_decode_chunk > 1:
        knobs.append("digen.model.vae_decode_chunk (decode fewer samples at a time)")
    if job.num_frames > 1 or job.height * job.width > 1024 * 1024:
        knobs.append("smaller digen.sampling.height / width / num_frames")
    if not job.prompt_cache_releases:
        knobs.append("digen.prompt_cache.enable=true")
        if not job.encoders_offloaded:
            knobs.append("digen.model.offload_text_encoders=true (text encoders on CPU between encodes)")
    return knobs


# ---------------------------------------------------------------------- entry points


def training_fits(plans: list[RolePlan]) -> bool:
    """Whether every role's training phase fits its GPU."""
    return all(sum(p.phases["train"].values()) / GIB <= p.device_gib for p in plans if "train" in p.phases)


def decide_job(job: JobShape, gib: float | Mapping[str, float], *, checkpointing: bool | None = None,
               optimizer_offload: bool | None = None, encoders_offloaded: bool | None = None) -> JobShape:
    """``job`` with its three memory decisions made, each as given or, where None (``auto``), by
    the run's rules, in the order the run applies them (``trainer/resolve.py``):

    1. ``optimizer_offload`` (:func:`decide_optimizer_offload`): parked for fused workers (they
       generate between steps); for disaggregated trainers exactly when parking lets training run
       with less: for each checkpointing choice allowed (``checkpointing`` as given, else without
       then with), resident if every role's training pass fits so, else parked if it fits parked.
       A recomputed forward per pass costs far more than a host round trip of the state per step;
    2. ``checkpointing`` (:func:`decide_checkpointing`): on exactly when some role's training pass
       (under GAT the rollout workers' too) would not fit without it;
    3. ``encoders_offloaded`` (:func:`decide_encoder_offload`): resident when the prompt cache
       releases them, or when every generating role (colocated, rollout) fits with them resident.

    While a later decision is open the earlier ones see the text encoders resident (or as given).
    The one rule for the run (``plan_job``) and for the simulator's cost model
    (``sim.cost_model.CostModel.memory_job``), which builds its ``job`` from a workload."""
    job = replace(job, encoders_offloaded=bool(encoders_offloaded))
    if optimizer_offload is None:
        optimizer_offload = job.placement == "colocated" or _parks_to_fit(job, gib, checkpointing)
    job = replace(job, optimizer_offload=optimizer_offload)
    if checkpointing is None:
        checkpointing = not training_fits(_planned(replace(job, checkpointing=False), _gib_key(gib)))
    job = replace(job, checkpointing=checkpointing)
    if encoders_offloaded is None:
        resident = _planned(replace(job, encoders_offloaded=False), _gib_key(gib))
        encoders_offloaded = not job.prompt_cache_releases and not all(
            p.peak_gib <= p.device_gib for p in resident if p.role in ("colocated", "rollout"))
    return replace(job, encoders_offloaded=encoders_offloaded)


def _parks_to_fit(job: JobShape, gib: float | Mapping[str, float], checkpointing: bool | None) -> bool:
    """A disaggregated run's ``optimizer_offload=auto`` (:func:`decide_job`, rule 1)."""
    for ckpt in ((False, True) if checkpointing is None else (checkpointing,)):
        if training_fits(_planned(replace(job, checkpointing=ckpt, optimizer_offload=False), _gib_key(gib))):
            return False
        if training_fits(_planned(replace(job, checkpointing=ckpt, optimizer_offload=True), _gib_key(gib))):
            return True
    return False


def _decided_job(cfg: DigenConfig, *, devices_per_node: int, nnodes: int, model_path: str | None) -> JobShape:
    """``cfg``'s job on its cluster with the memory decisions its ``auto`` settings leave open made."""
    job = job_shape(cfg, devices_per_node=devices_per_node, nnodes=nnodes, model_path=model_path)
    offload = None if cfg.model.optimizer_offload == "auto" else cfg.optimizer_offloaded
    return decide_job(job, device_gib(cfg), checkpointing=cfg.model.checkpointing, optimizer_offload=offload,
                      encoders_offloaded=cfg.model.encoders_offloaded)


def decide_checkpointing(cfg: DigenConfig, *, devices_per_node: int, nnodes: int = 1,
                         model_path: str | None = None) -> bool:
    """``digen.model.gradient_checkpointing`` as the run applies it: the setting when it is
    ``true`` or ``false``; for ``auto``, on exactly when a training pass would not fit without it
    (activation checkpointing costs a recomputed forward, so it is only worth it when needed;
    :func:`decide_job`). The cost model asks the same rule (``sim.cost_model.CostModel.memory_job``)."""
    if cfg.model.checkpointing is not None:
        return cfg.model.checkpointing
    return _decided_job(cfg, devices_per_node=devices_per_node, nnodes=nnodes, model_path=model_path).checkpointing


def decide_optimizer_offload(cfg: DigenConfig, *, devices_per_node: int, nnodes: int = 1,
                             model_path: str | None = None) -> bool:
    """``digen.model.optimizer_offload`` as the run applies it: the setting when ``true`` or
    ``false``; for ``auto``, parked for fused workers (they generate between steps), and for
    disaggregated trainers exactly when parking lets training run with less (:func:`decide_job`,
    rule 1). The cost model asks the same rule (``sim.cost_model.CostModel.memory_job``)."""
    if cfg.model.optimizer_offload != "auto" or cfg.placement == "colocated":
        return cfg.optimizer_offloaded
    return _decided_job(cfg, devices_per_node=devices_per_node, nnodes=nnodes, model_path=model_path).optimizer_offload


def decide_encoder_offload(cfg: DigenConfig, *, devices_per_node: int, nnodes: int = 1,
                           model_path: str | None = None) -> bool:
    """``digen.model.offload_text_encoders`` as the generating workers apply it: the setting when
    it is ``true`` or ``false``; for ``auto``, resident (False) when the prompt cache releases
    the encoders (nothing to move after the warm-up) or when every generating role (colocated,
    rollout) fits with them resident; offloaded otherwise (each generate call then moves them
    host <-> GPU, 10-16 GB each way, so only when they do not fit)."""
    if cfg.model.encoders_offloaded is not None:
        return cfg.model.encoders_offloaded
    if cfg.prompt_cache.enable and cfg.prompt_cache.release_encoders:
        return False
    return _decided_job(cfg, devices_per_node=devices_per_node, nnodes=nnodes, model_path=model_path).encoders_offloaded


def plan_job(cfg: DigenConfig, *, devices_per_node: int, nnodes: int = 1, model_path: str | None = None) -> list[RolePlan]:
    """Every role's per-GPU peak for the validated config ``cfg`` on its cluster (with the
    activation checkpointing, optimizer parking and encoder placement :func:`decide_job` makes)."""
    job = _decided_job(cfg, devices_per_node=devices_per_node, nnodes=nnodes, model_path=model_path)
    return plan_roles(job, device_gib(cfg))


# ---------------------------------------------------------------------- host RAM at load

# The largest file a component loads at once: diffusers' ``save_pretrained`` shards at
# ``max_shard_size="10GB"`` by default (the published FLUX.1, Qwen-Image, Wan and HunyuanVideo
# transformers are in shards of at most 10 GB). Loaded with ``device_map`` onto the GPU
# (models/base.py: load_component), a component passes through the host one shard at a time.
LOAD_SHARD_BYTES = 10 * 10**9
# One worker process on the host besides what it loads: the interpreter, torch with its CUDA
# libraries mapped and the context's host side, diffusers, transformers, veRL and Ray's core
# worker. An allowance (a CPU-only worker of this package is ~1 GiB resident; CUDA's libraries and
# host-side context add 1-2 GiB).
PROCESS_HOST_BYTES = 3 * GIB


@dataclass(frozen=True)
class NodeHostPlan:
    """What the workers of one node hold in host RAM at load, part by part (summed over them)."""

    node: int
    workers: dict[str, int]  # role -> workers of that role on the node
    parts: dict[str, int]  # what -> bytes, over the node's workers
    host_gib: float

    @property
    def total_bytes(self) -> int:
        return sum(self.parts.values())

    @property
    def total_gib(self) -> float:
        return self.total_bytes / GIB


def worker_host_bytes(job: JobShape, role: str, *, first_trainer: bool = False) -> dict[str, int]:
    """Host bytes one worker of ``role`` holds at load, by part: the process; the shard being
    loaded (models go straight to their GPU, one shard at a time: models/base.py); what stays on
    the host by design: a trainer's text encoders and VAE (workers/worker.py
    ROLE_CAPABILITIES["trainer"].offloads), a generating role's offloaded text encoders, the
    optimizer state parked between steps, FSDP's host-offloaded training state, an offloaded
    EMA, a full fine-tune's KL reference without FSDP (pinned host memory); and trainer 0's
    pinned host snapshot of the state it sends (disaggregated: workers/worker.py ``_capture``)."""
    params, dense_bytes, _block, lora_params, param_bytes = _transformer_facts(
        job.family, job.config_path, job.dtype, job.lora_targets, job.lora_rank)
    encoders, vae = _encoder_and_vae_bytes(job)
    parts = {"process": PROCESS_HOST_BYTES}
    if role == "reward":
        parts["reward model"] = job.reward_bytes  # built on the host, then moved to its GPU
        return parts
    parts["loading shard"] = min(LOAD_SHARD_BYTES, max(dense_bytes, encoders, vae))
    on_host = 0
    if role == "trainer":
        on_host += encoders + vae
    elif job.encoders_offloaded:
        on_host += encoders
    parts["encoders/VAE on host"] = on_host
    if role in ("trainer", "colocated"):
        state = trained_state_bytes(job, params, param_bytes, lora_params)
        if job.param_offload:
            parts["FSDP host offload"] = int(sum(state.values()))
        elif job.optimizer_offload:
            parts["parked optimizer"] = int(state["optimizer"])
        if job.ema_on_host:
            parts["EMA"] = int((lora_params if job.lora else params) * 4 / job.fsdp)
        if job.kl_reference and job.fsdp == 1:
            parts["KL reference"] = dense_bytes
    if first_trainer and role == "trainer":
        parts["sync snapshot"] = lora_params * job.trainable_bytes if job.lora else dense_bytes
    return {k: int(v) for k, v in parts.items() if v}


def host_plan(cfg: DigenConfig, *, devices_per_node: int, nnodes: int = 1, model_path: str | None = None,
              ) -> list[NodeHostPlan]:
    """Host RAM of every node at load: the workers the pool layout puts on it (the runtime's
    placement rule, platform/nodes.py ``node_counts``, as placement/pools.py ``pool_layout``
    reads it), each as :func:`worker_host_bytes` says, trainer 0 on the first node with a
    trainer."""
    from verl_digen.platform.nodes import node_counts

    job = _decided_job(cfg, devices_per_node=devices_per_node, nnodes=nnodes, model_path=model_path)
    if cfg.placement == "colocated":
        counts = {"colocated": (devices_per_node,) * nnodes}
    else:
        sizes = {"rollout": cfg.pools.rollout.world_size, "trainer": cfg.pools.trainer.world_size}
        if cfg.pools.reward.devices:
            sizes["reward"] = cfg.pools.reward.world_size
        counts = node_counts(sizes, devices_per_node, nnodes)
    per_worker: dict[tuple[str, bool], dict[str, int]] = {}
    nodes = []
    first_trainer_placed = False
    for node in range(nnodes):
        workers: dict[str, int] = {}
        parts: dict[str, int] = {}
        for role, on_nodes in counts.items():
            for _ in range(on_nodes[node]):
                first = role == "trainer" and not first_trainer_placed
                first_trainer_placed = first_trainer_placed or first
                held = per_worker.setdefault((role, first), worker_host_bytes(job, role, first_trainer=first))
                workers[role] = workers.get(role, 0) + 1
                for k, v in held.items():
                    parts[k] = parts.get(k, 0) + v
        nodes.append(NodeHostPlan(node, workers, parts, float(cfg.memory.host_gib)))
    return nodes


def host_ram_lines(cfg: DigenConfig, cluster: Any, model_path: str | None = None) -> list[str]:
    """``python -m verl_digen.check``'s host RAM line on ``cluster`` (a ``ClusterSpec``): the
    fullest node's bytes at load, by part."""
    nodes = host_plan(cfg, devices_per_node=cluster.n_devices_per_node, nnodes=cluster.nnodes, model_path=model_path)
    fullest = max(nodes, key=lambda n: n.total_bytes)
    workers = ", ".join(f"{n} {role}" for role, n in fullest.workers.items())
    parts = ", ".join(f"{k} {v / GIB:.1f}" for k, v in fullest.parts.items())
    return [f"host RAM per node at load: {fullest.total_gib:.1f} GiB of {fullest.host_gib:g} GiB "
            f"(digen.memory.host_gib), node {fullest.node} ({workers} worker(s)): {parts}"]


def check_host_memory(cfg: DigenConfig, *, devices_per_node: int, nnodes: int = 1, model_path: str | None = None,
                      ) -> list[NodeHostPlan]:
    """:func:`host_plan`, raising :class:`MemoryPlanError` when a node's workers would hold more
    host RAM at load than ``digen.memory.host_gib``."""
    nodes = host_plan(cfg, devices_per_node=devices_per_node, nnodes=nnodes, model_path=model_path)
    bad = [n for n in nodes if n.total_gib > n.host_gib]
    if bad:
        lines = [f"node {n.node} holds {n.total_gib:.1f} GiB at load ("
                 + ", ".join(f"{k} {v / GIB:.1f}" for k, v in n.parts.items()) + ")" for n in bad]
        raise MemoryPlanError(
            f"the job does not fit in host RAM: {' | '.join(lines)}, more than digen.memory.host_gib="
            f"{bad[0].host_gib:g}; set digen.memory.host_gib to the nodes' RAM if it is larger, or turn: "
            "digen.model.optimizer_offload=false, digen.fsdp.param_offload=false, digen.ema.offload=false, "
            "fewer workers per node (digen.pools.<pool>.nodes)")
    return nodes


def describe(plan: RolePlan) -> str:
    parts = ", ".join(f"{k} {v / GIB:.1f}" for k, v in plan.bytes.items() if v)
    return f"{plan.role} ({plan.devices} GPU(s)) peaks at {plan.peak_gib:.1f} GiB in its {plan.phase} phase ({parts})"


def check_job_memory(cfg: DigenConfig, *, devices_per_node: int, nnodes: int = 1, model_path: str | None = None,
                     ) -> list[RolePlan]:
    """:func:`plan_job`, raising :class:`MemoryPlanError` naming the knobs to turn when a role's
    peak exceeds its GPU's memory (``digen.memory.device_type`` / ``device_gib``)."""
    plans = plan_job(cfg, devices_per_node=devices_per_node, nnodes=nnodes, model_path=model_path)
    bad = [p for p in plans if p.peak_gib > p.device_gib]
    if bad:
        where = "digen.memory.device_gib" if cfg.memory.device_gib is not None else f"digen.memory.device_type={cfg.memory.device_type}"
        lines = [f"{describe(p)}, more than the {p.device_gib:g} GiB of a GPU ({where}); "
                 f"turn: {'; '.join(p.knobs) or 'a larger GPU'}" for p in bad]
        raise MemoryPlanError("the job does not fit in GPU memory: " + " | ".join(lines)
                              + " (plan it with python -m verl_digen.memory; digen.memory.check=false skips this check)")
    check_host_memory(cfg, devices_per_node=devices_per_node, nnodes=nnodes, model_path=model_path)
    return plans

