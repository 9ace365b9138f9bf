"""A training step's timing metrics, read from a timeline.

The same function serves the Ray loop (wall-clock seconds) and the simulator (virtual
seconds): images/s, step time, bubble fraction and where the idle time sits, weight-sync
time. What the step *learned* (rewards, losses) is the executor's to add.
"""

from __future__ import annotations

from typing import Any

from verl_digen.schedule.plan import TaskKind
from verl_digen.schedule.timeline import Timeline


def step_timing_metrics(spec: Any, timeline: Timeline, step: int, t0: float, t1: float) -> dict[str, Any]:
    """Metrics of training step ``step`` (0-based) that ran over ``[t0, t1]``."""
    wall = t1 - t0
    images = spec.groups_per_step * spec.group_size
    syncs = [r for r in timeline.since(t0) if r.kind == TaskKind.SYNC.value and r.end <= t1]
    trainers = [str(w) for w in spec.trainers]
    rollout = [str(w) for w in spec.generators]
    return {
        "step": step + 1,
        "images_per_s": images / wall if wall > 0 else 0.0,
        "images_per_device_s": images / wall / spec.devices if wall > 0 else 0.0,
        "step_time_s": wall,
        "bubble_fraction": timeline.bubble_fraction(t0, t1),
        "weight_sync_s": sum(r.end - r.start for r in syncs),
        # Where the idle time sits: trainers waiting for the first groups (head), rollout
        # waiting for the trainers to finish, step and sync (drain).
        "bubble/head_trainer": timeline.edge_idle(trainers, t0, t1, head_kind="train")[0],
        "bubble/drain_rollout": timeline.edge_idle(rollout, t0, t1, drain_kind="generate")[1],
        "strategy": spec.name,
        "devices": spec.devices,
    }
