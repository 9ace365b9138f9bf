"""Bad input on the command line: ``python -m verl_digen.main`` exits 2 with the message that names
the problem, before any worker starts (the checks themselves: tests/unit/test_bad_input.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.e2e
def test_main_cli_exits_2_with_the_message(tmp_path):
    missing = tmp_path / "nowhere"
    proc = subprocess.run(
        [sys.executable, "-m", "verl_digen.main", f"digen.model.path={missing}"],
        capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 2
    assert "nowhere" in proc.stderr and "does not exist" in proc.stderr
