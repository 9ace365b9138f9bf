"""veRL-Omni's published recipes run under ``python -m verl.trainer.main_ppo
trainer.v1.trainer_mode=digen``, changing only environment keys (model path, data files, device
counts, logger, number of steps) and dropping only the ``vllm_omni`` engine keys and the vLLM
reward-model keys, with veRL-Omni's data layout and its reward files' shapes:

- the SD3.5-M OCR LoRA recipe (``examples/flowgrpo_trainer/sd35/run_sd35_medium_ocr_lora.sh``),
  its reward a file shaped as veRL-Omni's ``jpeg_compressibility.compute_score(solution_image)``
  (the recipe's own ``genrm_ocr`` needs the vLLM reward model whose keys are dropped);
- the Qwen-Image OCR reward-server recipe (``.../qwen_image/run_qwen_image_ocr_reward_server.sh``):
  veRL-Omni's multi-reward manager with one HTTP scorer client, against our reward server
  serving the OCR reward as the OCR scorer service does (pickle in, pickle out).

The reward files here are written for this test in the shape of veRL-Omni's (their signatures,
their return values; the HTTP client keeps an ``aiohttp`` session on the function as veRL-Omni's
does, which needs one event loop for the life of the worker). Set ``DIGEN_VERL_OMNI_SRC`` to a
checkout of veRL-Omni to run the same tests with its own files instead: its
``jpeg_compressibility.py`` and its ``http_scorer_client.py``, both by path (the recipe's
``pkg://verl_omni...`` path imports veRL-Omni's package, which needs its vLLM-Omni engine).

The model sizes are the tiny ones. The SD3.5 recipe runs at its own batch (8 prompts x 8 images,
two PPO mini-batches) at 128 x 128 pixels, the most the tiny SD3's position embedding covers
(its 384 would be refused, naming the key). The Qwen-Image recipe's batch (32 prompts x 16
images at 512 x 512 per step) is cut to 4 x 4 at 64 x 64 with its micro-batches in proportion,
which is what a 2-core CPU can score in the suite's time. Every other key is the recipe's.
"""

from __future__ import annotations

import glob
import json
import os
import shlex

import pytest

from test_omni_keys import QWEN_OCR_REWARD_SERVER, SD35_OCR_LORA
from test_verl_entry import main_ppo

OMNI_SRC = os.environ.get("DIGEN_VERL_OMNI_SRC")

OCR_TEXTS = ["OPEN", "SALE", "EXIT", "STOP", "CAFE", "BOOK", "PARK", "TAXI"]

# veRL-Omni's jpeg_compressibility.compute_score, as its visual reward manager calls it: the image
# as a uint8 [3, H, W] tensor under the name solution_image; minus the JPEG size in kB / 500.
JPEG_REWARD = '''
import io

from PIL import Image


def compute_score(solution_image):
    if solution_image.ndim == 4:
        solution_image = solution_image[0]
    buffer = io.BytesIO()
    Image.fromarray(solution_image.permute(1, 2, 0).cpu().numpy()).save(buffer, format="JPEG", quality=95)
    return -(buffer.tell() / 1000) / 500
'''

# veRL-Omni's http_scorer_client.compute_score: async; the JPEG of the image and the ground truth as
# the prompt, metadata {}, pickled; a session cached on the function (bound to the loop it was
# made on); the answer's first score as {"score": ...}.
HTTP_SCORER_CLIENT = '''
import io
import pickle

import aiohttp
from PIL import Image


async def compute_score(solution_image, ground_truth, server_url, max_retries=2, **kwargs):
    buffer = io.BytesIO()
    Image.fromarray(solution_image.permute(1, 2, 0).cpu().numpy()).save(buffer, format="JPEG")
    payload = pickle.dumps({"images": [buffer.getvalue()], "prompts": [ground_truth], "metadata": {}})
    if not hasattr(compute_score, "_session") or compute_score._session.closed:
        compute_score._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120))
    async with compute_score._session.post(server_url, data=payload) as response:
        body = await response.read()
        if response.status != 200:
            raise RuntimeError(f"scorer returned HTTP {response.status}: {body[:200]!r}")
    return {"score": float(pickle.loads(body)["scores"][0])}
'''


def _parquet(path, rows: list[dict]) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), str(path))
    return str(path)


def sd3_ocr_rows(split: str, n: int) -> list[dict]:
    """Rows as veRL-Omni's ``data_process/sd3_ocr.py`` writes them: one user message, the text as
    the ground truth, ``extra_info.raw_prompt``."""
    rows = []
    for i in range(n):
        text = f'A storefront sign that says "{OCR_TEXTS[i % len(OCR_TEXTS)]}"'
        rows.append({"data_source": "flow_grpo/ocr", "prompt": [{"role": "user", "content": text}], "ability": "ocr",
                     "reward_model": {"style": "model", "ground_truth": OCR_TEXTS[i % len(OCR_TEXTS)]},
                     "extra_info": {"split": split, "index": i, "raw_prompt": text}})
    return rows


def qwen_ocr_http_rows(split: str, n: int) -> list[dict]:
    """Rows as veRL-Omni's ``data_process/qwenimage_ocr_http_service.py`` writes them: a system and a
    user message, a negative prompt of the same form, the whole prompt as the ground truth (the
    scorer service finds the quoted text in it)."""
    system = "Describe the image by detailing the color, shape, size, texture, quantity, text, spatial relationships."
    rows = []
    for i in range(n):
        text = f'A poster with the word "{OCR_TEXTS[i % len(OCR_TEXTS)]}"'
        rows.append({"data_source": "flow_grpo/ocr",
                     "prompt": [{"role": "system", "content": system}, {"role": "user", "content": text}],
                     "negative_prompt": [{"role": "system", "content": system}, {"role": "user", "content": " "}],
                     "ability": "ocr", "reward_model": {"style": "model", "ground_truth": text},
                     "extra_info": {"split": split, "index": i}})
    return rows


def _metrics(run_dir) -> list[dict]:
    (path,) = glob.glob(str(run_dir / "runs" / "*" / "*" / "metrics.jsonl"))
    with open(path) as f:
        return [json.loads(line) for line in f]


def _environment(argv: list[str], **values: str) -> list[str]:
    """``argv`` with the environment keys in ``values`` replaced (each must be in the recipe)."""
    out, seen = [], set()
    for arg in argv:
        key = arg.split("=", 1)[0]
        if key in values:
            arg, _ = f"{key}={values[key]}", seen.add(key)
        out.append(arg)
    missing = set(values) - seen
    assert not missing, f"not keys of the recipe: {sorted(missing)}"
    return out


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(1200)  # a whole main_ppo job (about 4 minutes alone; twice that beside another)
def test_verl_omnis_sd35_ocr_lora_recipe_trains_under_main_ppo(tmp_path, tiny_sd3, shared_ray):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    if OMNI_SRC:
        reward = os.path.join(OMNI_SRC, "verl_omni", "utils", "reward_score", "jpeg_compressibility.py")
    else:
        reward = str(run_dir / "jpeg_compressibility.py")
        (run_dir / "jpeg_compressibility.py").write_text(JPEG_REWARD)
    recipe = shlex.split(SD35_OCR_LORA.format(train="T", val="V", model="M", reward="R"))
    argv = _environment(
        recipe,
        **{"data.train_files": _parquet(tmp_path / "train.parquet", sd3_ocr_rows("train", 16)),
           "data.val_files": _parquet(tmp_path / "test.parquet", sd3_ocr_rows("test", 8)),
           "actor_rollout_ref.model.path": tiny_sd3,
           "reward.custom_reward_function.path": reward, "reward.custom_reward_function.name": "compute_score",
           "trainer.total_training_steps": "1", "trainer.n_gpus_per_node": "2",
           # the tiny SD3's position embedding covers 128 x 128 pixels (SD3.5-M's: 384 patches a side)
           "actor_rollout_ref.rollout.pipeline.height": "128", "actor_rollout_ref.rollout.pipeline.width": "128"})
    proc = main_ppo(run_dir, *argv[1:], timeout=1100)  # main_ppo() adds trainer.v1.trainer_mode=digen itself
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    (line,) = _metrics(run_dir)
    assert line["step"] == 1 and line["policy_version"] == 1
    assert -1.0 < line["reward_mean"] < 0.0  # minus a JPEG's kB / 500: a real score of the run's images
    assert line["actor/optimizer_steps"] == 2  # ppo_mini_batch_size=4 of train_batch_size=8: two steps




@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.usefixtures("loopback_no_proxy")
@pytest.mark.timeout(1200)  # a whole main_ppo job (about 4 minutes alone; twice that beside another)
def test_verl_omnis_qwen_image_ocr_reward_server_recipe_trains_under_main_ppo(tmp_path, tiny_dirs, shared_ray):
    from verl_digen.rewards.serve import RewardServer

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    if OMNI_SRC:  # by file: its pkg:// path imports veRL-Omni's package, which needs vllm_omni
        client = os.path.join(OMNI_SRC, "verl_omni", "utils", "reward_score", "http_scorer_client.py")
    else:
        (run_dir / "http_scorer_client.py").write_text(HTTP_SCORER_CLIENT)
        client = str(run_dir / "http_scorer_client.py")
    with RewardServer("ocr", port=0) as server:
        recipe = shlex.split(QWEN_OCR_REWARD_SERVER.format(
            train="T", val="V", model="M", server_url=server.url, checkpoints=tmp_path / "checkpoints",
            rollout_data_dir=tmp_path / "rollout_images"))
        argv = _environment(
            recipe,
            **{"data.train_files": _parquet(tmp_path / "train.parquet", qwen_ocr_http_rows("train", 8)),
               "data.val_files": _parquet(tmp_path / "test.parquet", qwen_ocr_http_rows("test", 4)),
               "actor_rollout_ref.model.path": tiny_dirs["qwen_image"], "+reward.reward_functions.ocr.path": client,
               "trainer.logger": '["console"]', "trainer.n_gpus_per_node": "2", "trainer.total_training_steps": "1",
               # a 2-core CPU's share of the recipe's batch: 4 prompts x 4 images at 64 x 64 pixels (the
               # recipe: 32 x 16 at 512 x 512), micro-batches in proportion (one group to train, two
               # mini-batches a step; the rollout's calls one group each, so each worker scores twice)
               "data.train_batch_size": "4", "actor_rollout_ref.rollout.n": "4",
               "actor_rollout_ref.actor.ppo_mini_batch_size": "2",
               "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": "4",
               "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": "4",
               "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": "4",
               "actor_rollout_ref.rollout.pipeline.height": "64", "actor_rollout_ref.rollout.pipeline.width": "64"})
        proc = main_ppo(run_dir, *argv, timeout=1100)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    (line,) = _metrics(run_dir)
    assert line["step"] == 1 and line["actor/optimizer_steps"] == 2  # two PPO mini-batches
    # veRL-Omni's multi-reward metrics: the component's score, and none of its calls failed
    # (a failure would score 0 quietly in veRL-Omni; here it is counted)
    assert line["reward/ocr"] == pytest.approx(line["reward_mean"], abs=1e-6)
    assert line["reward/ocr/failed"] == 0.0
    assert 0.0 <= line["reward_mean"] <= 1.0
    (dump,) = glob.glob(str(tmp_path / "rollout_images" / "1.jsonl"))
    with open(dump) as f:
        rows = [json.loads(r) for r in f]
    assert len(rows) == 16 and all("ocr" in r for r in rows)
