"""How long each task of a plan takes, from FLOPs, bytes and link bandwidths.

Profiles are data (``verl_digen/sim/profiles/*.yaml``, every constant with its source); this
module turns a *model* profile, a *workload* (resolution, frames, steps, CFG, SDE window,
group size, LoRA or full fine-tuning) and *device* profiles into seconds per task:

- **generate** ``n`` images: prompt encoding (first step only) + ``steps x forward(n)``
  (x2 with true CFG) + VAE decode (last step only). A forward on one sample costs
  ``2 x params x tokens + 4 x layers x tokens^2 x hidden`` FLOPs (linear layers plus
  attention scores and values), at ``peak x mfu_forward`` FLOP/s, plus a fixed launch
  overhead per call.
- **reward** ``n`` images: the reward model's FLOPs per image plus a per-call overhead.
- **train** ``n`` images: every trained time step (SDE window x timestep fraction) is one
  forward + backward (3x a forward, +1 forward for the KL reference) per device
  micro-batch, at ``mfu_train``. With FSDP over ``N`` ranks each of those passes also
  all-gathers the parameters twice (forward and backward) and reduce-scatters the trainable
  gradients: ``(2 x param_bytes + grad_bytes) x (N-1)/N`` over the collective bandwidth
  (NVLink inside a node, the NIC across nodes), of which a fraction ``comm_overlap`` of the
  pass's compute time hides. This is what makes colocated training (``N`` = every device)
  strong-scale poorly.
- **optimizer_step**: an Adam update of the local shard (memory bound) plus a fixed cost.
- **sync**: gather the trainable weights on trainer 0, broadcast them over the inter-pool
  link (LoRA: megabytes; full: ``2 x params`` bytes).
- **switch** (a worker changing between generating and training: colocated workers every
  step, trainers that assist generation): onload/offload of the rollout weights and the
  optimizer state over the host link, plus a fixed cost.

The interface is :meth:`CostModel.task_seconds` ``(task, worker, cluster, switch_from)``.
It reads the optional task fields the strategies set, so new strategies are costed by data:

- ``task.denoise = (start, end)`` on a GENERATE task covers only those denoising steps (a
  TSP rollout stage): prompt encoding only when ``start == 0``, VAE decoding only on the
  stage with ``task.final``;
- ``task.train_part = (part, parts)`` on a TRAIN task trains every ``parts``-th trained step
  from ``part`` (TSP training split by time step);
- a GENERATE task on a ``trainer`` worker (TAG) is costed on that worker's device; the mode
  switch (train -> generate -> train) is charged through ``switch_from``.
"""

from __future__ import annotations

import glob
import math
import os
import typing
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Iterable, Mapping

from verl_digen.schedule.plan import Task, TaskKind, WorkerId
from verl_digen.schedule.strategies import StepCosts, StrategySpec

PROFILE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "profiles")

GB = 1e9
TFLOP = 1e12

MODE_GENERATE = "generate"
MODE_TRAIN = "train"


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
    vae_spatial: int = 8  # pixels per latent pixel (each side)
    vae_temporal: int = 1  # frames per latent frame (video: 4, first frame kept)
    patch: int = 2  # latent pixels per token (each side)
    patch_t: int = 1  # latent frames per token
    text_tokens: int = 0  # text tokens in the sequence (joint attention) or cross-attended
    joint_text: bool = True  # MMDiT: text tokens join the self-attention sequence
    text_encoder_params: float = 0.0
    text_encoder_tokens: int = 0
    decode_flops_per_pixel: float = 0.0  # VAE decoder FLOPs per output pixel (per frame)
    reward_flops_per_image: float = 0.0  # reward model FLOPs per scored image / video
    lora_linears: int = 0  # linear layers LoRA adapts (attention projections)
    lora_params: float = 0.0  # measured LoRA parameters; overrides the lora_linears estimate
    gradient_checkpointing: bool = False  # default for this model's training (memory)
    max_device_batch: int = 0  # cap on samples per forward+backward pass (0: memory decides)
    video: bool = False
    defaults: Mapping[str, Any] = field(default_factory=dict)  # workload defaults
    sources: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class DeviceProfile:
    """One accelerator type (and the node it sits in)."""

    name: str
    peak_tflops: float  # dense bf16 tensor-core peak
    mfu_forward: float  # achieved / peak on large-sequence DiT forwards
    mfu_train: float  # achieved / peak on forward+backward
    hbm_gb: float
    hbm_tbps: float  # memory bandwidth
    intra_node_gbps: float  # collective bandwidth per device inside a node, one direction
    inter_node_gbps: float  # network bandwidth per device across nodes, one direction
    host_link_gbps: float  # device <-> host (PCIe), one direction
    devices_per_node: int = 8
    decode_mfu: float = 0.3  # convolutional VAE decoders reach less of the peak
    forward_overhead_s: float = 0.005  # per forward call (launches, Python)
    train_pass_overhead_s: float = 0.01  # per forward+backward pass
    generate_overhead_s: float = 0.05  # per generate call (batching, latents, scheduler)
    reward_overhead_s: float = 0.05  # per reward call
    # Devices that share one machine (CPU slots): extra fraction of a task's time per other busy
    # device on the machine when it starts (0: independent devices, as GPUs are).
    host_contention: float = 0.0
    system: str = "default"  # the software-stack constants (``systems:``) this device runs with
    sources: Mapping[str, str] = field(default_factory=dict)

    @property
    def flops(self) -> float:
        return self.peak_tflops * TFLOP


@dataclass(frozen=True)
class SystemProfile:
    """Constants of the software stack rather than of a device."""

    name: str = "default"
    nccl_efficiency: float = 0.8  # achieved collective bandwidth / link bandwidth
    comm_overlap: float = 0.5  # fraction of a pass's compute that hides its FSDP collectives
    switch_fixed_s: float = 1.0  # per generate <-> train switch of one worker
    optimizer_fixed_s: float = 0.1
    sync_fixed_s: float = 0.2
    grad_bytes_per_param: float = 4.0  # fp32 gradient reduce-scatter
    optimizer_bytes_per_param: float = 12.0  # fp32 master weights + Adam m and v
    memory_headroom: float = 0.9  # usable fraction of device memory
    activation_bytes: float = 34.0  # activation bytes per token per hidden unit per block
    collective_step_latency_s: float = 2e-5  # latency of one ring step of a collective
    hsdp_shard: int = 0  # 0: flat FSDP over all training ranks; k: shard over k, replicate
    task_overhead_s: float = 0.0  # the runtime's dispatch cost per task (driver -> worker -> driver)
    sources: Mapping[str, str] = field(default_factory=dict)


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
    train_device_batch: int | None = None  # samples per forward+backward pass; None: as many as fit
    gradient_checkpointing: bool | None = None  # None: the model profile's default

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


@dataclass
class Catalog:
    models: dict[str, ModelProfile] = field(default_factory=dict)
    devices: dict[str, DeviceProfile] = field(default_factory=dict)
    systems: dict[str, SystemProfile] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)

    def system(self, name: str) -> SystemProfile:
        if name not in self.systems:
            raise ProfileError(f"unknown system profile {name!r}; known: {', '.join(sorted(self.systems))}")
        return self.systems[name]

    def model(self, name: str) -> ModelProfile:
        if name not in self.models:
            raise ProfileError(f"unknown model profile {name!r}; known: {', '.join(sorted(self.models))}")
        return self.models[name]

    def device(self, name: str) -> DeviceProfile:
        if name not in self.devices:
            raise ProfileError(f"unknown device profile {name!r}; known: {', '.join(sorted(self.devices))}")
        return self.devices[name]


def _build(cls: type, name: str, data: Mapping[str, Any], path: str) -> Any:
    known = {f.name for f in fields(cls)}
    unknown = set(data) - known
    if unknown:
        raise ProfileError(f"{path}: {cls.__name__} {name!r} has unknown keys {sorted(unknown)}; valid: {sorted(known)}")
    hints = typing.get_type_hints(cls)
    values = {}
    for key, value in data.items():
        tp = hints[key]
        try:
            # YAML reads "11.9e9" (no sign in the exponent) as a string
            if tp is float and not isinstance(value, bool):
                value = float(value)
            elif tp is int and not isinstance(value, bool) and float(value) == int(float(value)):
                value = int(float(value))
        except (TypeError, ValueError):
            raise ProfileError(f"{path}: {cls.__name__} {name!r}: {key}={value!r} is not a number") from None
        values[key] = value
    try:
        return cls(name=name, **values) if "name" in known else cls(**values)
    except TypeError as e:
        raise ProfileError(f"{path}: {cls.__name__} {name!r}: {e}") from None


def load_catalog(extra: Iterable[str] = (), *, include_builtin: bool = True) -> Catalog:
    """Every profile in ``verl_digen/sim/profiles`` plus ``extra`` files (later files win).

    A profile file holds any of ``models:``, ``devices:`` and ``systems:`` (name -> fields,
    each with its ``sources``). A device names the system (software-stack constants) it uses.
    """
    import yaml

    paths = sorted(glob.glob(os.path.join(PROFILE_DIR, "*.yaml"))) if include_builtin else []
    paths += list(extra)
    cat = Catalog()
    for path in paths:
        if not os.path.isfile(path):
            raise ProfileError(f"profile file {path} does not exist")
        with open(path) as f:
            doc = yaml.safe_load(f) or {}
        for name, data in (doc.get("models") or {}).items():
            cat.models[name] = _build(ModelProfile, name, data, path)
        for name, data in (doc.get("devices") or {}).items():
            cat.devices[name] = _build(DeviceProfile, name, data, path)
        for name, data in (doc.get("systems") or {}).items():
            cat.systems[name] = _build(SystemProfile, name, data, path)
        unknown = set(doc) - {"models", "devices", "systems", "measurements"}
        if unknown:
            raise ProfileError(
                f"{path}: unknown top-level keys {sorted(unknown)}; valid: models, devices, systems, measurements"
            )
        cat.files.append(path)
    return cat


# ---------------------------------------------------------------------------- cluster


@dataclass(frozen=True)
class PoolPlacement:
    """A pool of ``size`` devices of one type spread over ``nodes`` nodes."""

    size: int
    nodes: int
    device: str


@dataclass(frozen=True)
class Cluster:
    """Where each pool sits: its device type and how many nodes it spans."""

    pools: Mapping[str, PoolPlacement]

    def placement(self, pool: str) -> PoolPlacement:
        if pool not in self.pools:
            raise KeyError(f"pool {pool!r} is not in the cluster ({', '.join(self.pools)})")
        return self.pools[pool]

    def device_of(self, worker: WorkerId) -> str:
        return self.placement(worker.pool).device

    @property
    def devices(self) -> int:
        return sum(p.size for p in self.pools.values())

    @classmethod
    def for_spec(cls, spec: StrategySpec, device: str, devices_per_node: int = 8) -> "Cluster":
        """Pack each pool onto as few nodes as possible (trainer first: it talks the most)."""

        def packed(n: int) -> PoolPlacement:
            return PoolPlacement(size=n, nodes=math.ceil(n / devices_per_node), device=device)

        if spec.placement == "colocated":
            return cls({"fused": packed(spec.rollout_workers)})
        pools = {"rollout": packed(spec.rollout_workers), "trainer": packed(spec.trainer_workers)}
        if spec.reward_workers:
            pools["reward"] = packed(spec.reward_workers)
        return cls(pools)


def training_pool(cluster: Cluster) -> str:
    return "fused" if "fused" in cluster.pools else "trainer"


# ---------------------------------------------------------------------------- the model


@dataclass(frozen=True)
class TrainGroup:
    """The training pool as FSDP sees it: ``ranks`` devices over ``nodes`` nodes; parameters
    are sharded over groups of ``shard`` ranks (``shard == ranks``: flat FSDP; fewer: HSDP,
    replicated ``ranks / shard`` times)."""

    ranks: int
    nodes: int
    shard: int
    shard_nodes: int

    @property
    def replicas(self) -> int:
        return max(1, self.ranks // self.shard)


@dataclass
class CostModel:
    model: ModelProfile
    workload: Workload
    devices: Mapping[str, DeviceProfile]
    system: SystemProfile = field(default_factory=SystemProfile)

    @classmethod
    def from_catalog(
        cls, catalog: Catalog, model: str, devices: Iterable[str] | None = None, **workload: Any
    ) -> "CostModel":
        """``workload`` overrides the model profile's defaults (any :class:`Workload` field)."""
        m = catalog.model(model)
        unknown = set(workload) - set(WORKLOAD_KEYS)
        if unknown:
            raise ProfileError(f"unknown workload keys {sorted(unknown)}; valid: {', '.join(WORKLOAD_KEYS)}")
        wl = dict(m.defaults)
        wl.update({k: v for k, v in workload.items() if v is not None})
        try:
            w = Workload(**wl)
        except TypeError as e:
            raise ProfileError(f"model {model!r} workload: {e}") from None
        names = list(devices) if devices is not None else list(catalog.devices)
        devs = {n: catalog.device(n) for n in names}
        systems = {d.system for d in devs.values()}
        if len(systems) > 1:
            raise ProfileError(f"devices {', '.join(names)} use different system profiles {sorted(systems)}")
        system = catalog.system(systems.pop()) if systems else SystemProfile()
        return cls(model=m, workload=w, devices=devs, system=system)

    def with_workload(self, **changes: Any) -> "CostModel":
        return replace(self, workload=replace(self.workload, **changes))

    def device(self, name: str) -> DeviceProfile:
        if name not in self.devices:
            raise ProfileError(f"device {name!r} is not in this cost model ({', '.join(self.devices)})")
        return self.devices[name]

    # ------------------------------------------------------------------ shapes

    def tokens(self) -> tuple[int, int]:
        """(image or video tokens, sequence length of the self-attention)."""
        m, w = self.model, self.workload
        lat_f = (w.frames - 1) // m.vae_temporal + 1 if m.video else 1
        lat_h, lat_w = w.height // m.vae_spatial, w.width // m.vae_spatial
        image = max(1, lat_f // m.patch_t) * max(1, lat_h // m.patch) * max(1, lat_w // m.patch)
        seq = image + (m.text_tokens if m.joint_text else 0)
        return image, seq

    def forward_flops(self) -> float:
        """FLOPs of one denoiser forward on one sample (one CFG branch)."""
        m = self.model
        image, seq = self.tokens()
        flops = 2.0 * m.params * seq + 4.0 * m.layers * seq * seq * m.hidden
        if not m.joint_text and m.text_tokens:
            flops += 4.0 * m.layers * image * m.text_tokens * m.hidden  # cross-attention scores/values
        return flops

    @property
    def gradient_checkpointing(self) -> bool:
        w = self.workload
        return self.model.gradient_checkpointing if w.gradient_checkpointing is None else w.gradient_checkpointing

    @property
    def train_flops_factor(self) -> float:
        """Forward-equivalents per trained sample-step: forward + backward (2x), a recomputed
        forward with activation checkpointing, a reference forward with KL."""
        return 3.0 + (1.0 if self.gradient_checkpointing else 0.0) + (1.0 if self.workload.kl else 0.0)

    @property
    def param_bytes(self) -> float:
        return 2.0 * self.model.params  # bf16

    @property
    def trainable_params(self) -> float:
        w, m = self.workload, self.model
        if w.lora:
            return m.lora_params or 2.0 * w.lora_rank * m.hidden * m.lora_linears
        return m.params

    @property
    def sync_bytes(self) -> float:
        return 2.0 * self.trainable_params  # bf16 weights (LoRA factors or the full model)

    # ------------------------------------------------------------------ the training pool

    def train_group(self, cluster: Cluster) -> TrainGroup:
        p = cluster.placement(training_pool(cluster))
        shard = self.system.hsdp_shard if 0 < self.system.hsdp_shard < p.size else p.size
        per_node = self.device(p.device).devices_per_node
        shard_nodes = 1 if shard <= per_node and p.nodes >= 1 and shard < p.size else p.nodes
        return TrainGroup(ranks=p.size, nodes=p.nodes, shard=shard, shard_nodes=shard_nodes)

    def state_bytes_per_rank(self, group: TrainGroup) -> float:
        s = self.system
        return (self.param_bytes + (s.grad_bytes_per_param + s.optimizer_bytes_per_param) * self.trainable_params) / group.shard

    def activation_bytes_per_sample(self) -> float:
        """Activations one sample keeps for its backward (both CFG branches).

        Without checkpointing every block keeps ``activation_bytes x tokens x hidden``; with
        it, only each block's bf16 input plus one block's full activations during recompute."""
        m, s = self.model, self.system
        seq = self.tokens()[1]
        per_block = s.activation_bytes * seq * m.hidden
        if self.gradient_checkpointing:
            act = 2.0 * m.layers * seq * m.hidden + per_block
        else:
            act = m.layers * per_block
        return act * self.workload.cfg_factor

    def device_batch(self, dev: DeviceProfile, group: TrainGroup) -> int:
        """Samples per forward+backward pass on one rank: the workload's value, or the most
        that fit next to the sharded training state (0: not even one fits)."""
        if self.workload.train_device_batch:
            return self.workload.train_device_batch
        free = dev.hbm_gb * GB * self.system.memory_headroom - self.state_bytes_per_rank(group)
        fit = int(free // self.activation_bytes_per_sample()) if free > 0 else 0
        cap = self.model.max_device_batch or self.workload.group_size
        return min(fit, cap)

    def collective_bw(self, device: DeviceProfile, nodes: int) -> float:
        link = device.inter_node_gbps if nodes > 1 else device.intra_node_gbps
        return link * GB * self.system.nccl_efficiency

    def fsdp_comm_seconds(self, dev: DeviceProfile, group: TrainGroup) -> float:
        """FSDP collectives of one forward+backward pass on one rank: all-gather the
        parameters for the forward and again for the backward, reduce-scatter the trainable
        gradients; one collective per block each, every ring step paying a latency."""
        k = group.shard
        if k <= 1:
            return 0.0
        s = self.system
        nbytes = 2.0 * self.param_bytes + s.grad_bytes_per_param * self.trainable_params
        latency = 3 * self.model.layers * (k - 1) * s.collective_step_latency_s
        return nbytes * (k - 1) / k / self.collective_bw(dev, group.shard_nodes) + latency

    # ------------------------------------------------------------------ per kind

    def encode_seconds(self, prompts: int, dev: DeviceProfile) -> float:
        m = self.model
        flops = 2.0 * m.text_encoder_params * m.text_encoder_tokens * prompts * self.workload.cfg_factor
        return flops / (dev.flops * dev.mfu_forward)

    def forward_seconds(self, samples: int, dev: DeviceProfile) -> float:
        """One denoiser call on ``samples`` samples (both CFG branches)."""
        flops = samples * self.workload.cfg_factor * self.forward_flops()
        return dev.forward_overhead_s + flops / (dev.flops * dev.mfu_forward)

    def decode_seconds(self, images: int, dev: DeviceProfile) -> float:
        w = self.workload
        flops = images * w.height * w.width * w.frames * self.model.decode_flops_per_pixel
        return flops / (dev.flops * dev.decode_mfu)

    def generate_seconds(
        self, images: int, dev: DeviceProfile, steps: tuple[int, int] | None = None, *, final: bool = True
    ) -> float:
        """Denoising steps ``[start, end)`` (all by default) of ``images`` samples; prompts are
        encoded by the stage that starts at step 0, latents decoded by the ``final`` one."""
        w = self.workload
        start, end = steps if steps is not None else (0, w.num_steps)
        if not 0 <= start < end <= w.num_steps:
            raise ValueError(f"denoise steps {(start, end)} outside [0, {w.num_steps}] (workload num_steps)")
        t = dev.generate_overhead_s + (end - start) * self.forward_seconds(images, dev)
        if start == 0:
            t += self.encode_seconds(math.ceil(images / w.group_size), dev)
        if final:
            t += self.decode_seconds(images, dev)
        return t

    def reward_seconds(self, images: int, dev: DeviceProfile) -> float:
        return dev.reward_overhead_s + images * self.model.reward_flops_per_image / (dev.flops * dev.mfu_forward)

    def train_pass_seconds(self, samples: int, dev: DeviceProfile, group: TrainGroup) -> float:
        w = self.workload
        compute = dev.train_pass_overhead_s + self.train_flops_factor * samples * w.cfg_factor * self.forward_flops() / (
            dev.flops * dev.mfu_train
        )
        comm = self.fsdp_comm_seconds(dev, group)
        return compute + max(0.0, comm - self.system.comm_overlap * compute)

    def train_seconds(self, images: int, dev: DeviceProfile, group: TrainGroup, trained_steps: int | None = None) -> float:
        k = self.workload.trained_steps if trained_steps is None else trained_steps
        b = max(1, self.device_batch(dev, group))  # an infeasible batch is reported by memory_problems
        full, rest = divmod(images, b)
        per_step = full * self.train_pass_seconds(b, dev, group)
        if rest:
            per_step += self.train_pass_seconds(rest, dev, group)
        return k * per_step

    def optimizer_seconds(self, dev: DeviceProfile, group: TrainGroup) -> float:
        s = self.system
        shard = self.trainable_params / group.shard
        # read + write fp32 master, m, v and the gradient of the local shard
        t = s.optimizer_fixed_s + 2.0 * (s.optimizer_bytes_per_param + s.grad_bytes_per_param) * shard / (dev.hbm_tbps * 1e12)
        if group.replicas > 1:  # HSDP: all-reduce the gradient shards across replicas once per step
            r = group.replicas
            t += 2.0 * (r - 1) / r * s.grad_bytes_per_param * shard / self.collective_bw(dev, 2)
        return t

    def sync_seconds(self, cluster: Cluster) -> float:
        tp = cluster.placement("trainer")
        dev = self.device(tp.device)
        group = self.train_group(cluster)
        gather = 0.0
        if group.shard > 1:  # trainer 0 gathers the FSDP shards of the trainable weights
            gather = self.sync_bytes * (group.shard - 1) / group.shard / self.collective_bw(dev, group.shard_nodes)
        rollout = cluster.placement("rollout")
        ends = (dev, self.device(rollout.device))
        # one node holds both pools only when they fit in it together
        same_node = tp.nodes == 1 and rollout.nodes == 1 and tp.size + rollout.size <= dev.devices_per_node
        link = min(d.intra_node_gbps if same_node else d.inter_node_gbps for d in ends)
        # a pipelined broadcast costs about bytes / bandwidth whatever the number of receivers
        return self.system.sync_fixed_s + gather + self.sync_bytes / (link * GB * self.system.nccl_efficiency)

    def switch_seconds(self, to_mode: str, dev: DeviceProfile, group: TrainGroup) -> float:
        """A worker turning from generating into training (or back)."""
        s = self.system
        opt_state = s.optimizer_bytes_per_param * self.trainable_params / group.shard
        host = dev.host_link_gbps * GB
        if to_mode == MODE_GENERATE:
            # gather the new full weights for the rollout engine, park the optimizer state
            k = group.shard
            gather = self.param_bytes * (k - 1) / k / self.collective_bw(dev, group.shard_nodes) if k > 1 else 0.0
            return s.switch_fixed_s + gather + opt_state / host
        # free the rollout weights, bring the optimizer state back
        return s.switch_fixed_s + opt_state / host

    # ------------------------------------------------------------------ tasks

    @staticmethod
    def mode_of(task: Task, worker: WorkerId) -> str | None:
        """The mode a worker must be in to run ``task`` (None: either)."""
        if task.kind == TaskKind.GENERATE:
            return MODE_GENERATE
        if task.kind in (TaskKind.TRAIN, TaskKind.OPTIMIZER_STEP):
            return MODE_TRAIN
        if task.kind == TaskKind.SYNC and worker.pool == "trainer":
            return MODE_TRAIN
        return None

    @staticmethod
    def initial_mode(worker: WorkerId) -> str:
        return MODE_TRAIN if worker.pool == "trainer" else MODE_GENERATE

    def contention_factor(self, worker: WorkerId, cluster: Cluster, busy_others: int) -> float:
        """Slow-down of a task that starts while ``busy_others`` other devices of the same
        machine are busy (only devices with ``host_contention``, i.e. CPU slots)."""
        dev = self.device(cluster.device_of(worker))
        return 1.0 + dev.host_contention * busy_others

    def trained_steps_of(self, task: Task) -> int:
        """Trained time steps a TRAIN task computes (its share under a time-step split)."""
        k = self.workload.trained_steps
        part = getattr(task, "train_part", None)
        if part is None:
            return k
        p, parts = part
        return len(range(p, k, parts))

    def step_profile(self, dev: DeviceProfile, images: int) -> dict[str, Any]:
        """Per-denoising-step seconds of a generate call and its head and tail (what TSP's
        stage balancing measures on a real rollout worker)."""
        w = self.workload
        return {
            "step_s": [self.forward_seconds(images, dev)] * w.num_steps,
            "head_s": dev.generate_overhead_s + self.encode_seconds(math.ceil(images / w.group_size), dev),
            "tail_s": self.decode_seconds(images, dev),
        }

    def task_seconds(
        self, task: Task, worker: WorkerId, cluster: Cluster, *, switch_from: str | None = None
    ) -> float:
        """Seconds ``worker`` is busy with ``task``; a mode switch is added when ``switch_from``
        is the worker's current mode and the task needs the other one."""
        dev = self.device(cluster.device_of(worker))
        images = task.images or len(task.groups) * self.workload.group_size
        if task.kind == TaskKind.GENERATE:
            t = self.generate_seconds(images, dev, getattr(task, "denoise", None), final=getattr(task, "final", True))
        elif task.kind == TaskKind.REWARD:
            t = self.reward_seconds(images, dev)
        elif task.kind == TaskKind.TRAIN:
            t = self.train_seconds(images, dev, self.train_group(cluster), self.trained_steps_of(task))
        elif task.kind == TaskKind.OPTIMIZER_STEP:
            t = self.optimizer_seconds(dev, self.train_group(cluster))
        elif task.kind == TaskKind.SYNC:
            t = self.sync_seconds(cluster)
        else:  # pragma: no cover - TaskKind is closed
            raise ValueError(task.kind)
        to = self.mode_of(task, worker)
        if switch_from is not None and to is not None and to != switch_from:
            t += self.switch_seconds(to, dev, self.train_group(cluster))
        return t + self.system.task_overhead_s

    # ------------------------------------------------------------------ planning and bounds

    def step_costs(self, spec: StrategySpec, cluster: Cluster) -> StepCosts:
        """Per-group costs for the planner's look-ahead decisions (no switches)."""
        G = spec.group_size
        gen_dev = self.device(cluster.device_of(spec.generators[0]))
        tr_dev = self.device(cluster.device_of(spec.trainers[0]))
        group = self.train_group(cluster)
        return StepCosts(
            generate_per_group=self.generate_seconds(G * spec.groups_per_task, gen_dev) / spec.groups_per_task,
            reward_per_group=self.reward_seconds(G, gen_dev),
            train_per_group=self.train_seconds(G * spec.train_micro_batch_groups, tr_dev, group)
            / spec.train_micro_batch_groups,
            optimizer_step=self.optimizer_seconds(tr_dev, group),
            sync=self.sync_seconds(cluster) if spec.placement == "disaggregated" else 0.0,
        )

    def device_seconds_per_image(self, dev: DeviceProfile) -> dict[str, float]:
        """The least device time one image can take on ``dev``: its FLOPs at the device's
        efficiency, without overheads, collectives or switches (what the bound charges)."""
        w = self.workload
        fwd = w.cfg_factor * self.forward_flops()
        generate = w.num_steps * fwd / (dev.flops * dev.mfu_forward)
        generate += self.encode_seconds(1, dev) / w.group_size + self.decode_seconds(1, dev)
        reward = self.model.reward_flops_per_image / (dev.flops * dev.mfu_forward)
        train = w.trained_steps * self.train_flops_factor * fwd / (dev.flops * dev.mfu_train)
        return {"generate": generate, "reward": reward, "train": train}

    def zero_bubble_bound(self, devices: Iterable[str]) -> float:
        """Images/s no schedule on ``devices`` can beat: devices / device-seconds per image.

        Every image must be generated, rewarded and trained; with several device types the
        fastest one's per-image time is charged for all (still an upper bound)."""
        names = list(devices)
        if not names:
            return 0.0
        per_image = min(sum(self.device_seconds_per_image(self.device(n)).values()) for n in set(names))
        return len(names) / per_image

    # ------------------------------------------------------------------ memory

    def memory_problems(self, cluster: Cluster, *, trainers_generate: bool = False) -> list[str]:
        """Why this placement does not fit in device memory (empty: it fits).

        ``trainers_generate`` (TAG): a trainer also holds the full weights while it generates."""
        problems = []
        train_pool = training_pool(cluster)
        group = self.train_group(cluster)
        for pool, p in cluster.pools.items():
            dev = self.device(p.device)
            cap = dev.hbm_gb * GB * self.system.memory_headroom
            if pool in ("rollout", "fused") and self.param_bytes > cap:
                problems.append(f"{pool}: {self.param_bytes / GB:.0f} GB of weights exceed {cap / GB:.0f} GB on {dev.name}")
            if pool == "trainer" and trainers_generate and self.param_bytes + self.state_bytes_per_rank(group) > cap:
                problems.append(
                    f"trainer: generating (TAG) needs the full {self.param_bytes / GB:.0f} GB of weights next to "
                    f"{self.state_bytes_per_rank(group) / GB:.0f} GB of training state on {dev.name}"
                )
            if pool == train_pool and self.device_batch(dev, group) < 1:
                state = self.state_bytes_per_rank(group)
                act = self.activation_bytes_per_sample()
                problems.append(
                    f"{pool}: {state / GB:.0f} GB of training state per rank ({group.shard}-way sharded) + "
                    f"{act / GB:.0f} GB of activations for one sample exceed {cap / GB:.0f} GB on {dev.name}"
                )
        return problems

    def describe(self, cluster: Cluster | None = None) -> dict[str, Any]:
        image, seq = self.tokens()
        out = {
            "model": self.model.name,
            "workload": asdict(self.workload),
            "image_tokens": image,
            "sequence_tokens": seq,
            "forward_tflops_per_sample": self.forward_flops() / TFLOP,
            "gradient_checkpointing": self.gradient_checkpointing,
            "trainable_params": self.trainable_params,
            "sync_gb": self.sync_bytes / GB,
            "activation_gb_per_sample": self.activation_bytes_per_sample() / GB,
        }
        if cluster is not None:
            group = self.train_group(cluster)
            dev = self.device(cluster.placement(training_pool(cluster)).device)
            out["train_device_batch"] = self.device_batch(dev, group)
            out["state_gb_per_rank"] = self.state_bytes_per_rank(group) / GB
        return out


# ---------------------------------------------------------------------------- fixed costs


@dataclass
class TableCostModel:
    """Fixed seconds per task kind (plus per image), for hand-computed timelines, tests and
    the emulated runtime's self-check. Same interface as :class:`CostModel`.

    ``seconds[kind] + per_image[kind] * images``; ``switch`` is added when a worker changes
    between generating and training (0 disables it).
    """

    seconds: Mapping[str, float]
    per_image: Mapping[str, float] = field(default_factory=dict)
    switch: float = 0.0
    group_size: int = 1

    mode_of = staticmethod(CostModel.mode_of)
    initial_mode = staticmethod(CostModel.initial_mode)

    def task_seconds(
        self, task: Task, worker: WorkerId, cluster: Cluster | None = None, *, switch_from: str | None = None
    ) -> float:
        kind = task.kind.value
        images = task.images or len(task.groups) * self.group_size
        t = self.seconds.get(kind, 0.0) + self.per_image.get(kind, 0.0) * images
        to = self.mode_of(task, worker)
        if self.switch and switch_from is not None and to is not None and to != switch_from:
            t += self.switch
        return t

    def step_costs(self, spec: StrategySpec, cluster: Cluster | None = None) -> StepCosts:
        def per_group(kind: str, groups: int) -> float:
            return (self.seconds.get(kind, 0.0) + self.per_image.get(kind, 0.0) * groups * spec.group_size) / groups

        return StepCosts(
            generate_per_group=per_group("generate", spec.groups_per_task),
            reward_per_group=per_group("reward", spec.groups_per_task),
            train_per_group=per_group("train", spec.train_micro_batch_groups),
            optimizer_step=self.seconds.get("optimizer_step", 0.0),
            sync=self.seconds.get("sync", 0.0),
        )

    def zero_bubble_bound(self, devices: Iterable[str]) -> float:
        """Devices over the per-image share of the generate, reward and train work (no
        fixed per-task share: a schedule could batch everything into one task)."""
        per_image = sum(self.per_image.get(k, 0.0) for k in ("generate", "reward", "train"))
        n = len(list(devices))
        return n / per_image if per_image > 0 else math.inf
