"""The ``examples/flowgrpo`` scripts, one per family and task, written as veRL-Omni writes its run
scripts (``python3 -m verl.trainer.main_ppo trainer.v1.trainer_mode=digen ...``), stay runnable:
every script, run by bash as a user runs it (its defaults: the real model's hub id, the GPU
counts it names, Flow-GRPO's or veRL-Omni's data layout under ``$WORKSPACE``), hands ``main_ppo``
a command line that passes every check the job makes in ``main_ppo``'s driver before Ray starts
(the digen mode's ``validate_config``): keys, data files, reward (a file loads, a server
answers), and the model at its real size on its real GPU counts (the family's shipped configs on
the meta device, every role's memory planned against the GPU). One of them trains for two steps
through the real ``main_ppo``: tests/e2e/test_examples_e2e.py.

The script's command line is read by putting a ``python3`` first on ``PATH`` that records its
arguments: the check then runs in this process, on exactly what the script would run."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from test_omni_keys import _verl_config
from test_omni_recipes import HTTP_SCORER_CLIENT, _parquet, qwen_ocr_http_rows

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = sorted(glob.glob(os.path.join(REPO, "examples", "flowgrpo", "*", "*.sh")))
OCR = ['A shop sign that says "OPEN"', 'A neon light that reads "JAZZ BAR"', 'A cake with "Happy Birthday" on it',
       'A street sign reading "Main St"', 'A book cover titled "Night"', 'A mug printed with "Coffee"']
PICKSCORE = ["a cat wearing a hat", "a mountain lake at dawn", "a red sports car", "an old lighthouse",
             "a bowl of ramen", "a city street in the rain"]
GENEVAL = [{"tag": "single_object", "include": [{"class": "cat", "count": 1}], "prompt": "a photo of a cat"},
           {"tag": "counting", "include": [{"class": "dog", "count": 2}], "exclude": [{"class": "dog", "count": 3}],
            "prompt": "a photo of two dogs"},
           {"tag": "colors", "include": [{"class": "car", "count": 1, "color": "red"}], "prompt": "a photo of a red car"}]


def test_there_is_a_script_per_family_and_the_tasks_are_covered():
    families = {os.path.basename(os.path.dirname(p)) for p in EXAMPLES}
    assert families == {"flux", "sd35", "qwen_image", "wan", "hunyuan_video"}
    names = " ".join(os.path.basename(p) for p in EXAMPLES)
    for task in ("_ocr", "_geneval_", "_pickscore_", "_lora.sh", "_full.sh"):
        assert task in names, task


@pytest.fixture
def workspace(tmp_path):
    """Flow-GRPO's dataset folder and veRL-Omni's OCR-service parquet, a few prompts each."""
    return _make_workspace(tmp_path / "workspace")


@pytest.fixture(scope="module")
def checked_workspace(tmp_path_factory):
    """The same workspace, made once for the module's checks: they only read it (each check
    asserts it left the workspace as it found it)."""
    return _make_workspace(tmp_path_factory.mktemp("examples") / "workspace")


def _workspace_files(root) -> dict[str, tuple[int, int]]:
    """Every file and folder under ``root`` with its size and time, but Python's own bytecode cache
    (importing the reward file writes ``__pycache__`` beside it, as any import does)."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))
            if "__pycache__" not in p.parts}


def _make_workspace(root):
    for task, lines in (("ocr", OCR), ("pickscore", PICKSCORE)):
        (root / "flow_grpo" / "dataset" / task).mkdir(parents=True)
        for split in ("train", "test"):
            (root / "flow_grpo" / "dataset" / task / f"{split}.txt").write_text("\n".join(lines) + "\n")
    (root / "flow_grpo" / "dataset" / "geneval").mkdir(parents=True)
    for split in ("train", "test"):
        path = root / "flow_grpo" / "dataset" / "geneval" / f"{split}_metadata.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in GENEVAL * 6))
    (root / "data" / "ocr_http").mkdir(parents=True)
    _parquet(root / "data" / "ocr_http" / "train.parquet", qwen_ocr_http_rows("train", 18))
    _parquet(root / "data" / "ocr_http" / "test.parquet", qwen_ocr_http_rows("test", 4))
    (root / "http_scorer_client.py").write_text(HTTP_SCORER_CLIENT)
    return root


def script_argv(script: str, env: dict[str, str], tmp_path) -> list[str]:
    """The arguments ``script`` hands ``python3``: bash runs it with a recording ``python3``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    record = tmp_path / "argv.json"
    (bin_dir / "python3").write_text(
        f"#!{sys.executable}\nimport json, sys\njson.dump(sys.argv[1:], open({str(record)!r}, 'w'))\n")
    (bin_dir / "python3").chmod(0o755)
    full_env = {**os.environ, **env, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run(["bash", script], env=full_env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(record.read_text())


@pytest.mark.usefixtures("loopback_no_proxy")
@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: os.path.relpath(p, os.path.join(REPO, "examples")))
def test_each_example_passes_main_ppos_checks_at_its_real_size(script, checked_workspace, tmp_path, monkeypatch):
    from verl_digen.config.omni_keys import plain_overrides
    from verl_digen.config.verl_keys import MAIN_PPO
    from verl_digen.rewards.serve import RewardServer
    from verl_digen.trainer.resolve import check_run_config

    # The GPU node's CPU slots (main_ppo's TransferQueue needs 9 besides the workers); no cluster to join.
    monkeypatch.setenv("RAY_OVERRIDE_RESOURCES", json.dumps({"CPU": 64}))
    monkeypatch.setenv("RAY_ADDRESS", "local")
    monkeypatch.setenv("WANDB_MODE", "offline")  # the scripts log to W&B; a user has a key, this machine none
    workspace = checked_workspace
    files = _workspace_files(workspace)
    with RewardServer("brightness", port=0) as server:  # stands in for the OCR and GenEval scorer servers
        argv = script_argv(script, {"WORKSPACE": str(workspace), "OCR_REWARD_SERVER_URL": server.url,
                                    "GENEVAL_SERVER_URL": server.url,
                                    "REWARD_CLIENT": str(workspace / "http_scorer_client.py")}, tmp_path)
        assert argv[:3] == ["-m", "verl.trainer.main_ppo", "trainer.v1.trainer_mode=digen"]
        config = _verl_config(plain_overrides(argv[2:]))
        checked = check_run_config(config, entry=MAIN_PPO, without_weights=True)
    trainer = OmegaConf.to_container(config.trainer, resolve=True)  # the script's, not the check's (the whole config: 1/3 s)
    assert checked.cluster.devices == trainer["n_gpus_per_node"] * trainer["nnodes"]
    assert checked.model_path.endswith(os.path.join("models", "configs", checked.cfg.model.arch))  # real size
    assert checked.memory_plan, "every role's memory is planned at the real size"
    assert all(plan.peak_bytes < plan.device_gib * 2**30 for plan in checked.memory_plan)
    used = sum(sum(counts) for counts, _accel in checked.layout.pools.values())
    assert used == checked.cluster.devices, f"the script leaves GPUs idle: {checked.layout.pools}"
    assert _workspace_files(workspace) == files  # the check wrote nothing there (the next script's check reads it)
