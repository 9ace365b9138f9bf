"""The pretrained toy digits generator (verl_digen.models.toy): a FLUX.1 pipeline trained with flow
matching on scikit-learn's 8x8 digits. Seeded builds, the cache and CLI, parity with diffusers'
FluxPipeline, on-policy ratio 1 with the digits preset's sampling settings, and that pretraining
learned something (the model draws the requested digit well above chance, better with CFG)."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from verl_digen.algos.window import SdeWindowConfig
from verl_digen.config.schema import AlgoConfig, LoraConfigSpec
from verl_digen.models import SampleSpec, detect_arch, load_adapter
from verl_digen.models import toy
from verl_digen.models.toy import ToyRecipe, build_toy, captions, ensure_toy

from runs import euler_sample

pytestmark = pytest.mark.usefixtures("one_thread")

SPEC = SampleSpec(height=8, width=8)
PROMPTS = ["a handwritten digit 7", "the number zero"]
# The same code path as the cached model, a few optimizer steps only.
SMALL = ToyRecipe(vae_steps=3, steps=3, batch_size=8)
WEIGHTS = {
    "transformer": "transformer/diffusion_pytorch_model.safetensors",
    "vae": "vae/diffusion_pytorch_model.safetensors",
    "text_encoder_2": "text_encoder_2/model.safetensors",
}


def _quiet(message: str) -> None:
    pass


def _weights(path: str) -> dict[str, dict[str, torch.Tensor]]:
    return {name: load_file(os.path.join(path, file)) for name, file in WEIGHTS.items()}


def test_build_is_deterministic_and_seeded(tmp_path):
    first = _weights(build_toy(str(tmp_path / "a"), SMALL, log=_quiet))
    again = _weights(build_toy(str(tmp_path / "b"), SMALL, log=_quiet))
    other = _weights(build_toy(str(tmp_path / "c"), dataclasses.replace(SMALL, seed=1), log=_quiet))
    for name in WEIGHTS:
        assert first[name].keys() == again[name].keys()
        assert all(torch.equal(first[name][k], again[name][k]) for k in first[name]), name
        assert not all(torch.equal(first[name][k], other[name][k]) for k in first[name]), name
    with open(tmp_path / "a" / "toy_recipe.json") as f:
        assert '"steps": 3' in f.read()  # the recipe is saved next to the weights


def test_cached_model_is_a_flux_pipeline_loaded_like_a_real_one(toy_digits):
    assert os.path.basename(toy_digits) == f"digits-{toy.TOY_VERSION}"
    assert detect_arch(toy_digits) == "flux"
    adapter = load_adapter(toy_digits)
    assert adapter.vae_scale_factor == 1 and adapter.latent_channels == 4  # 8x8 pixels -> 8x8x4 latents
    latents = adapter.prepare_latents(2, SPEC, torch.Generator().manual_seed(0))
    assert latents.shape == (2, 16, 16)  # 16 packed 2x2 tokens of 16 features
    # Every pretraining caption fits the text window without truncation.
    for digit in range(10):
        for caption in captions(digit):
            assert len(adapter.tokenizer_2.tokenize(caption)) < adapter.max_sequence_length


def test_the_shipped_model_is_the_default_recipes_and_the_cache_gets_a_copy(tmp_path, monkeypatch):
    """The package ships the built toy; ``toy_recipe.json`` says it was built from today's default
    recipe at this version (a recipe change without a rebuild and a version bump fails here).
    ``ensure_toy`` copies it into the cache, byte for byte, and builds nothing."""
    shipped = toy.shipped_toy("digits")
    assert shipped is not None and os.path.basename(shipped) == f"digits-{toy.TOY_VERSION}"
    with open(os.path.join(shipped, "toy_recipe.json")) as f:
        assert json.load(f) == {"version": toy.TOY_VERSION, **dataclasses.asdict(ToyRecipe())}

    def no_build(*args, **kwargs):
        raise AssertionError("built although the package ships the model")

    monkeypatch.setattr(toy, "build_toy", no_build)
    monkeypatch.setenv("VERL_DIGEN_CACHE", str(tmp_path))
    path = ensure_toy("digits", log=_quiet)
    assert path == str(tmp_path / "toy" / f"digits-{toy.TOY_VERSION}")
    files = sorted(os.path.relpath(os.path.join(r, n), shipped) for r, _, ns in os.walk(shipped) for n in ns)
    assert files == sorted(os.path.relpath(os.path.join(r, n), path) for r, _, ns in os.walk(path) for n in ns)
    for name in files:
        with open(os.path.join(shipped, name), "rb") as a, open(os.path.join(path, name), "rb") as b:
            assert a.read() == b.read(), name
    assert os.listdir(tmp_path / "toy") == [f"digits-{toy.TOY_VERSION}"]  # no temporary dirs left


def test_ensure_toy_builds_once_into_the_cache_when_none_is_shipped(tmp_path, monkeypatch):
    calls = []

    def small_build(out_dir, recipe=ToyRecipe(), *, log=print):
        calls.append(out_dir)
        return build_toy(out_dir, SMALL, log=_quiet)

    monkeypatch.setattr(toy, "build_toy", small_build)
    monkeypatch.setattr(toy, "SHIPPED_DIR", str(tmp_path / "none_shipped"))
    monkeypatch.setenv("VERL_DIGEN_CACHE", str(tmp_path))
    path = ensure_toy("digits", log=_quiet)
    assert path == str(tmp_path / "toy" / f"digits-{toy.TOY_VERSION}")
    assert os.listdir(tmp_path / "toy") == [f"digits-{toy.TOY_VERSION}"]  # no temporary dirs left
    assert ensure_toy("digits", log=_quiet) == path and len(calls) == 1
    with pytest.raises(ValueError, match="unknown toy model 'mnist'; known: digits"):
        ensure_toy("mnist")


def test_cli_prints_the_cached_model(toy_digits, run_as_main):
    status, out, err = run_as_main("verl_digen.models.toy",
                                   env={"VERL_DIGEN_CACHE": os.path.dirname(os.path.dirname(toy_digits))})
    assert status == 0, err
    assert out.strip().splitlines()[-1] == toy_digits
    status, _, err = run_as_main("verl_digen.models.toy", "--seed", "1")
    assert status == 2 and "--seed needs --out" in err


@pytest.mark.parametrize("cfg_scale", [1.0, 3.0])
def test_reproduces_its_diffusers_pipeline(toy_digits, cfg_scale):
    """Our Euler loop (the ODE the RL sampler and validation use) gives FluxPipeline's images."""
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(toy_digits)
    pipe.set_progress_bar_config(disable=True)
    kwargs = dict(true_cfg_scale=cfg_scale, negative_prompt="") if cfg_scale > 1 else {}
    expected = pipe(PROMPTS, height=8, width=8, num_inference_steps=10, output_type="pt", max_sequence_length=12,
                    generator=torch.Generator().manual_seed(3), **kwargs).images
    adapter = load_adapter(toy_digits)
    spec = dataclasses.replace(SPEC, guidance_scale=cfg_scale)
    ours = euler_sample(adapter, PROMPTS, spec, num_steps=10, seed=3, negative_prompt="" if cfg_scale > 1 else None)
    assert ours.shape == expected.shape == (2, 3, 8, 8)
    torch.testing.assert_close(ours, expected.float(), atol=1e-5, rtol=0)


def test_on_policy_ratio_is_one_with_the_preset_settings(toy_digits):
    """With the weights that sampled them, the trainer's recomputed log-probs equal the behaviour
    log-probs (LoRA r=32 as in the digits preset; SDE window = its first 3 steps)."""
    from verl_digen.workers.sampling import SamplingSettings, sample_groups
    from verl_digen.workers.training import PolicyUpdater, TrainSettings, add_lora

    adapter = load_adapter(toy_digits)
    add_lora(adapter, LoraConfigSpec(rank=32, alpha=64))
    settings = SamplingSettings(spec=SPEC, num_steps=10, noise_level=0.7, sde_type="sde",
                                window=SdeWindowConfig(mode="fixed", start=0, size=3), timestep_fraction=1.0)
    data = sample_groups(adapter, PROMPTS, [0, 1], [0, 1], group_size=4, settings=settings, training_step=0,
                         seed=42, policy_version=0)
    updater = PolicyUpdater(adapter, TrainSettings(algo=AlgoConfig(lr=3e-4), sampling=settings, lora_only=True,
                                                   images_per_step=len(data)))
    recomputed = updater.recompute_log_probs(data)
    window = data.batch["sde_mask"][0]
    assert window.tolist() == [True] * 3 + [False] * 7
    ratio = torch.exp(recomputed[:, window] - data.batch["log_probs"][:, window])
    torch.testing.assert_close(ratio, torch.ones_like(ratio), atol=1e-5, rtol=0)
    metrics = updater.train_micro_batch(data, torch.linspace(-1, 1, len(data)))
    assert metrics["actor/ratio_mean"] == pytest.approx(1.0, abs=1e-5) and metrics["actor/clip_frac"] == 0.0


def test_pretraining_learned_the_digits(toy_digits):
    """The VAE reconstructs real digits, and the generator draws the requested digit far above
    chance (0.1) from held-out phrasings; true CFG against the empty caption (trained with caption
    dropout) follows the prompt better still: there is room for RL between the two."""
    from verl_digen.data import builtin_prompts
    from verl_digen.models.toy import load_digits_data
    from verl_digen.rewards.digits import DigitClassifierReward

    reward = DigitClassifierReward()
    adapter = load_adapter(toy_digits)
    images, labels = load_digits_data()
    real = torch.from_numpy(images[:200])[:, None].expand(-1, 3, -1, -1)
    with torch.no_grad():
        recon = adapter.vae.decode(adapter.vae.encode(real * 2 - 1).latent_dist.mode()).sample / 2 + 0.5
    assert (recon.clamp(0, 1) - real).square().mean() < 0.01
    prompts = [f"the number {d}" for d in labels[:200]]
    assert reward(recon.clamp(0, 1), prompts).mean() > reward(real, prompts).mean() - 0.05

    val = builtin_prompts("digits_val")
    plain = reward(euler_sample(adapter, val, SPEC, num_steps=10, seed=0), val).mean().item()
    guided = reward(euler_sample(adapter, val, dataclasses.replace(SPEC, guidance_scale=3.0), num_steps=10, seed=0,
                                 negative_prompt=""), val).mean().item()
    assert plain > 0.25, plain
    assert guided > plain + 0.2, (plain, guided)
