"""The ``digen`` config group as typed dataclasses, validated before anything starts.

Hydra gives us a DictConfig; :func:`digen_config_from_dict` turns ``cfg.digen`` into a
:class:`DigenConfig`, refusing unknown keys (typos) and bad values with an error that names
the full key, the value and what would be valid. Nothing deep inside Ray ever sees a
config typo.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Optional


class ConfigError(ValueError):
    """A user configuration problem; the message names the key, the value and what is valid."""


def _fail(key: str, value: Any, valid: str) -> None:
    raise ConfigError(f"invalid config: {key}={value!r}; {valid}")


@dataclass
class LoraConfigSpec:
    enable: bool = True
    rank: int = 8
    alpha: float = 16.0
    # Attention projections of the FLUX, SD3, Qwen-Image, Wan and HunyuanVideo blocks (diffusers names). Modules absent
    # from an architecture are simply not matched.
    target_modules: list[str] = field(
        default_factory=lambda: ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]
    )
    init_seed: int = 0

    def validate(self, key: str) -> None:
        if self.rank < 1:
            _fail(f"{key}.rank", self.rank, "must be >= 1")
        if not self.target_modules:
            _fail(f"{key}.target_modules", self.target_modules, "must name at least one module")


@dataclass
class ModelConfig:
    path: Optional[str] = None  # local diffusers directory; None -> build the tiny model of tiny_arch
    arch: Optional[str] = None  # None -> detected from model_index.json
    tiny_arch: str = "flux"
    dtype: str = "fp32"  # fp32 | bf16 (bf16: autocast for the denoiser, SDE maths stay fp32)
    lora: LoraConfigSpec = field(default_factory=LoraConfigSpec)

    def validate(self, key: str) -> None:
        if self.dtype not in ("fp32", "bf16"):
            _fail(f"{key}.dtype", self.dtype, "valid: fp32, bf16")
        tiny_archs = ("flux", "sd3", "qwen_image", "wan", "hunyuan_video")  # verl_digen.models.tiny.TINY_ARCHS
        if self.tiny_arch not in tiny_archs:
            _fail(f"{key}.tiny_arch", self.tiny_arch, f"valid: {', '.join(tiny_archs)}")
        self.lora.validate(f"{key}.lora")


@dataclass
class SdeWindowSpec:
    mode: str = "all"  # all | fixed | random | sliding
    size: int = 0
    start: int = 0
    stride: int = 1
    range_end: Optional[int] = None


@dataclass
class SamplingConfig:
    height: int = 32
    width: int = 32
    num_frames: int = 1
    num_steps: int = 8
    guidance_scale: float = 1.0
    distilled_guidance: Optional[float] = None
    noise_level: float = 0.7
    sde_type: str = "sde"
    sde_window: SdeWindowSpec = field(default_factory=SdeWindowSpec)
    timestep_fraction: float = 1.0
    negative_prompt: str = ""

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
        if self.noise_level <= 0:
            _fail(f"{key}.noise_level", self.noise_level, "must be > 0")
        from verl_digen.algos.window import SdeWindowConfig

        try:
            SdeWindowConfig(**dataclasses.asdict(self.sde_window)).validate(self.num_steps)
        except ValueError as e:
            raise ConfigError(f"invalid config: {key}.sde_window: {e}") from None


@dataclass
class DataConfig:
    prompts: str = "builtin:demo"  # a .txt/.jsonl/.parquet path, or builtin:<name>
    shuffle: bool = True


@dataclass
class BatchConfig:
    groups_per_step: int = 4  # prompts per optimizer step
    group_size: int = 4  # images per prompt (G)
    groups_per_task: int = 1  # groups sampled together in one generate call
    train_micro_batch_groups: int = 1  # groups per trainer micro-batch (gradient accumulation unit)

    def validate(self, key: str) -> None:
        if self.group_size < 2:
            _fail(f"{key}.group_size", self.group_size, "GRPO needs at least 2 samples per group")
        if self.groups_per_step < 1:
            _fail(f"{key}.groups_per_step", self.groups_per_step, "must be >= 1")
        for name in ("groups_per_task", "train_micro_batch_groups"):
            v = getattr(self, name)
            if v < 1 or self.groups_per_step % v != 0:
                _fail(
                    f"{key}.{name}",
                    v,
                    f"must be >= 1 and divide {key}.groups_per_step={self.groups_per_step} (whole groups only)",
                )

    @property
    def images_per_step(self) -> int:
        return self.groups_per_step * self.group_size


@dataclass
class AlgoConfig:
    clip_range: float = 1e-4
    adv_clip_max: float = 5.0
    kl_beta: float = 0.0
    std_mode: str = "group"  # group | global | none
    lr: float = 3e-4
    weight_decay: float = 1e-4
    max_grad_norm: float = 1.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    optimizer: str = "adamw"  # adamw | sgd

    def validate(self, key: str) -> None:
        if self.std_mode not in ("group", "global", "none"):
            _fail(f"{key}.std_mode", self.std_mode, "valid: group, global, none")
        if self.clip_range <= 0:
            _fail(f"{key}.clip_range", self.clip_range, "must be > 0")
        if self.lr <= 0:
            _fail(f"{key}.lr", self.lr, "must be > 0")
        if self.kl_beta < 0:
            _fail(f"{key}.kl_beta", self.kl_beta, "must be >= 0")
        if self.optimizer not in ("adamw", "sgd"):
            _fail(f"{key}.optimizer", self.optimizer, "valid: adamw, sgd")


@dataclass
class RewardConfig:
    name: str = "brightness"
    kwargs: dict[str, Any] = field(default_factory=dict)
    components: list[dict[str, Any]] = field(default_factory=list)  # for name=weighted

    def as_spec(self) -> dict[str, Any]:
        """The mapping ``verl_digen.rewards.build_reward_from_config`` takes."""
        spec: dict[str, Any] = {"name": self.name, "kwargs": self.kwargs}
        if self.name == "weighted":
            spec["components"] = self.components
        return spec

    def validate(self, key: str) -> None:
        from verl_digen.rewards import registered_rewards

        names = [self.name] + [c.get("name", "?") for c in self.components]
        for n in names:
            if n not in registered_rewards():
                _fail(f"{key}.name", n, f"unknown reward; registered: {', '.join(registered_rewards())}")


@dataclass
class PoolSpec:
    devices: int = 1  # devices per node
    nodes: int = 1
    accelerator_type: Optional[str] = None  # Ray accelerator type for heterogeneous clusters (e.g. H800)

    @property
    def world_size(self) -> int:
        return self.devices * self.nodes


@dataclass
class PoolsConfig:
    rollout: PoolSpec = field(default_factory=PoolSpec)
    trainer: PoolSpec = field(default_factory=PoolSpec)
    reward: PoolSpec = field(default_factory=lambda: PoolSpec(devices=0))


@dataclass
class GapConfig:
    enable: bool = False


@dataclass
class AsyncConfig:
    max_staleness: int = 0

    def validate(self, key: str) -> None:
        if self.max_staleness not in (0, 1):
            _fail(f"{key}.max_staleness", self.max_staleness, "valid: 0 (on-policy) or 1 (one-step-constrained)")


@dataclass
class TspConfig:
    stages: int = 1  # rollout workers per time-step pipeline (1 = plain data parallel)
    train_split: str = "sample"  # sample | timestep
    balance: bool = True  # balance stage ranges by measured per-step cost (else an even split)

    def validate(self, key: str, num_steps: int) -> None:
        if self.stages < 1 or self.stages > num_steps:
            _fail(f"{key}.stages", self.stages, f"must be in [1, digen.sampling.num_steps={num_steps}]")
        if self.train_split not in ("sample", "timestep"):
            _fail(f"{key}.train_split", self.train_split, "valid: sample, timestep")


@dataclass
class TagConfig:
    enable: bool = False
    switch_cost_s: float = 0.0  # a trainer's generate->train switch (e.g. freeing activations)

    def validate(self, key: str) -> None:
        if self.switch_cost_s < 0:
            _fail(f"{key}.switch_cost_s", self.switch_cost_s, "must be >= 0")


@dataclass
class PromptCacheConfig:
    enable: bool = False  # encode every prompt once (memory + disk), then free the text encoders
    dir: Optional[str] = None  # default: $VERL_DIGEN_CACHE/prompt_embeds or ~/.cache/verl_digen/prompt_embeds
    release_encoders: bool = True


@dataclass
class EmulateConfig:
    model: Optional[str] = None  # a cost-model profile (flux-12b, wan2.1-14b, ...): workers sleep instead of compute
    device_type: str = "H800"
    time_scale: float = 1.0  # real seconds per modelled second

    def validate(self, key: str) -> None:
        if self.time_scale <= 0:
            _fail(f"{key}.time_scale", self.time_scale, "must be > 0")


@dataclass
class FsdpConfig:
    enable: bool = False  # FSDP2 (fully_shard) over the trainer pool; micro-batches run in lockstep
    gradient_checkpointing: bool = False
    reshard_after_forward: bool = True


@dataclass
class ValidationConfig:
    prompts: str = "builtin:val"  # held-out prompts (builtin:<name> or a file); trainer.test_freq sets how often
    num_prompts: int = 8
    seed: int = 2024

    def validate(self, key: str) -> None:
        if self.num_prompts < 1:
            _fail(f"{key}.num_prompts", self.num_prompts, "must be >= 1")


@dataclass
class EmaConfig:
    enable: bool = False
    decay: float = 0.999

    def validate(self, key: str) -> None:
        if not 0.0 < self.decay < 1.0:
            _fail(f"{key}.decay", self.decay, "must be in (0, 1)")


@dataclass
class SyncConfig:
    backend: str = "auto"  # auto | gloo | nccl

    def validate(self, key: str) -> None:
        if self.backend not in ("auto", "gloo", "nccl"):
            _fail(f"{key}.backend", self.backend, "valid: auto, gloo, nccl")


@dataclass
class DigenConfig:
    seed: int = 42
    output_dir: Optional[str] = None
    placement: str = "colocated"
    model: ModelConfig = field(default_factory=ModelConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    pools: PoolsConfig = field(default_factory=PoolsConfig)
    gap: GapConfig = field(default_factory=GapConfig)
    async_: AsyncConfig = field(default_factory=AsyncConfig)
    tsp: TspConfig = field(default_factory=TspConfig)
    tag: TagConfig = field(default_factory=TagConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    fsdp: FsdpConfig = field(default_factory=FsdpConfig)
    prompt_cache: PromptCacheConfig = field(default_factory=PromptCacheConfig)
    emulate: EmulateConfig = field(default_factory=EmulateConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    ema: EmaConfig = field(default_factory=EmaConfig)
    progress_bar: bool = True
    ray_num_cpus: Optional[int] = None
    task_timeout_s: float = 600.0
    gantt_last_steps: int = 3
    max_nonfinite_steps: int = 3
    # Testing knob: training steps (1-based) whose gradients are replaced by NaN before the
    # optimizer step, to exercise the non-finite path end to end. Never set in real runs.
    fault_nonfinite_grad_steps: list[int] = field(default_factory=list)  # optimizer steps skipped for NaN/inf gradients before the run stops
    save_final_weights: bool = False  # write the trained (LoRA or full) state to final_weights.safetensors

    def validate(self) -> None:
        if self.placement not in ("colocated", "disaggregated"):
            _fail("digen.placement", self.placement, "valid: colocated, disaggregated")
        self.model.validate("digen.model")
        self.sampling.validate("digen.sampling")
        self.batch.validate("digen.batch")
        self.algo.validate("digen.algo")
        self.reward.validate("digen.reward")
        self.async_.validate("digen.async")
        self.sync.validate("digen.sync")
        self.tsp.validate("digen.tsp", self.sampling.num_steps)
        self.tag.validate("digen.tag")
        self.validation.validate("digen.validation")
        self.emulate.validate("digen.emulate")
        if self.fsdp.enable:
            if self.placement != "disaggregated":
                _fail("digen.fsdp.enable", True, "FSDP shards the trainer pool: needs digen.placement=disaggregated")
            if self.tag.enable:
                _fail("digen.tag.enable", True, "TAG with FSDP would make generation a trainer collective; not supported")
            if self.tsp.train_split != "sample":
                _fail("digen.tsp.train_split", self.tsp.train_split, "FSDP splits each micro-batch by sample")
            if self.algo.kl_beta > 0 and not self.model.lora.enable:
                _fail("digen.algo.kl_beta", self.algo.kl_beta, "a full-copy KL reference is not supported with FSDP (use LoRA)")
        self.ema.validate("digen.ema")
        if self.placement == "colocated":
            if self.tsp.stages > 1 or self.tsp.train_split != "sample":
                _fail("digen.tsp.stages", self.tsp.stages, "TSP needs digen.placement=disaggregated")
            if self.tag.enable:
                _fail("digen.tag.enable", True, "TAG needs digen.placement=disaggregated")
        elif self.pools.rollout.world_size % self.tsp.stages:
            _fail(
                "digen.tsp.stages", self.tsp.stages,
                f"must divide the rollout pool size {self.pools.rollout.world_size} (pipelines of whole stages)",
            )
        if self.placement == "disaggregated":
            for role in ("rollout", "trainer"):
                spec: PoolSpec = getattr(self.pools, role)
                if spec.devices < 1 or spec.nodes < 1:
                    _fail(f"digen.pools.{role}.devices", spec.devices, f"the {role} pool needs at least 1 device")
            if self.pools.reward.devices < 0:
                _fail("digen.pools.reward.devices", self.pools.reward.devices, "must be >= 0 (0 = reward on rollout)")
        if self.async_.max_staleness > 0 and self.placement == "colocated":
            _fail("digen.async.max_staleness", self.async_.max_staleness, "async needs digen.placement=disaggregated")
        if self.algo.std_mode == "global" and self.gap.enable:
            _fail("digen.algo.std_mode", "global", "GAP streams groups before the batch is complete; use group or none")
        if self.task_timeout_s <= 0:
            _fail("digen.task_timeout_s", self.task_timeout_s, "must be > 0")


# ---------------------------------------------------------------------------
# dict -> dataclass, strict
# ---------------------------------------------------------------------------

_RENAMES = {"async": "async_"}


def _build(cls: type, data: Any, key: str) -> Any:
    if data is None:
        return cls()
    if not isinstance(data, dict):
        raise ConfigError(f"invalid config: {key} must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for raw_name, value in data.items():
        name = _RENAMES.get(raw_name, raw_name)
        if name not in names:
            valid = sorted(n.rstrip("_") for n in names)
            raise ConfigError(f"unknown config key {key}.{raw_name}; valid keys under {key}: {', '.join(valid)}")
        kwargs[name] = _coerce(hints[name], value, f"{key}.{raw_name}")
    return cls(**kwargs)


def _coerce(tp: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Union:  # Optional[X]
        if value is None:
            return None
        inner = [a for a in args if a is not type(None)][0]
        return _coerce(inner, value, key)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"invalid config: {key}={value!r}; expected true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"invalid config: {key}={value!r}; expected an integer")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"invalid config: {key}={value!r}; expected a number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"invalid config: {key}={value!r}; expected a string")
        return value
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"invalid config: {key}={value!r}; expected a list")
        return [_coerce(args[0], v, f"{key}[{i}]") if args else v for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"invalid config: {key}={value!r}; expected a mapping")
        return dict(value)
    return value


def digen_config_from_dict(data: dict[str, Any] | None) -> DigenConfig:
    """Strictly build and validate a :class:`DigenConfig` from the plain ``digen`` mapping."""
    cfg = _build(DigenConfig, data or {}, "digen")
    cfg.validate()
    return cfg
