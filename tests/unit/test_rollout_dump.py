"""Rollout dumps, veRL's ``trainer.rollout_data_dir`` (``digen.rollout_data_dir``): the scoring
worker writes each sample's image (exactly the pixels the reward scored) and returns its row with
the reward's score and extras; the controller writes ``<step>.jsonl`` in group and sample order;
the key maps from both entry points and a bad path stops the job naming the key the user wrote.
The tiny run that checks the dump against the run's own rewards is in ``test_reward_runs.py``."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from PIL import Image

from verl_digen.config.compose import compose_config
from verl_digen.config.schema import ConfigError, digen_config_from_dict
from verl_digen.workers.rollout_dump import dump_samples, write_step_rows

if TYPE_CHECKING:
    from verl import DataProto

# A veRL-style reward returning {"score": ..., key: value}: "bright" for every sample, "bonus"
# only where the ground truth asks for one (NaN elsewhere, a null in the dump).
REWARD = '''
import numpy as np

def compute_score(image, prompt, ground_truth):
    bright = float(np.asarray(image).mean()) / 255.0
    out = {"score": bright + len(prompt), "bright": bright}
    if ground_truth == "bonus":
        out["bonus"] = 1.0
    return out
'''


def _slice(images: torch.Tensor, group: int, samples: range, step: int, record: dict) -> DataProto:
    """A generate output of one slice of a group's samples, as ``finish_groups`` packs it."""
    from verl import DataProto

    n = len(samples)
    records = np.empty(n, dtype=object)
    records[:] = [record] * n
    return DataProto.from_dict(
        tensors={"images": images},
        non_tensors={"prompt": np.array([record["prompt"]] * n, dtype=object),
                     "group_id": np.full(n, group, dtype=np.int64),
                     "sample_index": np.array(list(samples), dtype=np.int64),
                     "prompt_index": np.full(n, 7, dtype=np.int64),
                     "policy_version": np.full(n, step, dtype=np.int64),
                     "metadata": records},
        meta_info={"training_step": step, "policy_version": step},
    )


def _worker(monkeypatch, tmp_path):
    """A fused worker (no Ray, no model) dumping into ``tmp_path / "dump"``, scoring with REWARD."""
    from verl_digen.rewards import build_reward
    from verl_digen.workers.worker import DiffusionWorker

    for key, value in {"WORLD_SIZE": "1", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(key, value)
    (tmp_path / "reward.py").write_text(REWARD)
    worker = DiffusionWorker("fused", digen_config_from_dict({"rollout_data_dir": str(tmp_path / "dump")}), "unused")
    worker.reward_fn = build_reward("custom", path=str(tmp_path / "reward.py"))
    return worker


def test_the_scoring_worker_writes_each_samples_image_and_returns_its_row(monkeypatch, tmp_path):
    worker = _worker(monkeypatch, tmp_path)
    images = torch.randint(0, 256, (4, 3, 16, 24), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    record = {"prompt": "a red cube", "ground_truth": "bonus", "data_source": "shapes"}
    # one group's samples from two generate tasks, the later slice first: reassembled in sample order
    result = worker.compute_reward(_slice(images[2:], 5, range(2, 4), 3, record),
                                   _slice(images[:2], 5, range(0, 2), 3, record))
    rows = list(result.rollout_rows)
    root = tmp_path / "dump"
    assert [(r["group_id"], r["sample_index"]) for r in rows] == [(5, 0), (5, 1), (5, 2), (5, 3)]
    for i, row in enumerate(rows):
        assert row["output"] == os.path.join("4", f"g5_s{i}.png")  # step 4: veRL's global step of training step 3
        with Image.open(root / row["output"]) as png:
            assert png.format == "PNG" and png.size == (24, 16)
            assert json.loads(png.text["prompts"]) == ["a red cube"]
            assert np.array_equal(np.asarray(png.convert("RGB")), images[i].permute(1, 2, 0).numpy())
        assert row["score"] == pytest.approx(float(result.rewards[i])) and row["score"] > len("a red cube")
        assert row["bright"] == pytest.approx(float(result.extra["bright"][i]))
        assert {k: row[k] for k in ("input", "gts", "step", "data_source", "prompt_index", "policy_version",
                                    "bonus")} == {"input": "a red cube", "gts": "bonus", "step": 4,
                                                  "data_source": "shapes", "prompt_index": 7, "policy_version": 3,
                                                  "bonus": 1.0}
    assert set(result.extra) == {"bright", "bonus"}  # the metrics' reward/<name> still get them


def test_extras_a_sample_lacks_and_ground_truth_a_record_lacks_are_null(tmp_path):
    pixels = torch.rand(2, 3, 8, 8)
    non_tensors = {"prompt": np.array(["a", "b"], dtype=object), "group_id": np.array([1, 2]),
                   "sample_index": np.array([0, 0]), "prompt_index": np.array([0, 1]),
                   "policy_version": np.array([0, 0]),
                   "metadata": np.array([{"prompt": "a", "ground_truth": np.array([1, 2])}, {"prompt": "b"}],
                                        dtype=object)}
    rows = dump_samples(str(tmp_path), 1, pixels, non_tensors, torch.tensor([0.5, 0.25]),
                        {"bonus": torch.tensor([float("nan"), 2.0]), "step": torch.tensor([9.0, 9.0])})
    assert [(r["gts"], r["data_source"], r["bonus"]) for r in rows] == [([1, 2], None, None), (None, None, 2.0)]
    assert [r["step"] for r in rows] == [1, 1]  # an extra named like a row key does not replace it


def test_a_video_sample_is_a_gif_as_validation_writes_them(tmp_path):
    video = torch.rand(1, 3, 5, 16, 16)
    non_tensors = {"prompt": np.array(["a wave"], dtype=object), "group_id": np.array([0]),
                   "sample_index": np.array([1]), "prompt_index": np.array([0]), "policy_version": np.array([0])}
    (row,) = dump_samples(str(tmp_path), 2, video, non_tensors, torch.tensor([0.1]), {})
    assert row["output"] == os.path.join("2", "g0_s1.gif") and row["gts"] is None
    with Image.open(tmp_path / row["output"]) as gif:
        assert gif.format == "GIF" and gif.n_frames == 5 and gif.size == (16, 16)


def test_the_controller_writes_the_steps_rows_in_group_and_sample_order(tmp_path):
    rows = [{"group_id": g, "sample_index": s, "score": g + s / 10, "input": "é"} for g, s in
            [(9, 1), (2, 0), (9, 0), (2, 1)]]  # as two workers' reward results arrive
    path = write_step_rows(str(tmp_path), 3, rows)
    assert path == str(tmp_path / "3.jsonl") and os.listdir(tmp_path) == ["3.jsonl"]
    with open(path, encoding="utf-8") as f:
        written = [json.loads(line) for line in f]
    assert [(r["group_id"], r["sample_index"]) for r in written] == [(2, 0), (2, 1), (9, 0), (9, 1)]
    assert written[0]["input"] == "é"


# ------------------------------------------------------------------------- the key


def _resolved(*overrides: str, entry: str = "verl_digen.main"):
    from verl_digen.config.verl_keys import resolve_run_config

    return resolve_run_config(OmegaConf.to_container(compose_config(list(overrides)), resolve=True), entry)


def test_verls_key_sets_the_dump_directory_and_null_leaves_it_off():
    assert _resolved("trainer.rollout_data_dir='~/rollouts'").digen["rollout_data_dir"] == os.path.expanduser(
        "~/rollouts")
    assert _resolved("trainer.rollout_data_dir=2024").digen["rollout_data_dir"] == "2024"  # Hydra read a number
    assert digen_config_from_dict(_resolved().digen).rollout_data_dir is None
    assert digen_config_from_dict(_resolved("trainer.rollout_data_dir=null").digen).rollout_data_dir is None
    with pytest.raises(ConfigError, match=r"rollout_data_dir='/a' and digen.rollout_data_dir='/b' are the same"):
        _resolved("trainer.rollout_data_dir=/a", "digen.rollout_data_dir=/b")
    with pytest.raises(ConfigError, match=r"trainer.rollout_data_dir=True; a directory"):
        _resolved("trainer.rollout_data_dir=true")


@pytest.mark.parametrize("key", ["trainer.rollout_data_dir", "digen.rollout_data_dir"])
def test_a_dump_path_at_or_under_a_file_stops_the_job_naming_the_key_written(tmp_path, key):
    from verl_digen.trainer.loop import DigenTrainer

    file = tmp_path / "notes.txt"
    file.write_text("x")
    for path in (file, file / "rollouts"):
        with pytest.raises(ConfigError, match=rf"^invalid config: {key}={path} cannot be a directory: {file} is a"):
            DigenTrainer(compose_config([f"{key}={path}", f"digen.output_dir={tmp_path / 'run'}"]))


def test_the_job_creates_the_dump_directory_as_an_absolute_path(tmp_path, monkeypatch, tiny_flux):
    from verl_digen.trainer.resolve import prepare_run

    monkeypatch.chdir(tmp_path)  # the workers that write there may run in another directory
    job = prepare_run(compose_config(["trainer.rollout_data_dir=dump/here", "trainer.logger=[]",
                                      f"digen.model.path={tiny_flux}", f"digen.output_dir={tmp_path / 'run'}"]))
    assert job.cfg.rollout_data_dir == str(tmp_path / "dump" / "here") and os.path.isdir(job.cfg.rollout_data_dir)


def test_an_emulated_cluster_refuses_a_dump_it_could_not_write():
    with pytest.raises(ConfigError, match=r"digen.rollout_data_dir='/x'; an emulated cluster .* makes no images"):
        digen_config_from_dict({"rollout_data_dir": "/x", "emulate": {"model": "flux-12b"}})
    with pytest.raises(ConfigError, match=r"digen.rollout_data_dir=' '; a directory path, or null"):
        digen_config_from_dict({"rollout_data_dir": " "})
