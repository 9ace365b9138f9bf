"""What crosses the Ray object store each step, recorded by a real run: each step's metrics carry
the bytes of its trajectories. What a trajectory carries and the prediction of its bytes:
tests/unit/test_object_store.py."""

from __future__ import annotations

import json
import os

import pytest


@pytest.mark.e2e
@pytest.mark.usefixtures("shared_ray")
def test_each_step_records_the_bytes_of_its_trajectories(tmp_path, tiny_flux):
    from runs import run

    result = run(tmp_path, "bytes", "trainer.total_training_steps=1")
    with open(os.path.join(result.output_dir, "metrics.jsonl")) as f:
        (m,) = [json.loads(line) for line in f]
    assert m["perf/object_store_bytes"] > 0
    assert m["perf/object_store_bytes"] == result.metrics[0]["perf/object_store_bytes"]
