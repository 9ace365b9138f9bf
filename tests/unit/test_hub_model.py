"""digen.model.path as a hub id: resolved through diffusers' DiffusionPipeline.download and the
Hugging Face cache, offline here (HF_HUB_OFFLINE=1) against a cache the tests populate with a tiny
model; the resolved snapshot gets the same checks as a local directory. ``main_ppo`` training a
model given by hub id: tests/e2e/test_hub_model_e2e.py."""

from __future__ import annotations

import hashlib
import os
import shutil

import pytest

from verl_digen.config.schema import ConfigError, digen_config_from_dict
from verl_digen.trainer.resolve import is_hub_id, resolve_model_path

REPO_ID = "digen-test/tiny-flux"
COMMIT = "1" * 40  # the snapshot's (made-up) commit hash, what refs/main points at


def populate_hub_cache(hub_cache: str, repo_id: str, model_dir: str) -> str:
    """Lay ``model_dir`` out in ``hub_cache`` exactly as ``huggingface_hub`` stores a downloaded
    repository (``models--org--name/{blobs, refs/main, snapshots/<commit>/...}``, snapshot files
    symlinked to content-addressed blobs), and return the snapshot directory. Written by hand
    because nothing here can download, and huggingface_hub has no public call that adds local
    files to its cache."""
    from huggingface_hub.file_download import repo_folder_name

    repo = os.path.join(hub_cache, repo_folder_name(repo_id=repo_id, repo_type="model"))
    snapshot = os.path.join(repo, "snapshots", COMMIT)
    os.makedirs(os.path.join(repo, "blobs"), exist_ok=True)
    os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
    with open(os.path.join(repo, "refs", "main"), "w") as f:
        f.write(COMMIT)
    for root, _, files in os.walk(model_dir):
        for name in files:
            src = os.path.join(root, name)
            with open(src, "rb") as f:
                blob = os.path.join(repo, "blobs", hashlib.sha256(f.read()).hexdigest())
            shutil.copyfile(src, blob)
            dst = os.path.join(snapshot, os.path.relpath(src, model_dir))
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            os.symlink(os.path.relpath(blob, os.path.dirname(dst)), dst)
    return snapshot


@pytest.fixture
def offline_hub(tmp_path, tiny_flux, monkeypatch):
    """An offline hub cache in ``tmp_path`` holding the tiny FLUX as ``REPO_ID``; returns the
    snapshot directory. huggingface_hub reads HF_HUB_OFFLINE and HF_HUB_CACHE from the
    environment at import, so in this process its module constants are set too."""
    from huggingface_hub import constants

    hub_cache = str(tmp_path / "hf" / "hub")
    snapshot = populate_hub_cache(hub_cache, REPO_ID, tiny_flux)
    for var, value in {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_CACHE": hub_cache, "HF_HUB_OFFLINE": "1"}.items():
        monkeypatch.setenv(var, value)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", hub_cache)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return snapshot


def _cfg(model_path: str):
    return digen_config_from_dict({"model": {"path": model_path}})


@pytest.mark.parametrize("path", ["org/name", "name", "black-forest-labs/FLUX.1-dev"])
def test_repo_ids_read_as_hub_ids(path):
    assert is_hub_id(path)


@pytest.mark.parametrize("path", ["/models/FLUX.1-dev", "./flux", "~/flux", "models/black-forest-labs/FLUX.1-dev", "a b/c"])
def test_local_looking_paths_are_not_hub_ids(path):
    assert not is_hub_id(path)


def test_hub_id_resolves_offline_to_its_cached_snapshot(offline_hub):
    assert resolve_model_path(_cfg(REPO_ID)) == offline_hub


def test_hub_id_missing_from_the_offline_cache_names_the_key_the_id_and_the_cache(offline_hub):
    with pytest.raises(FileNotFoundError, match=r"digen.model.path: model path 'digen-test/not-cached' .*HF_HUB_OFFLINE=1") as e:
        resolve_model_path(_cfg("digen-test/not-cached"))
    assert os.path.dirname(os.path.dirname(os.path.dirname(offline_hub))) in str(e.value)  # the cache it looked in


def test_missing_absolute_path_is_not_looked_up_on_the_hub(offline_hub, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"digen.model.path: model path '.*nowhere' does not exist$"):
        resolve_model_path(_cfg(str(tmp_path / "nowhere")))


def test_truncated_weights_in_a_cached_snapshot_are_refused(offline_hub):
    blob = os.path.realpath(os.path.join(offline_hub, "transformer", "diffusion_pytorch_model.safetensors"))
    with open(blob, "r+b") as f:
        f.truncate(os.path.getsize(blob) - 16)
    with pytest.raises(ConfigError, match=r"diffusion_pytorch_model.safetensors is not a whole safetensors file"):
        resolve_model_path(_cfg(REPO_ID))


def test_sample_size_rules_apply_to_a_cached_snapshot(offline_hub):
    cfg = digen_config_from_dict({"model": {"path": REPO_ID}, "sampling": {"height": 30, "width": 32}})
    with pytest.raises(ConfigError, match=r"digen.sampling.height=30"):
        resolve_model_path(cfg)
