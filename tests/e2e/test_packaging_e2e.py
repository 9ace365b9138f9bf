"""`pip install verl-digen` into a fresh virtual environment: the installed wheel runs a shipped
preset from outside the checkout, and ``--config-name`` finds the presets from any directory. The
wheel's contents and requirements: tests/unit/test_packaging.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from test_packaging import NOT_SOURCE, REPO, _fresh_venv, wheel  # noqa: F401 (wheel: a fixture)


@pytest.mark.e2e
@pytest.mark.slow
def test_installed_wheel_runs_a_shipped_preset_from_outside_the_checkout(wheel, tmp_path, tiny_cache):
    python = _installed("wheel", wheel, tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the checkout must not be importable
    where = subprocess.run([python, "-c", "import verl_digen; print(verl_digen.__file__)"], cwd=elsewhere, env=env,
                           check=True, capture_output=True, text=True).stdout.strip()
    assert where.startswith(str(tmp_path / "venv")), where
    # the pretrained toy ships inside the wheel: the digits preset copies it, builds nothing
    toy = subprocess.run([python, "-c", "from verl_digen.models import toy; print(toy.shipped_toy()); "
                          "import os; print(os.path.abspath(toy.ensure_toy(cache_dir='cache', log=print)))"],
                         cwd=elsewhere, env=env, check=True, capture_output=True, text=True, timeout=300).stdout.split()
    assert toy[0].startswith(str(tmp_path / "venv")) and toy[1] == str(elsewhere / "cache" / os.path.basename(toy[0]))
    assert os.path.getsize(os.path.join(toy[1], "transformer", "diffusion_pytorch_model.safetensors")) > 100_000

    out = tmp_path / "run"
    proc = subprocess.run(
        [python, "-m", "verl_digen.main", "--config-name", "flux_disaggregated", "+smoke=tiny",
         "digen.progress_bar=false", "trainer.logger=[]", f"digen.output_dir={out}"],
        cwd=elsewhere, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out / "metrics.jsonl") as f:
        steps = [json.loads(line) for line in f]
    assert [m["step"] for m in steps] == [1, 2]
    assert all(m["actor/ratio_mean"] == pytest.approx(1.0, abs=1e-4) for m in steps)  # disaggregated, on-policy


def _installed(kind: str, wheel: str, tmp_path) -> str:
    """A fresh venv with verl-digen installed from the wheel, or editable from a copy of the checkout."""
    python = _fresh_venv(str(tmp_path / "venv"))
    if kind == "wheel":
        target = [wheel]
    else:
        src = tmp_path / "checkout"
        shutil.copytree(REPO, src, ignore=NOT_SOURCE)
        target = ["--no-build-isolation", "-e", str(src)]
    subprocess.run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", "-q", *target],
                   check=True, capture_output=True, text=True, timeout=300)
    return python


@pytest.mark.e2e  # runs python -m verl_digen.main
@pytest.mark.parametrize("kind", ["wheel", "editable"])
def test_config_name_finds_the_presets_from_any_directory(kind, wheel, tmp_path):
    """``--config-name`` alone composes a preset (and its smoke group) from outside the checkout,
    for an installed wheel and for an editable install of a checkout (configs/ read in place)."""
    python = _installed(kind, wheel, tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    where = subprocess.run([python, "-c", "from verl_digen.config.compose import CONFIG_DIR; print(CONFIG_DIR)"],
                           cwd=elsewhere, env=env, check=True, capture_output=True, text=True).stdout.strip()
    expected = os.path.join(str(tmp_path / "venv"), "lib") if kind == "wheel" else str(tmp_path / "checkout" / "configs")
    assert where.startswith(expected), where
    proc = subprocess.run([python, "-m", "verl_digen.main", "--config-name", "qwen_image_full_disaggregated",
                           "+smoke=tiny", "--cfg", "job"], cwd=elsewhere, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "experiment_name: qwen_image_full_disaggregated" in proc.stdout
    assert "train_micro_batch_groups: 3" in proc.stdout and "height: 32" in proc.stdout  # preset and smoke group
