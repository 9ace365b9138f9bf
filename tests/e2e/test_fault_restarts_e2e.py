"""digen.fault.restarts in real runs: a worker killed after the checkpoint of step 2 is replaced in
the same job, the run resumes from that checkpoint and ends as the uninterrupted run does
(colocated and disaggregated GAP: the same final weights and per-step metrics, bitwise on CPU);
under TCSS the groups generated ahead on stale weights are regenerated and none is trained twice.
Without restarts a death stops the run: tests/e2e/test_checkpoint_e2e.py."""

from __future__ import annotations

import pytest
import ray
import torch
from safetensors.torch import load_file

from runs import metrics_lines, run_config, timeline_records
from test_checkpoint_e2e import EXACT_KEYS
from verl_digen.schedule.plan import WorkerId, group_ids
from verl_digen.trainer.checkpoint import RunCheckpoints
from verl_digen.trainer.loop import RunStopped, run_training

STEPS = 4
KILL_AFTER = 2  # the step whose checkpoint is written just before the kill
GROUPS = 4  # digen.batch.groups_per_step: the group ids of step s (0-based) are s * 4 .. s * 4 + 3
COMMON = [f"trainer.total_training_steps={STEPS}", "trainer.save_freq=1", "digen.save_final_weights=true"]
DISAGGREGATED = ["digen.placement=disaggregated", "digen.pools.rollout.devices=1", "digen.pools.trainer.devices=1"]
LAYOUTS = {
    "colocated": [],
    "gap": DISAGGREGATED + ["digen.gap.enable=true"],
}
TCSS = DISAGGREGATED + ["digen.gap.enable=true", "digen.async.max_staleness=1"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, tiny_flux, shared_ray):
    """The uninterrupted run of each layout, run once for the module's tests."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    runs = {}

    def get(name):
        if name not in runs:
            runs[name] = run_training(run_config(tmp, name, *COMMON, *LAYOUTS[name],
                                                 f"trainer.default_local_dir={tmp / name}_ck"))
        return runs[name]

    return get


def kill_after_saves(monkeypatch, victim: WorkerId, steps=(KILL_AFTER,)) -> list:
    """Kill ``victim`` (``ray.kill``) right after the checkpoint of each of ``steps`` is written,
    once per step: the next step finds it dead. Returns the list of kills made so far."""
    save = RunCheckpoints.save
    killed = []

    def save_then_kill(self, actors, step, metrics):
        path = save(self, actors, step, metrics)
        if step in steps and step not in killed:
            killed.append(step)
            ray.kill(actors[victim], no_restart=True)
        return path

    monkeypatch.setattr(RunCheckpoints, "save", save_then_kill)
    return killed


def killed_run(tmp_path, monkeypatch, overrides, victim: WorkerId):
    """A run with digen.fault.restarts=1 whose ``victim`` is killed after the checkpoint of step
    ``KILL_AFTER``."""
    killed = kill_after_saves(monkeypatch, victim)
    result = run_training(run_config(tmp_path, "killed", *COMMON, *overrides, "digen.fault.restarts=1",
                                     f"trainer.default_local_dir={tmp_path}/ck"))
    assert killed == [KILL_AFTER], "the victim was never killed"
    return result


def _victim(name: str) -> WorkerId:
    return WorkerId("rollout", 0) if name != "colocated" else WorkerId("fused", 0)


@pytest.mark.e2e
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_killed_worker_is_replaced_and_the_run_ends_as_the_uninterrupted_one(
        name, tmp_path, monkeypatch, uninterrupted, capfd):
    straight = uninterrupted(name)
    restarted = killed_run(tmp_path, monkeypatch, LAYOUTS[name], _victim(name))

    a, b = load_file(straight.extra["final_weights"]), load_file(restarted.extra["final_weights"])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ma, mb = metrics_lines(straight.output_dir), metrics_lines(restarted.output_dir)
    assert [m["step"] for m in mb] == list(range(1, STEPS + 1))
    for x, y in zip(ma, mb):
        assert {k: x[k] for k in EXACT_KEYS} == {k: y[k] for k in EXACT_KEYS}
    # counted: 0 in the steps the checkpoint brought back, 1 in each step after the restart
    assert [m["fault/restarts"] for m in mb] == [0] * KILL_AFTER + [1] * (STEPS - KILL_AFTER)
    assert restarted.extra["fault/restarts"] == 1
    lines = [line for line in capfd.readouterr().out.splitlines() if "(digen.fault.restarts)" in line]
    assert len(lines) == 1 and f"worker {_victim(name)} (pool '{_victim(name).pool}') died" in lines[0]
    assert f"resumed from step {KILL_AFTER}" in lines[0]


@pytest.mark.e2e
def test_a_tcss_restart_regenerates_the_groups_generated_ahead_and_trains_none_twice(tmp_path, monkeypatch, tiny_flux,
                                                                                   shared_ray):
    """Rule: the checkpoint of step k holds no group generated ahead for step k + 1 on the stale
    weights of version k - 1; after the restart those groups are generated again from the
    checkpoint's weights (version k), and every group of steps k + 1.. is trained exactly once."""
    restarted = killed_run(tmp_path, monkeypatch, TCSS, WorkerId("rollout", 0))
    assert restarted.extra["fault/restarts"] == 1
    recs = timeline_records(restarted.output_dir)  # the run after the restart
    trained = sorted(g for r in recs if r["kind"] == "train" for g in r["groups"])
    after = [g for s in range(KILL_AFTER, STEPS) for g in group_ids(s, GROUPS)]
    assert trained == sorted(after) and len(set(trained)) == len(trained)
    regenerated = sorted(g for r in recs if r["kind"] == "generate" and r["step"] == KILL_AFTER for g in r["groups"])
    assert regenerated == sorted(group_ids(KILL_AFTER, GROUPS))
    assert {r["version"] for r in recs if r["kind"] == "generate" and r["step"] == KILL_AFTER} == {KILL_AFTER}
    for r in recs:
        if r["kind"] == "generate":
            assert 0 <= r["step"] - r["version"] <= 1
    assert [m["step"] for m in metrics_lines(restarted.output_dir)] == list(range(1, STEPS + 1))


@pytest.mark.e2e
def test_a_death_after_the_restarts_are_used_up_stops_the_run_as_before(tmp_path, monkeypatch, tiny_flux, shared_ray,
                                                                      capfd):
    """digen.fault.restarts=1: the first death (after step 1) restarts, the second (the new
    worker, after step 2) stops the run cleanly, naming the worker and how to resume."""
    killed = kill_after_saves(monkeypatch, WorkerId("fused", 0), steps=(1, 2))
    with pytest.raises(RunStopped) as err:
        run_training(run_config(tmp_path, "twice", "trainer.total_training_steps=3", "trainer.save_freq=1",
                                "digen.fault.restarts=1", f"trainer.default_local_dir={tmp_path}/ck"))
    assert killed == [1, 2]
    assert "fused0 (pool 'fused') died" in str(err.value) and "resume_mode=auto" in str(err.value)
    out = capfd.readouterr().out
    assert out.count("(digen.fault.restarts)") == 1 and "resumed from step 1" in out
    assert [m["fault/restarts"] for m in metrics_lines(str(tmp_path / "twice"))] == [0, 1]
