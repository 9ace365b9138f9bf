"""The profile records a cost model is built from: a model, devices, a system, a reward model
(``verl_digen/sim/profiles/*.yaml``, read by :mod:`.catalog`), and one experiment's workload."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Mapping

GB = 1e9
GIB = 1024**3
TFLOP = 1e12

RESIDENT = "resident"  # the reward model stays loaded where it runs (its calls stream)
SWAP = "swap"  # the reward model shares the training devices: woken, run once on the step's batch, put to sleep
OURS = "verl-digen"


class ProfileError(ValueError):
    """A profile file or a name in it is missing or malformed; the message names it."""


# ---------------------------------------------------------------------------- profiles


@dataclass(frozen=True)
class ModelProfile:
    """One denoiser architecture (and the encoders around it)."""

    name: str
    params: float  # denoiser parameters
    layers: int  # transformer blocks attending over the whole (joint) sequence
    hidden: int  # attention width = heads x head_dim
    token_params: float = 0.0  # weights one token passes through per forward (0: all of params)
    vae_spatial: int = 8  # pixels per latent pixel (each side)
    vae_temporal: int = 1  # frames per latent frame (video: 4, first frame kept)
    patch: int = 2  # latent pixels per token (each side)
    patch_t: int = 1  # latent frames per token
    text_tokens: int = 0  # text tokens in the sequence (joint attention) or cross-attended
    joint_text: bool = True  # MMDiT: text tokens join the self-attention sequence
    text_encoder_params: float = 0.0
    text_encoder_tokens: int = 0
    decode_flops_per_pixel: float = 0.0  # VAE decoder FLOPs per output pixel (per frame)
    reward_flops_per_image: float = 0.0  # reward model FLOPs per scored image / video (without a reward profile)
    reward: str = ""  # the reward profile (``rewards:``) this model's default workload is scored with
    lora_linears: int = 0  # linear layers LoRA adapts (attention projections)
    lora_params: float = 0.0  # measured LoRA parameters; overrides the lora_linears estimate
    gradient_checkpointing: bool | None = None  # None: decided per pass by memory (CostModel.checkpointing)
    video: bool = False
    # The model family whose real configs the memory planner builds (models/real_configs.py:
    # flux, sd3, qwen_image, wan, hunyuan_video); "": none, so no memory plan (CostModel.plans_memory).
    family: str = ""
    defaults: Mapping[str, Any] = field(default_factory=dict)  # workload defaults
    sources: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class DeviceProfile:
    """One accelerator type (and the node it sits in): what the hardware costs."""

    name: str
    peak_tflops: float  # dense bf16 tensor-core peak
    mfu_forward: float  # achieved / peak on large forwards (the asymptote of the efficiency curve)
    mfu_train: float  # achieved / peak on forward+backward (asymptote)
    hbm_gb: float
    hbm_tbps: float  # memory bandwidth
    intra_node_gbps: float  # collective bandwidth per device inside a node, one direction
    inter_node_gbps: float  # network bandwidth per device (its NIC) across nodes, one direction
    host_link_gbps: float  # device <-> host (PCIe), one direction
    devices_per_node: int = 8
    # Tokens per forward at which the efficiency is half its asymptote (0: flat): small forwards
    # are launch- and memory-bound.
    mfu_half_tokens: float = 0.0
    # All NICs of a node together (0: devices_per_node x inter_node_gbps). A multi-node NCCL ring
    # crosses nodes on every NIC at once (one channel per NIC), so a collective spanning nodes runs
    # at min(intra_node_gbps, node_network_gbps) per device, not at one NIC's bandwidth.
    node_network_gbps: float = 0.0
    usd_per_hour: float = 0.0  # rental price of one device (docs/cost_model.md, "Prices")
    decode_mfu: float = 0.3  # convolutional VAE decoders reach less of the peak
    encode_mfu: float = 0.0  # text encoders' achieved / peak (0: mfu_forward)
    forward_overhead_s: float = 0.005  # per forward call (launches, Python)
    train_pass_overhead_s: float = 0.01  # per forward+backward pass
    generate_overhead_s: float = 0.05  # per generate call (batching, latents, scheduler)
    reward_overhead_s: float = 0.05  # per reward call
    # Devices that share one machine (CPU slots): extra fraction of a task's time per other busy
    # device on the machine when it starts (0: independent devices, as GPUs are).
    host_contention: float = 0.0
    system: str = OURS  # the software-stack profile (``systems:``) this device runs with by default
    sources: Mapping[str, str] = field(default_factory=dict, compare=False)  # citations, not costs

    @property
    def flops(self) -> float:
        return self.peak_tflops * TFLOP

    @property
    def cross_node_gbps(self) -> float:
        """Per-device bandwidth of a ring collective that spans nodes (every NIC of a node in use)."""
        node = self.node_network_gbps or self.devices_per_node * self.inter_node_gbps
        return min(self.intra_node_gbps, node)


@dataclass(frozen=True)
class SystemProfile:
    """What a training system does, and the constants of its software stack."""

    name: str = OURS
    description: str = ""
    placements: str = "colocated,disaggregated"  # the placements this system runs
    # -- behaviour (what the system does each step)
    recompute_logprob: bool = False  # one extra forward per trained step: old log-probs under the behaviour policy
    param_offload: bool = False  # training weights parked on the host while generating
    param_offload_roundtrips: int = 1  # host <-> device trips of the parameter shard per step
    optimizer_offload: bool = True  # optimizer state parked on the host while generating (colocated)
    reload_bytes_per_param: float = 2.0  # bytes per changed parameter gathered for the rollout engine
    engine_load_gbps: float = 0.0  # copying gathered weights into a separate rollout engine (0: in place)
    reward_residency: str = RESIDENT  # where a colocated worker's reward model lives: resident | swap
    engine_wake_s: float = 0.0  # one sleep or wake of a swapped reward engine (besides moving its weights)
    rollout_batch: int = 0  # samples per rollout forward, batched across a worker's requests (0: one task's)
    train_micro_batch: int = 0  # samples per forward+backward pass (0: as many as fit)
    logprob_micro_batch: int = 0  # samples per log-prob recompute forward (0: the train micro-batch)
    whole_step_tasks: bool = False  # one generate and one train call per worker and step (an engine batches)
    step_fixed_s: float = 0.0  # per-step overhead that no device count shrinks (driver, engines, barriers)
    # Per transformer call of a separate rollout engine (request scheduling, per-request state): a
    # structural cost of that engine, fitted to the system's own published runs; 0 for ours, whose
    # per-call cost is in the device's measured call-size curve (mfu_half_tokens, forward_overhead_s).
    engine_call_s: float = 0.0
    # Per denoising step of a generate call, beyond the transformer's forward: the sampler's own work
    # (SDE step, log-probs, latents, host syncs). Ours is measured (the GPU checks' generate phase
    # minus the measured forwards: python -m verl_digen.sim.calibrate); 0 where engine_call_s holds it.
    denoise_step_s: float = 0.0
    # Training passes run at train_efficiency x the device's mfu_train. The kernel efficiencies are
    # the device's and shared by every system (measured: docs/cost_model.md); 1 for every shipped
    # system, a knob for a stack whose passes are measured to differ.
    train_efficiency: float = 1.0
    # -- stack constants
    nccl_efficiency: float = 0.8  # achieved collective bandwidth / link bandwidth
    comm_overlap: float = 0.5  # fraction of a pass's compute that hides its FSDP collectives
    switch_fixed_s: float = 1.0  # per generate <-> train switch of one worker
    optimizer_fixed_s: float = 0.1
    sync_fixed_s: float = 0.2
    grad_bytes_per_param: float = 4.0  # fp32 gradient reduce-scatter
    # Gradient bytes a rank holds per trained parameter (0: grad_bytes_per_param). verl-digen's
    # bf16 full fine-tune keeps backward's bf16 gradients until they are folded into the fp32
    # masters' gradients (2 + 4), as the memory planner charges (memory/plan.py: trained_state_bytes).
    held_grad_bytes_per_param: float = 0.0
    optimizer_bytes_per_param: float = 12.0  # fp32 master weights + Adam m and v
    memory_headroom: float = 0.9  # usable fraction of device memory
    activation_bytes: float = 34.0  # activation bytes per token per hidden unit per block
    collective_step_latency_s: float = 2e-5  # latency of one ring step of a collective
    hsdp_shard: int = 0  # 0: flat FSDP over all training ranks; k: shard over k, replicate
    # FSDP's layout where hsdp_shard is 0: flat (one mesh over every rank), or auto (this runtime's
    # digen.fsdp.mesh=auto, memory/fsdp_layout.py: one replica per node, sharded within it, when the
    # training pool spans several nodes with as many devices on each; gradients all-reduced across
    # the replicas in every pass's backward, FSDP2's HSDP).
    fsdp_mesh: str = "flat"
    # The dtype of FSDP's gradient reduction: fp32 (grad_bytes_per_param), or auto (this runtime's
    # digen.fsdp.reduce_dtype=auto: bf16 for a full fine-tune of the bf16 weights charged here, fp32
    # for LoRA).
    grad_reduce_dtype: str = "fp32"
    # Whether training is sharded whatever the strategy (veRL's FSDP engine); False: only the
    # strategies with FSDP shard (digen.fsdp.enable), other trainers hold the whole state.
    always_sharded: bool = False
    task_overhead_s: float = 0.0  # the runtime's dispatch cost per task (driver -> worker -> driver)
    # The placements in which this system can give the reward model devices of its own (a reward
    # pool); "" for none.
    reward_pools: str = "disaggregated"
    # Whether this system's workers are this runtime's, whose memory the memory planner charges
    # (memory/plan.py; CostModel.plans_memory). False: another system's, whose fit, activation
    # checkpointing and memory-sized passes the cost model estimates from profile bytes
    # (activation_bytes, optimizer_bytes_per_param, memory_headroom).
    memory_planner: bool = True
    sources: Mapping[str, str] = field(default_factory=dict)

    def runs(self, placement: str) -> bool:
        return placement in {p.strip() for p in self.placements.split(",")}

    def reward_pool_in(self, placement: str) -> bool:
        return placement in {p.strip() for p in self.reward_pools.split(",") if p.strip()}


@dataclass(frozen=True)
class RewardProfile:
    """A reward model: a scorer (one forward per image) or a generative judge (prefill + decode)."""

    name: str
    params: float = 0.0  # weights (bf16 on the device; what a swap moves)
    tokens_per_image: float = 0.0  # tokens of one image's forward / prefill (vision + prompt)
    flops_per_image: float = 0.0  # 0: 2 x params x tokens_per_image
    decode_tail_s: float = 0.0  # sequential decoding until the longest answer of a call ends
    tp: int = 1  # devices one replica spans (its weights are split over them)
    # Served over HTTP by its own inference server (a VLM judge behind vLLM), not loaded into the
    # job's Ray workers: a reward pool for it is the server's devices.
    served: bool = False
    sources: Mapping[str, str] = field(default_factory=dict)

    @property
    def flops(self) -> float:
        return self.flops_per_image or 2.0 * self.params * self.tokens_per_image


@dataclass(frozen=True)
class Workload:
    """One experiment's settings (what is generated and trained each step)."""

    height: int
    width: int
    frames: int = 1
    num_steps: int = 16
    cfg: bool = False  # true classifier-free guidance (two branches per forward)
    group_size: int = 8
    groups_per_step: int = 32
    sde_window: int = 0  # SDE (trained) steps per trajectory; 0 = every step
    timestep_fraction: float = 1.0
    lora: bool = False
    lora_rank: int = 32
    kl: bool = False  # KL to a frozen reference: one extra forward per trained step
    train_device_batch: int | None = None  # samples per forward+backward pass; None: the system's pass
    gradient_checkpointing: bool | None = None  # None: the model profile's, else decided by memory
    # Samples per transformer call of a strategy, in rollout and in a training pass, as the
    # runtime computes them (schedule.strategies.call_rows); 0: a group. Set by for_spec.
    call_rows: int = 0
    # Whether the strategy shards training state over the training pool (FSDP); None: sharded
    # (profiles and callers that predate the flag). Set by for_spec.
    fsdp: bool | None = None
    mini_batches: int = 1  # PPO mini-batches (optimizer steps) per step
    # OPTIMIZER_STEP tasks a step's plan has (this runtime: one per mini-batch, StrategySpec.mini_batches;
    # 1: one task does all of the step's updates, how a published run of another system is planned). Set by for_spec.
    optimizer_tasks: int = 1
    text_tokens: int | None = None  # prompt tokens in the sequence; None: the model profile's
    reward: str | None = None  # reward profile; None: the model profile's
    # A disaggregated trainer pool's optimizer state on the host between optimizer steps
    # (digen.model.optimizer_offload); None: auto, parked exactly when that spares a training
    # pass its activation checkpointing (memory.plan.decide_optimizer_offload).
    optimizer_offload: bool | None = None
    # GAT (generator-assisted training, LoRA, disaggregated): rollout workers also train
    # micro-batches of the step's first PPO mini-batch and send their LoRA gradients to trainer 0
    # (StrategySpec.gat). Set by for_spec.
    gat: bool = False
    # Groups per generate task and per training micro-batch, and TAG (trainers generate too): what
    # the memory planner's roles hold (CostModel.memory_job). Set by for_spec.
    groups_per_task: int = 1
    micro_batch_groups: int = 1
    tag: bool = False
    # Samples per VAE decode call (digen.model.vae_decode_chunk; 0: the whole generate call, the
    # config's default): what a rollout worker's decode holds (the memory planner's), not its time.
    vae_decode_chunk: int = 0

    @property
    def cfg_factor(self) -> int:
        return 2 if self.cfg else 1

    @property
    def trained_steps(self) -> int:
        window = self.sde_window or self.num_steps
        return max(1, int(round(window * self.timestep_fraction)))

    @property
    def images_per_step(self) -> int:
        return self.group_size * self.groups_per_step


WORKLOAD_KEYS = tuple(f.name for f in fields(Workload))
