"""veRL-Omni's diffusion keys through the real entry point: ``python -m verl.trainer.main_ppo`` as a
subprocess takes them as veRL-Omni's scripts write them (no '+') and gets past Hydra to the first
check that needs a real file. How each key maps: tests/unit/test_omni_keys.py."""

from __future__ import annotations

import pytest

from test_omni_keys import ARR


@pytest.mark.e2e  # the real entry point as a subprocess (it stops before Ray)
@pytest.mark.parametrize("flags", [[], ["-W", "ignore"]])
def test_python_dash_m_main_ppo_takes_veRL_Omnis_keys_as_its_scripts_write_them(tmp_path, flags):
    """The real command: ``import verl`` runs the plugin while runpy is still importing
    ``verl.trainer`` (``__main__`` has no spec yet), so the plugin reads the command line itself.
    The job gets past Hydra and stops at the first check that needs a real file: the model path."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, *flags, "-m", "verl.trainer.main_ppo", "trainer.v1.trainer_mode=digen",
         f"{ARR}.model.algorithm=flow_grpo", f"{ARR}.rollout.pipeline.height=384",
         f"{ARR}.model.path={tmp_path / 'no-such-model'}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "Could not override" not in out, out[-3000:]
    assert "model path" in out and "no-such-model" in out, out[-3000:]
