"""The diffusion worker: one veRL ``Worker`` class, four roles.

- ``fused``   (colocated): generates, scores and trains with one copy of the weights;
- ``rollout`` (disaggregated): generates (and scores when there is no reward pool),
  receives weights from the trainer;
- ``trainer`` (disaggregated): trains, steps the optimizer, sends weights;
- ``reward``  (disaggregated): scores images.

Like veRL's ``ActorRolloutRefWorker(role=...)``, the role decides what is built in
``init_model``: one table, :data:`ROLE_CAPABILITIES`, says which of loading the policy,
preparing training and building the reward each role does. The task methods take and return
the typed messages of :mod:`verl_digen.workers.messages`. ``init_model`` is registered with
veRL's ``@register`` so a ``RayWorkerGroup`` can broadcast it (``ONE_TO_ALL``); the plan executor
calls the task methods on single actors (``wg.workers[i].generate.remote(...)``), which is how
tasks land on the worker a plan names.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from verl import DataProto
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register
from verl_digen.config.schema import ConfigError, DigenConfig
from verl_digen.memory.measure import interval_peaks, max_peaks
from verl_digen.sim.deadlines import Deadlines
from verl_digen.sync.snapshot import HostSnapshot, WeightsDigest, weights_digest
from verl_digen.sync.state import trainable_state
from verl_digen.sync.buckets import DEFAULT_BUCKET_BYTES
from verl_digen.sync.transport import WeightSyncMixin
from verl_digen.workers.messages import (
    GenerateRequest,
    Gradients,
    check_assisted_gradients,
    OptimizerRequest,
    OptimizerResult,
    RewardResult,
    SyncResult,
    TrainRequest,
    TrainResult,
)
from verl_digen.workers.sampling import (
    GroupRequest,
    GroupsInFlight,
    SamplingSettings,
    begin_groups,
    denoise,
    finish_groups,
    rank_rows,
)
from verl_digen.workers.training import PolicyUpdater, TrainSettings, add_lora


@dataclass(frozen=True)
class RoleCapabilities:
    """What :meth:`DiffusionWorker.init_model` builds for a role.

    ``policy``: loads the denoiser (to generate, train, or both); ``trains``: the training state
    (process group, gradient checkpointing, KL reference, FSDP, the updater); ``scores``: builds
    the reward; ``scores_without_reward_pool``: builds it when no reward pool exists (it
    scores what it generates); ``scores_when_generating``: builds it when the role generates
    part of a step (TAG) and no reward pool exists; ``assists_training``: builds a gradient-only
    updater when ``digen.gat.enable`` (GAT: it trains micro-batches the trainers then step
    on); ``offloads``: what stays on CPU between uses
    on a GPU (``"text_encoders"``, ``"vae"``); ``generates``: a generating role, whose text
    encoders stay on the GPU or on CPU as ``digen.model.offload_text_encoders`` (decided by the
    memory plan before Ray starts) says."""

    policy: bool
    trains: bool
    scores: bool
    scores_without_reward_pool: bool = False
    scores_when_generating: bool = False
    offloads: tuple[str, ...] = ()
    generates: bool = False
    assists_training: bool = False


ROLE_CAPABILITIES: dict[str, RoleCapabilities] = {
    "fused": RoleCapabilities(policy=True, trains=True, scores=True, generates=True),
    "rollout": RoleCapabilities(policy=True, trains=False, scores=False, scores_without_reward_pool=True,
                                generates=True, assists_training=True),
    # Trainers decode only for validation or TAG: the VAE waits on CPU too.
    "trainer": RoleCapabilities(policy=True, trains=True, scores=False, scores_when_generating=True,
                                offloads=("text_encoders", "vae")),
    "reward": RoleCapabilities(policy=False, trains=False, scores=True),
}
ROLES = tuple(ROLE_CAPABILITIES)


def offloaded_parts(caps: RoleCapabilities, cfg: DigenConfig) -> tuple[str, ...]:
    """What a worker of ``caps`` keeps on CPU between uses on a GPU: the role's fixed offloads,
    plus a generating role's text encoders when ``digen.model.offload_text_encoders`` is true
    (``auto`` is decided before Ray starts; left undecided, e.g. the built-in tiny models, they
    stay resident). The memory plan charges the same (``memory.plan``: ``encoders_offloaded``)."""
    if caps.generates and cfg.model.encoders_offloaded:
        return (*caps.offloads, "text_encoders")
    return caps.offloads


def sampling_settings(cfg: DigenConfig, fsdp_ranks: int = 1, rollout_lanes: int = 1) -> SamplingSettings:
    """The sampling settings of a run; ``fsdp_ranks``: the training ranks a micro-batch is
    sharded over (1 without FSDP), and ``rollout_lanes``: the rollout workers (TSP: pipelines)
    the planner spreads each step's groups over; together they fix the rows of every
    transformer call."""
    from verl_digen.schedule.strategies import pass_rows
    from verl_digen.models.base import SampleSpec
    from verl_digen.rewards.custom import reward_wants_latents

    s = cfg.sampling
    return SamplingSettings(
        spec=SampleSpec(
            height=s.height,
            width=s.width,
            num_frames=s.num_frames,
            guidance_scale=s.guidance_scale,
            distilled_guidance=s.distilled_guidance,
        ),
        num_steps=s.num_steps,
        noise_level=s.noise_level,
        sde_type=s.sde_type,
        window=dataclasses.replace(s.sde_window),
        timestep_fraction=s.timestep_fraction,
        negative_prompt=s.negative_prompt,
        time_shift=s.time_shift,
        same_initial_noise=s.same_initial_noise,
        keep_final_latents=reward_wants_latents(cfg.reward.as_spec()),
        vae_decode_chunk=cfg.model.vae_decode_chunk,
        forward_rows=pass_rows(
            cfg.batch.group_size, cfg.batch.train_micro_batch_groups, fsdp_ranks,
            cfg.batch.groups_per_step, cfg.batch.groups_per_task, rollout_lanes,
            cfg.units.fixed_sample_slices, cfg.units.train_slices, cfg.batch.train_micro_batch_rows,
        ),
    )


def configure_attention_kernels() -> None:
    """Keep cuDNN's fused attention out of ``scaled_dot_product_attention``, process-wide.

    On an H100 with torch 2.11 / CUDA 13, SDPA picks cuDNN's fused attention for the bf16
    transformers, and its backward failed on real-size FLUX (``mha_graph.execute(...)
    .is_good()``, then an illegal memory access that poisons the CUDA context: measured by
    ``python -m verl_digen.gpu_check``, docs/results_gpu.md). Flash / memory-efficient
    attention run instead. A process-wide flag, not a context manager: activation checkpointing
    recomputes the forward during ``backward()``, outside any ``with`` block of the forward,
    and rollout and trainer processes must pick the same kernels for the same calls (on-policy
    log-probs)."""
    torch.backends.cuda.enable_cudnn_sdp(False)


def compute_device() -> torch.device:
    """The worker's device (the current CUDA device, else the CPU), with the attention kernels
    every transformer call of the run uses (:func:`configure_attention_kernels`)."""
    configure_attention_kernels()
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_process_group_retrying(*, attempts: int = 30, wait_s: float = 2.0, **kwargs: Any) -> None:
    """``dist.init_process_group`` from the environment (``MASTER_ADDR`` / ``MASTER_PORT``), with
    rank 0 trying again while the port is in use.

    veRL's worker group picks ``MASTER_PORT`` when it creates rank 0 (a port the OS had free then)
    and every rank reads it at ``init_model``, after loading the model: on a busy machine another
    process can hold that port meanwhile, most often as the local end of a short-lived connection
    (a CI run failed so: ``EADDRINUSE``). Rank 0 waits for it for ``attempts x wait_s`` seconds;
    the other ranks already keep trying to reach the store. A port held longer is an error that
    names it."""
    for attempt in range(attempts):
        try:
            dist.init_process_group(**kwargs)
            return
        except dist.DistNetworkError as e:
            if "EADDRINUSE" not in str(e):
                raise
            if attempt == attempts - 1:
                raise RuntimeError(
                    f"the trainer ranks' rendezvous port MASTER_PORT={os.environ.get('MASTER_PORT')} on "
                    f"{os.environ.get('MASTER_ADDR')} stayed in use by another process for "
                    f"{attempts * wait_s:.0f} s; start the run again (veRL picks a new port)") from e
            time.sleep(wait_s)


def rendezvous_store(*, rank: int, world_size: int, port: int | None, timeout_s: float) -> dist.TCPStore | None:
    """The store of a trainer group's process group on a port handed out by the driver: rank 0's
    listens on a port the OS assigns at bind time (``port`` None; its ``.port`` is what the driver
    hands the other ranks), every other rank connects to ``port``. None for a rank given no port
    (then the group meets at veRL's ``MASTER_PORT``, :func:`init_process_group_retrying`).

    Why not veRL's ``MASTER_PORT``: veRL picks it when it creates the group, as a port free at that
    moment, and the ranks bind it only at ``init_model``, after loading the model; a port the OS
    assigns when rank 0 binds it cannot be taken in between (a CI run failed with ``EADDRINUSE``)."""
    from datetime import timedelta

    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    timeout = timedelta(seconds=timeout_s)
    if rank == 0:
        return dist.TCPStore(host, 0, world_size, is_master=True, wait_for_workers=False, timeout=timeout)
    if port is None:
        return None
    return dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)


def reward_device(setting: str, worker_device: torch.device) -> torch.device:
    """Where the reward model of a worker on ``worker_device`` runs (``digen.reward.device``):
    ``auto`` there (a GPU worker scores on its GPU, so a reward pool's GPUs are used), ``cpu``
    on CPU, ``cuda`` there too, refused when the worker has no GPU (it would not fall back
    silently)."""
    if setting == "cpu":
        return torch.device("cpu")
    if setting == "cuda" and worker_device.type != "cuda":
        raise ConfigError(
            f"invalid config: digen.reward.device='cuda' but this worker runs on {worker_device} (no GPU visible "
            "to it); use digen.reward.device=auto or cpu, or give the worker a GPU"
        )
    if setting not in ("auto", "cuda"):
        raise ConfigError(f"invalid config: digen.reward.device={setting!r}; one of auto, cpu, cuda")
    return worker_device


class DiffusionWorker(Worker, WeightSyncMixin):
    """A worker of one role (:data:`ROLE_CAPABILITIES`); its task methods are
    :class:`~verl_digen.workers.messages.WorkerTasks`."""

    def __init__(self, role: str, config: DigenConfig, model_path: str, num_threads: int = 1) -> None:
        """``config``: the driver's validated :class:`DigenConfig` (it pickles through Ray)."""
        super().__init__()
        if role not in ROLES:
            raise ValueError(f"unknown worker role {role!r}; valid: {', '.join(ROLES)}")
        if not isinstance(config, DigenConfig):
            raise TypeError(
                f"DiffusionWorker takes a DigenConfig, got {type(config).__name__} "
                "(verl_digen.config.digen_config_from_dict builds one from the digen mapping)"
            )
        self.role = role
        self.cfg = config
        self.model_path = model_path
        self.num_threads = num_threads
        self.policy_version = 0
        self.adapter = None
        self.updater: PolicyUpdater | None = None
        self.reward_fn = None
        self._pg: dist.ProcessGroup | None = None
        self._store: dist.TCPStore | None = None  # the trainer group's rendezvous (open_rendezvous)
        self.fsdp = ROLE_CAPABILITIES[role].trains and config.fsdp.enable
        self._snapshot: HostSnapshot | None = None  # FSDP rank 0 / the sender: this version on the host
        self._sync_digest: str | None = None  # FSDP ranks other than 0, after a checkpoint load
        # The weights version the last full-state stream carried (every FSDP rank alike). Only a
        # disaggregated run streams every version (trainer 0 sends each); a colocated one streams
        # when the full state is read (refresh_full_state), not tens of GB to the host per step.
        self._streamed_version: int | None = None
        self._stream_every_version = self.fsdp and config.placement == "disaggregated"
        # How long each blocking call may wait: the plan's (set_deadlines, before init_model);
        # digen.task_timeout_s for every call until then (tools and tests that build a worker).
        self.deadlines = Deadlines.floor(config.task_timeout_s)

    # ------------------------------------------------------------------ set-up

    def set_deadlines(self, deadlines: Deadlines) -> None:
        """The run's deadlines (:func:`verl_digen.sim.deadlines.plan_deadlines`, on the driver),
        before :meth:`open_rendezvous`: the trainer group's and the weight send's waits follow them."""
        self.deadlines = deadlines

    def _store_timeout_s(self) -> float:
        """The trainer group's store: ranks meet there as each finishes loading (a load's
        deadline), and the process group's collectives use it after (theirs)."""
        return max(self.deadlines.load_s, self.deadlines.collective_s)

    def open_rendezvous(self) -> int | None:
        """Rank 0 of a group that will join a process group (:meth:`_join_trainer_group`): open
        the group's store now, on a port the OS assigns, and return it for the driver to hand to
        every rank's :meth:`init_model`; None on every other worker."""
        if self.rank != 0 or not self._joins_trainer_group() or dist.is_initialized():
            return None
        if self._store is None:
            self._store = rendezvous_store(rank=0, world_size=self.world_size, port=None,
                                           timeout_s=self._store_timeout_s())
        return self._store.port

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self, rendezvous_port: int | None = None) -> dict[str, Any]:
        """Build what this worker's role needs (:data:`ROLE_CAPABILITIES`), in this order: the
        policy, then the training state, then the reward. Returns a record of what was built
        (the run's ``workers.json``). ``rendezvous_port``: the port rank 0's
        :meth:`open_rendezvous` returned, for a rank of its group (None: veRL's ``MASTER_PORT``)."""
        torch.set_num_threads(self.num_threads)
        import ray

        if rendezvous_port is not None and self.rank != 0:
            self._store = rendezvous_store(rank=self.rank, world_size=self.world_size, port=rendezvous_port,
                                           timeout_s=self._store_timeout_s())

        caps = ROLE_CAPABILITIES[self.role]
        info: dict[str, Any] = {"role": self.role, "rank": self.rank, "pid": os.getpid(),
                                "node_id": ray.get_runtime_context().get_node_id()}
        if caps.policy:
            info.update(self._load_policy(caps))
        if caps.trains:
            info.update(self._prepare_training())
        elif caps.assists_training and self.cfg.gat.enable:
            info.update(self._prepare_assisting())
        if self._scores_in_training(caps):
            info["reward_device"] = str(self._build_reward())
        # against memory.plan's load phase and host RAM; the device's peaks reset, so that the
        # first step's figures (memory/<pool>/*) are of the step, not of the load
        info["memory_at_load"] = interval_peaks(compute_device())
        return info

    def _load_policy(self, caps: RoleCapabilities) -> dict[str, Any]:
        """Load the denoiser (with LoRA when on) in the run's dtype, the sampling settings, and
        move what the role uses rarely off the GPU."""
        from verl_digen.models.base import resolve_dtype
        from verl_digen.models.registry import load_adapter

        cfg = self.cfg
        device = compute_device()
        # One precision path for rollout and trainer: weights in the run's dtype, LoRA (and
        # full fine-tune masters) in the trainable dtype, no autocast anywhere.
        dtype = resolve_dtype(cfg.model.dtype, device)
        self.trainable_dtype = resolve_dtype(cfg.model.trainable_dtype, device, key="digen.model.trainable_dtype")
        self.adapter = load_adapter(self.model_path, cfg.model.arch, device=device, dtype=dtype,
                                    max_sequence_length=cfg.model.max_sequence_length)
        if cfg.model.lora.enable:
            add_lora(self.adapter, cfg.model.lora, dtype=self.trainable_dtype)
        self.sync_module = self.adapter.transformer
        self.sync_lora_only = cfg.model.lora.enable
        # a fused worker's group is the whole cluster; pool workers read their pools from the config
        self.settings = sampling_settings(cfg, cfg.fsdp_ranks(self.world_size), cfg.rollout_lanes(self.world_size))
        if not caps.trains:  # generates only: weights change by sync, never by gradients
            self.adapter.transformer.requires_grad_(False).eval()
        vae = getattr(self.adapter, "vae", None)
        if self.settings.spec.num_frames > 1 and hasattr(vae, "enable_tiling"):
            vae.enable_tiling()  # video decodes tile by tile (diffusers' tiled VAE decode)
        info: dict[str, Any] = {}
        offloads = offloaded_parts(caps, self.cfg)
        if device.type == "cuda" and offloads:
            # Trainers keep the text encoders and the VAE (they decode only for validation or TAG)
            # on CPU between uses; generating roles their encoders when the memory plan says so.
            names = tuple(n for part in offloads for n in self._module_names(part))
            info["offloaded_bytes"] = self.adapter.offload_to_cpu(names)
        info["device"] = str(device)
        info["dtype"] = str(dtype).removeprefix("torch.")
        info["params"] = sum(p.numel() for p in self.adapter.transformer.parameters())
        return info

    def _module_names(self, part: str) -> tuple[str, ...]:
        """The adapter's modules of one offload entry of :class:`RoleCapabilities`."""
        return self.adapter.text_encoder_names if part == "text_encoders" else (part,)

    def _prepare_training(self) -> dict[str, Any]:
        """Join the trainer ranks' process group, then gradient checkpointing, FSDP sharding (and a
        full fine-tune's KL reference, built from the shards), then the :class:`PolicyUpdater`
        (its optimizer is built after sharding)."""
        info: dict[str, Any] = {}
        joined = self._join_trainer_group()
        if joined is not None:
            info["rendezvous"] = joined
        if self.cfg.model.checkpointing:  # decided before Ray starts when it was auto (trainer/resolve.py)
            from verl_digen.workers.fsdp import enable_gradient_checkpointing

            info["gradient_checkpointing"] = enable_gradient_checkpointing(self.adapter.transformer)
        reference = self._shard_for_training() if self.fsdp else None
        if self.fsdp and self.cfg.fsdp.param_offload:
            # The shards now live on the host; the forward, backward and sampling run on this
            # worker's device (FSDP2 moves the root's inputs there), and so must the rest.
            self.adapter.compute_device = compute_device()
        self.updater = PolicyUpdater(self.adapter, self._train_settings(), reference=reference)
        info["trainable_params"] = sum(p.numel() for p in self.updater.params)
        if self._stream_every_version:  # the sender's version 0 (open_weight_channel compares digests)
            self._refresh_sync_cache()
        return info

    def _prepare_assisting(self) -> dict[str, Any]:
        """GAT: the trainers' loss and passes on this rollout worker, for gradients only: no
        process group, no EMA, and an optimizer that never steps (AdamW allocates no state until
        it does). Gradient checkpointing as the trainers have it, so a pass computes exactly
        what theirs would (the memory plan charges this role a train phase)."""
        info: dict[str, Any] = {}
        if self.cfg.model.checkpointing:
            from verl_digen.workers.fsdp import enable_gradient_checkpointing

            info["gradient_checkpointing"] = enable_gradient_checkpointing(self.adapter.transformer)
        settings = dataclasses.replace(self._train_settings(), ema_decay=None, optimizer_offload=False)
        self.updater = PolicyUpdater(self.adapter, settings)
        self.adapter.transformer.eval()
        info["assists_training"] = sum(p.numel() for p in self.updater.params)
        return info

    def _join_trainer_group(self) -> str | None:
        """The trainer ranks' default process group, when there is more than one rank or FSDP
        (FSDP2 shards over the default group's mesh, so one sharded rank needs a group of one).
        On CUDA the group is bound to this worker's GPU (device_id: NCCL's communicator is
        created eagerly, on the right device, instead of at the first collective). Returns where
        the group met (``workers.json``), None for a worker that joins none."""
        if not self._joins_trainer_group():
            return None
        cuda = torch.cuda.is_available()
        how = "joined before"
        if not dist.is_initialized():
            # Without timeout= the group keeps NCCL's 10 minutes (gloo's 30), whatever the run's
            # deadlines say; a rank may wait that long in a collective while trainer 0 joins the
            # last weight send (a whole rollout phase under TCSS): the plan's collective deadline.
            extra: dict[str, Any] = {"timeout": timedelta(seconds=self.deadlines.collective_s)}
            if cuda:
                extra["device_id"] = compute_device()
            backend = "nccl" if cuda else "gloo"
            if cuda and self.cfg.fsdp.param_offload:
                # FSDP2's host offload keeps gradients on the host: their norm (clipping) is a
                # collective over host tensors, which NCCL cannot run; gloo takes those.
                backend = "cpu:gloo,cuda:nccl"
            if self._store is not None:  # the driver's rendezvous (open_rendezvous)
                dist.init_process_group(backend=backend, store=self._store, rank=self.rank,
                                        world_size=self.world_size, **extra)
                how = f"port {self._store.port} (the OS's choice, from rank 0)"
            else:
                init_process_group_retrying(backend=backend, rank=self.rank, world_size=self.world_size, **extra)
                how = f"MASTER_PORT {os.environ.get('MASTER_PORT')}"
        self._pg = dist.group.WORLD
        return how

    def _joins_trainer_group(self) -> bool:
        return ROLE_CAPABILITIES[self.role].trains and (self.world_size > 1 or self.fsdp)

    def _shard_for_training(self) -> torch.nn.Module | None:
        """FSDP2: shard the denoiser (parallelism applied in one place) and return a full
        fine-tune's frozen KL reference, built from the policy's shards (never a second dense copy
        on the GPU: :func:`~verl_digen.workers.fsdp.shard_with_reference`); None otherwise (LoRA
        disables its adapters instead; without a KL term there is none).

        The mesh and the reduction dtype are the group's layout (``digen.fsdp.mesh`` and
        ``reduce_dtype`` applied to the Ray nodes its ranks run on: HSDP, one replica per node,
        when they span several with as many on each), the one the memory planner and the cost
        model charge (:mod:`verl_digen.memory.fsdp_layout`)."""
        import ray

        from verl_digen.models.base import resolve_dtype
        from verl_digen.workers.fsdp import group_layout, reduce_torch_dtype, shard_with_reference, training_mesh

        self._check_fsdp_trainable_dtypes()
        lora = self.cfg.model.lora.enable
        weights = resolve_dtype(self.cfg.model.dtype, compute_device())
        self.fsdp_layout = group_layout(ray.get_runtime_context().get_node_id(), mesh=self.cfg.fsdp.mesh,
                                        reduce=self.cfg.fsdp.reduce_dtype, lora=lora,
                                        weights_dtype="bf16" if weights == torch.bfloat16 else "fp32")
        kl_reference = self.cfg.algo.kl_beta > 0 and not lora
        return shard_with_reference(self.adapter.transformer, reshard_after_forward=self.cfg.fsdp.reshard_after_forward,
                                    cpu_offload=self.cfg.fsdp.param_offload, mesh=training_mesh(self.fsdp_layout, self.deadlines.collective_s),
                                    reduce_dtype=reduce_torch_dtype(self.fsdp_layout), reference=kl_reference)

    def _train_settings(self) -> TrainSettings:
        """What the updater needs of the run: the loss, the sampler's settings (it recomputes the
        rollout's transformer calls), the trained parameters and their dtype, EMA."""
        cfg = self.cfg
        return TrainSettings(
            algo=cfg.algo,
            sampling=self.settings,
            lora_only=cfg.model.lora.enable,
            images_per_step=cfg.batch.images_per_optimizer_step,
            ema_decay=cfg.ema.decay if cfg.ema.enable else None,
            ema_offload=cfg.ema.offload,
            trainable_dtype=self.trainable_dtype,
            optimizer_offload=cfg.optimizer_offloaded,
        )

    def _scores_in_training(self, caps: RoleCapabilities) -> bool:
        """Whether this worker scores training samples (and so holds the reward model on its
        device from the start): the memory planner charges the reward on the same roles."""
        no_pool = self.cfg.pools.reward.devices == 0
        return caps.scores or (caps.scores_without_reward_pool and no_pool) or (
            caps.scores_when_generating and self._generates_without_reward_pool())

    def _generates_without_reward_pool(self) -> bool:
        """Trainers generate part of a step under TAG; they score it when no reward pool exists."""
        return self.cfg.tag.enable and self.cfg.pools.reward.devices == 0

    def _check_fsdp_trainable_dtypes(self) -> None:
        """FSDP2 reduce-scatters one unit's gradients in one dtype: every trained parameter of a
        block must share a dtype (a bf16 full fine-tune of a model that keeps some block
        parameters in fp32, like Wan, does not qualify)."""
        from verl_digen.workers.fsdp import block_modules

        lora = self.cfg.model.lora.enable
        blocks = block_modules(self.adapter.transformer)
        in_blocks = {id(p) for b in blocks for p in b.parameters()}
        units = [list(b.named_parameters()) for b in blocks]
        units.append([(n, p) for n, p in self.adapter.transformer.named_parameters() if id(p) not in in_blocks])
        for i, named in enumerate(units):
            block = blocks[i] if i < len(blocks) else self.adapter.transformer
            dtypes = {p.dtype for n, p in named if not lora or "lora_" in n}
            if len(dtypes) > 1:
                raise ValueError(
                    f"digen.fsdp.enable=true with digen.model.lora.enable=false: {type(block).__name__} #{i} of "
                    f"the denoiser holds trained parameters of several dtypes {sorted(map(str, dtypes))} (the model "
                    "keeps some in fp32); FSDP2 reduces a unit's gradients in one dtype. Use LoRA "
                    "(digen.model.lora.enable=true) or digen.model.dtype=fp32."
                )

    def _build_reward(self, validation_only: bool = False) -> torch.device:
        """Build the reward with its model on this worker's device (``digen.reward.device``);
        returns that device. Rewards without a model (rule-based, remote) ignore it. A worker
        that scores only validation images (a trainer) keeps the model on CPU: its GPU's
        memory is the training state's (the planner charges no reward there)."""
        from verl_digen.rewards import build_reward_from_config

        device = torch.device("cpu") if validation_only else reward_device(self.cfg.reward.device, compute_device())
        self.reward_fn = build_reward_from_config(self.cfg.reward.as_spec(), device=device)
        return device

    # ------------------------------------------------------------------ tasks

    def generate(self, request: GenerateRequest, previous: GroupsInFlight | None = None) -> DataProto | GroupsInFlight:
        """Sample whole groups, or one TSP stage of them (``request.denoise`` = (start, end)).

        A stage after the first continues the ``previous`` stage's in-flight state. The last
        stage (or a plain call) returns the trajectory record, the one batch type the reward and
        the loss read (:func:`~verl_digen.workers.sampling.finish_groups`).
        """
        if request.version != self.policy_version:
            raise RuntimeError(
                f"{self.role}{self.rank} holds weights version {self.policy_version} but the plan "
                f"generates groups {list(request.group_ids)} with version {request.version}"
            )
        start, end = request.denoise or (0, self.settings.num_steps)
        state = previous
        if state is None:
            if start != 0:
                raise RuntimeError(f"TSP stage [{start}, {end}) of groups {list(request.group_ids)} got no input state")
            groups = GroupRequest.for_generate(
                request, group_size=self.cfg.batch.group_size, seed=self.cfg.seed, policy_version=self.policy_version
            )
            state = begin_groups(self.adapter, groups, self.settings)
        elif state.request.policy_version != self.policy_version:
            raise RuntimeError(
                f"groups {list(state.request.group_ids)} began with weights version {state.request.policy_version} "
                f"but {self.role}{self.rank} holds {self.policy_version}: a trajectory must use one version"
            )
        denoise(self.adapter, state, self.settings, end)
        if end < self.settings.num_steps:
            state.memory = max_peaks(state.memory, interval_peaks(compute_device()))  # a TSP stage's, passed on
            return state
        out = finish_groups(self.adapter, state, self.settings)
        # the generating worker's peaks (a TSP group's: the max over its stages), for the reward to
        # pass on to the controller; split keeps meta_info, so every chunk carries them
        out.meta_info["memory"] = max_peaks(state.memory, interval_peaks(compute_device()))
        if request.chunk_rows:  # one object per chunk of one group's samples (rows are group-major)
            return tuple(out.split(request.chunk_rows))
        return out

    def profile_step_costs(self, prompt: str, repeats: int = 2) -> dict[str, Any]:
        """Measured seconds of encode+noise (head), each denoising step, and decode (tail).

        One group of the configured size sampled from ``prompt``, one of the run's training
        prompts: with the prompt cache on, those are the prompts the warm-up encoded before the
        text encoders were released, so the head is a cache read, as in the run. Used to balance
        TSP stage ranges.
        """
        import time as _time

        def timed(fn):
            best = float("inf")
            for _ in range(repeats):
                t0 = _time.perf_counter()
                out = fn()
                best = min(best, _time.perf_counter() - t0)
            return best, out

        groups = GroupRequest([prompt], [0], [0], group_size=self.cfg.batch.group_size, training_step=0,
                              seed=self.cfg.seed, policy_version=self.policy_version)
        head, state = timed(lambda: begin_groups(self.adapter, groups, self.settings))
        steps = []
        for i in range(self.settings.num_steps):
            snapshot = (list(state.latents), state.log_probs.clone(), state.generator_states, state.next_step)

            def one_step():
                state.latents, state.log_probs, state.generator_states, state.next_step = (
                    list(snapshot[0]), snapshot[1].clone(), snapshot[2], snapshot[3])
                return denoise(self.adapter, state, self.settings, i + 1)

            t, _ = timed(one_step)
            steps.append(t)
        tail, _ = timed(lambda: finish_groups(self.adapter, state, self.settings))
        return {"head_s": head, "step_s": steps, "tail_s": tail}

    def compute_reward(self, *slices: DataProto) -> RewardResult:
        """Score whole groups: ``slices`` are the trajectories of their generate tasks (one, or a
        group's sample slices, reassembled here in sample order)."""
        data = slices[0] if len(slices) == 1 else _in_sample_order(list(slices))
        prompts = [str(p) for p in data.non_tensor_batch["prompt"]]
        # Each sample's prompt record (ground truth, ...) when the data had one.
        records = data.non_tensor_batch.get("metadata")
        metadata = [dict(r) for r in records] if records is not None else None
        from verl_digen.models.base import pixels_from_uint8
        from verl_digen.memory.object_store import trajectory_payload_bytes
        from verl_digen.workers.sampling import latent_fields

        # Trajectories carry uint8 pixels; rewards take fp32 in [0, 1] (the same pixels, quantised).
        pixels = pixels_from_uint8(data.batch["images"])
        self.reward_fn.give_sample_tensors(latent_fields(data))  # output_type latent / both only
        rewards = self.reward_fn(pixels, prompts, metadata).detach().float().cpu()
        extras = self.reward_fn.take_extras()
        rows: tuple[dict[str, Any], ...] = ()
        if self.cfg.rollout_data_dir is not None:  # this worker holds the pixels: it writes them (rollout_dump.py)
            from verl_digen.workers.rollout_dump import dump_samples

            step = int(slices[0].meta_info["training_step"]) + 1  # veRL's global step, as metrics.jsonl's
            rows = tuple(dump_samples(self.cfg.rollout_data_dir, step, pixels, data.non_tensor_batch, rewards, extras))
        return RewardResult(
            group_id=torch.tensor(data.non_tensor_batch["group_id"].astype(np.int64)),
            rewards=rewards,
            policy_version=torch.tensor(data.non_tensor_batch["policy_version"].astype(np.int64)),
            extra=extras,
            rollout_rows=rows,
            trajectory_bytes=sum(trajectory_payload_bytes(s) for s in slices),
            memory=interval_peaks(compute_device()),
            generator_memory=max_peaks(*(s.meta_info.get("memory", {}) for s in slices)),
        )

    def train_micro_batch(self, request: TrainRequest, *trajectories: DataProto) -> TrainResult | tuple[TrainResult, Gradients]:
        """Accumulate the gradients of ``request.groups``' rows (selected from the trajectories)
        with ``request.advantages``, one per row of the selection; ``request.return_gradients``
        (GAT, a rollout worker): return them too, as a second object for trainer 0."""
        if self.updater is None:
            _no_updater(self.role)
        advantages = request.advantages
        if request.row_part is None:
            data = select_groups(trajectories, list(request.groups))
        else:  # an FSDP gang rank's share of the micro-batch's samples, or a pulled row slice
            r, n = request.row_part
            rows = rank_rows(len(advantages), self.settings.forward_rows, r, n)
            advantages = advantages[rows]
            if request.presliced:  # the executor sent this rank's chunks only
                data = select_groups(trajectories, list(request.groups), partial=True)
                if len(data) != len(rows):
                    raise RuntimeError(f"rank {r} of {n} got {len(data)} rows of groups {list(request.groups)}; "
                                       f"its share is {len(rows)}")
            else:
                data = select_groups(trajectories, list(request.groups)).select_idxs(rows)
        try:
            metrics = self.updater.train_micro_batch(data, advantages, part=request.train_part)
        finally:
            if request.return_gradients:
                self.adapter.transformer.eval()  # a rollout worker generates next
        versions = data.non_tensor_batch["policy_version"]
        result = TrainResult(
            metrics=metrics,
            staleness_max=float(self.policy_version - versions.min()),
            staleness_min=float(self.policy_version - versions.max()),
            memory=interval_peaks(compute_device()),
        )
        if not request.return_gradients:
            return result
        return result, Gradients(self.updater.take_gradients(), self.policy_version, tuple(request.groups))

    def optimizer_step(self, request: OptimizerRequest = OptimizerRequest(), *gradients: Gradients) -> OptimizerResult:
        """Step on the accumulated gradients (one PPO mini-batch's) plus ``gradients``, the
        micro-batches rollout workers trained (GAT), which must be of the weights this worker
        holds; after the step's last mini-batch, the next version: sent to rollout, streamed
        out of FSDP shards for it (a disaggregated run only; colocated, ``refresh_full_state``
        streams when it is read)."""
        check_assisted_gradients(request, gradients, self.policy_version, f"{self.role}{self.rank}")
        for g in gradients:
            self.updater.add_gradients(g.tensors)
        if request.final and self.policy_version + 1 in self.cfg.fault_nonfinite_grad_steps:
            for p in self.updater.opt_params:  # fault injection for tests (digen.fault_nonfinite_grad_steps)
                if p.grad is not None:
                    p.grad.fill_(float("nan"))
        # FSDP already reduce-scattered the gradients in backward: no second all-reduce.
        metrics = self.updater.optimizer_step(None if self.fsdp else self._pg)
        if not request.final:  # between mini-batches: no version to publish yet
            return OptimizerResult(metrics=metrics, policy_version=self.policy_version,
                                   memory=interval_peaks(compute_device()))
        self.policy_version += 1
        if self._stream_every_version:
            self._refresh_sync_cache()
        if self._weight_channel is not None and self._weight_channel.rank == 0:
            # The weight-sync sender (trainer 0 of a disaggregated run): send the new version
            # from a copy on a side thread; the plan's sync task is the receivers' part, and
            # this trainer goes on training meanwhile (schedule/mechanisms.py: WeightSync).
            self.sync_send_in_background(self._sync_snapshot(), self.policy_version, self.deadlines.send_s,
                                         self.deadlines.join_s)
        return OptimizerResult(metrics=metrics, policy_version=self.policy_version,
                               memory=interval_peaks(compute_device()))

    def _sync_snapshot(self) -> HostSnapshot:
        """The weights to send, as a copy training will not change: FSDP's host snapshot of this
        version (taken for every version by ``_refresh_sync_cache``), else one taken now, into
        the same reused (pinned, on a GPU) host buffers."""
        if not self.fsdp:
            self._capture(trainable_state(self.adapter.transformer, lora_only=self.cfg.model.lora.enable))
        return self._require_snapshot()

    def _capture(self, named_tensors) -> None:
        """Copy a version into the host snapshot, once the send still reading it has ended."""
        self.sync_join(self.deadlines.join_s)
        if self._snapshot is None:
            self._snapshot = HostSnapshot(DEFAULT_BUCKET_BYTES)
        self._snapshot.capture(named_tensors)

    def _require_snapshot(self) -> HostSnapshot:
        if self._snapshot is None:
            raise RuntimeError(f"{self.role}{self.rank}: only FSDP rank 0 and the weight-sync sender keep a host snapshot")
        return self._snapshot

    # ------------------------------------------------------------------ inspection

    def recompute_log_probs(self, data: DataProto) -> torch.Tensor:
        return self.updater.recompute_log_probs(data) if self.updater else _no_updater(self.role)

    def _refresh_sync_cache(self, *, digest: bool = False) -> None:
        """FSDP: stream the full trained state out of the shards (a collective: every rank, once
        per version), one bucket at a time on the device. Rank 0 (the sender, and the source of
        checkpoints and final weights) copies each bucket into its reused host snapshot (pinned,
        on a side stream: :class:`HostSnapshot`); the other ranks only take part, and digest what
        passes on the device when ``digest`` (after a checkpoint load, whose digest every rank
        reports). Every rank records the version streamed, so all decide alike whether
        ``refresh_full_state`` streams again."""
        if self.fsdp:
            from verl_digen.workers.fsdp import stream_full_state

            self._streamed_version = self.policy_version

            stream = stream_full_state(self.adapter.transformer, lora_only=self.cfg.model.lora.enable)
            if self.rank == 0:
                self._capture(stream)
                return
            d = WeightsDigest() if digest else None
            for name, full in stream:
                if d is not None:
                    d.update(name, full)
            self._sync_digest = d.hexdigest() if d is not None else None

    def refresh_full_state(self) -> int:
        """FSDP: stream this version's full state out of the shards unless the last stream carried
        it already; a collective, so every trainer rank runs it together (``trainer/runtime.py:
        finish_weights`` before a colocated run saves its final weights). Returns the version."""
        if self.fsdp and self._streamed_version != self.policy_version:
            self._refresh_sync_cache()
        return self.policy_version

    def _full_state(self) -> dict[str, torch.Tensor]:
        """The trained weights: FSDP rank 0's host snapshot (views) of this version, never an
        older one's, else the module's own."""
        if self.fsdp:
            if self._streamed_version != self.policy_version:
                raise RuntimeError(
                    f"{self.role}{self.rank}: the host snapshot holds weights version {self._streamed_version} but "
                    f"this rank trained version {self.policy_version}; run refresh_full_state on every trainer rank "
                    "together first (a colocated FSDP run gathers the full state only when it is read)")
            return self._require_snapshot().state()
        return trainable_state(self.adapter.transformer, lora_only=self.cfg.model.lora.enable)

    def sync_send(self, version: int) -> SyncResult:
        """Send now, blocking (tools and tests; a run's optimizer step sends in the background):
        FSDP's snapshot as packed, else the module's weights straight from the device."""
        self.sync_join(self.deadlines.join_s)
        state = self._require_snapshot() if self.fsdp else self._full_state()
        stats = self._require_sync_channel().send(state, version)
        self.policy_version = version
        return SyncResult(**stats.as_dict())

    def sync_recv(self) -> SyncResult:
        """Receive the next weights version (:meth:`WeightSyncMixin.sync_recv`), as a typed result."""
        return SyncResult(**WeightSyncMixin.sync_recv(self))

    def weights_digest(self) -> str:
        """A :class:`WeightsDigest` of the trained weights, summed on this worker's device (a
        host snapshot goes over in chunks): seconds for a full model, not a CPU sha256's minutes."""
        if self.fsdp and self.rank != 0:
            if self._sync_digest is None:
                raise RuntimeError(f"{self.role}{self.rank}: an FSDP rank other than 0 digests the weights only "
                                   "when it loads a checkpoint")
            return self._sync_digest
        return weights_digest(self._full_state(), device=compute_device())

    # ------------------------------------------------------------------ prompt cache (workers/prompt_warmup.py)

    def _prompt_cache(self):
        from verl_digen.workers.prompt_warmup import open_cache

        if getattr(self, "prompt_cache", None) is None:
            self.prompt_cache = open_cache(self.adapter, self.model_path, self.cfg.prompt_cache)
        return self.prompt_cache

    def _node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def prompt_cache_probe(self, token: str) -> str:
        """Mark this node in the cache directory (:func:`~verl_digen.workers.prompt_warmup.write_probe`)."""
        from verl_digen.workers.prompt_warmup import cache_root, write_probe

        write_probe(cache_root(self.cfg.prompt_cache), token, self._node_id())
        return self._node_id()

    def prompt_cache_peers(self, token: str) -> list[str]:
        """The nodes this worker shares the cache directory with."""
        from verl_digen.workers.prompt_warmup import cache_root, visible_nodes

        return visible_nodes(cache_root(self.cfg.prompt_cache), token)

    def warm_prompt_cache(self, prompts: list[str], index: int = 0, count: int = 1) -> dict[str, Any]:
        """Encode share ``index`` of ``count`` of ``prompts`` into the disk cache, in bounded batches
        on this worker's device (:func:`~verl_digen.workers.prompt_warmup.warm_share`)."""
        from verl_digen.workers.prompt_warmup import warm_share

        return warm_share(self._prompt_cache(), prompts, index, count, self.cfg.prompt_cache.encode_batch_size)

    def finish_prompt_cache(self, prompts: list[str], token: str | None = None, rows_shared: bool = True) -> dict[str, Any]:
        """Every prompt this worker may need (``prompts`` and its negative prompt) cached, the cache
        installed, the text encoders released when ``digen.prompt_cache.release_encoders``;
        ``rows_shared``: the run has one cache domain (else trajectories carry their embeddings)."""
        from verl_digen.workers.prompt_warmup import cache_root, finish, remove_probe

        pc = self.cfg.prompt_cache
        needed = list(dict.fromkeys([*prompts, self.settings.negative_prompt]))
        out = finish(self._prompt_cache(), needed, batch_size=pc.encode_batch_size, release=pc.release_encoders,
                     rows_shared=rows_shared)
        if token is not None:
            remove_probe(cache_root(pc), token, self._node_id())
        return out

    def validate(
        self, prompts: list[str], step: int, out_dir: str, metadata: list[dict[str, Any]] | None = None
    ) -> dict[str, Any]:
        """Deterministic samples of held-out prompts with the newest weights (EMA when on).

        ``metadata``: each prompt's record (ground truth, ...), for the reward."""
        from contextlib import nullcontext

        from verl_digen.workers.validation import run_validation

        if self.reward_fn is None:
            self._build_reward(validation_only=True)
        import tempfile

        ema = getattr(self.updater, "ema", None) if self.updater is not None else None
        reward = self.reward_fn
        if metadata is not None:  # the held-out prompts' records reach the reward as in training
            reward = lambda images, batch_prompts: self.reward_fn(images, batch_prompts, metadata)  # noqa: E731
        # Under FSDP every trainer rank samples (forwards are collectives); rank 0 writes. The others'
        # grids go to a directory removed right after (the controller reads rank 0's only): one
        # kept per validation per rank filled /tmp over a long run.
        scratch = tempfile.TemporaryDirectory(prefix="digen_val_") if self.rank != 0 else nullcontext(out_dir)
        val = self.cfg.validation
        settings = self.settings if val.num_steps is None else dataclasses.replace(self.settings,
                                                                                     num_steps=val.num_steps)
        with scratch as target, ema.swapped_in() if ema is not None else nullcontext():
            result = run_validation(
                self.adapter, prompts, settings, reward, seed=val.seed, step=step,
                out_dir=target, records=metadata,  # a record's own negative prompt, as in training
                log_images=val.log_images,
                give_latents=lambda tensors: self.reward_fn.give_sample_tensors(tensors, validation=True),
            )
        grid = (result.logged_grid_path or result.grid_path) if self.rank == 0 else None
        out = {"metrics": result.metrics(prefix="val"), "grid_path": grid}
        out["metrics"]["val/ema"] = float(ema is not None)
        return out

    def save_checkpoint_shard(self, directory: str) -> dict[str, Any]:
        """Write this trainer rank's part of a checkpoint into ``directory`` (DCP, every trainer
        rank together); return the files written and their checksums, and the weights version."""
        from verl_digen.workers.sharded_state import save_rank_state

        files = save_rank_state(
            directory, module=self.adapter.transformer, optimizer=self.updater.optimizer,
            ema=getattr(self.updater, "ema", None), lora_only=self.cfg.model.lora.enable,
            version=self.policy_version, rank=self.rank, group=self._pg, master=self.updater.master,
        )
        return {"files": files, "version": self.policy_version}

    def load_checkpoint_shard(self, directory: str, version: int) -> str:
        """Load a checkpoint written by any number of trainer ranks (DCP reshards); trainers take
        the optimizer, EMA and RNG too, others the weights only. Returns the weights' digest."""
        from verl_digen.workers.sharded_state import load_rank_state

        # the training roles' (a GAT rollout worker's gradient-only updater keeps no state to load)
        trains = ROLE_CAPABILITIES[self.role].trains
        load_rank_state(
            directory, module=self.adapter.transformer, optimizer=self.updater.optimizer if trains else None,
            ema=getattr(self.updater, "ema", None) if trains else None, lora_only=self.cfg.model.lora.enable,
            rank=self.rank, group=self._pg if trains else None, master=self.updater.master if trains else None,
        )
        if trains:
            self.updater.park_optimizer()  # the loaded state lands where the parameters are
        self.policy_version = version
        self._refresh_sync_cache(digest=True)
        return self.weights_digest()

    def save_final_weights(self, path: str) -> str:
        """The trained weights as one safetensors file, written here (the full state this rank
        already holds for the weight sync), not through the driver; returns ``path``."""
        from safetensors.torch import save_file

        save_file({k: v.detach().cpu().contiguous() for k, v in self._full_state().items()}, path)
        return path

    def get_policy_version(self) -> int:
        return self.policy_version

    def ping(self) -> str:
        return f"{self.role}{self.rank}"


def _no_updater(role: str):
    raise RuntimeError(f"a {role} worker has no policy updater (it does not train)")


def select_groups(trajectories: tuple[DataProto, ...], groups: list[int], *, partial: bool = False) -> DataProto:
    """Rows of the given groups, in the order of ``groups`` and of each group's samples, from one
    or more generate outputs (a group split over several rollout workers is in several).
    ``partial``: the trajectories may hold some of the groups only (an FSDP rank's chunks)."""
    rows: list[tuple[int, int, int, int]] = []  # (group position, sample index, trajectory, row)
    order = {g: k for k, g in enumerate(groups)}
    for t, data in enumerate(trajectories):
        gids = data.non_tensor_batch["group_id"]
        samples = data.non_tensor_batch.get("sample_index")
        for i, gid in enumerate(gids):
            if int(gid) in order:
                rows.append((order[int(gid)], int(samples[i]) if samples is not None else i, t, i))
    missing = set(groups) - {groups[r[0]] for r in rows}
    if missing and not (partial and rows):
        raise KeyError(f"groups {sorted(missing)} are in none of the trajectories passed to the trainer")
    rows.sort()
    parts = []  # one per run of consecutive rows from the same trajectory
    start = 0
    while start < len(rows):
        t = rows[start][2]
        end = start
        while end < len(rows) and rows[end][2] == t:
            end += 1
        part = trajectories[t].select_idxs([r[3] for r in rows[start:end]])
        part.meta_info = {}  # per-task timings differ; concat requires equal meta
        parts.append(part)
        start = end
    return DataProto.concat(parts) if len(parts) > 1 else parts[0]


def _in_sample_order(slices: list[DataProto]) -> DataProto:
    """A group's sample slices as one batch, rows ordered by (group, sample index)."""
    groups = list(dict.fromkeys(int(g) for data in slices for g in data.non_tensor_batch["group_id"]))
    return select_groups(tuple(slices), groups)
