"""Deadlines that follow the plan: how long each blocking call of a run may wait.

A run blocks in a handful of places: the workers' load, the weight channel's set-up, the
executor's wait for the next task to finish, TSP's profile call, the weight send's wait for the
rollout workers, the join of that send, the trainer group's and the channel's collectives, a
checkpoint save, the final sync and save, and the pools' placement groups. One global number
cannot fit them all: under TCSS the send normally waits a whole rollout phase (the rollout
workers reach the sync only after generating the next step), which at real size is ten minutes
for Wan2.1 on 4 + 4 GPUs, while a tiny run's calls take seconds.

So each call's deadline is the cost model's predicted wait at real size (what the call waits
for, simulated on the run's own plan: :func:`predicted_waits`) times :data:`MARGIN`, plus the
user's floor ``digen.task_timeout_s``: ``deadline = floor + MARGIN x predicted``. A run without a
real-size prediction (a tiny model, an architecture without a profile) gets the floor for every
call, as before. An emulated run sleeps ``time_scale`` real seconds per modelled second, so its
deadlines are scaled alike (:meth:`Deadlines.scaled`), and its rehearsal sees the real run's
waits, timeouts and orderings. ``python -m verl_digen.check`` prints each call's predicted wait
next to its deadline (:func:`check_lines`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any

from verl_digen.schedule.plan import TaskKind

# The cost model's real-size prediction is a model, not a measurement (the simulator's plans
# match the published runs to ~10-20%: docs/cost_model.md); twice the predicted wait leaves room
# for that error and for a slow step (a node under load, a long prompt), while a hang is still
# reported within a few predicted waits instead of never.
MARGIN = 2.0

# Weights read from disk at load and written at a checkpoint, per worker: an assumed 0.5 GB/s,
# the low end of a network filesystem shared by the 8 GPUs of a node (a local NVMe reads 2-7
# GB/s); a deadline errs long.
DISK_GBPS = 0.5

# The cost-model profile of each shipped architecture (verl_digen/sim/profiles/*.yaml). The sd3
# presets are Stable Diffusion 3.5 Medium (configs/sd3_*.yaml).
PROFILE_OF_ARCH = {
    "flux": "flux-12b",
    "sd3": "sd3.5-medium",
    "qwen_image": "qwen-image-20b",
    "wan": "wan2.1-14b",
    "hunyuan_video": "hunyuanvideo-13b",
}

# What each deadline covers, in the order the check prints them.
CALLS = {
    "placement_s": "placement groups ready (placement/pools.py)",
    "load_s": "workers load and set up (init_models, prompt-cache warm-up, the weight channel opening)",
    "channel_s": "weight channel's collectives (receivers in the broadcast)",
    "profile_s": "TSP's step profile on a rollout worker",
    "task_s": "executor: some task finishes",
    "send_s": "weight send waits for the rollout workers (TCSS: a rollout phase)",
    "join_s": "the next optimizer step joins that send",
    "collective_s": "trainer group's collectives (process-group timeout)",
    "checkpoint_s": "checkpoint save",
    "final_s": "final sync join and weights save",
}


# The calls an emulated run times as the real run would (its workers sleep the modelled seconds
# of tasks and transfers, and wait on an emulated weight channel): the executor's wait, the weight
# send's, its join, the channel's and the trainer group's collectives, the final join.
EMULATED = ("task_s", "send_s", "join_s", "channel_s", "collective_s", "final_s")


@dataclass(frozen=True)
class Waits:
    """The predicted longest wait of each blocking call, in modelled seconds (0: none predicted)."""

    placement_s: float = 0.0
    load_s: float = 0.0
    channel_s: float = 0.0
    profile_s: float = 0.0
    task_s: float = 0.0
    send_s: float = 0.0
    join_s: float = 0.0
    collective_s: float = 0.0
    checkpoint_s: float = 0.0
    final_s: float = 0.0


@dataclass(frozen=True)
class Deadlines:
    """Seconds each blocking call of a run may wait before it is an error (see the module
    docstring for the rule). Built on the driver and handed to the workers (``set_deadlines``)."""

    placement_s: float
    load_s: float
    channel_s: float
    profile_s: float
    task_s: float
    send_s: float
    join_s: float
    collective_s: float
    checkpoint_s: float
    final_s: float

    @classmethod
    def from_waits(cls, waits: Waits, floor_s: float) -> "Deadlines":
        """``floor_s + MARGIN x wait`` for each call, with two orderings the failure messages need:
        the join outlasts the send it waits for (the send's own error names what it waited for),
        a collective outlasts the join (trainer 0 joins the last send while the other FSDP ranks
        wait in the state stream's all-gather; the channel's receivers wait in the broadcast while
        the sender waits for them), and a checkpoint save outlasts a task (it is queued behind one)."""
        d = {f.name: floor_s + MARGIN * getattr(waits, f.name) for f in fields(Waits)}
        d["join_s"] = max(d["join_s"], d["send_s"] + floor_s)
        d["channel_s"] = max(d["channel_s"], d["send_s"])
        d["collective_s"] = max(d["collective_s"], d["join_s"] + floor_s)
        d["final_s"] = max(d["final_s"], d["join_s"])
        # a save is queued behind the task a trainer is running
        d["checkpoint_s"] = max(d["checkpoint_s"], d["task_s"])
        return cls(**d)

    @classmethod
    def floor(cls, floor_s: float) -> "Deadlines":
        """Every call at the floor: a run without a real-size prediction."""
        return cls.from_waits(Waits(), floor_s)

    def scaled(self, time_scale: float) -> "Deadlines":
        """The deadlines of an emulated run that sleeps ``time_scale`` real seconds per modelled
        one: those of the calls the emulation times (:data:`EMULATED`) scaled, so its rehearsal
        meets the real run's waits, timeouts and orderings; the set-up calls' kept, since emulated
        workers load nothing and their set-up takes what Ray's actor start takes."""
        return replace(self, **{name: getattr(self, name) * time_scale for name in EMULATED})


def workload_of(cfg: Any) -> dict[str, Any]:
    """The cost model's :class:`~verl_digen.sim.cost_model.Workload` of a run's config: its
    sizes, steps, guidance, batch, SDE window, LoRA, KL and mini-batches. The reward is costed as
    a cheap one (the shipped presets score pixels on the host)."""
    s, b = cfg.sampling, cfg.batch
    return dict(
        height=s.height, width=s.width, frames=s.num_frames, num_steps=s.num_steps, cfg=s.guidance_scale > 1.0,
        group_size=b.group_size, groups_per_step=b.groups_per_step,
        sde_window=0 if s.sde_window.mode == "all" else s.sde_window.size, timestep_fraction=s.timestep_fraction,
        lora=cfg.model.lora.enable, lora_rank=cfg.model.lora.rank, kl=cfg.algo.kl_beta > 0,
        gradient_checkpointing=cfg.model.checkpointing, mini_batches=b.mini_batches_per_step,
        vae_decode_chunk=cfg.model.vae_decode_chunk or 0, reward="",
    )


def run_costs(cfg: Any, spec: Any, *, model: str | None = None, device: str | None = None,
              catalog: Any = None) -> Any | None:
    """The cost model of the run ``cfg`` plans as ``spec``: profile ``model`` (default: the
    architecture's, :data:`PROFILE_OF_ARCH`) of ``catalog`` (default: the shipped profiles) on
    ``device`` (default ``digen.memory.device_type``) with the config's workload; None when the
    architecture has no profile."""
    from verl_digen.sim.cost_model import CostModel, load_catalog

    model = model or PROFILE_OF_ARCH.get(cfg.model.arch or "")
    if model is None:
        return None
    catalog = catalog if catalog is not None else load_catalog()
    costs = CostModel.from_catalog(catalog, model, devices=[device or cfg.memory.device_type], **workload_of(cfg))
    return costs.for_spec(spec)


def predicted_waits(cfg: Any, layout: Any, costs: Any, device: str) -> Waits:
    """Each blocking call's longest wait, in modelled seconds, from three steps of the run's own
    plan simulated with ``costs`` (the loop's step driver: :func:`~verl_digen.sim.simulator.simulate`).

    - task: the longest task (the executor waits for *some* task; never longer than that);
    - send: from an optimizer step's end (the send starts) to the end of its sync (the receivers
      arrive after their generation, then the broadcast); join: how far that send runs past the
      next optimizer step's end, where trainer 0 joins it;
    - load: the denoiser and text encoders read from disk at :data:`DISK_GBPS`, then the first
      state stream; checkpoint: a rank's share of the trainable weights and Adam's two moments
      written alike; profile: a rollout worker's two profiled generate calls of one group;
    - final: the last step's send and the final weights written.
    """
    from verl_digen.sim.cost_model import Cluster, PoolPlacement
    from verl_digen.sim.simulator import simulate

    spec = layout.spec
    # each pool's devices on every node, as the emulated cluster places them (workers/emulated.py)
    cluster = Cluster({name: PoolPlacement.spread(on_nodes, device) for name, (on_nodes, _accel) in layout.pools.items()})
    steps = 3
    sim = simulate(spec, costs, cluster, steps=steps, warmup=1, mirror_loop=True, tag_switch_s=cfg.tag.switch_cost_s,
                   tsp_balance=spec.tsp_stages > 1 and cfg.tsp.balance, gat_micro_batches=cfg.gat.fixed,
                   tag_groups=cfg.tag.fixed)
    records = sim.timeline.records
    task = max((r.end - r.start for r in records), default=0.0)
    opt_end: dict[int, float] = {}
    for r in records:
        if r.kind == TaskKind.OPTIMIZER_STEP.value:
            opt_end[r.step] = max(opt_end.get(r.step, 0.0), r.end)
    sync_end = {r.step: r.end for r in records if r.kind == TaskKind.SYNC.value}
    send = max((sync_end[s] - opt_end[s] for s in sync_end if s in opt_end), default=0.0)
    join = max((sync_end[s] - opt_end[s + 1] for s in sync_end if s + 1 in opt_end), default=0.0)
    dev = costs.device(device)
    group = costs.train_group(cluster)
    m = costs.model
    read = (costs.param_bytes + 2.0 * m.text_encoder_params) / (DISK_GBPS * 1e9)
    state = 3 * 4.0 * costs.trainable_params / max(1, group.shard)  # fp32 weights + two moments, per rank
    stream = costs.state_stream_seconds(dev, group)
    sync = costs.sync_seconds(cluster) if spec.placement == "disaggregated" else 0.0
    profile = 2 * costs.generate_seconds(spec.group_size, dev) if spec.tsp_stages > 1 else 0.0
    last = max(opt_end) if opt_end else None
    final_send = (sync_end[last] - opt_end[last]) if last in sync_end else sync
    return Waits(
        load_s=read + stream, channel_s=sync, profile_s=profile, task_s=task, send_s=max(send, 0.0),
        join_s=max(join, 0.0), collective_s=stream, checkpoint_s=state / (DISK_GBPS * 1e9),
        final_s=max(final_send, 0.0) + 2.0 * costs.trainable_params / (DISK_GBPS * 1e9),
    )


def plan_deadlines(cfg: Any, layout: Any, costs: Any | None, device: str, time_scale: float = 1.0) -> tuple[Waits, Deadlines]:
    """The run's predicted waits (modelled seconds) and deadlines (real seconds: :meth:`Deadlines.scaled`
    by ``time_scale`` for an emulated run); without ``costs`` no wait is predicted and every
    deadline is ``digen.task_timeout_s``."""
    waits = predicted_waits(cfg, layout, costs, device) if costs is not None else Waits()
    deadlines = Deadlines.from_waits(waits, cfg.task_timeout_s)
    return waits, deadlines.scaled(time_scale) if time_scale != 1.0 else deadlines


def run_deadlines(cfg: Any, layout: Any, spec: Any, emulation: tuple[Any, str, float] | None, *,
                  use_gpu: bool) -> Deadlines:
    """The deadlines a run sets (the training loop's): predicted for an emulated run
    (``emulation``: its cost model, device type and time scale, scaled as its sleeps) and for a GPU
    run of a model at a real path (its architecture's profile on ``digen.memory.device_type``); a
    CPU or tiny-model run keeps ``digen.task_timeout_s`` for every call (no real-size prediction
    applies to it), as does an architecture without a profile."""
    if emulation is not None:
        costs, device, scale = emulation
    elif use_gpu and cfg.model.path is not None:
        costs, device, scale = run_costs(cfg, spec), cfg.memory.device_type, 1.0
    else:
        costs = None
    if costs is None:
        return Deadlines.floor(cfg.task_timeout_s)
    _, deadlines = plan_deadlines(cfg, layout, costs, device, scale)
    print(f"[verl-digen] deadlines from the plan (python -m verl_digen.check lists them): weight send "
          f"{deadlines.send_s:.3g} s, task {deadlines.task_s:.3g} s, load {deadlines.load_s:.3g} s", flush=True)
    return deadlines


def check_lines(checked: Any) -> list[str]:
    """``python -m verl_digen.check``'s lines: each blocking call's predicted longest wait at real
    size next to its deadline (none may exceed it)."""
    cfg = checked.cfg
    costs = run_costs(cfg, checked.layout.spec)
    if costs is None:
        return [f"deadlines: every blocking call {cfg.task_timeout_s:g} s (digen.task_timeout_s; "
                f"no real-size profile of digen.model.arch={cfg.model.arch!r} to predict waits)"]
    waits, deadlines = plan_deadlines(cfg, checked.layout, costs, cfg.memory.device_type)
    lines = [f"deadlines (predicted wait at real size on {cfg.memory.device_type} -> deadline = "
             f"digen.task_timeout_s {cfg.task_timeout_s:g} s + {MARGIN:g} x wait):"]
    for name, what in CALLS.items():
        wait, limit = getattr(waits, name), getattr(deadlines, name)
        flag = "" if wait < limit else "  EXCEEDS ITS DEADLINE"
        lines.append(f"  {what}: {_s(wait)} -> {_s(limit)}{flag}")
    return lines


def _s(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds >= 10 or seconds == 0 else f"{seconds:.2g} s" if math.isfinite(seconds) else "inf"
