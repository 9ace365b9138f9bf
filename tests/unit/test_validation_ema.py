"""Validation (deterministic sampling, grids, logging, run_validation) and the parameter EMA."""

from __future__ import annotations

import glob
import json
import os
import sys
import types

import numpy as np
import pytest
import torch
from PIL import Image

from verl_digen.algos.window import SdeWindowConfig
from verl_digen.models.base import DiffusionAdapter, SampleSpec
from verl_digen.rewards import build_reward_from_config
from verl_digen.trainer.media import close_tensorboard_writers, log_images_tensorboard, log_images_wandb
from verl_digen.workers.ema import EMA, named_trainable_parameters
from verl_digen.workers.sampling import SamplingSettings
from verl_digen.workers.validation import (
    ValidationResult,
    image_grid,
    run_validation,
    sample_deterministic,
    save_grid_png,
    save_video_gif,
    validation_seed,
)

PROMPTS = ["a red apple", "a blue car"]


def _settings(guidance: float = 1.0, spec: SampleSpec | None = None) -> SamplingSettings:
    return SamplingSettings(
        spec=spec or SampleSpec(height=32, width=32, guidance_scale=guidance),
        num_steps=2,
        noise_level=0.7,
        sde_type="sde",
        window=SdeWindowConfig(mode="fixed", start=0, size=2),
        timestep_fraction=1.0,
    )


@pytest.fixture(scope="module")
def flux(tiny_flux):
    from verl_digen.models import load_adapter

    return load_adapter(tiny_flux)


# ----------------------------------------------------------------------------- sampling


def test_deterministic_sampling_is_bitwise_repeatable_and_seed_dependent(flux):
    settings = _settings()
    flux.transformer.train()
    a = sample_deterministic(flux, PROMPTS, settings, seed=3)
    assert flux.transformer.training  # mode restored
    b = sample_deterministic(flux, PROMPTS, settings, seed=3)
    c = sample_deterministic(flux, PROMPTS, settings, seed=4)
    assert a.shape == (2, 3, 32, 32) and a.dtype == torch.float32 and a.device.type == "cpu"
    assert float(a.min()) >= 0.0 and float(a.max()) <= 1.0
    assert torch.equal(a, b)
    assert not torch.allclose(a, c)
    assert not torch.allclose(a[0], a[1])
    # Prompt i's noise depends only on (seed, i): batching does not change the result.
    one_by_one = sample_deterministic(flux, PROMPTS, settings, seed=3, batch_size=1)
    torch.testing.assert_close(one_by_one, a, atol=1e-5, rtol=1e-5)


def test_deterministic_sampling_with_cfg_is_repeatable(flux):
    settings = _settings(guidance=2.0)
    a = sample_deterministic(flux, PROMPTS[:1], settings, seed=3)
    b = sample_deterministic(flux, PROMPTS[:1], settings, seed=3)
    assert torch.equal(a, b)
    assert not torch.allclose(a, sample_deterministic(flux, PROMPTS[:1], _settings(), seed=3))


def test_ode_mode_of_the_rollout_sampler_keeps_no_trajectory(flux):
    from verl_digen.workers.sampling import GroupRequest, begin_groups, decode_groups, denoise, finish_groups

    settings = _settings()
    request = GroupRequest(PROMPTS, [7, 8], [0, 1], group_size=1, training_step=0, seed=3, policy_version=0)
    state = denoise(flux, begin_groups(flux, request, settings, ode=True), settings, settings.num_steps)
    assert state.window == [] and len(state.latents) == 1 and not state.log_probs.any()
    assert decode_groups(flux, state, settings).shape == (2, 3, 32, 32)
    with pytest.raises(ValueError, match="ode=True"):
        finish_groups(flux, state, settings)


def test_validation_seeds_do_not_collide_with_training_groups():
    from verl_digen.workers.sampling import group_seed

    train = {group_seed(0, g) for g in range(1000)}
    assert not train & {validation_seed(0, i) for i in range(100)}


def test_run_validation_scores_the_deterministic_images(flux, tmp_path):
    settings = _settings()
    reward = build_reward_from_config({"name": "brightness"})
    res = run_validation(flux, PROMPTS, settings, reward, seed=5, step=12, out_dir=str(tmp_path))
    images = sample_deterministic(flux, PROMPTS, settings, seed=5)
    expected = reward(images, PROMPTS)
    assert isinstance(res, ValidationResult) and res.step == 12
    assert res.rewards == [float(r) for r in expected]
    assert res.reward_mean == pytest.approx(float(expected.mean()), abs=1e-7)
    assert res.grid_path == os.path.join(str(tmp_path), "val_step000012.png")
    with Image.open(res.grid_path) as im:
        assert im.size == (2 * 34 + 2, 34 + 2)  # 2 images -> nrow 2, padding 2
        assert json.loads(im.info["prompts"]) == PROMPTS
    assert res.gif_paths == []
    assert set(res.metrics()) == {"val/reward_mean", "val/reward_std", "val/reward_min", "val/reward_max"}


def test_run_validation_logs_only_the_first_log_images_images(flux, tmp_path):
    """veRL's trainer.log_val_generations (digen.validation.log_images): the loggers get a grid of
    the first N images; the full grid is still written."""
    settings = _settings()
    reward = build_reward_from_config({"name": "brightness"})
    res = run_validation(flux, PROMPTS, settings, reward, seed=5, step=3, out_dir=str(tmp_path), log_images=1)
    assert res.logged_grid_path == os.path.join(str(tmp_path), "val_step000003_logged.png")
    with Image.open(res.logged_grid_path) as im:
        assert im.size == (34 + 2, 34 + 2) and json.loads(im.info["prompts"]) == PROMPTS[:1]
        logged = np.asarray(im.convert("RGB"))
    with Image.open(res.grid_path) as im:
        assert json.loads(im.info["prompts"]) == PROMPTS
        full = np.asarray(im.convert("RGB"))
    assert np.array_equal(logged[2:34, 2:34], full[2:34, 2:34])  # the same first image
    assert run_validation(flux, PROMPTS, settings, reward, seed=5, step=4, out_dir=str(tmp_path),
                          log_images=2).logged_grid_path is None  # all of them: the grid itself


class _FakeVideoAdapter(DiffusionAdapter):
    """Minimal video 'model': velocity = latents, decode = sigmoid, [B, 3, F, 8, 8]."""

    arch = "fake_video"

    def __init__(self) -> None:
        self.transformer = torch.nn.Linear(1, 1)

    @classmethod
    def from_pretrained(cls, path, *, device="cpu", dtype=torch.float32):
        return cls()

    def encode_prompts(self, prompts):
        return {"emb": torch.tensor([[float(len(p))] for p in prompts])}

    def prepare_latents(self, batch_size, spec, generator):
        return torch.randn((batch_size, 3, spec.num_frames, spec.height, spec.width), generator=generator)

    def sigmas(self, num_steps, spec):
        return torch.linspace(1.0, 0.0, num_steps + 1)

    def predict_velocity(self, latents, sigma, cond, spec, negative_cond=None):
        return 0.5 * latents + 0.01 * cond["emb"].reshape(-1, 1, 1, 1, 1)

    def decode(self, latents, spec):
        return torch.sigmoid(latents)


def test_run_validation_writes_gifs_for_video(tmp_path):
    spec = SampleSpec(height=8, width=8, num_frames=4)
    prompts = [f"clip {i}" for i in range(5)]
    res = run_validation(
        _FakeVideoAdapter(), prompts, _settings(spec=spec), build_reward_from_config({"name": "brightness"}),
        seed=0, step=7, out_dir=str(tmp_path),
    )
    assert [os.path.basename(p) for p in res.gif_paths] == [f"val_step000007_{i}.gif" for i in range(4)]
    with Image.open(res.gif_paths[0]) as im:
        assert im.n_frames == 4 and im.size == (8, 8)
    assert len(res.rewards) == 5


# ----------------------------------------------------------------------------- images and logs


def test_image_grid_shape_and_placement():
    images = torch.rand(5, 3, 6, 4)
    grid = image_grid(images, nrow=3)
    assert grid.dtype == np.uint8
    assert grid.shape == (2 * (6 + 2) + 2, 3 * (4 + 2) + 2, 3)
    np.testing.assert_array_equal(
        grid[2 + 8 : 2 + 8 + 6, 2 + 6 : 2 + 6 + 4], np.rint(images[4].permute(1, 2, 0).numpy() * 255)
    )
    assert image_grid(images, nrow=3, padding=0).shape == (12, 12, 3)
    assert image_grid(images).shape == (2 * 8 + 2, 3 * 6 + 2, 3)  # default nrow = ceil(sqrt(5)) = 3
    video = torch.rand(2, 3, 5, 6, 4)
    np.testing.assert_array_equal(image_grid(video, padding=0), image_grid(video[:, :, 2], padding=0))


def test_png_grid_and_video_files(tmp_path):
    images = torch.rand(5, 3, 8, 8)
    path = save_grid_png(images, str(tmp_path / "sub" / "grid.png"), prompts=list("abcde"), nrow=3)
    with Image.open(path) as im:
        im.load()
        assert im.mode == "RGB" and im.size == (3 * 10 + 2, 2 * 10 + 2)
        np.testing.assert_array_equal(np.asarray(im), image_grid(images, nrow=3))
    video = torch.rand(3, 6, 8, 10)
    gif = save_video_gif(video, str(tmp_path / "clip.gif"), fps=8)
    with Image.open(gif) as im:
        assert im.format == "GIF" and im.n_frames == 6 and im.size == (10, 8)
    with pytest.raises(ValueError, match="video"):
        save_video_gif(torch.rand(1, 3, 6, 8, 8), str(tmp_path / "bad.gif"))


def test_tensorboard_event_file_is_written(tmp_path):
    log_dir = str(tmp_path / "tb")
    grid = image_grid(torch.rand(2, 3, 8, 8))
    try:
        log_images_tensorboard(log_dir, "val/images", grid, step=3)
        log_images_tensorboard(log_dir, "val/images", grid, step=4)
    finally:
        close_tensorboard_writers()
    files = glob.glob(os.path.join(log_dir, "events.out.tfevents.*"))
    assert len(files) == 1 and os.path.getsize(files[0]) > grid.size // 10


def test_wandb_logs_only_with_an_active_run(monkeypatch):
    logged = []
    fake = types.SimpleNamespace(run=None, Image=lambda x: ("img", x.shape), log=lambda d, step: logged.append((d, step)))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    grid = np.zeros((4, 4, 3), dtype=np.uint8)
    assert log_images_wandb("val/images", grid, 1) is False and logged == []
    fake.run = object()
    assert log_images_wandb("val/images", grid, 2) is True
    assert logged == [({"val/images": ("img", (4, 4, 3))}, 2)]


# ----------------------------------------------------------------------------- EMA


def _param(*values, dtype=torch.float32):
    return torch.nn.Parameter(torch.tensor(values, dtype=dtype))


def test_ema_hand_computed_without_warmup():
    p = _param(1.0, 2.0)
    ema = EMA([("w", p)], decay=0.9, warmup=False)
    with torch.no_grad():
        p.copy_(torch.tensor([3.0, 4.0]))
    assert ema.update() == pytest.approx(0.9)
    with torch.no_grad():
        p.copy_(torch.tensor([5.0, 0.0]))
    ema.update()
    # 0.9*1 + 0.1*3 = 1.2 -> 0.9*1.2 + 0.1*5 = 1.58;  0.9*2 + 0.1*4 = 2.2 -> 0.9*2.2 + 0 = 1.98
    torch.testing.assert_close(ema.shadow("w"), torch.tensor([1.58, 1.98]))
    assert ema.num_updates == 2


def test_ema_hand_computed_with_warmup():
    p = _param(1.0, 2.0)
    ema = EMA([("w", p)], decay=0.999, warmup=True)
    with torch.no_grad():
        p.copy_(torch.tensor([3.0, 4.0]))
    assert ema.update() == pytest.approx(0.1)  # min(0.999, 1/10)
    with torch.no_grad():
        p.copy_(torch.tensor([5.0, 0.0]))
    assert ema.update() == pytest.approx(2 / 11)  # min(0.999, 2/11)
    # 0.1*1 + 0.9*3 = 2.8 -> (2/11)*2.8 + (9/11)*5 = 4.6;  0.1*2 + 0.9*4 = 3.8 -> (2/11)*3.8
    torch.testing.assert_close(ema.shadow("w"), torch.tensor([4.6, 2 / 11 * 3.8]))
    ema.num_updates = 100_000
    assert ema.update() == 0.999  # past the warm-up: the configured decay


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swapped_in_restores_live_params_bitwise(dtype):
    torch.manual_seed(0)
    module = torch.nn.Linear(4, 3).to(dtype)
    ema = EMA(named_trainable_parameters(module), decay=0.5)
    assert all(s.dtype == torch.float32 for s in ema.state_dict()["shadow"].values())
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn_like(p) / 3)
    ema.update()
    with torch.no_grad():
        for p in module.parameters():
            p.mul_(1.7).add_(0.013)
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    with ema.swapped_in():
        for n, p in module.named_parameters():
            torch.testing.assert_close(p, ema.shadow(n).to(dtype), atol=0, rtol=0)
            assert not torch.equal(p, before[n])
    for n, p in module.named_parameters():
        assert torch.equal(p, before[n]) and p.dtype == dtype
    with pytest.raises(RuntimeError, match="boom"):
        with ema.swapped_in():
            raise RuntimeError("boom")
    for n, p in module.named_parameters():
        assert torch.equal(p, before[n])


def test_ema_state_dict_round_trip():
    torch.manual_seed(1)
    a = torch.nn.Linear(3, 2)
    ema = EMA(a.named_parameters(), decay=0.99)
    for _ in range(3):
        with torch.no_grad():
            a.weight.add_(1.0)
        ema.update()
    state = ema.state_dict()
    b = torch.nn.Linear(3, 2)
    ema2 = EMA(b.named_parameters(), decay=0.99)
    ema2.load_state_dict(state)
    assert ema2.num_updates == 3
    for n in ema.names:
        assert torch.equal(ema2.shadow(n), ema.shadow(n))
    b.load_state_dict(a.state_dict())
    ema.update()
    ema2.update()
    for n in ema.names:
        assert torch.equal(ema2.shadow(n), ema.shadow(n))
    with pytest.raises(KeyError, match="missing"):
        EMA([("other", torch.nn.Parameter(torch.zeros(2)))]).load_state_dict(state)
    bad = {**state, "shadow": {**state["shadow"], "weight": torch.zeros(5)}}
    with pytest.raises(ValueError, match="shape"):
        ema2.load_state_dict(bad)


@pytest.mark.parametrize("decay", [0.0, 1.0, -0.1, 1.5])
def test_ema_rejects_bad_decay(decay):
    with pytest.raises(ValueError, match=r"decay must be in \(0, 1\)"):
        EMA([("w", _param(1.0))], decay=decay)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_workers_validation_leaves_no_grid_behind_on_ranks_other_than_0(monkeypatch, tmp_path, tiny_flux, rank):
    """Under FSDP every trainer rank samples the validation prompts and rank 0 writes the grid the
    controller logs; the other ranks' grids go to a scratch directory that is removed (one kept
    per validation per rank filled the temp folder over a long run)."""
    import tempfile

    from verl_digen.config.schema import digen_config_from_dict
    from verl_digen.models.registry import load_adapter
    from verl_digen.workers.worker import DiffusionWorker, sampling_settings

    for key, value in {"WORLD_SIZE": "2", "RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(key, value)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    cfg = digen_config_from_dict({"sampling": {"num_steps": 2}, "reward": {"name": "brightness"}})
    worker = DiffusionWorker("rollout", cfg, tiny_flux)
    assert worker.rank == rank
    worker.adapter, worker.settings = load_adapter(tiny_flux), sampling_settings(cfg)
    out_dir = tmp_path / "val"
    out = worker.validate(PROMPTS, step=4, out_dir=str(out_dir))
    assert set(out["metrics"]) >= {"val/reward_mean", "val/ema"}
    assert list(scratch.iterdir()) == []
    if rank == 0:
        assert out["grid_path"] == str(out_dir / "val_step000004.png") and os.path.exists(out["grid_path"])
    else:
        assert out["grid_path"] is None and not out_dir.exists()
