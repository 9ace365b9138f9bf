"""Our own per-step cost (``benchmarks/step_overhead.py``): what a step takes beyond its busiest
worker's tasks, read from a run's timeline, and the ``verl-digen`` profile's ``step_fixed_s`` set
from it (not veRL-Omni's fitted one)."""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks"))

from step_overhead import main, run_overhead, step_overheads  # noqa: E402

from verl_digen.sim.cost_model import load_catalog  # noqa: E402


def task(name, step, worker, start, end):
    workers = worker if isinstance(worker, list) else [worker]
    return {"task": name, "step": step, "workers": workers, "worker": ",".join(workers), "start": start, "end": end}


def two_steps(gap: float) -> list[dict]:
    """Two colocated workers; step 0's busiest worker is busy 0.9 s of a period of 1.0 + gap."""
    return [
        task("gen:0", 0, "fused0", 0.0, 0.5), task("gen:1", 0, "fused1", 0.0, 0.4),
        task("train:0", 0, "fused0", 0.55, 0.85), task("train:1", 0, "fused1", 0.5, 0.8),
        task("opt:0", 0, ["fused0", "fused1"], 0.9, 1.0),
        task("gen:2", 1, "fused0", 1.0 + gap, 1.5 + gap), task("opt:1", 1, ["fused0", "fused1"], 1.6 + gap, 1.7 + gap),
    ]


def test_the_overhead_is_the_period_beyond_the_busiest_workers_tasks():
    # fused0: 0.5 + 0.3 + 0.1 = 0.9 s of tasks in a 1.0 s period: 0.1 s of dispatch and gaps
    assert step_overheads(two_steps(0.0)) == {0: pytest.approx(0.1)}
    # the driver's time between steps (advantages, logging, a checkpoint) adds one for one
    assert step_overheads(two_steps(0.25)) == {0: pytest.approx(0.35)}


def test_a_multi_worker_task_counts_for_each_worker_and_the_last_step_is_left_out():
    records = two_steps(0.0)
    over = step_overheads(records)
    assert set(over) == {0}  # step 1 has no next start
    # without the shared optimizer step, fused0 is busy 0.8 s: 0.2 s beyond it
    no_opt = [r for r in records if r["task"] != "opt:0"]
    assert step_overheads(no_opt)[0] == pytest.approx(0.2)


def test_a_run_directory_is_read_and_the_warmup_left_out(tmp_path, capsys):
    records = []
    for s in range(5):  # a period of 1.0 s with 0.6 s of tasks, the first step 0.5 s longer (warm-up)
        t0 = s * 1.0 + (0.5 if s else 0.0)
        records.append(task(f"gen:{s}", s, "fused0", t0, t0 + 0.6 + (0.5 if s == 0 else 0.0)))
    (tmp_path / "timeline.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s + 1, "step_time_s": 1.0}) + "\n" for s in range(5)))
    out = run_overhead(str(tmp_path), warmup=1)
    assert out["steps"] == 3 and out["median_s"] == pytest.approx(0.4) and out["median_step_s"] == 1.0
    assert main([str(tmp_path)]) == 0
    assert "per-step overhead median 0.400 s" in capsys.readouterr().out
    with pytest.raises(ValueError, match="no step after"):
        run_overhead(str(tmp_path), warmup=10)


def test_our_step_fixed_s_is_the_measured_one_with_its_source():
    ours = load_catalog().systems["verl-digen"]
    assert 0 < ours.step_fixed_s < 0.1 * load_catalog().systems["verl-omni"].step_fixed_s  # our runtime, not veRL-Omni's ~26 s
    assert "benchmarks/step_overhead.py" in ours.sources["step_fixed_s"]
