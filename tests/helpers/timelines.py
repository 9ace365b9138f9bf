"""Checks on a run's timeline that tests share (the runtime never needs them)."""

from __future__ import annotations

from verl_digen.schedule.timeline import Timeline, TaskRecord


def assert_exclusive(timeline: Timeline, eps: float = 1e-9) -> None:
    """Fail if two tasks overlap on one worker (a worker runs one task at a time); ``eps``
    forgives clock jitter between a task's end and the next one's start on real runs."""
    per: dict[str, list[TaskRecord]] = {w: [] for w in timeline.workers}
    for r in timeline.records:
        for w in r.workers:
            per[w].append(r)
    for w, recs in per.items():
        recs.sort(key=lambda r: r.start)
        for a, b in zip(recs, recs[1:]):
            assert b.start >= a.end - eps, f"{a.task} and {b.task} overlap on {w}"
