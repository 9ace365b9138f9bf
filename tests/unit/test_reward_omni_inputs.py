"""What a veRL-Omni reward function receives through our reward path: its video layout (uint8
``[3, F, H, W]``), and with ``pipeline.output_type=latent`` / ``both`` the samples' final latents
(``solution_image`` / ``extra_info["latents_clean"]``) and their conditioning. The reward files
below are written here in the shape of veRL-Omni's own scorers (a frame extractor as its video
scorers have, a latent client that batches ``latents_clean`` with the prompt embeddings) and run
unchanged; the rollout side carries the latents only when the config asks for them."""

from __future__ import annotations

import pytest
import torch

from test_omni_keys import QWEN_MULTI, _resolved
from verl_digen.config.schema import ConfigError
from verl_digen.rewards import build_reward, build_reward_from_config
from verl_digen.rewards.custom import CustomRewardError, reward_wants_latents

# A video scorer as veRL-Omni's are: a 4-D channels-first video is [C, F, H, W]: subsample the
# frames with extra_info["frame_interval"], put frames first, one PIL image per frame (HWC).
OMNI_VIDEO = '''
import numpy as np
import torch
from PIL import Image

SEEN = []

def _extract_frames(solution_image, frame_interval=1):
    if solution_image.ndim == 3:
        solution_image = solution_image.unsqueeze(0)
    elif solution_image.ndim == 4:
        solution_image = solution_image[:, ::frame_interval].permute(1, 0, 2, 3)
    out = []
    for frame in solution_image:
        array = frame.cpu().numpy()
        if array.ndim == 3 and array.shape[0] in (1, 3):
            array = array.transpose(1, 2, 0)
        out.append(Image.fromarray(array))
    return out

def to_pil_frames(video):
    if video.dtype != torch.uint8:
        raise ValueError(f"Expected a uint8 video tensor, got {video.dtype}")
    if video.shape[0] == 3 and video.shape[1] != 3:
        video = video.permute(1, 0, 2, 3)
    if video.shape[1] != 3:
        raise ValueError(f"Expected [T, 3, H, W], got {tuple(video.shape)}")
    return [Image.fromarray(f) for f in video.permute(0, 2, 3, 1).contiguous().numpy()]

def compute_score_video(data_source, solution_image, ground_truth, extra_info, **kwargs):
    SEEN.append(solution_image)
    frames = _extract_frames(solution_image, extra_info.get("frame_interval", 2))
    assert [f.size for f in to_pil_frames(solution_image)] == [frames[0].size] * solution_image.shape[1]
    # the red channel's mean of the kept frames, in [0, 1]
    red = [np.asarray(f, dtype=np.float64)[..., 0].mean() / 255 for f in frames]
    return {"score": float(sum(red) / len(red)), "frames": float(len(frames))}
'''

# A latent reward as veRL-Omni's DRM client reads its inputs: latents_clean from extra_info, else
# a 16-channel solution_image; one sample each, batched to rank 4 with the prompt embeddings.
OMNI_LATENT = '''
import torch

SEEN = []

def _batched(value, name, rank):
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.ndim == rank - 1:
        value = value.unsqueeze(0)
    elif value.ndim != rank:
        raise ValueError(f"{name} must have rank {rank - 1} or {rank}, got shape {tuple(value.shape)}")
    return value.cpu().contiguous()

async def compute_score(solution_image, extra_info, noise_level=0.4, **kwargs):
    latents = extra_info.get("latents_clean")
    if latents is None and isinstance(solution_image, torch.Tensor) and solution_image.shape[-3] == 16:
        latents = solution_image
    latents = _batched(latents, "latents_clean", 4)
    embeds = _batched(extra_info.get("prompt_embeds"), "prompt_embeds", 3)
    pooled = _batched(extra_info.get("pooled_prompt_embeds"), "pooled_prompt_embeds", 2)
    SEEN.append((solution_image, extra_info))
    return {"score": float(latents.sum() + embeds.sum() + pooled.sum()) * noise_level}
'''


def _write(tmp_path, text, name):
    path = tmp_path / f"{name}.py"
    path.write_text(text)
    return str(path)


def test_a_veRL_Omni_video_scorer_runs_unchanged_on_our_frames(tmp_path):
    reward = build_reward("custom", path=_write(tmp_path, OMNI_VIDEO, "omni_video"), function="compute_score_video")
    # 2 videos of 5 frames: frame f's red channel is f / 8, green and blue random
    video = torch.rand(2, 3, 5, 6, 10)
    video[:, 0] = (torch.arange(5, dtype=torch.float32) / 8).view(1, 5, 1, 1)
    scores = reward(video, ["a", "b"], [{"extra_info": {"frame_interval": 2}}] * 2)
    seen = reward.fn.__globals__["SEEN"]
    assert [(tuple(x.shape), x.dtype) for x in seen] == [((3, 5, 6, 10), torch.uint8)] * 2
    assert torch.equal(seen[1], (video[1] * 255).round().to(torch.uint8))  # [C, F, H, W], values in [0, 255]
    kept = [round(f / 8 * 255) / 255 for f in (0, 2, 4)]  # frames 0, 2, 4 (frame_interval 2)
    assert scores.tolist() == pytest.approx([sum(kept) / 3] * 2, abs=1e-6)
    assert reward.take_extras()["frames"].tolist() == [3.0, 3.0]


def test_the_frames_first_layout_is_a_setting_and_a_wrong_one_is_refused(tmp_path):
    path = _write(tmp_path, "SEEN = []\ndef compute_score(solution_image):\n    SEEN.append(solution_image)\n"
                            "    return 0.0\n", "frames_first")
    reward = build_reward("custom", path=path, video_layout="fchw")
    video = torch.rand(1, 3, 4, 6, 6)
    reward(video, ["a"])
    (seen,) = reward.fn.__globals__["SEEN"]
    assert torch.equal(seen, (video[0].permute(1, 0, 2, 3) * 255).round().to(torch.uint8))  # [F, 3, H, W]
    with pytest.raises(ValueError, match="video_layout='tchw'"):
        build_reward("custom", path=path, video_layout="tchw")


def _latents(batch=2):
    torch.manual_seed(0)
    return {"latents_clean": torch.randn(batch, 16, 4, 6), "prompt_embeds": torch.randn(batch, 7, 8),
            "pooled_prompt_embeds": torch.randn(batch, 5)}


def _drm_spec(tmp_path, output_type):
    """The weighted sum veRL-Omni's multi-reward keys make of one DRM-style entry."""
    return {"name": "weighted", "components": [{"name": "custom", "label": "drm", "weight": 1.0, "kwargs": {
        "path": _write(tmp_path, OMNI_LATENT, "omni_latent"), "function": "compute_score", "required": True,
        "reward_kwargs": {"noise_level": 0.5}, "where": "reward.reward_functions.drm", "output_type": output_type}}]}


@pytest.mark.parametrize("output_type", ["latent", "both"])
def test_a_veRL_Omni_latent_reward_gets_the_final_latents_as_its_output_type_says(tmp_path, output_type):
    spec = _drm_spec(tmp_path, output_type)
    assert reward_wants_latents(spec)
    reward = build_reward_from_config(spec)
    assert reward.wants_latents
    tensors = _latents()
    images = torch.rand(2, 3, 32, 48)
    reward.give_sample_tensors(tensors)
    scores = reward(images, ["a", "b"])
    expected = [0.5 * float(tensors["latents_clean"][i].sum() + tensors["prompt_embeds"][i].sum()
                            + tensors["pooled_prompt_embeds"][i].sum()) for i in range(2)]
    assert scores.tolist() == pytest.approx(expected, rel=1e-5)
    (_, fn_reward, _), = reward.components
    for i, (solution, info) in enumerate(fn_reward.fn.__globals__["SEEN"]):
        assert torch.equal(info["latents_clean"], tensors["latents_clean"][i])  # one sample: [16, h, w]
        assert info["latents_clean"].dtype == torch.float32
        if output_type == "latent":  # the latents are the solution_image
            assert torch.equal(solution, tensors["latents_clean"][i])
        else:  # pixels, as for image rewards
            assert solution.dtype == torch.uint8 and tuple(solution.shape) == (3, 32, 48)
    # the tensors were for that call only
    with pytest.raises(CustomRewardError, match=f"output_type={output_type} .* received none"):
        reward(images, ["a", "b"])


def test_a_pixel_reward_takes_no_latents_and_a_wrong_output_type_is_refused(tmp_path):
    path = _write(tmp_path, "def compute_score(solution_image, extra_info):\n"
                            "    assert 'latents_clean' not in extra_info\n    return float(solution_image.dim())\n",
                  "pixels")
    reward = build_reward("custom", path=path, output_type="image")
    assert not reward.wants_latents and not reward_wants_latents({"name": "custom", "kwargs": {"path": path}})
    reward.give_sample_tensors(_latents(1))  # handed, not kept: the function scores pixels
    assert reward(torch.rand(1, 3, 8, 8), ["a"]).tolist() == [3.0]
    with pytest.raises(ValueError, match=r"pipeline.output_type='latents'"):
        build_reward("custom", path=path, output_type="latents")


PIPE = "actor_rollout_ref.rollout.pipeline.output_type"
VAL_PIPE = "actor_rollout_ref.rollout.val_kwargs.pipeline.output_type"


@pytest.mark.parametrize(("value", "wants"), [("latent", True), ("both", True), ("image", False), ("pt", False)])
def test_veRL_Omnis_output_type_reaches_every_reward_function(value, wants):
    reward = _resolved(*QWEN_MULTI, f"{PIPE}={value}").digen["reward"]
    assert [c["kwargs"]["output_type"] for c in reward["components"]] == [value, value]
    assert reward_wants_latents(reward) is wants
    unset = _resolved(*QWEN_MULTI).digen["reward"]
    assert all("output_type" not in c["kwargs"] for c in unset["components"]) and not reward_wants_latents(unset)


def test_the_video_layout_setting_reaches_veRL_Omnis_reward_functions():
    reward = _resolved(*QWEN_MULTI, "+digen.reward.kwargs.video_layout=fchw").digen["reward"]
    assert [c["kwargs"]["video_layout"] for c in reward["components"]] == ["fchw", "fchw"]


@pytest.mark.parametrize(("overrides", "message"), [
    ([f"{PIPE}=latents"], rf"{PIPE}='latents'; valid: image, pt, np, pil"),
    ([f"{PIPE}=latent", f"{VAL_PIPE}=latents"], rf"{VAL_PIPE}='latents'; valid: image, pt, np, pil"),
])
def test_an_output_type_that_cannot_apply_is_refused_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        _resolved(*QWEN_MULTI, *overrides)


def test_validation_scores_with_its_own_output_type_as_veRL_Omnis_drm_recipe_sets_it(tmp_path):
    """veRL-Omni's SD3.5 DRM recipe: latent in training, both in validation."""
    reward = _resolved(*QWEN_MULTI, f"{PIPE}=latent", f"{VAL_PIPE}=both").digen["reward"]
    assert [(c["kwargs"]["output_type"], c["kwargs"]["validation_output_type"]) for c in reward["components"]] == \
        [("latent", "both")] * 2
    spec = _drm_spec(tmp_path, "image")
    spec["components"][0]["kwargs"]["validation_output_type"] = "both"
    assert reward_wants_latents(spec)  # validation's: the rollout keeps them
    built = build_reward_from_config(spec)
    (_, fn_reward, _), = built.components
    seen = fn_reward.fn.__globals__["SEEN"]
    images, tensors = torch.rand(2, 3, 8, 8), _latents()
    built.give_sample_tensors(tensors, validation=True)
    built(images, ["a", "b"])
    solution, info = seen[-1]
    assert solution.dtype == torch.uint8 and torch.equal(info["latents_clean"], tensors["latents_clean"][1])
    # a training call: image, the tensors handed are not kept, and the function gets pixels only
    built.give_sample_tensors(tensors)
    with pytest.raises(CustomRewardError, match="latents_clean must be a torch.Tensor, got NoneType"):
        built(images, ["a", "b"])


def test_latents_without_a_reward_function_are_refused():
    with pytest.raises(ConfigError, match=rf"{PIPE}='latent' hands latents to a reward function"):
        _resolved(f"{PIPE}=latent")


def test_the_rollout_carries_the_final_latents_only_when_the_reward_reads_them(tiny_sd3, tmp_path):
    import dataclasses

    from verl_digen.config.schema import DigenConfig, RewardConfig
    from verl_digen.models import load_adapter
    from verl_digen.models.base import pixels_from_uint8, pixels_to_uint8
    from verl_digen.workers.sampling import GroupRequest, begin_groups, denoise, finish_groups, latent_fields
    from verl_digen.workers.validation import run_validation
    from verl_digen.workers.worker import sampling_settings

    torch.set_num_threads(1)
    spec = _drm_spec(tmp_path, "latent")
    assert not sampling_settings(DigenConfig()).keep_final_latents
    settings = sampling_settings(DigenConfig(reward=RewardConfig(name="weighted", components=spec["components"])))
    assert settings.keep_final_latents
    adapter = load_adapter(tiny_sd3)

    def sample(settings):
        request = GroupRequest(["a red cube", "a cat"], [0, 1], [0, 1], group_size=2, training_step=1, seed=3,
                               policy_version=0)
        state = begin_groups(adapter, request, settings)
        denoise(adapter, state, settings, settings.num_steps)
        return finish_groups(adapter, state, settings)

    plain = sample(dataclasses.replace(settings, keep_final_latents=False))
    assert "final_latents" not in plain.batch.keys() and latent_fields(plain) is None
    data = sample(settings)
    fields = latent_fields(data)
    final = fields["latents_clean"]
    # SD3's own layout [B, C, h, w] (16 channels at full size, the tiny model's fewer)
    assert final.dtype == torch.float32 and final.shape[:2] == (4, adapter.latent_channels) and final.dim() == 4
    # the final clean latents: they decode to the trajectory's pixels
    decoded = pixels_to_uint8(adapter.decode(final.to(adapter.device), settings.spec).float().clamp(0, 1).cpu())
    assert torch.equal(decoded, data.batch["images"])
    assert fields["prompt_embeds"].shape[0] == 4 and fields["pooled_prompt_embeds"].dim() == 2
    # the DRM-style function runs on them unchanged, as the scoring worker calls it
    reward = build_reward_from_config(spec)
    reward.give_sample_tensors(fields)
    scores = reward(pixels_from_uint8(data.batch["images"]), list(data.non_tensor_batch["prompt"]))
    expected = [0.5 * float(final[i].sum() + fields["prompt_embeds"][i].sum() + fields["pooled_prompt_embeds"][i].sum())
                for i in range(4)]
    assert scores.tolist() == pytest.approx(expected, rel=1e-4)
    # validation hands them over too
    val = run_validation(adapter, ["a red cube"], settings, reward, seed=0, step=0, out_dir=str(tmp_path / "val"),
                         give_latents=reward.give_sample_tensors)
    (_, fn_reward, _), = reward.components
    solution, info = fn_reward.fn.__globals__["SEEN"][-1]
    assert solution is info["latents_clean"] and solution.shape == final.shape[1:]
    assert val.rewards == pytest.approx([0.5 * float(solution.sum() + info["prompt_embeds"].sum()
                                                     + info["pooled_prompt_embeds"].sum())], rel=1e-4)
    with pytest.raises(CustomRewardError, match="received none"):  # not handed: refused, not scored on nothing
        run_validation(adapter, ["a red cube"], settings, reward, seed=0, step=0, out_dir=str(tmp_path / "val"))
