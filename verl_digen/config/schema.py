"""The ``digen`` config group as typed dataclasses: its only defaults, and its validation.

The dataclasses below are the single source of the ``digen`` defaults (each field carries the
comment documenting its key). :func:`register_configs` puts them into Hydra's ConfigStore as
the node ``digen_defaults`` (package ``digen``), which ``digen_base.yaml`` lists in its
defaults, so every composed config (``python -m verl_digen.main``, ``compose_config``, the
presets in ``configs/``) holds the full ``digen`` tree; YAML files only override it.

:func:`digen_config_from_dict` turns the composed ``cfg.digen`` mapping into a
:class:`DigenConfig` through OmegaConf's structured-config merge (unknown keys and values of
the wrong type are refused), then :meth:`DigenConfig.validate` checks every rule, raising a
:class:`ConfigError` that names the full key, the value and what would be valid. Nothing deep
inside Ray ever sees a config typo: workers receive the validated dataclass.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

from verl_digen.algos.window import SdeWindowConfig
from verl_digen.config.errors import ConfigError  # noqa: F401 (re-exported: every caller imports it from here)


DEVICES = ("cuda", "cpu")  # trainer.device: veRL's two values that apply here


def _fail(key: str, value: Any, valid: str) -> None:
    raise ConfigError(f"invalid config: {key}={value!r}; {valid}")


def prompt_sources(value: Any, key: str) -> list[str]:
    """A prompt setting as a list: ``builtin:<name>``, one file, or a list of files (read in order
    and concatenated, as veRL reads ``data.train_files``)."""
    sources = [value] if isinstance(value, str) else list(value)
    if not sources or not all(isinstance(s, str) and s for s in sources):
        _fail(key, value, "give builtin:<name>, a prompt file, or a list of files")
    if len(sources) > 1 and any(s.startswith("builtin:") for s in sources):
        _fail(key, sources, "a builtin prompt set cannot be combined with files")
    return sources


def _finite(value: Any) -> bool:
    """A real number that is neither NaN nor infinite (NaN slips through ``x <= 0`` checks)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _positive(key: str, value: Any) -> None:
    if not (_finite(value) and value > 0):
        _fail(key, value, "must be a finite number > 0")


def _non_negative(key: str, value: Any) -> None:
    if not (_finite(value) and value >= 0):
        _fail(key, value, "must be a finite number >= 0")


@dataclass
class LoraConfigSpec:
    enable: bool = True  # LoRA adapters on the denoiser; false: full fine-tuning of every weight
    rank: int = 8  # LoRA rank r (veRL's actor_rollout_ref.model.lora_rank)
    alpha: float = 16.0  # LoRA alpha: the adapters' output is scaled by alpha / rank
    # Attention projections of the FLUX, SD3, Qwen-Image, Wan and HunyuanVideo blocks (diffusers names). Modules absent
    # from an architecture are simply not matched.
    target_modules: list[str] = field(
        default_factory=lambda: ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]
    )
    init_seed: int = 0  # seed of the LoRA matrices' initialisation (the same adapters on every worker)

    def validate(self, key: str) -> None:
        if self.rank < 1:
            _fail(f"{key}.rank", self.rank, "must be >= 1")
        if not self.target_modules:
            _fail(f"{key}.target_modules", self.target_modules, "must name at least one module")


@dataclass
class ModelConfig:
    path: Optional[str] = None  # local diffusers directory or hub id; None builds and uses a tiny model of tiny_arch
    arch: Optional[str] = None  # flux | sd3 | qwen_image | wan | hunyuan_video; None: read from model_index.json
    # Random-init tiny model of a family, or "digits": the pretrained toy FLUX of verl_digen.models.toy.
    tiny_arch: str = "flux"
    # The dtype the weights are loaded and computed in (rollout and training alike): auto = bf16
    # when the workers run on CUDA, fp32 on CPU. The SDE maths stay fp32 whatever this says.
    dtype: str = "auto"  # auto | fp32 | bf16
    # The dtype of the trained parameters (LoRA, or the fp32 master copy of a full fine-tune)
    # and of their optimizer state.
    trainable_dtype: str = "fp32"  # fp32 | bf16
    # Activation checkpointing of the denoiser's blocks in every training path (diffusers'
    # enable_gradient_checkpointing), with or without FSDP: true | false | auto. auto: on exactly
    # when a training pass (one transformer call's rows, see workers/training.py) would not fit
    # the GPU without it, as the memory planner computes it before Ray starts (memory.plan:
    # decide_checkpointing); the simulator's cost model asks the same rule (CostModel.memory_job). The built-in tiny models
    # (no digen.model.path) train without it.
    gradient_checkpointing: str = "auto"
    # Text encoders of the generating workers (fused, rollout) between encode calls: true: on
    # CPU, moved to the GPU for each encode; false: resident on the GPU; auto: resident exactly
    # when the memory plan fits with them resident, decided before Ray starts (memory.plan:
    # decide_encoder_offload). Moot once the prompt cache releases them; trainers always keep
    # them (and the VAE) on CPU between uses. The built-in tiny models keep them resident.
    offload_text_encoders: str = "auto"
    # Samples per VAE decode call (0: the whole batch at once); video VAEs also decode tiled.
    vae_decode_chunk: int = 0
    # Text tokens each prompt is encoded to (the pipelines' max_sequence_length: T5 for FLUX and
    # SD3, UMT5 for Wan, the template-cropped Qwen2.5-VL / Llama tokens for Qwen-Image and
    # HunyuanVideo); null: the pipeline's default (FLUX 512, SD3 256, Qwen-Image 512, Wan 512,
    # HunyuanVideo 256). It sets the transformer's text tokens, so memory and cost follow it.
    max_sequence_length: Optional[int] = None
    # The optimizer state between optimizer steps: true: on the host, on the GPU only for the step
    # (veRL's actor.fsdp_config.optimizer_offload); false: resident; auto: on the host for fused
    # (colocated) workers, which generate in between (what the cost model has always charged
    # them: one round trip per step), resident for disaggregated trainers, which never switch.
    optimizer_offload: str = "auto"
    lora: LoraConfigSpec = field(default_factory=LoraConfigSpec)

    @property
    def checkpointing(self) -> bool | None:
        """``gradient_checkpointing`` as a bool; None while it is ``auto`` (undecided)."""
        return {"true": True, "false": False, "auto": None}[self.gradient_checkpointing]

    @property
    def encoders_offloaded(self) -> bool | None:
        """``offload_text_encoders`` as a bool; None while it is ``auto`` (undecided)."""
        return {"true": True, "false": False, "auto": None}[self.offload_text_encoders]

    def validate(self, key: str) -> None:
        # hydra and YAML give true/false as booleans, which the str fields receive as True/False
        for name in ("gradient_checkpointing", "offload_text_encoders", "optimizer_offload"):
            value = str(getattr(self, name)).lower()
            if value not in ("true", "false", "auto"):
                _fail(f"{key}.{name}", getattr(self, name), "valid: true, false, auto")
            setattr(self, name, value)
        if self.dtype not in ("auto", "fp32", "bf16"):
            _fail(f"{key}.dtype", self.dtype, "valid: auto, fp32, bf16")
        if self.trainable_dtype not in ("fp32", "bf16"):
            _fail(f"{key}.trainable_dtype", self.trainable_dtype, "valid: fp32, bf16")
        if self.vae_decode_chunk < 0:
            _fail(f"{key}.vae_decode_chunk", self.vae_decode_chunk, "must be >= 0 (0: the whole batch)")
        from verl_digen.models.families import FAMILY_NAMES, FAMILY_SPECS  # light: no diffusers

        if self.max_sequence_length is not None:
            n, limit = self.max_sequence_length, None
            family = self.arch or (self.tiny_arch if self.path is None else None)  # None: read at load
            if family in FAMILY_SPECS:
                limit = FAMILY_SPECS[family].max_sequence_length_limit
            if isinstance(n, bool) or not isinstance(n, int) or n < 1 or (limit is not None and n > limit):
                upper = f" and <= {limit} (the {family} pipeline's limit)" if limit is not None else ""
                _fail(f"{key}.max_sequence_length", n, f"an integer >= 1{upper}, or null for the pipeline's default")
        from verl_digen.models.toy import TOY_MODELS

        tiny_archs = (*FAMILY_NAMES, *TOY_MODELS)  # every registered family has a tiny builder
        if self.tiny_arch not in tiny_archs:
            _fail(f"{key}.tiny_arch", self.tiny_arch, f"valid: {', '.join(tiny_archs)}")
        self.lora.validate(f"{key}.lora")


@dataclass
class SamplingConfig:
    height: int = 32  # sample height in pixels (a size the model's VAE and patching accept)
    width: int = 32  # sample width in pixels
    num_frames: int = 1  # frames per sample: 1 for images, more for the video families
    num_steps: int = 8  # denoising steps per sample (rollout; training recomputes the trained ones)
    guidance_scale: float = 1.0  # > 1: true CFG with negative_prompt
    distilled_guidance: Optional[float] = None  # FLUX.1-dev style guidance embedding
    noise_level: float = 0.7  # the SDE's noise scale (a in Flow-GRPO, eta in DanceGRPO)
    sde_type: str = "sde"  # sde | cps | dance_sde
    # null: the pipeline scheduler's sigmas; a number s: DanceGRPO's shifted schedule, sigma = s*t / (1 + (s-1)*t)
    # at t = 1, 1 - 1/N, ..., 1/N, then 0 (veRL-Omni's dance_grpo: s = 5, its Wan2.2 pipeline's)
    time_shift: Optional[float] = None
    # Every sample of a group starts from the same initial noise (DanceGRPO's shared noise, veRL-Omni's
    # init_same_noise); the SDE steps' noise still differs per sample
    same_initial_noise: bool = False
    # Which steps are stochastic (and trained): mode all | fixed | random | sliding, with size,
    # start, stride, range_end (see verl_digen.algos.window).
    sde_window: SdeWindowConfig = field(default_factory=SdeWindowConfig)
    # Fraction of the window's SDE steps trained per trajectory (Flow-GRPO's timestep_fraction;
    # at least one, chosen at random per sample).
    timestep_fraction: float = 1.0
    negative_prompt: str = ""  # the negative prompt of true CFG (guidance_scale > 1)

    def validate(self, key: str) -> None:
        from verl_digen.algos.sde import SDE_TYPES

        if self.sde_type not in SDE_TYPES:
            _fail(f"{key}.sde_type", self.sde_type, f"valid: {', '.join(SDE_TYPES)}")
        if self.num_steps < 1:
            _fail(f"{key}.num_steps", self.num_steps, "must be >= 1")
        for name in ("height", "width"):
            if getattr(self, name) < 8:
                _fail(f"{key}.{name}", getattr(self, name), "must be >= 8 pixels")
        if not 0.0 < self.timestep_fraction <= 1.0:
            _fail(f"{key}.timestep_fraction", self.timestep_fraction, "must be in (0, 1]")
        _positive(f"{key}.noise_level", self.noise_level)
        if self.time_shift is not None and not self.time_shift > 0:
            _fail(f"{key}.time_shift", self.time_shift, "must be > 0, or null for the pipeline's sigmas")
        try:
            self.sde_window.validate(self.num_steps)
        except ValueError as e:
            raise ConfigError(f"invalid config: {key}.sde_window: {e}") from None


@dataclass
class DataConfig:
    # builtin:<name>, or a .txt / .jsonl / .parquet file, or a list of files (read in order and
    # concatenated, as veRL's data.train_files does)
    prompts: Any = "builtin:demo"
    shuffle: bool = True  # shuffle the prompts every epoch (veRL's data.shuffle), seeded by digen.seed
    # Longest prompt accepted, in characters: every text encoder here truncates far below this,
    # so a longer one is a data error (and would only slow each step down), refused up front.
    max_prompt_chars: int = 16384
    # Longest prompt accepted, in tokens of the model's length tokenizer (the text encoder read to
    # digen.model.max_sequence_length: T5 for FLUX and SD3, UMT5 for Wan, Qwen2.5-VL / Llama with
    # the pipeline's chat template for Qwen-Image / HunyuanVideo), special tokens included: veRL's
    # data.max_prompt_length. null: no limit (the text encoder truncates at max_sequence_length).
    max_prompt_tokens: Optional[int] = None
    # Over-long prompts (max_prompt_tokens) are dropped when the data is read, and how many is
    # printed (veRL's data.filter_overlong_prompts); false: the run is refused naming the first.
    filter_overlong_prompts: bool = False
    # A Jinja chat template that makes a chat prompt (veRL's parquet) into the image prompt, rendered
    # with ``messages`` (veRL's actor_rollout_ref.model.custom_chat_template, as veRL-Omni's SD3.5
    # recipe writes it); null: the chat's last user message.
    chat_template: Optional[str] = None


@dataclass
class BatchConfig:
    groups_per_step: int = 4  # prompts per optimizer step
    group_size: int = 4  # images per prompt (GRPO group, G)
    groups_per_task: int = 1  # groups sampled together in one generate call
    train_micro_batch_groups: int = 1  # groups per trainer micro-batch (the plan's train task)
    # Rows (samples) per training pass on one trainer rank: one forward + backward, the unit of
    # gradient accumulation and of activation memory (veRL's ppo_micro_batch_size_per_gpu below
    # rollout.n). It may split a group: advantages are computed over whole groups first, and the
    # loss weighs each row by 1 / images of the mini-batch, so the update is the same whatever
    # the size. Must divide group_size (and a sample slice of it, dealt in whole calls over the
    # FSDP ranks); the rollout makes transformer calls of the same rows (exact on-policy
    # log-probs). null: the largest such call, a whole group when nothing splits it.
    train_micro_batch_rows: Optional[int] = None
    # PPO mini-batches: optimizer steps per training step, each on groups_per_step / mini_batches_per_step
    # groups (veRL's ppo_mini_batch_size); the ratio stays against the rollout's log-probs.
    mini_batches_per_step: int = 1

    def validate(self, key: str) -> None:
        # That groups_per_task and train_micro_batch_groups divide groups_per_step is a
        # strategy rule (verl_digen.schedule.strategies.strategy_violations).
        if self.group_size < 2:
            _fail(f"{key}.group_size", self.group_size, "GRPO needs at least 2 samples per group")
        if self.groups_per_step < 1:
            _fail(f"{key}.groups_per_step", self.groups_per_step, "must be >= 1")

    @property
    def images_per_step(self) -> int:
        return self.groups_per_step * self.group_size

    @property
    def images_per_optimizer_step(self) -> int:
        """Images of one PPO mini-batch: what one optimizer step's loss is the mean over."""
        return self.images_per_step // self.mini_batches_per_step


@dataclass
class AlgoConfig:
    clip_range: float = 1e-4  # PPO ratio clip: the ratio is clamped to [1 - clip_range, 1 + clip_range]
    adv_clip_max: float = 5.0  # advantages are clamped to [-adv_clip_max, adv_clip_max]
    kl_beta: float = 0.0  # weight of the KL to the frozen reference model; 0: no KL, no reference kept
    std_mode: str = "group"  # group | global | none
    # How a std is estimated: population (numpy.std of the rewards, Flow-GRPO's) | verl_omni (torch.std of
    # each reward repeated once per recorded SDE step, T of them: divisor n - 1/T, veRL-Omni's)
    std_estimator: str = "population"
    lr: float = 3e-2  # tiny demo; Flow-GRPO uses 3e-4 for LoRA on real models (see the presets in configs/)
    weight_decay: float = 1e-4  # the optimizer's weight decay
    max_grad_norm: float = 1.0  # gradients are clipped to this global norm before each optimizer step
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # AdamW's betas
    eps: float = 1e-8  # AdamW's epsilon
    optimizer: str = "adamw"  # adamw | sgd

    def validate(self, key: str) -> None:
        if self.std_mode not in ("group", "global", "none"):
            _fail(f"{key}.std_mode", self.std_mode, "valid: group, global, none")
        if self.std_estimator not in ("population", "verl_omni"):
            _fail(f"{key}.std_estimator", self.std_estimator, "valid: population, verl_omni")
        _positive(f"{key}.clip_range", self.clip_range)
        _positive(f"{key}.lr", self.lr)
        _non_negative(f"{key}.kl_beta", self.kl_beta)
        if self.optimizer not in ("adamw", "sgd"):
            _fail(f"{key}.optimizer", self.optimizer, "valid: adamw, sgd")


REWARD_DEVICES = ("auto", "cpu", "cuda")


@dataclass
class RewardConfig:
    name: str = "brightness"  # a registered reward (a wrong name is refused, listing them), or weighted
    kwargs: dict[str, Any] = field(default_factory=dict)  # the reward's arguments (+digen.reward.kwargs.KEY=VALUE)
    components: list[dict[str, Any]] = field(default_factory=list)  # for name=weighted: [{name, weight, kwargs}, ...]
    # Where a reward model runs: auto = its worker's device (the GPU Ray gave it, else CPU);
    # cpu; cuda (the worker's GPU; an error on a worker without one). A reward's own
    # kwargs.device wins for that reward.
    device: str = "auto"

    def as_spec(self) -> dict[str, Any]:
        """The mapping ``verl_digen.rewards.build_reward_from_config`` takes."""
        spec: dict[str, Any] = {"name": self.name, "kwargs": self.kwargs}
        if self.name == "weighted":
            spec["components"] = self.components
        return spec

    def validate(self, key: str) -> None:
        from verl_digen.rewards import registered_rewards

        if self.device not in REWARD_DEVICES:
            _fail(f"{key}.device", self.device, f"one of {', '.join(REWARD_DEVICES)}")
        names = [self.name] + [c.get("name", "?") for c in self.components]
        for n in names:
            if n not in registered_rewards():
                _fail(f"{key}.name", n, f"unknown reward; registered: {', '.join(registered_rewards())}")


@dataclass
class PoolSpec:
    # With ``nodes`` unset: the pool's devices, any number the cluster holds (10 of 4 x 8 GPUs
    # is 8 on one node and 2 on another; pools may share a node). With ``nodes=k``: devices
    # on each of k nodes. Either way the runtime places the workers
    # (verl_digen.placement.pools.assign_nodes: the trainer pool packed on as few nodes as
    # possible, the other pools on the devices left).
    devices: int = 1
    nodes: Optional[int] = None  # null: devices is the pool's total; k: devices on each of k nodes
    accelerator_type: Optional[str] = None  # Ray accelerator type for heterogeneous clusters (e.g. H800)

    @property
    def world_size(self) -> int:
        return self.devices * (self.nodes or 1)


@dataclass
class PoolsConfig:
    """Disaggregated placement only."""

    rollout: PoolSpec = field(default_factory=PoolSpec)
    trainer: PoolSpec = field(default_factory=PoolSpec)
    reward: PoolSpec = field(default_factory=lambda: PoolSpec(devices=0))  # devices 0: score on the rollout workers

    def validate(self, key: str) -> None:
        for role in ("rollout", "trainer"):
            spec: PoolSpec = getattr(self, role)
            if spec.devices < 1:
                _fail(f"{key}.{role}.devices", spec.devices, f"the {role} pool needs at least 1 device")
            if spec.nodes is not None and spec.nodes < 1:
                _fail(f"{key}.{role}.nodes", spec.nodes, "must be >= 1, or unset (devices is then the pool's total)")
        if self.reward.devices < 0:
            _fail(f"{key}.reward.devices", self.reward.devices, "must be >= 0 (0 = reward on rollout)")

    def validate_cluster(self, key: str, n_devices_per_node: int, nnodes: int) -> None:
        """The pools fit the declared cluster (``trainer.n_gpus_per_node`` x ``trainer.nnodes``)."""
        total = 0
        for role in ("rollout", "trainer", "reward"):
            p: PoolSpec = getattr(self, role)
            if role == "reward" and p.devices == 0:
                continue
            if p.nodes is not None and p.devices > n_devices_per_node:
                raise ConfigError(
                    f"invalid config: {key}.{role}.devices={p.devices} per node ({key}.{role}.nodes={p.nodes}) "
                    f"exceeds trainer.n_gpus_per_node={n_devices_per_node}; unset {key}.{role}.nodes to give "
                    "the pool's total instead"
                )
            if p.nodes is not None and p.nodes > nnodes:
                raise ConfigError(f"invalid config: {key}.{role}.nodes={p.nodes} exceeds trainer.nnodes={nnodes}")
            total += p.world_size
        if total > n_devices_per_node * nnodes:
            raise ConfigError(
                f"invalid config: {key} need {total} devices "
                f"(rollout {self.rollout.world_size} + trainer {self.trainer.world_size} + "
                f"reward {self.reward.world_size}) but the cluster has "
                f"trainer.n_gpus_per_node x trainer.nnodes = {n_devices_per_node * nnodes}"
            )


@dataclass
class GapConfig:
    # GAP: the batch is cut into micro-batches of whole groups, each finished group is scored and
    # streamed to the trainers, which accumulate gradients as groups arrive (disaggregated only).
    enable: bool = False


@dataclass
class AsyncConfig:
    max_staleness: int = 0  # 0 on-policy, 1 one-step-constrained (TCSS)

    def validate(self, key: str) -> None:
        if self.max_staleness not in (0, 1):
            _fail(f"{key}.max_staleness", self.max_staleness, "valid: 0 (on-policy) or 1 (one-step-constrained)")


@dataclass
class TspConfig:
    stages: int = 1  # K: rollout workers per time-step pipeline (1 = plain data parallel; must divide the rollout pool)
    train_split: str = "sample"  # sample | timestep: trainer ranks split each micro-batch by denoising step
    balance: bool = True  # balance stage ranges by measured per-step cost (else an even split)


@dataclass
class TagConfig:
    enable: bool = False  # trainers generate part of each step's groups (share decided per step)
    switch_cost_s: float = 0.0  # a trainer's generate->train switch (e.g. freeing activations)
    # "auto": decided every step from the rates measured before (0 when it does not pay); an
    # integer: that many groups every step (whole generate tasks; under FSDP as many per rank).
    groups: Any = "auto"

    @property
    def fixed(self) -> int | None:
        """The fixed share (None: decided per step)."""
        return None if self.groups == "auto" else int(self.groups)

    def validate(self, key: str) -> None:
        _non_negative(f"{key}.switch_cost_s", self.switch_cost_s)
        g = self.groups
        if g != "auto" and (isinstance(g, bool) or not isinstance(g, int) or g < 0):
            _fail(f"{key}.groups", g, "valid: auto (decided per step) or an integer >= 0")


@dataclass
class GatConfig:
    """GAT, generator-assisted training (TAG reversed, LoRA runs): rollout workers train
    micro-batches of the step's first PPO mini-batch with the weights they hold, which are the
    trainers' then, and send the LoRA gradients to the trainers, which add them before their
    optimizer step (trainer 0, or under FSDP every rank its shard): the same update as if the
    trainers had computed it, to float rounding."""

    enable: bool = False  # GAT on (disaggregated, LoRA, not with TAG)
    # "auto": decided every step from the rates the previous step measured (0 when it does not
    # pay); an integer: that many micro-batches every step (at most the first mini-batch's).
    micro_batches: Any = "auto"

    @property
    def fixed(self) -> int | None:
        """The fixed share (None: decided per step)."""
        return None if self.micro_batches == "auto" else int(self.micro_batches)

    def validate(self, key: str) -> None:
        m = self.micro_batches
        if m != "auto" and (isinstance(m, bool) or not isinstance(m, int) or m < 0):
            _fail(f"{key}.micro_batches", m, "valid: auto (decided per step) or an integer >= 0")


@dataclass
class UnitsConfig:
    """Work units of a disaggregated run. ``pull``: generate, reward and training tasks are
    taken by whichever worker of their pool is free next, instead of dealt round-robin when the
    step is planned (a worker that finishes early takes the next unit rather than idling behind
    a slow one: uneven prompts, a reward server's latency, a device of another kind). Every
    sample is the same trajectory wherever it runs (seeded by group and sample), so only where
    work runs changes; with several trainers the all-reduce sums the micro-batches' gradients in
    another grouping (the same update to float rounding)."""

    pull: bool = False  # pulled units: tasks taken by the next free worker of their pool (not with TSP or colocated)
    # generate tasks per group (equal sample slices, each a whole number of transformer calls);
    # "auto": one per group unless the step has fewer groups than rollout workers
    sample_slices: Any = "auto"
    # pulled row slices per training micro-batch (1: whole micro-batches); needs pull, no FSDP
    train_slices: int = 1

    @property
    def fixed_sample_slices(self) -> int | None:
        return None if self.sample_slices == "auto" else int(self.sample_slices)

    def validate(self, key: str) -> None:
        v = self.sample_slices
        if v != "auto" and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            _fail(f"{key}.sample_slices", v, "valid: auto or an integer >= 1 dividing digen.batch.group_size")
        if isinstance(self.train_slices, bool) or not isinstance(self.train_slices, int) or self.train_slices < 1:
            _fail(f"{key}.train_slices", self.train_slices, "valid: an integer >= 1")


@dataclass
class PromptCacheConfig:
    """Text encoders run once per unique prompt (memory + disk), then are freed.

    Before training the prompt set is encoded once per run: the workers that see the same cache
    directory split it and encode their shares on their own GPUs (trainer/warmup.py)."""

    enable: bool = False  # encode every prompt once before training and serve the embeddings from the cache
    dir: Optional[str] = None  # default: $VERL_DIGEN_CACHE/prompt_embeds or ~/.cache/verl_digen/prompt_embeds
    release_encoders: bool = True  # free the text encoders once the cache holds every prompt the run needs
    # Prompts per text-encoder call while warming up (the memory plan charges this batch's activations).
    encode_batch_size: int = 32
    # Host RAM of embedding rows each worker keeps (least recently used evicted, read back from disk).
    max_host_mb: float = 2048.0

    def validate(self, key: str) -> None:
        if isinstance(self.encode_batch_size, bool) or not isinstance(self.encode_batch_size, int) \
                or self.encode_batch_size < 1:
            _fail(f"{key}.encode_batch_size", self.encode_batch_size, "must be an integer >= 1")
        _non_negative(f"{key}.max_host_mb", self.max_host_mb)


@dataclass
class EmulateConfig:
    """Emulated cluster: the real executor drives workers that sleep for the cost model's time."""

    # A cost-model profile, e.g. flux-12b (python -m verl_digen.sim.planner --list); None: real workers.
    model: Optional[str] = None
    device_type: str = "H800"  # the device profile the emulated workers take the cost model's seconds of
    time_scale: float = 1.0  # real seconds per modelled second

    def validate(self, key: str) -> None:
        _positive(f"{key}.time_scale", self.time_scale)


@dataclass
class FsdpConfig:
    """FSDP2 (fully_shard) over the training ranks (the trainer pool, or every fused worker when
    colocated); each micro-batch runs on every rank in lockstep. Activation checkpointing is
    ``digen.model.gradient_checkpointing`` (every training path, sharded or not)."""

    enable: bool = False  # shard the denoiser with FSDP2 over the training ranks
    reshard_after_forward: bool = True  # free each block's gathered parameters after its forward (FSDP2's option)
    # FSDP2's host offload (veRL's fsdp_config.param_offload): the sharded parameters, their
    # gradients and the optimizer step on the host; each block's forward and backward copies its
    # shard in. Less GPU memory, every forward pays the host link (generation too, colocated).
    param_offload: bool = False
    # How the training ranks are grouped (verl_digen/memory/fsdp_layout.py): auto | flat | hsdp.
    # flat shards over every rank: with ranks on several nodes each pass's all-gathers and its
    # gradient reduce-scatter are rings over the network. hsdp (FSDP2 over a 2-D DeviceMesh
    # ("replicate", "shard")) shards over the ranks of one node and replicates across nodes: the
    # collectives stay on the node's links and only each rank's 1/k shard of the gradients is
    # all-reduced across nodes; each rank then holds 1/k of the training state (k ranks per node)
    # instead of 1/N. auto: hsdp exactly when the ranks span more than one node with as many on
    # each, else flat. hsdp where that does not hold is an error. Sharded checkpoints load
    # across layouts (flat <-> hsdp, any rank count).
    mesh: str = "auto"
    # The dtype gradients are reduced in: auto | fp32 | bf16. auto: bf16 for a full fine-tune of
    # bf16 weights (digen.model.dtype bf16, or auto on a GPU), fp32 otherwise. Exact: each rank's
    # gradient (autograd writes it in the weights' dtype, bf16), the sharded result (FSDP2 hands
    # it back in that dtype either way) and what follows: fp32 master gradients accumulated over
    # micro-batches and steps, fp32 masters and AdamW states. Not exact: the partial sums of the
    # reduction's ring are rounded to bf16 at every hop (up to N - 1 roundings of relative 2**-9,
    # where fp32 rounds once at the end), for half the bytes per pass. LoRA stays fp32 (its
    # gradients are megabytes); bf16 with LoRA is refused; bf16 on fp32 weights rounds each
    # rank's gradient too (allowed, not the default).
    reduce_dtype: str = "auto"

    def validate(self, key: str, *, lora: bool) -> None:
        from verl_digen.memory.fsdp_layout import MESH_MODES, reduce_dtype

        if self.mesh not in MESH_MODES:
            _fail(f"{key}.mesh", self.mesh, f"valid: {', '.join(MESH_MODES)}")
        reduce_dtype(self.reduce_dtype, lora=lora, weights_dtype="bf16")  # raises naming the key

    def check_layout(self, node_ranks: list[int]) -> None:
        """The mesh can be built over training ranks placed ``node_ranks[i]`` on node ``i`` of the
        declared cluster (``ConfigError`` naming ``digen.fsdp.mesh`` otherwise)."""
        from verl_digen.memory.fsdp_layout import mesh_shape

        if self.enable:
            mesh_shape(node_ranks, self.mesh)


@dataclass
class ValidationConfig:
    """Every trainer.test_freq steps: deterministic (ODE) samples of held-out prompts."""

    prompts: Any = "builtin:val"  # held-out prompts: builtin:<name>, a file, or a list of files
    num_prompts: int = 8  # held-out prompts sampled at each validation (the first N of the file)
    seed: int = 2024  # seed of the validation samples' noise (the same images for the same weights)
    # Denoising steps of a validation sample (ODE: no memory beyond one step); None: digen.sampling.num_steps.
    num_steps: Optional[int] = None
    # Validation images sent to the loggers (the first N, in prompt order); None: all. The grid
    # file in <run dir>/val always has every image.
    log_images: Optional[int] = None

    def validate(self, key: str) -> None:
        if self.num_prompts < 1:
            _fail(f"{key}.num_prompts", self.num_prompts, "must be >= 1")
        for name in ("num_steps", "log_images"):
            value = getattr(self, name)
            if value is not None and value < 1:
                _fail(f"{key}.{name}", value, "must be >= 1 (or null)")


# What makes a resumed run the run that wrote the checkpoint (``meta.json``'s ``identity``,
# written and compared by verl_digen.trainer.checkpoint): identity key -> the config key behind it.
IDENTITY_KEYS = {
    "model_fingerprint": "digen.model.path (the model's files)",
    "arch": "digen.model.arch",
    "lora_only": "digen.model.lora.enable",
    "lora_rank": "digen.model.lora.rank",
    "lora_alpha": "digen.model.lora.alpha",
    "lora_target_modules": "digen.model.lora.target_modules",
    "dtype": "digen.model.dtype",
    "trainable_dtype": "digen.model.trainable_dtype",
    "group_size": "digen.batch.group_size (actor_rollout_ref.rollout.n)",
    "ema": "digen.ema.enable",
}


@dataclass
class ResumeConfig:
    """How a run resumes (with ``trainer.resume_mode``)."""

    # resume_mode=auto finds checkpoints but none intact: start fresh anyway (else stop, listing
    # each and why); damaged checkpoints are never written over.
    fresh_if_damaged: bool = False
    # Identity keys (IDENTITY_KEYS) allowed to differ from the
    # checkpoint's, e.g. [model_fingerprint] for a base model re-saved on purpose.
    allow_changes: list[str] = field(default_factory=list)

    def validate(self, key: str) -> None:
        unknown = [k for k in self.allow_changes if k not in IDENTITY_KEYS]
        if unknown:
            _fail(f"{key}.allow_changes", unknown, f"valid: {', '.join(IDENTITY_KEYS)}")


@dataclass
class FaultConfig:
    """What the run does when one of its Ray workers dies during training."""

    # Worker deaths the run survives in the same job: the run's workers are released and started
    # anew, the newest intact checkpoint is loaded (as trainer.resume_mode=auto would; none: from
    # step 0) and training continues. 0: the run stops with a checkpoint of its completed steps.
    restarts: int = 0

    def validate(self, key: str) -> None:
        if isinstance(self.restarts, bool) or not isinstance(self.restarts, int) or self.restarts < 0:
            _fail(f"{key}.restarts", self.restarts, "an integer >= 0")


@dataclass
class EmaConfig:
    """EMA of the trained weights, used for validation when on."""

    enable: bool = False  # keep an EMA of the trained weights and validate with it
    decay: float = 0.999  # the EMA's decay per optimizer step, in (0, 1)
    offload: bool = True  # keep the EMA weights on CPU (moved to the device only to be swapped in)

    def validate(self, key: str) -> None:
        if not 0.0 < self.decay < 1.0:
            _fail(f"{key}.decay", self.decay, "must be in (0, 1)")


@dataclass
class MemoryConfig:
    """The per-GPU memory check run before any worker starts (``python -m verl_digen.memory``)."""

    check: bool = True  # plan every role's peak memory and refuse a job that cannot fit
    device_type: str = "H100"  # a device of verl_digen/platform/devices.yaml (its memory)
    device_gib: Optional[float] = None  # override the device type's memory (GiB per GPU)
    # Host RAM of one node (GiB): the workers a node runs must fit it at load, each the shard it
    # loads plus what it keeps on the host (offloaded encoders, parked optimizer, trainer 0's
    # snapshot). 8-GPU H100/H200 servers ship with 1-2 TiB; set the nodes' own figure.
    host_gib: float = 1024.0

    def validate(self, key: str) -> None:
        _positive(f"{key}.host_gib", self.host_gib)
        if self.device_gib is not None:
            _positive(f"{key}.device_gib", self.device_gib)
            return
        from verl_digen.platform.devices import device_types

        known = device_types()
        if self.device_type not in known:
            _fail(f"{key}.device_type", self.device_type, f"valid: {', '.join(known)} (or set {key}.device_gib)")


@dataclass
class SyncConfig:
    backend: str = "auto"  # auto | gloo | nccl

    def validate(self, key: str) -> None:
        if self.backend not in ("auto", "gloo", "nccl"):
            _fail(f"{key}.backend", self.backend, "valid: auto, gloo, nccl")


# The digen.* key of each StrategySpec field that a DigenConfig determines.
_STRATEGY_KEYS = {
    "placement": "digen.placement",
    "rollout_workers": "the rollout pool size digen.pools.rollout.devices (x digen.pools.rollout.nodes when set)",
    "groups_per_step": "digen.batch.groups_per_step",
    "groups_per_task": "digen.batch.groups_per_task",
    "train_micro_batch_groups": "digen.batch.train_micro_batch_groups",
    "train_micro_batch_rows": "digen.batch.train_micro_batch_rows",
    "mini_batches": "digen.batch.mini_batches_per_step",
    "max_staleness": "digen.async.max_staleness",
    "tsp_stages": "digen.tsp.stages",
    "num_steps": "digen.sampling.num_steps",
    "train_split": "digen.tsp.train_split",
    "tag": "digen.tag.enable",
    "fsdp": "digen.fsdp.enable",
    "gat": "digen.gat.enable",
    "pull": "digen.units.pull",
    "sample_slices": "digen.units.sample_slices",
    "train_slices": "digen.units.train_slices",
    "group_size": "digen.batch.group_size",
}


@dataclass
class DigenConfig:
    seed: int = 42  # seed of the prompt order, every sample's noise (by group and sample) and the SDE windows
    output_dir: Optional[str] = None  # default: runs/<project_name>/<experiment_name>-<timestamp>
    # veRL's trainer.rollout_data_dir: every training step k writes each sample's image (video:
    # GIF, as validation writes them) under <dir>/<k>/ and one JSON line per sample to
    # <dir>/<k>.jsonl (verl_digen.workers.rollout_dump); None: no dump. Several nodes: a
    # shared filesystem path (each worker writes the images it scored on its own node).
    rollout_data_dir: Optional[str] = None
    placement: str = "colocated"  # colocated | disaggregated
    model: ModelConfig = field(default_factory=ModelConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    pools: PoolsConfig = field(default_factory=PoolsConfig)
    gap: GapConfig = field(default_factory=GapConfig)
    async_: AsyncConfig = field(default_factory=AsyncConfig)  # hydra key: digen.async (see HYDRA_KEYS)
    tsp: TspConfig = field(default_factory=TspConfig)
    tag: TagConfig = field(default_factory=TagConfig)
    gat: GatConfig = field(default_factory=GatConfig)
    units: UnitsConfig = field(default_factory=UnitsConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    fsdp: FsdpConfig = field(default_factory=FsdpConfig)
    prompt_cache: PromptCacheConfig = field(default_factory=PromptCacheConfig)
    emulate: EmulateConfig = field(default_factory=EmulateConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    ema: EmaConfig = field(default_factory=EmaConfig)
    resume: ResumeConfig = field(default_factory=ResumeConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    progress_bar: bool = True  # a tqdm bar over the training steps
    # CPU slots of the local Ray instance the job starts (null: Ray's count); refused when the job
    # joins a running cluster, whose nodes declared theirs at ray start.
    ray_num_cpus: Optional[int] = None
    # How long the local Ray instance the job starts may take to come up (seconds). Ray gives its
    # raylet 30 s to register and then raises "The current node timed out during startup"; on a
    # busy machine the job tries again (at least once, then while this lasts) before it stops with
    # one line naming Ray's logs and this key.
    ray_start_timeout_s: float = 120.0
    # The floor of every blocking call's deadline (seconds). Each call (the workers' load, the
    # executor's wait for a task, the weight send's wait for the rollout workers and its join, the
    # process groups' collectives, checkpoint saves, the final sync) may wait this long plus twice
    # the cost model's predicted wait of what it waits for, at real size on the run's own plan
    # (verl_digen/sim/deadlines.py; python -m verl_digen.check prints each). Under TCSS the send
    # waits a whole rollout phase: ten minutes for Wan2.1 on 4 + 4 GPUs. Raise it for a slow
    # filesystem or cluster; runs without a real-size prediction (CPU, the tiny models) use it
    # alone. An emulated run scales the deadlines of the calls it times by digen.emulate.time_scale.
    task_timeout_s: float = 600.0
    gantt_last_steps: int = 3  # the run's gantt.png shows its last N training steps
    max_nonfinite_steps: int = 3  # skipped (non-finite) optimizer steps tolerated before the run stops
    # Testing knob only: training steps (1-based) whose gradients are replaced by NaN before the
    # optimizer step, to exercise the non-finite path end to end. Never set in real runs.
    fault_nonfinite_grad_steps: list[int] = field(default_factory=list)
    save_final_weights: bool = False  # final_weights.safetensors in the run dir (LoRA-only when LoRA is on)

    def strategy_fields(self) -> dict[str, Any]:
        """The :class:`~verl_digen.schedule.strategies.StrategySpec` fields this config fixes
        (``rollout_workers`` is None when colocated: the cluster decides it)."""
        b = self.batch
        return dict(
            placement=self.placement,
            rollout_workers=self.pools.rollout.world_size if self.placement == "disaggregated" else None,
            groups_per_step=b.groups_per_step,
            groups_per_task=b.groups_per_task,
            train_micro_batch_groups=b.train_micro_batch_groups,
            train_micro_batch_rows=b.train_micro_batch_rows,
            mini_batches=b.mini_batches_per_step,
            max_staleness=self.async_.max_staleness,
            tsp_stages=self.tsp.stages,
            num_steps=self.sampling.num_steps,
            train_split=self.tsp.train_split,
            tag=self.tag.enable,
            fsdp=self.fsdp.enable,
            gat=self.gat.enable,
            pull=self.units.pull,
            sample_slices=self.units.fixed_sample_slices,
            train_slices=self.units.train_slices,
            group_size=b.group_size,
        )

    def fsdp_ranks(self, devices: int) -> int:
        """The ranks one training micro-batch is sharded over (1 without FSDP): the trainer pool,
        or when colocated every one of the cluster's ``devices``."""
        if not self.fsdp.enable:
            return 1
        return self.pools.trainer.world_size if self.placement == "disaggregated" else devices

    @property
    def fsdp_trainers(self) -> bool:
        """Whether the trainer pool is a lockstep FSDP gang of a disaggregated run (TAG then cuts
        its share into equal slices per rank)."""
        return self.fsdp.enable and self.placement == "disaggregated"

    @property
    def tag_slices(self) -> int:
        """TAG's generate tasks per chunk of groups on the trainers (1: TAG off, or whole groups;
        :func:`verl_digen.schedule.strategies.tag_split`)."""
        from verl_digen.schedule.strategies import tag_split

        if not (self.tag.enable and self.fsdp_trainers):
            return 1
        rows = self.pass_rows(self.pools.trainer.world_size)  # devices: only a colocated run reads them
        return tag_split(self.batch.group_size, self.pools.trainer.world_size, rows)

    @property
    def tag_unit(self) -> int:
        """TAG's share comes in multiples of this many groups
        (:func:`verl_digen.schedule.strategies.tag_unit`)."""
        from verl_digen.schedule.strategies import tag_unit

        return tag_unit(self.batch.groups_per_task, self.pools.trainer.world_size, self.fsdp_trainers, self.tag_slices)

    def rollout_lanes(self, devices: int) -> int:
        """The rollout lanes the planner spreads a step's groups over (StrategySpec.sample_split):
        the rollout workers (colocated: the cluster's ``devices``), or with TSP their pipelines."""
        workers = self.pools.rollout.world_size if self.placement == "disaggregated" else devices
        return max(1, workers // self.tsp.stages)

    @property
    def optimizer_offloaded(self) -> bool:
        """``digen.model.optimizer_offload`` decided for this placement (auto: colocated only)."""
        setting = self.model.optimizer_offload
        return self.placement == "colocated" if setting == "auto" else setting == "true"

    def pass_rows(self, devices: int) -> int:
        """Samples per transformer call, in rollout and in a training pass, on a cluster of
        ``devices`` GPUs (:func:`verl_digen.schedule.strategies.pass_rows`, what every worker
        computes); a micro-batch whose rows cannot be dealt in whole calls over the FSDP ranks
        (known only with the cluster when colocated) is a :class:`ConfigError` naming the keys."""
        from verl_digen.schedule.strategies import pass_rows

        b = self.batch
        try:
            return pass_rows(b.group_size, b.train_micro_batch_groups, self.fsdp_ranks(devices), b.groups_per_step,
                             b.groups_per_task, self.rollout_lanes(devices), self.units.fixed_sample_slices,
                             self.units.train_slices, b.train_micro_batch_rows)
        except ValueError as e:
            if str(e).startswith("digen.batch.train_micro_batch_rows"):
                raise ConfigError(f"invalid config: {e}") from None
            where = "the trainer pool" if self.placement == "disaggregated" else f"all {devices} colocated GPUs"
            raise ConfigError(f"invalid config: {e} (digen.fsdp.enable=true shards each micro-batch over {where}); "
                              "raise digen.batch.train_micro_batch_groups or digen.batch.group_size") from None

    def validate(self) -> None:
        from verl_digen.schedule.strategies import fsdp_rows_split, strategy_violations

        _check_finite(self, "digen")
        _check_ranges(self)
        self.model.validate("digen.model")
        self.sampling.validate("digen.sampling")
        self.batch.validate("digen.batch")
        self.algo.validate("digen.algo")
        self.reward.validate("digen.reward")
        self.async_.validate("digen.async")
        self.sync.validate("digen.sync")
        self.tag.validate("digen.tag")
        self.gat.validate("digen.gat")
        self.units.validate("digen.units")
        self.validation.validate("digen.validation")
        self.emulate.validate("digen.emulate")
        self.prompt_cache.validate("digen.prompt_cache")
        self.ema.validate("digen.ema")
        self.resume.validate("digen.resume")
        self.fault.validate("digen.fault")
        self.memory.validate("digen.memory")
        # Placement, TCSS/TSP/TAG/FSDP and batch divisibility: the planner's own rules.
        fields = self.strategy_fields()
        for name, valid in strategy_violations(**fields, name=_STRATEGY_KEYS.__getitem__):
            _fail(_STRATEGY_KEYS[name], fields[name], valid)
        self.fsdp.validate("digen.fsdp", lora=self.model.lora.enable)
        if self.fsdp.param_offload and not self.fsdp.enable:
            _fail("digen.fsdp.param_offload", True, "it is FSDP2's host offload: set digen.fsdp.enable=true too "
                                                    "(veRL's fsdp_config.param_offload=true does)")
        if self.fsdp.enable:
            if self.tsp.train_split != "sample":
                _fail("digen.tsp.train_split", self.tsp.train_split, "FSDP splits each micro-batch by sample")
            if self.placement == "disaggregated" and not fsdp_rows_split(
                self.batch.train_micro_batch_groups, self.batch.group_size, self.pools.trainer.world_size
            ):
                rows = self.batch.train_micro_batch_groups * self.batch.group_size
                _fail("digen.batch.train_micro_batch_groups", self.batch.train_micro_batch_groups,
                      f"x digen.batch.group_size={self.batch.group_size} = {rows} rows must split evenly over the "
                      f"{self.pools.trainer.world_size} FSDP trainer ranks")
        if self.placement == "disaggregated":
            self.pools.validate("digen.pools")
            if self.batch.train_micro_batch_rows is not None:
                self.pass_rows(self.pools.trainer.world_size)  # the pass's rows against the pools (colocated: resolve)
        elif self.pools.reward.devices:
            # the pools are the disaggregated placement's; a colocated run would not place it
            _fail("digen.pools.reward.devices", self.pools.reward.devices,
                  "a reward pool needs digen.placement=disaggregated (colocated workers score what they generate)")
        self._check_gat()
        self._check_tag()
        if self.algo.std_mode == "global" and self.gap.enable:
            _fail("digen.algo.std_mode", "global", "GAP streams groups before the batch is complete; use group or none")
        _positive("digen.task_timeout_s", self.task_timeout_s)
        self._check_rollout_data_dir()

    def _check_gat(self) -> None:
        """GAT sends LoRA gradients (megabytes; a full fine-tune's would be the model's size)."""
        if not self.gat.enable:
            if self.gat.micro_batches != "auto":
                _fail("digen.gat.micro_batches", self.gat.micro_batches, "is GAT's share; set digen.gat.enable=true too")
            return
        if not self.model.lora.enable:
            _fail("digen.gat.enable", True, "GAT sends LoRA gradients from rollout to the trainers; it needs "
                                            "digen.model.lora.enable=true")
        if self.gat.micro_batches == 0:
            _fail("digen.gat.micro_batches", 0, "assigns nothing every step; set digen.gat.enable=false instead "
                                                "(the rollout workers would still be set up and planned to train)")
        b = self.batch
        first = b.groups_per_step // b.mini_batches_per_step // b.train_micro_batch_groups
        if self.gat.micro_batches != "auto" and self.gat.micro_batches > first:
            _fail("digen.gat.micro_batches", self.gat.micro_batches,
                  f"at most the {first} micro-batches of a step's first PPO mini-batch (the rollout workers' "
                  "weights are the trainers' only until its optimizer step)")

    def _check_tag(self) -> None:
        """A fixed TAG share: whole generate tasks, under FSDP as many on every trainer rank."""
        g = self.tag.groups
        if g == "auto":
            return
        if not self.tag.enable:
            _fail("digen.tag.groups", g, "is TAG's share; set digen.tag.enable=true too")
        b, unit, ranks = self.batch, self.tag_unit, self.pools.trainer.world_size
        if g > b.groups_per_step or g % unit:
            why = (f" (whole generate tasks of digen.batch.groups_per_task={b.groups_per_task} groups, in "
                   f"{self.tag_slices} sample slices, as many on each of the {ranks} FSDP trainer ranks: their "
                   "generate calls are collectives)") if self.fsdp_trainers else f" (digen.batch.groups_per_task: whole generate tasks)"
            _fail("digen.tag.groups", g, f"must be a multiple of {unit}{why}, at most "
                                         f"digen.batch.groups_per_step={b.groups_per_step}")

    def _check_rollout_data_dir(self) -> None:
        """A dump directory is a path, and needs real workers: emulated ones make no images."""
        if self.rollout_data_dir is None:
            return
        if not self.rollout_data_dir.strip():
            _fail("digen.rollout_data_dir", self.rollout_data_dir, "a directory path, or null (no dump)")
        if self.emulate.model is not None:
            _fail("digen.rollout_data_dir", self.rollout_data_dir,
                  f"an emulated cluster (digen.emulate.model={self.emulate.model!r}) makes no images to dump; "
                  "unset one of them")


def _check_finite(node: Any, key: str) -> None:
    """Every number anywhere in the config is finite: NaN passes ``x <= 0`` checks and inf
    passes ``x > 0``, so neither may reach a range check (or a worker)."""
    if dataclasses.is_dataclass(node):
        for f in dataclasses.fields(node):
            _check_finite(getattr(node, f.name), f"{key}.{HYDRA_KEYS.get(f.name, f.name)}")
    elif isinstance(node, dict):
        for k, v in node.items():
            _check_finite(v, f"{key}.{k}")
    elif isinstance(node, (list, tuple)):
        for i, v in enumerate(node):
            _check_finite(v, f"{key}[{i}]")
    elif isinstance(node, float) and not math.isfinite(node):
        _fail(key, node, "must be a finite number (NaN and inf are refused)")


# Ranges of the numeric keys no section checks itself: key -> (test, what is valid).
_RANGES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "seed": (lambda v: v >= 0, "must be >= 0"),
    "model.lora.alpha": (lambda v: v > 0, "must be > 0"),
    "sampling.num_frames": (lambda v: v >= 1, "must be >= 1"),
    "sampling.guidance_scale": (lambda v: v >= 1.0, "must be >= 1 (1 disables CFG)"),
    "sampling.distilled_guidance": (lambda v: v is None or v > 0, "must be > 0 or null"),
    "batch.groups_per_task": (lambda v: v >= 1, "must be >= 1"),
    "batch.train_micro_batch_groups": (lambda v: v >= 1, "must be >= 1"),
    "batch.train_micro_batch_rows": (lambda v: v is None or v >= 1, "must be >= 1 or null"),
    "algo.adv_clip_max": (lambda v: v > 0, "must be > 0"),
    "algo.weight_decay": (lambda v: v >= 0, "must be >= 0"),
    "algo.max_grad_norm": (lambda v: v > 0, "must be > 0"),
    "algo.eps": (lambda v: v > 0, "must be > 0"),
    "algo.betas": (lambda v: len(v) == 2 and all(0 <= b < 1 for b in v), "must be two numbers in [0, 1)"),
    "validation.seed": (lambda v: v >= 0, "must be >= 0"),
    "data.max_prompt_chars": (lambda v: v >= 1, "must be >= 1"),
    "data.max_prompt_tokens": (lambda v: v is None or v >= 1, "must be >= 1 or null"),
    "ray_num_cpus": (lambda v: v is None or v >= 1, "must be >= 1 or null"),
    "ray_start_timeout_s": (lambda v: v > 0, "must be > 0"),
    "gantt_last_steps": (lambda v: v >= 1, "must be >= 1"),
    "max_nonfinite_steps": (lambda v: v >= 0, "must be >= 0"),
}


def _check_ranges(cfg: "DigenConfig") -> None:
    for path, (ok, valid) in _RANGES.items():
        value: Any = cfg
        for part in path.split("."):
            value = getattr(value, part)
        if not ok(value):
            _fail(f"digen.{path}", value, valid)


# ---------------------------------------------------------------------------
# Hydra: the defaults node, and the composed mapping -> dataclass
# ---------------------------------------------------------------------------

# Python field -> hydra key, where the key is a Python keyword. A dataclass field cannot be
# named ``async``, and an OmegaConf structured node keeps field names as keys, so the
# ConfigStore node is built from ``asdict(DigenConfig())`` with this rename (see
# :func:`hydra_defaults`) and the rename is undone before the structured merge.
HYDRA_KEYS = {"async_": "async"}
_FIELDS = {v: k for k, v in HYDRA_KEYS.items()}


def hydra_defaults() -> dict[str, Any]:
    """The ``digen`` tree of the composed config: ``DigenConfig()``'s defaults, hydra key names."""
    return {HYDRA_KEYS.get(k, k): v for k, v in dataclasses.asdict(DigenConfig()).items()}


def register_configs() -> None:
    """Store the ``digen`` defaults in Hydra's ConfigStore as ``digen_defaults`` (package
    ``digen``), the entry ``digen_base.yaml`` lists in its defaults.

    The node is plain data rather than a structured (typed) node: its top-level key ``async``
    cannot be a dataclass field, and Hydra's ``+digen.x.y=...`` appends bypass a structured
    node's key check anyway, so types and keys are enforced once, for every source (CLI,
    presets, dicts given in code), by :func:`digen_config_from_dict`.
    """
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="digen_defaults", node=hydra_defaults(), package="digen")


def _valid_keys(path: list[str]) -> list[str]:
    """The hydra keys under the section at ``path`` (python field names below ``DigenConfig``)."""
    section: Any = DigenConfig()
    for part in path:
        section = getattr(section, part, None)
    if not dataclasses.is_dataclass(section):
        return []
    return sorted(HYDRA_KEYS.get(f.name, f.name) for f in dataclasses.fields(section))


def _config_error(e: Exception) -> ConfigError:
    """An OmegaConf merge error as a :class:`ConfigError` naming the ``digen.*`` key."""
    from omegaconf.errors import ConfigKeyError

    full_key = str(getattr(e, "full_key", "") or "")
    parts = full_key.split(".") if full_key else []
    if parts:
        parts[0] = HYDRA_KEYS.get(parts[0], parts[0])
    key = ".".join(["digen", *parts])
    msg = str(getattr(e, "msg", None) or e).splitlines()[0]
    if isinstance(e, ConfigKeyError) and parts:
        parent = ".".join(["digen", *parts[:-1]])
        path = [_FIELDS.get(p, p) for p in full_key.split(".")[:-1]]
        return ConfigError(f"unknown config key {key}; valid keys under {parent}: {', '.join(_valid_keys(path))}")
    if parts:
        return ConfigError(f"invalid config: {key}={getattr(e, 'value', None)!r}; {msg}")
    return ConfigError(f"invalid config under digen: {msg}")


def digen_config_from_dict(data: Mapping[str, Any] | None) -> DigenConfig:
    """Strictly build and validate a :class:`DigenConfig` from the plain ``digen`` mapping.

    Missing keys take the dataclass defaults; unknown keys and values of the wrong type are
    refused (OmegaConf structured merge), then :meth:`DigenConfig.validate` runs.
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    if data is not None and not isinstance(data, Mapping):
        raise ConfigError(f"invalid config: digen must be a mapping, got {data!r}")
    renamed = {_FIELDS.get(k, k): v for k, v in (data or {}).items()}
    try:
        cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(DigenConfig), renamed))
    except OmegaConfBaseException as e:
        raise _config_error(e) from None
    assert isinstance(cfg, DigenConfig)
    cfg.validate()
    return cfg
