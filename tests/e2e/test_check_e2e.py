"""``python -m verl_digen.check`` on every shipped preset at its real device counts (minutes: every
preset's memory plan at real size, no Ray, no run): each would start, planned with its family's
shipped real configs, its deadlines kept, nothing written. The command's other checks:
tests/unit/test_check.py."""

from __future__ import annotations

import os

import pytest

from verl_digen.config.compose import CONFIG_DIR
from test_check import _run

PRESETS = sorted(f[:-5] for f in os.listdir(CONFIG_DIR) if f.endswith(".yaml") and f != "digen_base.yaml")


@pytest.mark.e2e
@pytest.mark.slow  # minutes: every preset's memory plan at real size (no Ray, no run)
def test_every_shipped_preset_would_start_at_its_real_device_counts(capsys, tmp_path, monkeypatch):
    import ray
    import yaml

    monkeypatch.chdir(tmp_path)  # nothing may be written (a run directory would appear here)
    assert {"wan_colocated", "qwen_image_full_disaggregated", "digits", "digen_trainer"} <= set(PRESETS)
    for name in PRESETS:
        status, out, err = _run(capsys, "--config-name", name)
        assert status == 0, (name, err)
        with open(os.path.join(CONFIG_DIR, f"{name}.yaml")) as f:
            doc = yaml.safe_load(f)
        gpus = (doc.get("trainer") or {}).get("n_gpus_per_node", 2)
        nnodes = (doc.get("trainer") or {}).get("nnodes", 1)
        assert f"cluster: {nnodes} node(s) x {gpus} GPU(s)" in out, (name, out)
        assert "check: OK, the run would start" in out and "call rows: " in out
        assert "object-store bytes per step: " in out, (name, out)  # memory/object_store.py
        assert "deadlines" in out and "EXCEEDS ITS DEADLINE" not in out, (name, out)  # predicted waits (sim/deadlines.py)
        arch = ((doc.get("digen") or {}).get("model") or {}).get("arch")
        if arch:  # a real family: planned at real size with the shipped configs, every role shown
            assert f"digen.model.path unset: checked with the shipped configs of {arch}" in out, out
            placement = doc["digen"]["placement"]
            roles = ["colocated"] if placement == "colocated" else ["rollout", "trainer"]
            for role in roles:
                assert f"memory: {role} peaks at " in out, (name, out)
        else:  # the built-in tiny / toy models: not built by the check
            assert "built-in tiny model" in out and "memory: not planned" in out
    assert os.listdir(tmp_path) == [] and not ray.is_initialized()
