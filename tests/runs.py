"""Helpers the end-to-end tests share: run the real job quietly, read what it wrote."""

from __future__ import annotations

import json
import os

from verl_digen.config.compose import compose_config
from verl_digen.trainer.loop import RunResult, run_training

QUIET = ["digen.progress_bar=false", "trainer.logger=[]"]


def run_config(tmp_path, name: str, *overrides: str):
    """The main job's config with quiet output into ``tmp_path / name``."""
    return compose_config(QUIET + [f"digen.output_dir={tmp_path / name}", *overrides])


def run(tmp_path, name: str, *overrides: str) -> RunResult:
    return run_training(run_config(tmp_path, name, *overrides))


def _jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def timeline_records(output_dir: str) -> list[dict]:
    return _jsonl(os.path.join(output_dir, "timeline.jsonl"))


def metrics_lines(output_dir: str) -> list[dict]:
    return _jsonl(os.path.join(output_dir, "metrics.jsonl"))
