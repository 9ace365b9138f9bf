"""The GPU check's tiny run (``python -m verl_digen.gpu_check``), stopped by its time limit, says so
and which limit. The check's other parts and the measured reports: tests/unit/test_gpu_check.py."""

from __future__ import annotations

import pytest

from verl_digen import gpu_check


@pytest.mark.e2e  # starts `python -m verl_digen.main` (stopped after a second)
def test_a_run_stopped_by_its_time_limit_says_so_and_which_limit(tmp_path):
    """On the H100 a tiny run given too short a limit was reported as "first run exited None"."""
    with pytest.raises(RuntimeError, match=r"^first run timed out after 1 s \(each of the two runs gets half of "
                                           r"--tiny-run-timeout\)"):
        gpu_check.part_tiny_run(2.0, "fp32")
