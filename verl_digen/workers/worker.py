"""The diffusion worker: one veRL ``Worker`` class, four roles.

- ``fused``   (colocated): generates, scores and trains with one copy of the weights;
- ``rollout`` (disaggregated): generates (and scores when there is no reward pool),
  receives weights from the trainer;
- ``trainer`` (disaggregated): trains, steps the optimizer, sends weights;
- ``reward``  (disaggregated): scores images.

Like veRL's ``ActorRolloutRefWorker(role=...)``, the role decides what is built in
``init_model``. Methods are registered with veRL's ``@register`` so a ``RayWorkerGroup``
can broadcast them (``ONE_TO_ALL``); the plan executor also calls them on single actors
(``wg.workers[i].generate.remote(...)``), which is how tasks land on the worker a plan names.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from verl import DataProto
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register
from verl_digen.config.schema import DigenConfig
from verl_digen.sync.state import digest_update, state_digest, trainable_state
from verl_digen.sync.transport import WeightSyncMixin
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

ROLES = ("fused", "rollout", "trainer", "reward")


def sampling_settings(cfg: DigenConfig, fsdp_ranks: int = 1, rollout_lanes: int = 1) -> SamplingSettings:
    """The sampling settings of a run; ``fsdp_ranks``: the training ranks a micro-batch is
    sharded over (1 without FSDP), and ``rollout_lanes``: the rollout workers (TSP: pipelines)
    the planner spreads each step's groups over; together they fix the rows of every
    transformer call."""
    from verl_digen.schedule.strategies import sample_split
    from verl_digen.models.base import SampleSpec
    from verl_digen.workers.sampling import forward_rows

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
        vae_decode_chunk=cfg.model.vae_decode_chunk,
        forward_rows=forward_rows(
            cfg.batch.group_size, cfg.batch.train_micro_batch_groups, fsdp_ranks,
            sample_split(cfg.batch.groups_per_step, cfg.batch.groups_per_task, cfg.batch.group_size, rollout_lanes),
        ),
    )


def configure_attention_kernels() -> None:
    """Keep cuDNN's fused attention out of ``scaled_dot_product_attention``, process-wide.

    On an H100 with torch 2.11 / CUDA 13, SDPA picks cuDNN's fused attention for the bf16
    transformers, and its backward failed on real-size FLUX (``mha_graph.execute(...)
    .is_good()``, then an illegal memory access that poisons the CUDA context: measured by
    ``python -m verl_digen.gpu_check``, README "Measured on a GPU"). Flash / memory-efficient
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


class DiffusionWorker(Worker, WeightSyncMixin):
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
        self.trainer: PolicyUpdater | None = None
        self.reward_fn = None
        self._pg: dist.ProcessGroup | None = None

    # ------------------------------------------------------------------ set-up

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> dict[str, Any]:
        torch.set_num_threads(self.num_threads)
        cfg = self.cfg
        import ray

        info: dict[str, Any] = {"role": self.role, "rank": self.rank, "pid": os.getpid(),
                                "node_id": ray.get_runtime_context().get_node_id()}
        if self.role in ("fused", "rollout", "trainer"):
            from verl_digen.models.base import resolve_dtype
            from verl_digen.models.registry import load_adapter

            device = compute_device()
            # One precision path for rollout and trainer: weights in the run's dtype, LoRA (and
            # full fine-tune masters) in the trainable dtype, no autocast anywhere.
            dtype = resolve_dtype(cfg.model.dtype, device)
            self.trainable_dtype = resolve_dtype(cfg.model.trainable_dtype, device, key="digen.model.trainable_dtype")
            self.adapter = load_adapter(self.model_path, cfg.model.arch, device=device, dtype=dtype)
            if cfg.model.lora.enable:
                add_lora(self.adapter, cfg.model.lora, dtype=self.trainable_dtype)
            self.sync_module = self.adapter.transformer
            self.sync_lora_only = cfg.model.lora.enable
            self.settings = sampling_settings(cfg, self._fsdp_ranks(), self._rollout_lanes())
            if self.role == "rollout":
                self.adapter.transformer.requires_grad_(False).eval()
            vae = getattr(self.adapter, "vae", None)
            if self.settings.spec.num_frames > 1 and hasattr(vae, "enable_tiling"):
                vae.enable_tiling()  # video decodes tile by tile (diffusers' tiled VAE decode)
            if device.type == "cuda" and self.role in ("fused", "trainer"):
                # Training GPUs keep the text encoders (and, on trainers, which decode only for
                # validation or TAG, the VAE) on CPU between uses.
                names = self.adapter.text_encoder_names + (("vae",) if self.role == "trainer" else ())
                info["offloaded_bytes"] = self.adapter.offload_to_cpu(names)
            info["device"] = str(device)
            info["dtype"] = str(dtype).removeprefix("torch.")
            info["params"] = sum(p.numel() for p in self.adapter.transformer.parameters())
        trains = self.role in ("fused", "trainer")
        self.fsdp = trains and cfg.fsdp.enable
        self._sync_cache: dict[str, torch.Tensor] | None = None
        self._sync_digest: str | None = None  # FSDP ranks other than 0, after a checkpoint load
        if trains and (self.world_size > 1 or self.fsdp):
            # FSDP2 shards over the default group's mesh, so one sharded rank needs a group of one.
            # On CUDA the group is bound to this worker's GPU (device_id: NCCL's communicator is
            # created eagerly, on the right device, instead of at the first collective).
            cuda = torch.cuda.is_available()
            if not dist.is_initialized():
                extra = {"device_id": compute_device()} if cuda else {}
                dist.init_process_group(backend="nccl" if cuda else "gloo", rank=self.rank,
                                        world_size=self.world_size, **extra)
            self._pg = dist.group.WORLD
        reference = None
        if trains:
            from verl_digen.workers.fsdp import enable_gradient_checkpointing

            if cfg.model.gradient_checkpointing:
                info["gradient_checkpointing"] = enable_gradient_checkpointing(self.adapter.transformer)
            if self.fsdp and cfg.algo.kl_beta > 0 and not cfg.model.lora.enable:
                # A sharded module cannot be deep-copied: copy first, shard both.
                import copy

                reference = copy.deepcopy(self.adapter.transformer).requires_grad_(False).eval()
        if self.fsdp:
            # Parallelism applied in one place; the optimizer must be built after sharding.
            from verl_digen.workers.fsdp import shard_for_training

            self._check_fsdp_trainable_dtypes()
            for module in (self.adapter.transformer, reference):
                if module is not None:
                    shard_for_training(module, reshard_after_forward=cfg.fsdp.reshard_after_forward)
        if trains:
            self.trainer = PolicyUpdater(
                self.adapter,
                TrainSettings(
                    algo=cfg.algo,
                    sampling=self.settings,
                    lora_only=cfg.model.lora.enable,
                    images_per_step=cfg.batch.images_per_step,
                    ema_decay=cfg.ema.decay if cfg.ema.enable else None,
                    ema_offload=cfg.ema.offload,
                    trainable_dtype=self.trainable_dtype,
                ),
                reference=reference,
            )
            info["trainable_params"] = sum(p.numel() for p in self.trainer.params)
            self._refresh_sync_cache()
        # Trainers score too when they generate (TAG) and no reward pool exists.
        scores = self.role in ("fused", "rollout", "reward") or (
            self.role == "trainer" and cfg.tag.enable and cfg.pools.reward.devices == 0
        )
        if scores:
            self._build_reward()
        return info

    def _rollout_lanes(self) -> int:
        """The rollout lanes the planner spreads a step's groups over (StrategySpec.sample_split):
        the rollout workers, or with TSP their pipelines."""
        workers = self.cfg.pools.rollout.world_size if self.cfg.placement == "disaggregated" else self.world_size
        return max(1, workers // self.cfg.tsp.stages)

    def _fsdp_ranks(self) -> int:
        """The ranks one training micro-batch is sharded over (1 without FSDP)."""
        if not self.cfg.fsdp.enable:
            return 1
        if self.role in ("fused", "trainer"):
            return self.world_size
        return self.cfg.pools.trainer.world_size

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

    def _build_reward(self) -> None:
        from verl_digen.rewards import build_reward_from_config

        self.reward_fn = build_reward_from_config(self.cfg.reward.as_spec())

    # ------------------------------------------------------------------ tasks

    def generate(self, request: dict[str, Any], state: GroupsInFlight | None = None) -> DataProto | GroupsInFlight:
        """Sample whole groups, or one TSP stage of them.

        ``request``: group_ids, prompts, prompt_indices, metadata (each prompt's record), step, version, and for a TSP stage
        ``denoise`` = (start, end); a stage after the first receives the previous stage's
        ``state``. The last stage (or a plain call) returns the trajectory record.
        """
        expected = request["version"]
        if expected != self.policy_version:
            raise RuntimeError(
                f"{self.role}{self.rank} holds weights version {self.policy_version} but the plan "
                f"generates groups {request['group_ids']} with version {expected}"
            )
        start, end = request.get("denoise") or (0, self.settings.num_steps)
        if state is None:
            if start != 0:
                raise RuntimeError(f"TSP stage [{start}, {end}) of groups {request['group_ids']} got no input state")
            groups = GroupRequest(
                request["prompts"],
                request["group_ids"],
                request["prompt_indices"],
                group_size=self.cfg.batch.group_size,
                training_step=request["step"],
                seed=self.cfg.seed,
                policy_version=self.policy_version,
                metadata=request.get("metadata"),
                samples=tuple(request["samples"]) if request.get("samples") else None,
            )
            state = begin_groups(self.adapter, groups, self.settings)
        elif state.policy_version != self.policy_version:
            raise RuntimeError(
                f"groups {state.group_ids} began with weights version {state.policy_version} but "
                f"{self.role}{self.rank} holds {self.policy_version}: a trajectory must use one version"
            )
        denoise(self.adapter, state, self.settings, end)
        if end < self.settings.num_steps:
            return state
        return finish_groups(self.adapter, state, self.settings)

    def profile_step_costs(self, repeats: int = 2) -> dict[str, Any]:
        """Measured seconds of encode+noise (head), each denoising step, and decode (tail).

        One group of the configured size; used to balance TSP stage ranges.
        """
        import time as _time

        def timed(fn):
            best = float("inf")
            for _ in range(repeats):
                t0 = _time.perf_counter()
                out = fn()
                best = min(best, _time.perf_counter() - t0)
            return best, out

        groups = GroupRequest(["a photo"], [0], [0], group_size=self.cfg.batch.group_size, training_step=0,
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

    def compute_reward(self, *slices: DataProto) -> dict[str, Any]:
        """Score whole groups: ``slices`` are the trajectories of their generate tasks (one, or a
        group's sample slices, reassembled here in sample order)."""
        data = slices[0] if len(slices) == 1 else _in_sample_order(list(slices))
        prompts = [str(p) for p in data.non_tensor_batch["prompt"]]
        # Each sample's prompt record (ground truth, ...) when the data had one.
        records = data.non_tensor_batch.get("metadata")
        metadata = [dict(r) for r in records] if records is not None else None
        from verl_digen.models.base import pixels_from_uint8

        # Trajectories carry uint8 pixels; rewards take fp32 in [0, 1] (the same pixels, quantised).
        rewards = self.reward_fn(pixels_from_uint8(data.batch["images"]), prompts, metadata)
        return {
            "group_id": torch.tensor(data.non_tensor_batch["group_id"].astype(np.int64)),
            "rewards": rewards.detach().float().cpu(),
            "policy_version": torch.tensor(data.non_tensor_batch["policy_version"].astype(np.int64)),
        }

    def train_micro_batch(self, request: dict[str, Any], *trajectories: DataProto) -> dict[str, float]:
        """``request``: groups (to select from the trajectories), advantages per row of the selection."""
        data = select_groups(trajectories, request["groups"])
        advantages = request["advantages"]
        if request.get("row_part"):  # FSDP gang: this rank's share of the micro-batch's samples
            r, n = request["row_part"]
            rows = rank_rows(len(data), self.settings.forward_rows, r, n)
            data, advantages = data.select_idxs(rows), advantages[rows]
        metrics = self.trainer.train_micro_batch(data, advantages, part=request.get("train_part"))
        versions = data.non_tensor_batch["policy_version"]
        metrics["staleness_max"] = float(self.policy_version - versions.min())
        metrics["staleness_min"] = float(self.policy_version - versions.max())
        return metrics

    def optimizer_step(self) -> dict[str, float]:
        if self.policy_version + 1 in self.cfg.fault_nonfinite_grad_steps:
            for p in self.trainer.opt_params:  # fault injection for tests (digen.fault_nonfinite_grad_steps)
                if p.grad is not None:
                    p.grad.fill_(float("nan"))
        # FSDP already reduce-scattered the gradients in backward: no second all-reduce.
        metrics = self.trainer.optimizer_step(None if self.fsdp else self._pg)
        self.policy_version += 1
        self._refresh_sync_cache()
        metrics["policy_version"] = float(self.policy_version)
        return metrics

    # ------------------------------------------------------------------ inspection

    def recompute_log_probs(self, data: DataProto) -> torch.Tensor:
        return self.trainer.recompute_log_probs(data) if self.trainer else _no_trainer(self.role)

    def _refresh_sync_cache(self, *, digest: bool = False) -> None:
        """FSDP: stream the full trained state out of the shards (a collective: every rank, once
        per version), one bucket at a time on the device. Rank 0 (the sender, and the source of
        checkpoints and final weights) keeps it on CPU and hashes it when asked; the other ranks
        only take part, and hash what passes when ``digest`` (after a checkpoint load, whose
        digest every rank reports): hashing the full model on every rank at every step would
        cost more than the step's sync."""
        if self.fsdp:
            from verl_digen.workers.fsdp import stream_full_state

            keep = self.rank == 0
            h = hashlib.sha256() if digest and not keep else None
            cache: dict[str, torch.Tensor] = {}
            for name, full in stream_full_state(self.adapter.transformer, lora_only=self.cfg.model.lora.enable):
                if keep:
                    cache[name] = full.to("cpu", copy=True)
                elif h is not None:
                    digest_update(h, name, full)
            self._sync_cache = cache if keep else None
            self._sync_digest = h.hexdigest() if h is not None else None

    def _full_state(self) -> dict[str, torch.Tensor]:
        if self.fsdp:
            if self._sync_cache is None:
                raise RuntimeError(f"{self.role}{self.rank}: only FSDP rank 0 keeps the gathered weights")
            return self._sync_cache
        return trainable_state(self.adapter.transformer, lora_only=self.cfg.model.lora.enable)

    def sync_send(self, version: int) -> dict[str, Any]:
        stats = self._require_sync_channel().send(self._full_state(), version)
        self.policy_version = version
        return stats.as_dict()

    def weights_digest(self) -> str:
        if self.fsdp and self.rank != 0:
            if self._sync_digest is None:
                raise RuntimeError(f"{self.role}{self.rank}: an FSDP rank other than 0 hashes the weights only "
                                   "when it loads a checkpoint")
            return self._sync_digest
        return state_digest(self._full_state())

    def warm_prompt_cache(self, prompts: list[str]) -> dict[str, Any]:
        """Encode every prompt this worker may need once, then free the text encoders.

        ``prompts``: training + validation prompts (the negative prompt is added here).
        """
        import os as _os

        from verl_digen.models.prompt_cache import PromptEmbeddingCache, model_cache_key

        pc = self.cfg.prompt_cache
        root = pc.dir or _os.path.join(
            _os.environ.get("VERL_DIGEN_CACHE") or _os.path.join(_os.path.expanduser("~"), ".cache", "verl_digen"),
            "prompt_embeds",
        )
        cache = PromptEmbeddingCache(self.adapter, model_key=model_cache_key(self.model_path, self.adapter), cache_dir=root)
        cache.warm(list(dict.fromkeys(list(prompts) + [self.settings.negative_prompt])))
        cache.install()
        freed = cache.release_encoders() if pc.release_encoders else 0
        self.prompt_cache = cache
        return {**cache.stats(), "bytes_freed": freed}

    def validate(
        self, prompts: list[str], step: int, out_dir: str, metadata: list[dict[str, Any]] | None = None
    ) -> dict[str, Any]:
        """Deterministic samples of held-out prompts with the newest weights (EMA when on).

        ``metadata``: each prompt's record (ground truth, ...), for the reward."""
        from contextlib import nullcontext

        from verl_digen.workers.validation import run_validation

        if self.reward_fn is None:
            self._build_reward()
        import tempfile

        ema = getattr(self.trainer, "ema", None) if self.trainer is not None else None
        reward = self.reward_fn
        if metadata is not None:  # the held-out prompts' records reach the reward as in training
            reward = lambda images, batch_prompts: self.reward_fn(images, batch_prompts, metadata)  # noqa: E731
        # Under FSDP every trainer rank samples (forwards are collectives); rank 0 writes.
        target = out_dir if self.rank == 0 else tempfile.mkdtemp(prefix="digen_val_")
        with ema.swapped_in() if ema is not None else nullcontext():
            result = run_validation(
                self.adapter, prompts, self.settings, reward, seed=self.cfg.validation.seed, step=step,
                out_dir=target,
            )
        out = {"metrics": result.metrics(prefix="val"), "grid_path": result.grid_path}
        out["metrics"]["val/ema"] = float(ema is not None)
        return out

    def save_checkpoint_shard(self, directory: str) -> dict[str, Any]:
        """Write this trainer rank's part of a checkpoint into ``directory`` (DCP, every trainer
        rank together); return the files written and their checksums, and the weights version."""
        from verl_digen.workers.sharded_state import save_rank_state

        files = save_rank_state(
            directory, module=self.adapter.transformer, optimizer=self.trainer.optimizer,
            ema=getattr(self.trainer, "ema", None), lora_only=self.cfg.model.lora.enable,
            version=self.policy_version, rank=self.rank, group=self._pg, master=self.trainer.master,
        )
        return {"files": files, "version": self.policy_version}

    def load_checkpoint_shard(self, directory: str, version: int) -> str:
        """Load a checkpoint written by any number of trainer ranks (DCP reshards); trainers take
        the optimizer, EMA and RNG too, others the weights only. Returns the weights' digest."""
        from verl_digen.workers.sharded_state import load_rank_state

        trains = self.trainer is not None
        load_rank_state(
            directory, module=self.adapter.transformer, optimizer=self.trainer.optimizer if trains else None,
            ema=getattr(self.trainer, "ema", None) if trains else None, lora_only=self.cfg.model.lora.enable,
            rank=self.rank, group=self._pg if trains else None, master=self.trainer.master if trains else None,
        )
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


def _no_trainer(role: str):
    raise RuntimeError(f"a {role} worker has no trainer")


def select_groups(trajectories: tuple[DataProto, ...], groups: list[int]) -> DataProto:
    """Rows of the given groups, in the order of ``groups`` and of each group's samples, from one
    or more generate outputs (a group split over several rollout workers is in several)."""
    rows: list[tuple[int, int, int, int]] = []  # (group position, sample index, trajectory, row)
    order = {g: k for k, g in enumerate(groups)}
    for t, data in enumerate(trajectories):
        gids = data.non_tensor_batch["group_id"]
        samples = data.non_tensor_batch.get("sample_index")
        for i, gid in enumerate(gids):
            if int(gid) in order:
                rows.append((order[int(gid)], int(samples[i]) if samples is not None else i, t, i))
    missing = set(groups) - {groups[r[0]] for r in rows}
    if missing:
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
