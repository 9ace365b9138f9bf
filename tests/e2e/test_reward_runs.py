"""End-to-end: prompt records reach the rewards of a real run (tiny FLUX on Ray, CPU slots).

- A pickle-protocol reward server (the flow_grpo / veRL-Omni wire format), written here as a
  plain ``http.server`` handler because the point is to speak *their* protocol, not ours: it
  checks it receives JPEG images and each prompt's ground truth (both GenEval metadata shapes), and
  the run's rewards must be exactly the scores it returned; so must the rows of the run's rollout
  dump (veRL's ``trainer.rollout_data_dir``), each with its sample's PNG at the run's size.
- The real OCR reward in a 2-step run with ground truths from a jsonl file, validation included.
"""

from __future__ import annotations

import io
import json
import pickle
import threading

import pytest
import torch
from PIL import Image

from runs import JsonHandler, metrics_lines, run, serve

# Every test is a run on the session's Ray instance.
pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("loopback_no_proxy", "tiny_flux", "shared_ray")]

RECORDS = [
    {"prompt": "a red apple", "ground_truth": "APPLE", "tag": "single_object"},
    {"prompt": "a blue car", "ground_truth": "CAR", "tag": "colors"},
    {"prompt": "a tall tree", "ground_truth": "TREE", "tag": "single_object"},
    {"prompt": "a small boat", "ground_truth": "BOAT", "tag": "counting"},
]
SCORE = {"APPLE": 0.1, "CAR": 0.4, "TREE": 0.7, "BOAT": 0.9}


@pytest.fixture
def prompt_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    return str(path)


class _PickleScorer(JsonHandler):
    """flow_grpo-style server: pickle in, pickle out; scores each sample by its ground truth."""

    state: dict

    def do_POST(self) -> None:
        data = pickle.loads(self.rfile.read(int(self.headers["Content-Length"])))
        problems = []
        # the records twice: nested for the GenEval scorer service, top level for reward-server's app
        nested = data.get("metadata")
        if not isinstance(nested, dict) or nested.get("meta_datas") != data.get("meta_datas"):
            problems.append("metadata is not {'meta_datas': <the top-level meta_datas>, ...}")
        elif nested.get("only_strict") != data.get("only_strict"):
            problems.append("the extra fields are not inside metadata too")
        sizes = set()
        for raw in data["images"]:
            if not (isinstance(raw, bytes) and raw.startswith(b"\xff\xd8\xff")):
                problems.append("an image is not JPEG bytes")
                continue
            with Image.open(io.BytesIO(raw)) as image:
                sizes.add((image.format, image.size, image.mode))
        scores = [SCORE[m["ground_truth"]] for m in data["meta_datas"]]
        with self.state["lock"]:
            self.state["requests"].append({"prompts": data["prompts"], "metadata": data["meta_datas"],
                                           "sizes": sizes, "scores": scores, "problems": problems,
                                           "only_strict": data.get("only_strict")})
        self.reply(200, pickle.dumps({"scores": scores, "rewards": scores}))


def test_run_scored_by_a_pickle_server_gets_ground_truth_and_its_scores(tmp_path, prompt_file):
    state = {"lock": threading.Lock(), "requests": []}
    dump = tmp_path / "rollouts"  # veRL's trainer.rollout_data_dir: checked below against the same scores
    with serve(_PickleScorer, state) as url:
        result = run(tmp_path, "pickle", "trainer.total_training_steps=2", f"digen.data.prompts={prompt_file}",
                     "digen.reward.name=http", f"+digen.reward.kwargs.url={url}",
                     "+digen.reward.kwargs.protocol=pickle", "+digen.reward.kwargs.extra_fields.only_strict=false",
                     f"trainer.rollout_data_dir={dump}")
    requests = state["requests"]
    per_step = 4  # groups_per_step=4 groups, one reward request per group
    assert len(requests) == 2 * per_step
    by_prompt = {r["prompt"]: r for r in RECORDS}
    for request in requests:
        assert request["problems"] == []
        assert request["sizes"] == {("JPEG", (32, 32), "RGB")}
        assert request["only_strict"] is False
        for prompt, record in zip(request["prompts"], request["metadata"], strict=True):
            assert record == by_prompt[prompt]  # the whole jsonl record arrived, with its ground truth
    metrics = metrics_lines(result.output_dir)
    for step, line in enumerate(metrics):
        returned = torch.tensor([s for r in requests[step * per_step:(step + 1) * per_step] for s in r["scores"]])
        assert line["reward_mean"] == pytest.approx(float(returned.mean()), abs=1e-6)
        assert line["reward_std"] == pytest.approx(float(returned.std(unbiased=False)), abs=1e-6)
        _check_dump(dump, line, returned)


def _check_dump(dump, line: dict, returned: torch.Tensor) -> None:
    """``<dump>/<step>.jsonl`` has a row for every sample of the step (4 groups x 4), each scored
    as the server scored its ground truth, the step's scores being those the run recorded; each
    row's image is a 32x32 PNG."""
    with open(dump / f"{line['step']}.jsonl") as f:
        rows = [json.loads(row) for row in f]
    groups = sorted({r["group_id"] for r in rows})  # in group, then sample, order
    assert len(groups) == 4 and [(r["group_id"], r["sample_index"]) for r in rows] == [(g, s) for g in groups
                                                                                       for s in range(4)]
    assert {r["step"] for r in rows} == {line["step"]}
    by_prompt = {r["prompt"]: r for r in RECORDS}
    for row in rows:
        assert row["gts"] == by_prompt[row["input"]]["ground_truth"]
        assert row["score"] == pytest.approx(SCORE[row["gts"]], abs=1e-6)
        with Image.open(dump / row["output"]) as image:
            image.verify()  # a whole PNG file
        with Image.open(dump / row["output"]) as image:
            assert (image.format, image.size) == ("PNG", (32, 32))  # the run's width x height
    scores = torch.tensor([r["score"] for r in rows])
    assert sorted(scores.tolist()) == pytest.approx(sorted(returned.tolist()), abs=1e-6)
    assert float(scores.mean()) == pytest.approx(line["reward_mean"], abs=1e-6)


def test_two_step_run_with_the_real_ocr_reward(tmp_path, prompt_file):
    # The prompts quote no text: without their records' ground truth the OCR reward would
    # raise, in training and in validation (which scores the held-out prompts at step 2).
    result = run(tmp_path, "ocr", "trainer.total_training_steps=2", f"digen.data.prompts={prompt_file}",
                 "digen.reward.name=ocr", "trainer.test_freq=2", f"digen.validation.prompts={prompt_file}",
                 "digen.validation.num_prompts=2")
    assert [m["step"] for m in result.metrics] == [1, 2]
    for m in result.metrics:
        assert 0.0 <= m["reward_mean"] <= 1.0  # tiny-model noise reads as (almost) no text
    assert 0.0 <= result.metrics[-1]["val/reward_mean"] <= 1.0
