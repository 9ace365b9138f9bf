"""Tests for verl_digen.rewards: registry, image rewards, video averaging, CLIP, HTTP client."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import torch

from verl_digen.rewards import (
    HttpReward,
    RewardFn,
    RewardServerError,
    UnknownRewardError,
    WeightedReward,
    build_reward,
    build_reward_from_config,
    build_tiny_clip,
    decode_images_png_b64,
    encode_images_png_b64,
    registered_rewards,
)
from verl_digen.sync import find_free_port

from runs import JsonHandler, quantised_rand, serve

BUILTINS = {
    "brightness",
    "clip_score",
    "colorfulness",
    "http",
    "jpeg_compressibility",
    "jpeg_incompressibility",
    "weighted",
}


# --------------------------------------------------------------------------- registry


def test_registry_lists_builtins() -> None:
    assert BUILTINS <= set(registered_rewards())
    assert registered_rewards() == sorted(registered_rewards())


def test_unknown_reward_error_lists_registered_names() -> None:
    with pytest.raises(UnknownRewardError) as info:
        build_reward("aesthetic_v9")
    message = str(info.value)
    assert "'aesthetic_v9'" in message
    for name in BUILTINS:
        assert name in message
    assert isinstance(info.value, ValueError)


def test_bad_kwargs_name_reward_and_argument() -> None:
    with pytest.raises(ValueError, match=r"'jpeg_compressibility'.*'qualty'"):
        build_reward("jpeg_compressibility", qualty=90)
    with pytest.raises(ValueError, match=r"'http'.*'url'"):
        build_reward("http")
    with pytest.raises(ValueError, match=r"quality"):
        build_reward("jpeg_compressibility", quality=0)


def test_build_reward_from_config_forms() -> None:
    from omegaconf import OmegaConf

    images = quantised_rand(2, 3, 16, 16)
    prompts = ["a", "b"]
    brightness = build_reward("brightness")(images, prompts)

    assert build_reward_from_config("brightness").name == "brightness"
    jpeg = build_reward_from_config({"name": "jpeg_compressibility", "kwargs": {"quality": 80}})
    assert jpeg.quality == 80

    components = [{"name": "brightness", "weight": 2.0}, {"name": "colorfulness", "weight": 0.5}]
    expected = 2.0 * brightness + 0.5 * build_reward("colorfulness")(images, prompts)
    for cfg in (
        components,
        {"name": "weighted", "components": components},
        {"name": "weighted", "kwargs": {"components": components}},
        OmegaConf.create({"name": "weighted", "components": components}),
        OmegaConf.create(components),
    ):
        reward = build_reward_from_config(cfg)
        assert isinstance(reward, WeightedReward)
        torch.testing.assert_close(reward(images, prompts), expected)

    with pytest.raises(ValueError, match="unknown key"):
        build_reward_from_config({"name": "brightness", "kwrgs": {}})
    with pytest.raises(UnknownRewardError, match="nope"):
        build_reward_from_config([{"name": "nope"}])


def test_input_validation() -> None:
    reward = build_reward("brightness")
    with pytest.raises(ValueError, match="2 images but 1 prompts"):
        reward(torch.rand(2, 3, 8, 8), ["x"])
    with pytest.raises(ValueError, match="shape"):
        reward(torch.rand(2, 4, 8, 8), ["x", "y"])
    with pytest.raises(ValueError, match="float"):
        reward(torch.zeros(1, 3, 8, 8, dtype=torch.uint8), ["x"])


# --------------------------------------------------------------------------- image statistics


def test_jpeg_flat_image_more_compressible_than_noise() -> None:
    flat = torch.full((1, 3, 64, 64), 0.5)
    noise = quantised_rand(1, 3, 64, 64)
    images = torch.cat([flat, noise])
    prompts = ["flat", "noise"]

    compress = build_reward("jpeg_compressibility")(images, prompts)
    incompress = build_reward("jpeg_incompressibility")(images, prompts)

    assert compress.dtype == torch.float32 and compress.shape == (2,)
    assert (compress < 0).all() and (incompress > 0).all()
    torch.testing.assert_close(compress, -incompress / 500)  # Flow-GRPO's scales (test_reward_factory)
    assert compress[0] > compress[1]  # flat is more compressible
    assert incompress[1] > incompress[0]
    assert incompress[1] > 5.0  # 64x64 noise at quality 95 is several kB


def test_brightness_of_constant_image() -> None:
    images = torch.stack([torch.full((3, 8, 8), value) for value in (0.0, 0.25, 0.7, 1.0)])
    scores = build_reward("brightness")(images, ["p"] * 4)
    torch.testing.assert_close(scores, torch.tensor([0.0, 0.25, 0.7, 1.0]))


def test_colorfulness_grey_is_zero_and_vivid_is_higher() -> None:
    grey = torch.full((1, 3, 16, 16), 0.4)
    vivid = torch.zeros(1, 3, 16, 16)
    vivid[0, 0, :, :8] = 1.0  # left half red
    vivid[0, 2, :, 8:] = 1.0  # right half blue
    scores = build_reward("colorfulness")(torch.cat([grey, vivid]), ["grey", "vivid"])
    assert scores[0].item() == pytest.approx(0.0, abs=1e-6)
    assert scores[1] > 0.5
    assert scores[1] < 1.3  # documented range: roughly [0, 1], at most ~1.2


@pytest.mark.parametrize("name", ["brightness", "colorfulness", "jpeg_compressibility"])
def test_video_reward_is_mean_over_frames(name: str) -> None:
    reward = build_reward(name)
    videos = quantised_rand(2, 3, 4, 16, 16, seed=1)  # [B, 3, F, H, W]
    videos[1, :, 0] = 0.5  # make one frame flat so frames differ a lot
    prompts = ["v0", "v1"]

    scores = reward(videos, prompts)

    manual = torch.stack(
        [torch.stack([reward(videos[b : b + 1, :, f], [prompts[b]])[0] for f in range(4)]).mean() for b in range(2)]
    )
    assert scores.shape == (2,) and scores.dtype == torch.float32
    torch.testing.assert_close(scores, manual)


# --------------------------------------------------------------------------- weighted


def test_weighted_sum_equals_manual_combination() -> None:
    brightness, colorful, jpeg = (build_reward(n) for n in ("brightness", "colorfulness", "jpeg_incompressibility"))
    reward = WeightedReward([(brightness, 1.5), ("colour", colorful, -0.5), (jpeg, 0.01), (brightness, 2.0)])
    images = quantised_rand(3, 3, 16, 16, seed=2)
    prompts = ["a", "b", "c"]

    total, parts = reward.score_with_components(images, prompts)

    b, c, j = brightness(images, prompts), colorful(images, prompts), jpeg(images, prompts)
    torch.testing.assert_close(total, 1.5 * b - 0.5 * c + 0.01 * j + 2.0 * b)
    torch.testing.assert_close(reward(images, prompts), total)
    assert list(parts) == ["brightness", "colour", "jpeg_incompressibility", "brightness_1"]
    torch.testing.assert_close(parts["colour"], c)
    assert reward.weights == {"brightness": 1.5, "colour": -0.5, "jpeg_incompressibility": 0.01, "brightness_1": 2.0}


def test_weighted_on_video_matches_components() -> None:
    reward = build_reward_from_config([{"name": "brightness", "weight": 1.0}, {"name": "colorfulness", "weight": 2.0}])
    videos = quantised_rand(2, 3, 3, 8, 8, seed=3)
    prompts = ["a", "b"]
    expected = build_reward("brightness")(videos, prompts) + 2.0 * build_reward("colorfulness")(videos, prompts)
    torch.testing.assert_close(reward(videos, prompts), expected)


def test_weighted_rejects_bad_components() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        WeightedReward([])
    with pytest.raises(ValueError, match="weight must be a finite number"):
        WeightedReward([(build_reward("brightness"), float("nan"))])
    with pytest.raises(ValueError, match="expected a RewardFn"):
        WeightedReward([("x", lambda images, prompts: images, 1.0)])


# --------------------------------------------------------------------------- CLIP


@pytest.fixture(scope="module")
def tiny_clip_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_clip(tmp_path_factory.mktemp("tiny_clip"))


@pytest.fixture(scope="module")
def clip_reward(tiny_clip_dir: str) -> RewardFn:
    return build_reward("clip_score", model_path=tiny_clip_dir, device="cpu")


def test_clip_score_finite_and_deterministic(clip_reward: RewardFn) -> None:
    image = quantised_rand(1, 3, 40, 48, seed=4)  # not the model's 32x32: exercises resize + crop
    other = quantised_rand(1, 3, 40, 48, seed=5)
    images = torch.cat([image, other, image])
    prompts = ["a red apple", "a blue car", "a red apple"]

    scores = clip_reward(images, prompts)

    assert scores.shape == (3,) and scores.dtype == torch.float32
    assert torch.isfinite(scores).all()
    assert (scores.abs() <= 1.0 + 1e-5).all()  # cosine similarity with scale 1
    assert scores[0] == scores[2]  # identical image and prompt -> identical score
    torch.testing.assert_close(clip_reward(images, prompts), scores)


def test_clip_score_matches_transformers_forward(tiny_clip_dir: str, clip_reward: RewardFn) -> None:
    from transformers import CLIPModel, CLIPProcessor

    model = CLIPModel.from_pretrained(tiny_clip_dir).eval()
    processor = CLIPProcessor.from_pretrained(tiny_clip_dir)
    images = quantised_rand(2, 3, 32, 32, seed=6)
    prompts = ["a cat", "two dogs playing"]
    arrays = [(img.permute(1, 2, 0) * 255).round().to(torch.uint8).numpy() for img in images]

    inputs = processor(images=arrays, text=prompts, padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = model(**inputs).logits_per_image / model.logit_scale.exp()

    torch.testing.assert_close(clip_reward(images, prompts), logits.diagonal(), atol=1e-5, rtol=1e-4)


def test_clip_score_on_video(clip_reward: RewardFn) -> None:
    videos = quantised_rand(2, 3, 2, 32, 32, seed=7)
    prompts = ["a", "b"]
    per_frame = torch.stack([clip_reward(videos[:, :, f], prompts) for f in range(2)], dim=1)
    torch.testing.assert_close(clip_reward(videos, prompts), per_frame.mean(dim=1))


def test_clip_score_missing_model_dir(tmp_path) -> None:
    missing = tmp_path / "no_such_clip"
    with pytest.raises(FileNotFoundError, match="no_such_clip"):
        build_reward("clip_score", model_path=str(missing))
    with pytest.raises(FileNotFoundError, match="config.json"):
        build_reward("clip_score", model_path=str(tmp_path))


# --------------------------------------------------------------------------- HTTP


def test_png_b64_round_trip() -> None:
    images = quantised_rand(3, 3, 10, 12, seed=8)
    encoded = encode_images_png_b64(images)
    assert len(encoded) == 3 and all(isinstance(e, str) for e in encoded)
    torch.testing.assert_close(decode_images_png_b64(encoded), images, atol=0, rtol=0)
    with pytest.raises(ValueError, match="image 1"):
        decode_images_png_b64([encoded[0], "not base64!!"])


@dataclass
class ServerState:
    """What the test server does next, and what it saw."""

    mode: str = "ok"  # ok | fail_then_ok | forbidden | not_json | no_rewards | wrong_length | nan | slow
    failures_left: int = 0
    requests: int = 0
    batch_sizes: list[int] = field(default_factory=list)
    auth_headers: list[str | None] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


class _Handler(JsonHandler):
    state: ServerState

    def do_POST(self) -> None:
        payload = self.read_json()
        state = self.state
        with state.lock:
            state.requests += 1
            state.auth_headers.append(self.headers.get("Authorization"))
            fail = state.mode == "fail_then_ok" and state.failures_left > 0
            if fail:
                state.failures_left -= 1
        if fail:
            return self.reply(500, b'{"error": "try again"}')
        if state.mode == "forbidden":
            return self.reply(403, b'{"error": "bad token"}')
        if state.mode == "slow":
            time.sleep(0.5)
        if state.mode == "not_json":
            return self.reply(200, b"<html>oops</html>")
        if state.mode == "no_rewards":
            return self.reply(200, b'{"scores_v2": [1.0]}')
        images = decode_images_png_b64(payload["images"])
        assert len(payload["prompts"]) == images.shape[0]
        with state.lock:
            state.batch_sizes.append(images.shape[0])
        rewards = images.mean(dim=(1, 2, 3)).tolist()
        if state.mode == "wrong_length":
            rewards = rewards[:-1]
        if state.mode == "nan":
            rewards[0] = float("nan")
        self.reply(200, {"rewards": rewards})


@pytest.fixture
def reward_server(loopback_no_proxy) -> Iterator[tuple[str, ServerState]]:
    """A brightness reward server on 127.0.0.1:<free port>; yields (url, state)."""
    state = ServerState()
    with serve(_Handler, state) as base_url:
        yield f"{base_url}/score", state


def test_http_reward_round_trip_equals_local_brightness(reward_server) -> None:
    url, state = reward_server
    reward = build_reward("http", url=url, batch_size=2)
    images = quantised_rand(5, 3, 8, 8, seed=9)
    prompts = [f"p{i}" for i in range(5)]

    scores = reward(images, prompts)

    assert scores.dtype == torch.float32 and scores.shape == (5,)
    torch.testing.assert_close(scores, build_reward("brightness")(images, prompts))
    assert state.batch_sizes == [2, 2, 1]
    assert state.auth_headers == [None, None, None]


def test_http_reward_video(reward_server) -> None:
    url, _ = reward_server
    videos = quantised_rand(2, 3, 3, 8, 8, seed=10)
    prompts = ["a", "b"]
    torch.testing.assert_close(HttpReward(url)(videos, prompts), build_reward("brightness")(videos, prompts))


def test_http_reward_sends_bearer_token(reward_server) -> None:
    url, state = reward_server
    HttpReward(url, token="s3cret")(quantised_rand(1, 3, 8, 8), ["p"])
    assert state.auth_headers == ["Bearer s3cret"]


def test_http_reward_retries_5xx_then_succeeds(reward_server) -> None:
    url, state = reward_server
    state.mode, state.failures_left = "fail_then_ok", 2
    images = quantised_rand(2, 3, 8, 8)

    scores = HttpReward(url, max_retries=3, backoff_s=0.01)(images, ["a", "b"])

    assert state.requests == 3
    torch.testing.assert_close(scores, images.mean(dim=(1, 2, 3)))


def test_http_reward_gives_up_on_persistent_5xx(reward_server) -> None:
    url, state = reward_server
    state.mode, state.failures_left = "fail_then_ok", 10
    with pytest.raises(RewardServerError, match=r"failed after 2 attempts: HTTP 500"):
        HttpReward(url, max_retries=2, backoff_s=0.01)(quantised_rand(1, 3, 8, 8), ["a"])
    assert state.requests == 2


def test_http_reward_times_out_and_retries(reward_server) -> None:
    url, state = reward_server
    state.mode = "slow"
    with pytest.raises(RewardServerError, match=r"after 2 attempts: .*timed out"):
        HttpReward(url, timeout_s=0.1, max_retries=2, backoff_s=0.01)(quantised_rand(1, 3, 8, 8), ["a"])
    assert state.requests == 2


def test_http_reward_unreachable_port_raises_naming_url(loopback_no_proxy) -> None:
    url = f"http://127.0.0.1:{find_free_port('127.0.0.1')}/score"  # nothing listens there
    reward = HttpReward(url, timeout_s=10.0, max_retries=3, backoff_s=0.01)

    start = time.monotonic()
    with pytest.raises(RewardServerError) as info:
        reward(quantised_rand(1, 3, 8, 8), ["a"])
    elapsed = time.monotonic() - start

    message = str(info.value)
    assert url in message and "unreachable after 3 attempts" in message
    assert "refused" in message.lower()
    assert elapsed < 15.0  # refused at once: waiting out timeout_s would take 3 x 10 s


@pytest.mark.parametrize(
    ("mode", "problem"),
    [
        ("not_json", "not JSON"),
        ("no_rewards", "expected an object with a 'rewards' or 'scores' key, got keys ['scores_v2']"),
        ("wrong_length", "got 1 rewards for 2 samples"),
        ("nan", "score 0 is not a finite number"),
    ],
)
def test_http_reward_malformed_response(reward_server, mode: str, problem: str) -> None:
    url, state = reward_server
    state.mode = mode
    with pytest.raises(RewardServerError, match="malformed") as info:
        HttpReward(url, backoff_s=0.01)(quantised_rand(2, 3, 8, 8), ["a", "b"])
    assert url in str(info.value) and problem in str(info.value)
    assert state.requests == 1  # malformed answers are not retried


def test_http_reward_4xx_not_retried(reward_server) -> None:
    url, state = reward_server
    state.mode = "forbidden"
    with pytest.raises(RewardServerError, match=r"rejected the request: HTTP 403"):
        HttpReward(url, max_retries=3, backoff_s=0.01)(quantised_rand(1, 3, 8, 8), ["a"])
    assert state.requests == 1


# --------------------------------------------------------------------------- metadata


class _GroundTruthLength(RewardFn):
    """Scores each sample by the length of its record's ground truth (and checks the prompt)."""

    name = "gt_length"

    def score_images(self, images: torch.Tensor, prompts: list[str], metadata) -> torch.Tensor:
        return torch.tensor([float(len(m.get("ground_truth", ""))) for m in metadata])


def test_metadata_reaches_rewards_that_ask_for_it() -> None:
    reward = _GroundTruthLength()
    assert reward.takes_metadata and not build_reward("brightness").takes_metadata
    images = quantised_rand(3, 3, 4, 4)
    records = [{"ground_truth": "ab"}, {"ground_truth": "abcd"}, None]
    assert reward(images, ["x", "y", "z"], records).tolist() == [2.0, 4.0, 0.0]
    assert reward(images, ["x", "y", "z"]).tolist() == [0.0, 0.0, 0.0]  # no metadata: empty records
    # rewards that do not take metadata ignore it
    torch.testing.assert_close(build_reward("brightness")(images, list("xyz"), records), images.mean(dim=(1, 2, 3)))
    with pytest.raises(ValueError, match=r"'gt_length': got 3 samples but 2 metadata records"):
        reward(images, list("xyz"), records[:2])
    with pytest.raises(TypeError, match="metadata record 1 must be a mapping"):
        reward(images, list("xyz"), [{}, "gt", {}])


def test_metadata_on_video_frames_and_through_weighted() -> None:
    videos = quantised_rand(2, 3, 3, 4, 4)
    records = [{"ground_truth": "a"}, {"ground_truth": "abc"}]
    assert _GroundTruthLength()(videos, ["x", "y"], records).tolist() == [1.0, 3.0]  # each frame, its sample's record
    weighted = WeightedReward([(_GroundTruthLength(), 2.0), (build_reward("brightness"), 1.0)])
    expected = 2.0 * torch.tensor([1.0, 3.0]) + build_reward("brightness")(videos, ["x", "y"])
    torch.testing.assert_close(weighted(videos, ["x", "y"], records), expected)
