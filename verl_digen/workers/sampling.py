"""Sampling groups of SDE trajectories with behaviour log-probs (the rollout's maths).

A *group* is G images of one prompt. Each sample's randomness comes from its own generator,
seeded from ``(seed, group_id, sample index)``, so a sample is the same trajectory whichever
worker samples it, in whatever order, and whatever slice of its group it is sampled with: this
is what makes GAP, TSP, TAG and groups split over several rollout workers exact.

The record of a trajectory is what its readers read, and no more: it crosses the Ray object store
from the rollout to the reward and to the trainer (1-9 GB a step at real video sizes when it held
every step's latents and the text embeddings). With ``K`` latents carried (:func:`carried_latent_steps`):

- ``latents``      ``[B, K, *latent]``  x_i for each i of ``latent_steps``: each trained step j's input
                                          x_j and output x_{j+1} (the loss's transition), model space, fp32
- ``latent_steps`` ``[B, K]``          int64, which x_i each column of ``latents`` is (:func:`step_latents`)
- ``log_probs`` ``[B, S]``             behaviour log-prob of each SDE step (0 for ODE steps)
- ``sigmas``    ``[B, S+1]``           noise levels
- ``sde_mask``  ``[B, S]``             steps inside the SDE window (stochastic, log-prob recorded)
- ``train_mask`` ``[B, S]``            steps that are trained (SDE window, subsampled)
- ``images``    ``[B, 3, H, W]``       decoded pixels, uint8 in [0, 255] (video: ``[B, 3, F, H, W]``), the reward's
- ``final_latents`` ``[B, *latent]``   x_S, the final (clean) latents, fp32: only when the reward reads them
                                        (veRL-Omni's ``pipeline.output_type`` latent / both, :func:`latent_fields`)
- ``cond`` / ``neg``                   conditioning (and CFG negative): nested tables of ``[B, ...]``
                                        tensors, one per name the adapter's ``encode_prompts`` gives;
                                        only when the rollout has no prompt cache, or one that
                                        other workers do not share (several cache directories:
                                        ``rows_shared``). With one (``digen.prompt_cache.enable``)
                                        the trainer reads each row's
                                        embeddings from its own cache by prompt (and ``negative_prompt``),
                                        the same rows bit for bit (checked: ``cond_digest`` /
                                        ``neg_digest``, :func:`conditioning_from`). Without a cache
                                        they travel: re-encoding on the trainer would not be exact
                                        (an encoder's row can depend on its batch, e.g. SD3's CLIP
                                        projection, Qwen-Image's padding to the longest prompt).

The same functions sample deterministically for validation (``begin_groups(..., ode=True)``):
every step is an Euler ODE step and only the newest latents are kept; :func:`decode_groups`
gives the images (``verl_digen.workers.validation`` is the caller).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from tensordict import TensorDict

from verl import DataProto
from verl_digen.algos.sde import ode_step, sde_step_with_logprob, time_shift_sigmas
from verl_digen.algos.window import SdeWindowConfig, select_sde_window, subsample_timesteps
from verl_digen.models.base import Conditioning, DiffusionAdapter, SampleSpec, onloaded, pixels_to_uint8

if TYPE_CHECKING:
    from verl_digen.workers.messages import GenerateRequest


@dataclass(frozen=True)
class SamplingSettings:
    spec: SampleSpec
    num_steps: int
    noise_level: float
    sde_type: str
    window: SdeWindowConfig
    timestep_fraction: float
    negative_prompt: str = ""
    vae_decode_chunk: int = 0  # samples per VAE decode call (0: the whole batch)
    # Rows per transformer call (0: the whole batch), the same in rollout and training: see
    # :func:`velocity_in_chunks`. Set by the worker from the batch layout (:func:`forward_rows`).
    forward_rows: int = 0
    # digen.sampling.time_shift: None, the adapter's sigmas; s, DanceGRPO's shifted schedule
    time_shift: float | None = None
    # digen.sampling.same_initial_noise: every sample of a group starts from its sample 0's noise
    same_initial_noise: bool = False
    # The reward reads the final latents (veRL-Omni's pipeline.output_type latent / both): each
    # trajectory carries them as final_latents [B, ...] fp32 (rewards.custom.reward_wants_latents).
    keep_final_latents: bool = False

    @property
    def uses_cfg(self) -> bool:
        return self.spec.guidance_scale > 1.0


def group_seed(seed: int, group_id: int) -> int:
    return (seed * 1_000_003 + group_id * 7919 + 17) % (2**63 - 1)


def sample_seed(seed: int, group_id: int, index: int) -> int:
    """The seed of sample ``index`` of group ``group_id`` (sample 0 has the group's seed)."""
    return (group_seed(seed, group_id) + index * 1_000_000_007) % (2**63 - 1)


def step_plan(settings: SamplingSettings, *, training_step: int, seed: int) -> tuple[list[int], list[int]]:
    """The SDE window of a training step and the steps trained inside it (same for all groups)."""
    window = select_sde_window(settings.num_steps, settings.window, training_step=training_step, seed=seed)
    gen = torch.Generator().manual_seed(group_seed(seed, -1 - training_step))
    trained = subsample_timesteps(window, settings.timestep_fraction, generator=gen)
    return window, trained


def shared_initial_noise(adapter: DiffusionAdapter, spec: SampleSpec, seed: int, group_ids: Sequence[int],
                         rows: int, x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[len(group_ids) * rows, ...]`` (each group's rows in turn) with every row of a group
    set to the initial noise of the group's sample 0 (DanceGRPO's shared noise): drawn from sample
    0's seed whichever slice of the group these rows are, so that a group split over workers
    still shares it. Each sample's own generator has drawn (and discarded) its own, so its SDE
    noise is the stream it has without sharing."""
    firsts = [adapter.prepare_latents(1, spec, torch.Generator().manual_seed(sample_seed(seed, g, 0)))
              for g in group_ids]
    return torch.cat([first.expand(rows, *first.shape[1:]) for first in firsts]).to(x.dtype).clone()


def carried_latent_steps(trained: Sequence[int]) -> list[int]:
    """The latents a trajectory carries: x_j and x_{j+1} of every trained step j, ascending
    (the trained steps of a window are consecutive, so ``len(trained) + 1`` of them then)."""
    return sorted({i for j in trained for i in (j, j + 1)})


def held_steps(trained: Sequence[int], next_step: int) -> list[int]:
    """The latents a :class:`GroupsInFlight` holds once steps ``[0, next_step)`` are taken: the
    carried ones reached so far and the newest, x_{next_step} (the next step's input)."""
    return sorted({i for i in carried_latent_steps(trained) if i < next_step} | {next_step})


def latent_fields(data: DataProto) -> dict[str, torch.Tensor] | None:
    """What a reward that reads latents gets of a trajectory record (None: it carries no final
    latents): ``latents_clean``, the final latents ``[B, ...]``, and the prompt conditioning the
    record carries (``prompt_embeds``, ``pooled_prompt_embeds``, ...: veRL-Omni's latent rewards
    send them with the latents). A record whose conditioning stays in the trainers' prompt cache
    (only digests travel) has the latents alone."""
    keys = data.batch.keys()
    if "final_latents" not in keys:
        return None
    out = {"latents_clean": data.batch["final_latents"]}
    if "cond" in keys:
        out |= {name: value for name, value in data.batch["cond"].items()}
    return out


def step_latents(data: DataProto, i: int, rows: slice | list[int] = slice(None)) -> torch.Tensor:
    """x_i ``[rows, *latent]`` of a trajectory record (every row carries the same steps)."""
    steps = data.batch["latent_steps"]
    if not torch.equal(steps, steps[:1].expand_as(steps)):
        raise ValueError("the rows of a micro-batch carry the latents of different steps (different training "
                         "steps' trajectories): every sample of a micro-batch must train the same steps")
    where = torch.nonzero(steps[0] == i).flatten()
    if not len(where):
        raise ValueError(f"the trajectory carries no x_{i}: only x_i for i in {steps[0].tolist()} (the input and "
                         "output latents of its trained steps)")
    return data.batch["latents"][rows, int(where[0])]


def velocity_in_chunks(
    adapter: DiffusionAdapter,
    x: torch.Tensor,
    sigma: torch.Tensor,
    cond: Conditioning,
    spec: SampleSpec,
    neg: Conditioning | None,
    rows: int,
) -> torch.Tensor:
    """fp32 velocity ``[B, ...]`` of ``x`` ``[B, ...]``, one transformer call per ``rows`` rows
    (``rows`` <= 0 or >= B: one call).

    Why chunks: a kernel's result for one row can depend on how many rows it is computed with
    (a GEMM picks its blocking from the shapes; in bf16 the results then differ in the last bit),
    and Qwen-Image trims the text padding to the longest prompt of
    the call. Rollout and trainer therefore make the *same* calls: chunks of ``rows`` consecutive
    rows starting at a multiple of ``rows``, where ``rows`` divides the group size, so each chunk
    is the same rows of one group whichever batch the group is in (see :func:`forward_rows`).
    A batch that is not a multiple of ``rows`` (validation's one sample per prompt) ends with a
    smaller call.
    """
    batch = x.shape[0]
    if rows <= 0 or rows >= batch:
        return adapter.predict_velocity(x, sigma, cond, spec, negative_cond=neg).float()
    out = []
    for start in range(0, batch, rows):
        part = slice(start, start + rows)
        out.append(
            adapter.predict_velocity(
                x[part], sigma[part], {k: v[part] for k, v in cond.items()}, spec,
                negative_cond={k: (v[part] if v.shape[0] == batch else v) for k, v in neg.items()} if neg else None,
            ).float()
        )
    return torch.cat(out)


def forward_rows(group_size: int, micro_batch_groups: int, ranks: int, split: int = 1,
                 rows_per_pass: int | None = None) -> int:
    """Rows per transformer call for rollout and training (:func:`velocity_in_chunks`); the
    arithmetic is the planner's (:func:`verl_digen.schedule.strategies.call_rows`), since it
    depends on how the planner splits groups over rollout workers."""
    from verl_digen.schedule.strategies import call_rows

    return call_rows(group_size, micro_batch_groups, ranks, split, rows_per_pass)


def rank_rows(batch: int, rows: int, rank: int, ranks: int) -> list[int]:
    """The rows of a ``batch``-row micro-batch that FSDP rank ``rank`` of ``ranks`` trains: whole
    transformer-call chunks of ``rows`` rows (:func:`forward_rows`), dealt round-robin, so that
    every rank makes the rollout's calls, as many as the others (the calls are collectives)."""
    m = rows or 1
    if batch % (m * ranks):
        raise ValueError(f"{batch} rows do not split into chunks of {m} rows evenly over {ranks} ranks")
    return [c * m + t for c in range(rank, batch // m, ranks) for t in range(m)]


def negative_prompt_of(record: Mapping[str, Any] | None, default: str) -> str:
    """The CFG negative prompt of a prompt record: its ``negative_prompt`` when it has a string
    there (a per-row column), else ``default`` (``digen.sampling.negative_prompt``)."""
    value = record.get("negative_prompt") if record is not None else None
    return value if isinstance(value, str) else default


def _repeat_cond(cond: Conditioning, n: int) -> Conditioning:
    return {k: v.repeat_interleave(n, dim=0) for k, v in cond.items()}


@dataclass(frozen=True)
class GroupRequest:
    """Which groups to sample: ``group_size`` images of each of ``prompts``.

    Group ``group_ids[k]`` (prompt ``prompts[k]``, dataset index ``prompt_indices[k]``) draws the
    noise of its sample ``i`` from ``sample_seed(seed, group_ids[k], i)``; ``training_step`` picks the SDE window and
    ``policy_version`` is the weights version the trajectories are recorded with.
    ``metadata[k]`` is prompt ``k``'s record (ground truth, ...): every sample of the group
    carries it to the reward. ``samples = (start, end)`` samples only that slice of each group
    (the same trajectories as in a whole-group call); None: all of them.

    A worker builds it from the controller's :class:`~verl_digen.workers.messages.GenerateRequest`
    (:meth:`for_generate`), adding what only the worker knows (its group size and seed).
    """

    prompts: Sequence[str]
    group_ids: Sequence[int]
    prompt_indices: Sequence[int]
    group_size: int
    training_step: int
    seed: int
    policy_version: int
    metadata: Sequence[dict[str, Any]] | None = field(default=None, kw_only=True)
    samples: tuple[int, int] | None = field(default=None, kw_only=True)

    @classmethod
    def for_generate(
        cls, request: GenerateRequest, *, group_size: int, seed: int, policy_version: int
    ) -> GroupRequest:
        """The groups a controller's generate request names, sampled with this worker's
        ``group_size``, ``seed`` and weights ``policy_version``."""
        return cls(
            request.prompts,
            request.group_ids,
            request.prompt_indices,
            group_size=group_size,
            training_step=request.step,
            seed=seed,
            policy_version=policy_version,
            metadata=request.metadata,
            samples=request.samples,
        )

    @property
    def sample_range(self) -> range:
        start, end = self.samples or (0, self.group_size)
        return range(start, end)

    @property
    def rows_per_group(self) -> int:
        return len(self.sample_range)


@dataclass
class GroupsInFlight:
    """A :class:`GroupRequest` part-way through sampling: what a TSP stage hands to the next one.

    ``request`` is the request itself (not a copy of its fields). Everything is on CPU so it can
    travel between processes (Ray object store); the generators travel as their states, so stage
    k+1 draws exactly the noise a single worker would have drawn. ``latents`` holds, in blocks
    ``[k, B, ...]`` along the first dimension, x_i for each i of
    ``held_steps(trained, next_step)``: the latents the trajectory will carry that are reached
    so far, and the newest; the others are dropped as each :func:`denoise` call reads its steps
    back, so neither a TSP stage's hand-over nor a worker's host memory holds all S+1.
    """

    request: GroupRequest
    window: list[int]
    trained: list[int]
    cond: Conditioning
    neg: Conditioning | None
    sigmas: torch.Tensor  # [S+1]
    latents: list[torch.Tensor]  # x_i, i in held_steps(trained, next_step), in blocks [k, B, ...] (ode: the newest)
    log_probs: torch.Tensor  # [B, S]
    generator_states: list[torch.Tensor]
    next_step: int = 0  # the first denoising step not yet taken
    ode: bool = False  # deterministic sampling (validation): ODE steps only, no trajectory kept
    # the max of the memory peaks of the stages taken so far (memory/measure.py interval_peaks,
    # each stage's worker's); the last stage puts it in the record's meta_info["memory"]
    memory: dict[str, float] = field(default_factory=dict)

    @property
    def batch(self) -> int:
        return self.latents[0].shape[1]

    @property
    def newest(self) -> torch.Tensor:
        """The latents of the last step taken (x_0 before any), ``[B, ...]``."""
        return self.latents[-1][-1]


@torch.no_grad()
def _encoders_on_device(adapter: DiffusionAdapter):
    """The block the prompts are encoded in: offloaded text encoders :func:`onloaded` for it,
    unless a prompt cache serves ``adapter.encode_prompts``. The cache moves them only for its
    misses, so a step whose prompts are all cached moves nothing (without this, 10-16 GB of
    encoders would cross the host link both ways on every generate call)."""
    from contextlib import nullcontext

    from verl_digen.models.prompt_cache import prompt_cache_of

    if prompt_cache_of(adapter) is not None:
        return nullcontext()
    return onloaded(adapter, adapter.text_encoder_names)


def begin_groups(
    adapter: DiffusionAdapter, request: GroupRequest, settings: SamplingSettings, *, ode: bool = False
) -> GroupsInFlight:
    """Encode the prompts and draw each group's initial noise (the head of sampling).

    ``ode=True`` samples deterministically (validation): no SDE window (every step is an Euler
    ODE step, no step noise drawn, log-probs stay 0), :func:`denoise` keeps only the newest
    latents, and the CFG negative prompt is encoded once and broadcast to every row. Rollouts
    encode it once per prompt; both keep the numerics they always had (for encoders whose
    output depends on the batch size, e.g. SD3's CLIP projection, the two differ by ~1 ulp).
    """
    spec = settings.spec
    prompts, rows = list(request.prompts), request.rows_per_group
    if request.samples is not None and not 0 <= request.samples[0] < request.samples[1] <= request.group_size:
        raise ValueError(f"samples={request.samples} is not a slice of a group of {request.group_size}")
    if ode:
        window, trained = [], []
    else:
        window, trained = step_plan(settings, training_step=request.training_step, seed=request.seed)
    # CFG's negative prompt: a prompt record's own (a "negative_prompt" column, as veRL-Omni's data
    # scripts write), else digen.sampling.negative_prompt
    negatives = [negative_prompt_of(record, settings.negative_prompt)
                 for record in (request.metadata or [None] * len(prompts))]
    with _encoders_on_device(adapter):  # offloaded encoders visit the device (if they encode)
        cond = _repeat_cond(adapter.encode_prompts(prompts), rows)  # [B, ...], B = groups x rows per group
        neg = None
        if settings.uses_cfg and ode and len(set(negatives)) == 1:
            batch = len(prompts) * rows
            neg_one = adapter.encode_prompts(negatives[:1])
            neg = {k: v.expand(batch, *v.shape[1:]).contiguous() for k, v in neg_one.items()}
        elif settings.uses_cfg:
            neg = _repeat_cond(adapter.encode_prompts(negatives), rows)
    generators = [torch.Generator().manual_seed(sample_seed(request.seed, g, i))
                  for g in request.group_ids for i in request.sample_range]
    x = torch.cat([adapter.prepare_latents(1, spec, gen) for gen in generators], dim=0)
    if settings.same_initial_noise:
        x = shared_initial_noise(adapter, spec, request.seed, list(request.group_ids), len(request.sample_range), x)
    if settings.time_shift is not None:
        sigmas = time_shift_sigmas(settings.num_steps, settings.time_shift)  # [S+1]
    else:
        sigmas = adapter.sigmas(settings.num_steps, spec).to(dtype=torch.float32).cpu()  # [S+1]
    return GroupsInFlight(
        request=request,
        window=window,
        trained=trained,
        cond={k: v.cpu() for k, v in cond.items()},
        neg={k: v.cpu() for k, v in neg.items()} if neg is not None else None,
        sigmas=sigmas,
        latents=[x.float().cpu()[None]],
        log_probs=torch.zeros(x.shape[0], settings.num_steps, dtype=torch.float32),
        generator_states=[g.get_state() for g in generators],
        ode=ode,
    )


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device`` without a host sync. PyTorch's blocking copy to a GPU ends with a
    stream synchronize (``memcpy_and_sync``), so a host tensor goes in through pinned memory,
    asynchronously (the caching host allocator keeps the pinned block until the copy is done)."""
    if device.type == "cuda" and t.device.type == "cpu":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


class _DeviceRecord:
    """Steps ``[start, end)`` of a trajectory, recorded on the device and read back once.

    One flat fp32 buffer holds the latents after each step ``[k, B, ...]`` and the log-probs of
    the SDE steps among them ``[m, B]``: a single device -> host copy (one host sync) at the end
    of the call, instead of one per step. The latents are what the memory planner charges a
    generate call on the device (``memory.plan``: ``samples * (num_steps + 1)`` latents, and
    ``samples * num_steps`` log-probs)."""

    def __init__(self, x: torch.Tensor, steps: range, sde_steps: list[int], *, ode: bool) -> None:
        self.steps = steps
        self.shape = (1 if ode else len(steps), *x.shape)
        self.n_latents = math.prod(self.shape)
        self.row = {i: k for k, i in enumerate(sde_steps)}
        self.flat = x.new_empty(self.n_latents + len(sde_steps) * x.shape[0], dtype=torch.float32)
        self.latents = self.flat[: self.n_latents].view(self.shape)
        self.log_probs = self.flat[self.n_latents :].view(len(sde_steps), x.shape[0])
        self.ode = ode

    def add(self, k: int, x: torch.Tensor, i: int, log_prob: torch.Tensor | None) -> None:
        """Record the latents after the ``k``-th step of the call (step ``i``) and its log-prob."""
        if not self.ode:
            self.latents[k] = x
        if log_prob is not None:
            self.log_probs[self.row[i]] = log_prob

    def read_back(self, state: GroupsInFlight, x: torch.Tensor) -> None:
        """The one host sync: the record into ``state`` (ode: only the newest latents ``x``)."""
        if self.ode:
            self.latents[0] = x
        host = self.flat.cpu()
        latents = host[: self.n_latents].view(self.shape)
        if self.ode:
            state.latents = [latents]
        elif self.shape[0]:  # keep what the trajectory will carry, and the newest (held_steps)
            start, end = self.steps.start, self.steps.stop
            keep = set(held_steps(state.trained, end))
            before = zip(held_steps(state.trained, start), torch.cat(state.latents))
            parts = [x for i, x in before if i in keep]
            parts += [latents[i - start - 1] for i in range(start + 1, end + 1) if i in keep]
            state.latents = [torch.stack(parts)]  # a copy: the call's whole read-back is freed
        for i, k in self.row.items():
            state.log_probs[:, i] = host[self.n_latents :].view(-1, self.shape[1])[k]


@torch.no_grad()
def denoise(adapter: DiffusionAdapter, state: GroupsInFlight, settings: SamplingSettings, end: int) -> GroupsInFlight:
    """Take denoising steps ``[state.next_step, end)`` (a TSP stage's share), in place.

    Nothing is read back from the device step by step: the trajectory is recorded on the device
    and read back once at the end (:class:`_DeviceRecord`), and inputs go in asynchronously
    (:func:`to_device`)."""
    if not state.next_step <= end <= settings.num_steps:
        raise ValueError(f"cannot denoise steps [{state.next_step}, {end}) of {settings.num_steps}")
    device = adapter.device
    spec = settings.spec
    steps = range(state.next_step, end)
    window_set = set(state.window)
    cond = {k: to_device(v, device) for k, v in state.cond.items()}
    neg = {k: to_device(v, device) for k, v in state.neg.items()} if state.neg is not None else None
    generators = []
    for st in state.generator_states:
        gen = torch.Generator()
        gen.set_state(st)
        generators.append(gen)
    x = to_device(state.newest, device)
    batch = state.batch
    sigmas = to_device(state.sigmas, device)
    record = _DeviceRecord(x, steps, [i for i in steps if i in window_set], ode=state.ode)
    for k, i in enumerate(steps):
        sigma = sigmas[i].expand(batch)
        sigma_next = sigmas[i + 1].expand(batch)
        # No autocast: the weights are in the run's dtype and the adapter casts every input to
        # it, exactly as the trainer's recomputation does (same path, same numbers).
        v = velocity_in_chunks(adapter, x, sigma, cond, spec, neg, settings.forward_rows)
        log_prob = None
        if i in window_set:
            # Each sample draws its step noise from its own generator: identical wherever it runs.
            noise = torch.cat([torch.randn((1, *x.shape[1:]), generator=gen, dtype=torch.float32) for gen in generators])
            out = _sde_with_noise(v, x, sigma, sigma_next, to_device(noise, device), settings)
            x, log_prob = out.prev_sample, out.log_prob
        else:
            x = ode_step(v, x, sigma, sigma_next)
        record.add(k, x, i, log_prob)
    record.read_back(state, x)  # before next_step moves on: held_steps(trained, next_step) was held
    state.generator_states = [gen.get_state() for gen in generators]
    state.next_step = end
    return state


@torch.no_grad()
def decode_groups(adapter: DiffusionAdapter, state: GroupsInFlight, settings: SamplingSettings) -> torch.Tensor:
    """Decode the final latents: ``[B, 3, H, W]`` (video ``[B, 3, F, H, W]``) fp32 CPU pixels in [0, 1],
    ``settings.vae_decode_chunk`` samples per VAE call (0: all at once), so the VAE's activations
    (large for video) stay bounded whatever the batch."""
    if state.next_step != settings.num_steps:
        raise ValueError(f"groups {list(state.request.group_ids)} finished at step {state.next_step} of {settings.num_steps}")
    latents = state.newest
    chunk = settings.vae_decode_chunk if settings.vae_decode_chunk > 0 else latents.shape[0]
    out = []
    with onloaded(adapter, ("vae",)):
        for start in range(0, latents.shape[0], chunk):
            part = latents[start : start + chunk].to(adapter.device)
            out.append(adapter.decode(part, settings.spec).float().clamp(0, 1).cpu())
    return torch.cat(out)


@torch.no_grad()
def finish_groups(adapter: DiffusionAdapter, state: GroupsInFlight, settings: SamplingSettings) -> DataProto:
    """Decode the final latents and pack the trajectory record (the tail of sampling)."""
    if state.ode:
        raise ValueError(f"groups {list(state.request.group_ids)} were sampled with ode=True (no trajectory): use decode_groups")
    from verl_digen.models.prompt_cache import prompt_cache_of

    images = pixels_to_uint8(decode_groups(adapter, state, settings))  # crosses processes as uint8
    request = state.request
    batch, g = state.batch, request.rows_per_group
    train_mask = torch.zeros(batch, settings.num_steps, dtype=torch.bool)
    train_mask[:, state.trained] = True
    sde_mask = torch.zeros_like(train_mask)
    sde_mask[:, state.window] = True
    carried = carried_latent_steps(state.trained)
    held = dict(zip(held_steps(state.trained, state.next_step), torch.cat(state.latents)))
    latents = torch.stack([held[i] for i in carried], dim=1) if carried else state.newest[:, None][:, :0]
    tensors = {
        "latents": latents.contiguous(),  # [B, K, ...]
        "latent_steps": torch.tensor(carried, dtype=torch.int64).expand(batch, -1).contiguous(),
        "log_probs": state.log_probs,
        "sigmas": state.sigmas.unsqueeze(0).expand(batch, -1).contiguous(),
        "train_mask": train_mask,
        "sde_mask": sde_mask,
        "images": images,
    }
    if settings.keep_final_latents:  # only when the reward asks: they cost object-store bytes
        tensors["final_latents"] = state.newest.detach().float().cpu().contiguous()
    prompts = [p for p in request.prompts for _ in range(g)]
    cache = prompt_cache_of(adapter)
    non_tensors: dict[str, np.ndarray] = {}
    if cache is None or not cache.rows_shared:
        # Nested tables: cut by rows with the rest of the record (select, concat), read back whole.
        # Also with a cache whose rows other workers do not share (cache domains, trainer/warmup.py).
        tensors["cond"] = TensorDict(state.cond, batch_size=[batch])
        if state.neg is not None:
            tensors["neg"] = TensorDict(state.neg, batch_size=[batch])
    else:  # the trainer reads the rows from its own cache: only which rows, and their digests, travel
        non_tensors["cond_digest"] = np.array([cache.digest(p) for p in prompts], dtype=object)
        if state.neg is not None:
            negatives = [negative_prompt_of(record, settings.negative_prompt)
                         for record in (request.metadata or [None] * len(request.prompts)) for _ in range(g)]
            non_tensors["negative_prompt"] = np.array(negatives, dtype=object)
            non_tensors["neg_digest"] = np.array([cache.digest(p) for p in negatives], dtype=object)
    non_tensors |= {
        "prompt": np.array(prompts, dtype=object),
        "group_id": np.array([x for x in request.group_ids for _ in range(g)], dtype=np.int64),
        "sample_index": np.array([i for _ in request.group_ids for i in request.sample_range], dtype=np.int64),
        "prompt_index": np.array([p for p in request.prompt_indices for _ in range(g)], dtype=np.int64),
        "policy_version": np.full(batch, request.policy_version, dtype=np.int64),
    }
    if request.metadata is not None:  # each sample carries its prompt's record to the reward
        records = np.empty(batch, dtype=object)
        records[:] = [record for record in request.metadata for _ in range(g)]
        non_tensors["metadata"] = records
    return DataProto.from_dict(
        tensors=tensors,
        non_tensors=non_tensors,
        meta_info={"training_step": request.training_step, "policy_version": request.policy_version,
                   "window": state.window},
    )


def sample_groups(adapter: DiffusionAdapter, *request: Any, settings: SamplingSettings, **fields: Any) -> DataProto:
    """Sample ``group_size`` trajectories for each prompt; a DataProto of ``len(prompts) * G`` rows.

    ``request`` / ``fields`` are :class:`GroupRequest`'s, positional or by name:
    ``sample_groups(adapter, prompts, group_ids, prompt_indices, group_size=G, settings=s,
    training_step=t, seed=seed, policy_version=v)``.
    """
    state = begin_groups(adapter, GroupRequest(*request, **fields), settings)
    denoise(adapter, state, settings, settings.num_steps)
    return finish_groups(adapter, state, settings)


def _sde_with_noise(v, x, sigma, sigma_next, noise, settings: SamplingSettings):
    """One SDE step whose Gaussian noise is given (drawn per group by the caller).

    ``sde_step_with_logprob`` draws from one generator for the whole batch; groups need
    their own streams, so we compute the mean/std by scoring a dummy and then form the
    sample from the caller's noise and score it.
    """
    probe = sde_step_with_logprob(
        v, x, sigma, sigma_next, noise_level=settings.noise_level, sde_type=settings.sde_type, prev_sample=x
    )
    prev = probe.mean + probe.std * noise
    return sde_step_with_logprob(
        v, x, sigma, sigma_next, noise_level=settings.noise_level, sde_type=settings.sde_type, prev_sample=prev
    )


def conditioning_from(data: DataProto, adapter: DiffusionAdapter | None = None) -> tuple[Conditioning, Conditioning | None]:
    """A trajectory record's conditioning and CFG negative (None without CFG), ``{name: [B, ...]}``.

    A record without them (its rollout had a prompt cache) is served from ``adapter``'s prompt
    cache, row by row from its ``prompt`` (and ``negative_prompt``), after checking that each
    row is bitwise the rollout's (``cond_digest`` / ``neg_digest``): two caches that encoded a
    prompt apart (separate cache directories on two nodes) may hold rows a few ulp apart, and the
    trainer's log-probs must be the rollout's."""
    if "cond" in data.batch.keys():
        cond = dict(data.batch["cond"].items())
        neg = dict(data.batch["neg"].items()) if "neg" in data.batch.keys() else None
        return cond, neg
    from verl_digen.models.prompt_cache import prompt_cache_of

    cache = prompt_cache_of(adapter) if adapter is not None else None
    if cache is None:
        raise RuntimeError("this trajectory carries no text embeddings (its rollout read them from its prompt cache, "
                           "digen.prompt_cache.enable) but this worker has no prompt cache installed to read them "
                           "from: enable digen.prompt_cache for every generating and training worker")
    columns = data.non_tensor_batch
    out = []
    for prompts_key, digest_key in (("prompt", "cond_digest"), ("negative_prompt", "neg_digest")):
        if prompts_key not in columns:
            out.append(None)
            continue
        prompts = [str(p) for p in columns[prompts_key]]
        for prompt, digest in sorted(set(zip(prompts, columns[digest_key]))):  # every row's, each pair once
            if cache.digest(prompt) != digest:
                raise RuntimeError(
                    f"the prompt cache {cache.model_key!r} of this worker holds other embeddings of {prompt!r} than "
                    "the rollout's (encoded apart, e.g. in separate cache directories): the trainer would not "
                    "recompute the rollout's log-probs. Put digen.prompt_cache.dir on a file system every node "
                    "shares, so each prompt is encoded once, or disable digen.prompt_cache (the embeddings then "
                    "travel with the trajectories)")
        out.append(cache.encode(prompts, device="cpu"))
    return out[0], out[1]
