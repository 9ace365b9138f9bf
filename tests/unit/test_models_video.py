"""Qwen-Image, Wan2.1 and HunyuanVideo specifics on their tiny models: tokenizers, shapes,
schedules, CFG / distilled guidance, parity with the diffusers pipelines, on-policy consistency
through the rollout and trainer code, the tiny-model cache, and the ``temporal_smoothness`` video
reward. What holds for every architecture (round trip, seeded builds, shapes, sigmas, gradients,
decoding, registry errors, the CLI) is tested over all of them in test_models.py."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from verl_digen.models import SampleSpec, detect_arch, load_adapter
from verl_digen.models.tiny import TINY_VERSION, ensure_tiny

from runs import PIXEL_SHAPE, PROMPTS, SPECS, euler_sample

pytestmark = pytest.mark.usefixtures("one_thread")

ARCHS = ["qwen_image", "wan", "hunyuan_video"]


# ---------------------------------------------------------------------- tokenizers and prompts


def test_qwen_tokenizer_template_prefix_is_what_the_pipeline_drops(adapters):
    from verl_digen.models.qwen_image import PROMPT_TEMPLATE, PROMPT_TEMPLATE_DROP

    tokenizer = adapters["qwen_image"].tokenizer
    prefix = PROMPT_TEMPLATE.split("{}")[0]
    assert len(tokenizer(prefix).input_ids) == PROMPT_TEMPLATE_DROP == 34
    assert tokenizer.tokenize("a photo of a cat") == ["a", "\u0120photo", "\u0120of", "\u0120a", "\u0120cat"]
    # Prompt + "<|im_end|>\n<|im_start|>assistant\n" (5 tokens) is what conditions the model.
    mask = adapters["qwen_image"].encode_prompts(PROMPTS)["prompt_embeds_mask"]
    assert mask.sum(dim=1).tolist() == [5 + 5, 6 + 5]


def test_hunyuan_tokenizer_template_prefix_is_what_the_pipeline_crops(adapters):
    from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE

    adapter = adapters["hunyuan_video"]
    prefix = DEFAULT_PROMPT_TEMPLATE["template"].split("{}")[0]
    assert len(adapter.tokenizer(prefix).input_ids) == DEFAULT_PROMPT_TEMPLATE["crop_start"] == adapter.crop_start == 95
    assert adapter.tokenizer.padding_side == "right"
    assert adapter.tokenizer.tokenize("a red cube") == ["\u2581a", "\u2581red", "\u2581cube"]
    # Prompt + "<|eot_id|>", right-padded (the transformer reads the mask as a length).
    mask = adapter.encode_prompts(PROMPTS)["prompt_attention_mask"]
    assert mask.sum(dim=1).tolist() == [5 + 1, 6 + 1]
    assert torch.equal(mask, (torch.arange(mask.shape[1]) < mask.sum(dim=1, keepdim=True)).to(mask.dtype))


@pytest.mark.parametrize("arch", ARCHS)
def test_prompts_are_separated_and_any_text_encodes(arch, adapters):
    cond = adapters[arch].encode_prompts(["a red cube", "a blue cube", "\u00fcn\u00efcode \u2713 prompt"])
    for key, tensor in cond.items():
        assert tensor.shape[0] == 3
        assert torch.isfinite(tensor.float()).all()
        if "mask" not in key:
            assert not torch.equal(tensor[0], tensor[1]), key


def test_wan_padding_rows_are_zero(adapters):
    adapter = adapters["wan"]
    embeds = adapter.encode_prompts(PROMPTS)["prompt_embeds"]
    lengths = adapter.tokenizer(PROMPTS, return_tensors="pt", padding=True).attention_mask.sum(dim=1)
    for row, length in zip(embeds, lengths.tolist()):
        assert row[length:].abs().sum() == 0 and row[:length].abs().sum() > 0


def test_qwen_stored_padding_length_does_not_change_velocity(tiny_dirs, adapters):
    """Conditioning is stored padded to max_sequence_length; the transformer only sees what is used."""
    from verl_digen.models.qwen_image import QwenImageAdapter

    longer = QwenImageAdapter.from_pretrained(tiny_dirs["qwen_image"], max_sequence_length=48)
    spec = SPECS["qwen_image"]
    cond_32, cond_48 = adapters["qwen_image"].encode_prompts(PROMPTS), longer.encode_prompts(PROMPTS)
    assert cond_32["prompt_embeds"].shape[1] == 32 and cond_48["prompt_embeds"].shape[1] == 48
    latents = longer.prepare_latents(2, spec, torch.Generator().manual_seed(0))
    with torch.no_grad():
        v32 = adapters["qwen_image"].predict_velocity(latents, torch.tensor([0.7, 0.2]), cond_32, spec)
        v48 = longer.predict_velocity(latents, torch.tensor([0.7, 0.2]), cond_48, spec)
    assert torch.equal(v32, v48)


# ---------------------------------------------------------------------- shapes and schedule


@pytest.mark.parametrize("arch", ARCHS)
def test_bad_sizes_are_rejected(arch, adapters):
    adapter = adapters[arch]
    with pytest.raises(ValueError, match="divisible"):
        bad = SampleSpec(height=30, width=32, num_frames=SPECS[arch].num_frames)
        adapter.prepare_latents(1, bad, torch.Generator())
    with pytest.raises(ValueError, match="num_frames"):
        adapter.prepare_latents(1, SampleSpec(height=32, width=32, num_frames=4), torch.Generator())


@pytest.mark.parametrize("arch", ARCHS)
def test_sigmas_are_the_pipeline_schedulers(arch, tiny_dirs, adapters):
    """Each adapter's sigmas are the ones its pipeline sets on the scheduler (shift included)."""
    import numpy as np
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

    if arch == "wan":  # the real UniPC multistep scheduler, set_timesteps(N) with flow_shift 3
        from diffusers import UniPCMultistepScheduler

        scheduler = UniPCMultistepScheduler.from_pretrained(tiny_dirs[arch], subfolder="scheduler")
    else:
        scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(tiny_dirs[arch], subfolder="scheduler")
    if arch == "qwen_image":  # linspace(1, 1/N), mu from the 64 image tokens
        c = scheduler.config
        mu = calculate_shift(64, c.base_image_seq_len, c.max_image_seq_len, c.base_shift, c.max_shift)
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / 6, 6), mu=mu)
    elif arch == "wan":
        scheduler.set_timesteps(6)
        assert 1 - 1e-5 < scheduler.sigmas[0] < 1  # diffusers moves the first sigma 1e-6 below 1
    else:  # linspace(1, 0, N + 1)[:-1] with the fixed shift 7
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 0.0, 7)[:-1])
    torch.testing.assert_close(adapters[arch].sigmas(6, SPECS[arch]), scheduler.sigmas.float(), atol=0, rtol=0)


def test_qwen_sigmas_use_resolution_shift(adapters):
    small = adapters["qwen_image"].sigmas(4, SampleSpec(32, 32))
    large = adapters["qwen_image"].sigmas(4, SampleSpec(256, 256))
    assert torch.all(large[1:-2] > small[1:-2])


def test_hunyuan_sigmas_use_fixed_shift(adapters):
    sigmas = adapters["hunyuan_video"].sigmas(4, SPECS["hunyuan_video"])
    base = torch.tensor([1.0, 0.75, 0.5, 0.25])
    torch.testing.assert_close(sigmas[:-1], 7 * base / (1 + 6 * base))


def test_wan_unipc_config_gives_unipc_flow_sigmas(tmp_path):
    """Real Wan2.1 checkpoints ship a UniPC scheduler with flow sigmas: the adapter steps those sigmas."""
    from diffusers import DDIMScheduler, UniPCMultistepScheduler

    from verl_digen.models.base import load_scheduler_config
    from verl_digen.models.wan import flow_sigmas

    unipc = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    unipc.save_pretrained(str(tmp_path / "scheduler"))  # as in a Wan2.1 checkpoint directory
    sigmas = flow_sigmas(load_scheduler_config(str(tmp_path)), 10)
    unipc.set_timesteps(10)
    assert sigmas.shape == (11,) and sigmas.dtype == torch.float32 and sigmas[-1] == 0
    torch.testing.assert_close(sigmas, unipc.sigmas.float(), atol=0, rtol=0)
    assert sigmas[0].item() == pytest.approx(1.0, abs=1e-5)
    with pytest.raises(ValueError, match="flow"):
        flow_sigmas({"_class_name": "DDIMScheduler", **DDIMScheduler().config}, 10)


# ---------------------------------------------------------------------- guidance, grads, pixels


def test_qwen_true_cfg_preserves_the_conditional_norm(adapters):
    """QwenImagePipeline rescales the CFG combination to the conditional velocity's norm, per token."""
    adapter, spec = adapters["qwen_image"], SPECS["qwen_image"]
    cond, negative = adapter.encode_prompts(PROMPTS), adapter.encode_prompts([""])
    latents = adapter.prepare_latents(2, spec, torch.Generator().manual_seed(0))
    sigma = torch.tensor([0.8, 0.3])
    with torch.no_grad():
        v_pos = adapter.predict_velocity(latents, sigma, cond, spec)
        v_neg = adapter.predict_velocity(latents, sigma, negative, spec)
        cfg = adapter.predict_velocity(latents, sigma, cond, SampleSpec(32, 32, guidance_scale=4.0), negative)
    combined = v_neg + 4.0 * (v_pos - v_neg)
    torch.testing.assert_close(cfg.norm(dim=-1), v_pos.norm(dim=-1), atol=1e-5, rtol=1e-5)
    expected = combined * (v_pos.norm(dim=-1, keepdim=True) / combined.norm(dim=-1, keepdim=True))
    torch.testing.assert_close(cfg, expected, atol=1e-5, rtol=1e-5)


def test_qwen_batched_cfg_equals_two_forwards(adapters):
    """A negative prompt as long as the longest prompt runs in one [cond; uncond] forward (the
    masks are merged); the result is that of two separate forwards."""
    adapter, spec = adapters["qwen_image"], SPECS["qwen_image"]
    cond = adapter.encode_prompts(PROMPTS)  # 10 and 11 tokens: masked
    negative = adapter.encode_prompts(["a blue cube on a chair"])  # 11 tokens: no mask needed
    assert negative["prompt_embeds_mask"].sum() == cond["prompt_embeds_mask"].sum(dim=1).max()
    latents = adapter.prepare_latents(2, spec, torch.Generator().manual_seed(0))
    sigma = torch.tensor([0.8, 0.3])
    with torch.no_grad():
        v_pos = adapter.predict_velocity(latents, sigma, cond, spec)
        negative_2 = {k: v.expand(2, *v.shape[1:]) for k, v in negative.items()}
        v_neg = adapter.predict_velocity(latents, sigma, negative_2, spec)
        cfg = adapter.predict_velocity(latents, sigma, cond, SampleSpec(32, 32, guidance_scale=3.0), negative)
    combined = v_neg + 3.0 * (v_pos - v_neg)
    expected = combined * (v_pos.norm(dim=-1, keepdim=True) / combined.norm(dim=-1, keepdim=True))
    torch.testing.assert_close(cfg, expected, atol=1e-5, rtol=1e-5)


def test_wan_cfg_is_linear_in_the_scale(adapters):
    adapter, spec = adapters["wan"], SPECS["wan"]
    cond, negative = adapter.encode_prompts(PROMPTS), adapter.encode_prompts([""])
    latents = adapter.prepare_latents(2, spec, torch.Generator().manual_seed(0))
    sigma = torch.tensor([0.6, 0.6])
    with torch.no_grad():
        v_pos = adapter.predict_velocity(latents, sigma, cond, spec)
        v_neg = adapter.predict_velocity(latents, sigma, negative, spec)
        cfg_spec = SampleSpec(32, 32, num_frames=5, guidance_scale=5.0)
        cfg = adapter.predict_velocity(latents, sigma, cond, cfg_spec, negative)
    torch.testing.assert_close(cfg, v_neg + 5.0 * (v_pos - v_neg), atol=1e-5, rtol=1e-5)


def test_hunyuan_distilled_guidance_changes_velocity(adapters):
    adapter = adapters["hunyuan_video"]
    cond = adapter.encode_prompts(PROMPTS)
    latents = adapter.prepare_latents(2, SPECS["hunyuan_video"], torch.Generator().manual_seed(0))
    sigma = torch.tensor([0.5, 0.5])

    def velocity(guidance):
        spec = SampleSpec(32, 32, num_frames=5, distilled_guidance=guidance)
        with torch.no_grad():
            return adapter.predict_velocity(latents, sigma, cond, spec)

    low, high = velocity(1.0), velocity(8.0)
    assert not torch.allclose(low, high, atol=1e-5)
    assert torch.equal(velocity(None), velocity(6.0))  # the pipeline's default guidance_scale


# ---------------------------------------------------------------------- parity with diffusers


@pytest.mark.parametrize("guided", [False, True], ids=["plain", "guided"])
@pytest.mark.parametrize("arch", ARCHS)
def test_matches_diffusers_pipeline(arch, guided, tiny_dirs, adapters):
    """Our Euler loop reproduces the diffusers pipeline's images / videos from the same generator seed.

    Guided: Qwen-Image true CFG (``true_cfg_scale``, norm-preserving rescale) against the empty
    prompt; Wan CFG (``guidance_scale``) against the empty prompt; HunyuanVideo distilled guidance
    3.0 plus true CFG. Plain: no CFG (HunyuanVideo still with its default distilled guidance 6.0).
    The pipelines run their own scheduler with the family's real config (FlowMatchEuler for
    Qwen-Image and HunyuanVideo; Wan2.1's UniPC, as its first-order predictor)."""
    from diffusers import HunyuanVideoPipeline, QwenImagePipeline, WanPipeline

    adapter = adapters[arch]
    common = dict(height=32, width=32, num_inference_steps=4, output_type="pt")
    scale = 2.5 if guided else 1.0
    negative = "" if guided else None
    if arch == "qwen_image":
        from verl_digen.models.qwen_image import PROMPT_TEMPLATE, PROMPT_TEMPLATE_DROP

        pipe = QwenImagePipeline.from_pretrained(tiny_dirs[arch])
        assert (pipe.prompt_template_encode, pipe.prompt_template_encode_start_idx) == (
            PROMPT_TEMPLATE, PROMPT_TEMPLATE_DROP
        )
        kwargs = dict(true_cfg_scale=scale, negative_prompt=negative, max_sequence_length=32)
        spec = SampleSpec(32, 32, guidance_scale=scale)
    elif arch == "wan":
        pipe = WanPipeline.from_pretrained(tiny_dirs[arch])
        assert type(pipe.scheduler).__name__ == "UniPCMultistepScheduler"  # the real Wan2.1 config
        # UniPC's first-order predictor without corrector is exactly the Euler step (in x0
        # prediction: x' = (s'/s) x - (1 - s')(s'(1 - s)/((1 - s')s) - 1) x0 = x + (s' - s) v);
        # the default bh2 order-2 solver with corrector is another integrator than the RL
        # sampler's Euler steps, so only the sigmas and timesteps can match it (tested above).
        pipe.scheduler = type(pipe.scheduler).from_config(
            pipe.scheduler.config, solver_order=1, disable_corrector=list(range(4))
        )
        kwargs = dict(num_frames=5, guidance_scale=scale, negative_prompt=negative, max_sequence_length=16)
        spec = SampleSpec(32, 32, num_frames=5, guidance_scale=scale)
    else:
        pipe = HunyuanVideoPipeline.from_pretrained(tiny_dirs[arch])
        distilled = 3.0 if guided else 6.0
        kwargs = dict(num_frames=5, guidance_scale=distilled, true_cfg_scale=scale, negative_prompt=negative,
                      max_sequence_length=16)
        spec = SampleSpec(32, 32, num_frames=5, guidance_scale=scale, distilled_guidance=3.0 if guided else None)
    pipe.set_progress_bar_config(disable=True)
    out = pipe(PROMPTS, generator=torch.Generator().manual_seed(3), **common, **kwargs)
    expected = out.images if arch == "qwen_image" else out.frames.permute(0, 2, 1, 3, 4)  # [B, 3, F, H, W]
    ours = euler_sample(adapter, PROMPTS, spec, num_steps=4, seed=3, negative_prompt=negative)
    assert ours.shape == expected.shape == PIXEL_SHAPE[arch]
    torch.testing.assert_close(ours, expected.float(), atol=1e-5, rtol=0)


def test_wan_expand_timesteps_matches_pipeline(tiny_dirs, adapters):
    """Wan2.2 TI2V-style per-token timesteps (``expand_timesteps``) give the pipeline's video too."""
    from diffusers import WanPipeline

    from verl_digen.models.wan import WanAdapter

    base = adapters["wan"]
    adapter = WanAdapter(
        transformer=base.transformer, vae=base.vae, text_encoder=base.text_encoder, tokenizer=base.tokenizer,
        scheduler_config=base.scheduler_config, expand_timesteps=True,
    )
    loaded = WanPipeline.from_pretrained(tiny_dirs["wan"])
    # UniPC as its first-order predictor (the Euler step; see test_matches_diffusers_pipeline).
    euler_unipc = type(loaded.scheduler).from_config(loaded.scheduler.config, solver_order=1, disable_corrector=[0, 1])
    pipe = WanPipeline(
        tokenizer=loaded.tokenizer, text_encoder=loaded.text_encoder, vae=loaded.vae, scheduler=euler_unipc,
        transformer=loaded.transformer, expand_timesteps=True,
    )
    pipe.set_progress_bar_config(disable=True)
    expected = pipe(
        PROMPTS, height=32, width=32, num_frames=5, num_inference_steps=2, guidance_scale=1.0,
        generator=torch.Generator().manual_seed(5), output_type="pt", max_sequence_length=16,
    ).frames.permute(0, 2, 1, 3, 4)
    ours = euler_sample(adapter, PROMPTS, SPECS["wan"], num_steps=2, seed=5)
    torch.testing.assert_close(ours, expected.float(), atol=1e-5, rtol=0)


def test_wan_two_expert_pipeline_is_refused(tmp_path, tiny_dirs):
    copy = shutil.copytree(tiny_dirs["wan"], tmp_path / "wan22")
    index_file = copy / "model_index.json"
    index = json.loads(index_file.read_text())
    index["transformer_2"] = ["diffusers", "WanTransformer3DModel"]
    index_file.write_text(json.dumps(index))
    with pytest.raises(ValueError, match="transformer_2"):
        load_adapter(str(copy))


# ---------------------------------------------------------------------- on-policy consistency


@pytest.mark.parametrize(
    "arch,guidance,distilled",
    [("qwen_image", 4.0, None), ("wan", 3.0, None), ("hunyuan_video", 1.0, 6.0)],
    ids=["qwen_image-true_cfg", "wan-cfg", "hunyuan_video-distilled"],
)
def test_recomputed_log_probs_equal_behaviour_log_probs(arch, guidance, distilled, tiny_dirs):
    """Rollout (sample_groups) and trainer (recompute_log_probs) agree on the same weights."""
    from verl_digen.algos.window import SdeWindowConfig
    from verl_digen.config.schema import AlgoConfig, LoraConfigSpec
    from verl_digen.workers.sampling import SamplingSettings, sample_groups
    from verl_digen.workers.training import PolicyUpdater, TrainSettings, add_lora

    adapter = load_adapter(tiny_dirs[arch])
    add_lora(adapter, LoraConfigSpec(rank=4))  # the default targets exist in every architecture
    spec = SampleSpec(32, 32, num_frames=SPECS[arch].num_frames, guidance_scale=guidance, distilled_guidance=distilled)
    settings = SamplingSettings(
        spec=spec,
        num_steps=4,
        noise_level=0.7,
        sde_type="sde",
        window=SdeWindowConfig(mode="fixed", start=1, size=2),
        timestep_fraction=1.0,
    )
    data = sample_groups(
        adapter, ["a red apple"], [0], [0], group_size=2, settings=settings, training_step=0, seed=7,
        policy_version=0,
    )
    assert len(data) == 2 and data.batch["images"].shape == PIXEL_SHAPE[arch]
    updater = PolicyUpdater(
        adapter, TrainSettings(algo=AlgoConfig(), sampling=settings, lora_only=True, images_per_step=len(data))
    )
    recomputed = updater.recompute_log_probs(data)
    window = data.batch["sde_mask"][0]
    assert window.sum() == 2
    behaviour = data.batch["log_probs"][:, window]
    assert torch.isfinite(behaviour).all() and behaviour.abs().sum() > 0
    torch.testing.assert_close(recomputed[:, window], behaviour, atol=1e-5, rtol=0)


# ---------------------------------------------------------------------- tiny-model cache


def test_ensure_tiny_video_arch(tmp_path, monkeypatch):
    monkeypatch.setenv("VERL_DIGEN_CACHE", str(tmp_path))
    path = ensure_tiny("hunyuan_video")
    assert path == str(tmp_path / "tiny" / f"hunyuan_video-{TINY_VERSION}")
    assert detect_arch(path) == "hunyuan_video"


# ---------------------------------------------------------------------- temporal_smoothness reward


def test_temporal_smoothness_values():
    from verl_digen.rewards import build_reward, registered_rewards

    assert "temporal_smoothness" in registered_rewards()
    reward = build_reward("temporal_smoothness")
    assert reward.supports_video
    still = torch.full((1, 3, 4, 8, 8), 0.3)
    # Frames 0, 1, 0, 1: every consecutive pair differs by 1 everywhere -> -1.
    flicker = torch.arange(4).remainder(2).float().view(1, 1, 4, 1, 1).expand(1, 3, 4, 8, 8)
    ramp = torch.linspace(0, 0.3, 4).view(1, 1, 4, 1, 1).expand(1, 3, 4, 8, 8)  # steps of 0.1
    scores = reward(torch.cat([still, flicker, ramp]), ["a", "b", "c"])
    assert scores.dtype == torch.float32 and scores.shape == (3,)
    torch.testing.assert_close(scores, torch.tensor([0.0, -1.0, -0.01]))
    one_frame = reward(torch.rand(2, 3, 1, 8, 8), ["a", "b"])
    assert torch.equal(one_frame, torch.zeros(2))


def test_temporal_smoothness_rejects_images():
    from verl_digen.rewards import build_reward

    reward = build_reward("temporal_smoothness")
    with pytest.raises(ValueError, match=r"temporal_smoothness.*videos \[B, 3, F, H, W\]"):
        reward(torch.rand(2, 3, 8, 8), ["a", "b"])


def test_temporal_smoothness_on_tiny_video(adapters):
    from verl_digen.rewards import build_reward

    video = euler_sample(adapters["wan"], PROMPTS, SPECS["wan"], num_steps=2, seed=0)
    scores = build_reward("temporal_smoothness")(video, PROMPTS)
    assert scores.shape == (2,) and torch.all(scores <= 0) and torch.all(scores > -1)
