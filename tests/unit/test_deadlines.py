"""Deadlines follow the plan (verl_digen/sim/deadlines.py): each blocking call may wait
``digen.task_timeout_s`` plus twice the cost model's predicted wait of what it waits for.

- the rule and its orderings (the join outlasts the send, a collective the join);
- the trainer group is created with that collective deadline (not NCCL's default 10 minutes);
- every shipped preset's predicted waits stay under their deadlines: ``python -m verl_digen.check``
  prints them, and test_check_e2e.py's walk of every preset asserts none exceeds its deadline;
- the rehearsals of every preset at its real device count, whose observed waits stay within
  their deadlines: tests/e2e/test_deadlines_e2e.py."""

from __future__ import annotations

from datetime import timedelta

import pytest

from verl_digen.sim.deadlines import EMULATED, MARGIN, Deadlines, Waits


def test_a_deadline_is_the_floor_plus_twice_the_predicted_wait_with_the_joins_and_collectives_outlasting_the_send():
    waits = Waits(task_s=179.0, send_s=616.0, load_s=79.0)
    d = Deadlines.from_waits(waits, 600.0)
    assert d.task_s == 600 + MARGIN * 179 and d.load_s == 600 + MARGIN * 79
    assert d.send_s == 600 + MARGIN * 616 > 616
    # the send's own error (what it waited for) comes first; a collective outlasts the join
    assert d.join_s > d.send_s and d.collective_s > d.join_s and d.channel_s >= d.send_s and d.final_s >= d.join_s
    assert d.checkpoint_s >= d.task_s  # a save is queued behind a running task
    # an emulated run scales the calls it times, not its set-up (emulated workers load nothing)
    s = d.scaled(0.01)
    assert all(getattr(s, n) == pytest.approx(getattr(d, n) * 0.01) for n in EMULATED)
    assert s.load_s == d.load_s and s.placement_s == d.placement_s
    # nothing predicted: every call at the floor
    assert set(vars(Deadlines.floor(600.0)).values()) >= {600.0}


def test_the_trainer_group_is_created_with_the_plans_collective_deadline(monkeypatch):
    """Without ``timeout=`` the default group keeps NCCL's 10 minutes whatever the run allows; the
    trainer ranks wait in a collective while trainer 0 joins the last weight send."""
    import torch.distributed as dist

    from verl_digen.config.schema import DigenConfig
    from verl_digen.workers import worker as worker_module

    w = worker_module.DiffusionWorker.__new__(worker_module.DiffusionWorker)  # no Ray, no model: the group only
    w.cfg = DigenConfig()
    w.deadlines = Deadlines.from_waits(Waits(send_s=616.0), 600.0)
    w._store = None
    seen = {}
    monkeypatch.setattr(w, "_joins_trainer_group", lambda: True)
    monkeypatch.setattr(type(w), "rank", property(lambda self: 0))
    monkeypatch.setattr(type(w), "world_size", property(lambda self: 2))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(worker_module, "init_process_group_retrying", lambda **kw: seen.update(kw))
    monkeypatch.setattr(worker_module.torch.cuda, "is_available", lambda: False)
    w._join_trainer_group()
    assert seen["timeout"] == timedelta(seconds=w.deadlines.collective_s)
    assert seen["timeout"] > timedelta(seconds=600 + 616)
