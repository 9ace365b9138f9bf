"""Every shipped preset and ``examples/flowgrpo`` script is rehearsed: lists configs/ and
examples/flowgrpo/ and fails on a preset or script that neither tests/e2e/test_rehearsal.py nor
tests/e2e/test_rehearsal_examples_e2e.py rehearses (or on a test that NOT_REHEARSED_HERE names and
that is gone)."""

from __future__ import annotations

import os

import test_rehearsal as presets
import test_rehearsal_examples_e2e as examples
from suite_paths import LANES
from test_rehearsal import CONFIGS, NOT_REHEARSED_HERE, REPO


def _rehearsed(test) -> list:
    """The values ``test`` is parametrized over (what the suite rehearses)."""
    (mark,) = [m for m in test.pytestmark if m.name == "parametrize"]
    return list(mark.args[1])


def test_every_preset_and_example_is_rehearsed():
    """Lists configs/ and examples/flowgrpo/ afresh: a preset or script added to either folder
    and not rehearsed here (or by the test NOT_REHEARSED_HERE names) fails this test."""
    configs = {f for f in os.listdir(CONFIGS) if os.path.isfile(os.path.join(CONFIGS, f))}
    assert {f"{p}.yaml" for p in _rehearsed(presets.test_preset_runs_two_steps_as_shipped_and_resumes)} | set(NOT_REHEARSED_HERE) \
        == configs
    for reason in NOT_REHEARSED_HERE.values():  # a named test still exists
        for test_file in (w for w in reason.split() if w.startswith("test_") and w.endswith(".py")):
            assert any(os.path.isfile(os.path.join(REPO, "tests", lane, test_file)) for lane in LANES), test_file
    scripts = {os.path.join(d, f) for d, _, files in os.walk(os.path.join(REPO, "examples", "flowgrpo")) for f in files
               if f.endswith(".sh")}
    assert set(_rehearsed(examples.test_example_runs_two_steps_as_shipped_and_resumes)) == scripts
