"""Tests for the ``vlm_judge`` reward (verl_digen.rewards.vlm_judge).

vLLM itself cannot run here (no GPU, no model weights), so a local server speaking the
OpenAI chat completions protocol stands in for ``vllm serve <VLM>``: a stdlib
``http.server`` on 127.0.0.1:<free port> that validates each request's shape (model name,
one user message with a text part and an ``image_url`` part whose data URL decodes as a
PNG, ``max_tokens``, ``temperature``) and answers
``{"choices": [{"message": {"content": "Score: 7"}}]}`` (or per-test variations).
"""

from __future__ import annotations

import base64
import io
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from PIL import Image

from verl_digen.rewards import RewardServerError, build_reward, build_reward_from_config, registered_rewards
from verl_digen.rewards.vlm_judge import VlmJudgeReward, chat_completions_url
from verl_digen.sync import find_free_port

from runs import JsonHandler, quantised_rand, serve

MODEL = "Qwen/Qwen2.5-VL-7B-Instruct"
TIMEOUT = 10.0


@dataclass
class JudgeState:
    """What the fake judge does next, and what it saw."""

    mode: str = "ok"  # ok | fail_then_ok | echo | garbage | not_json | unknown_model | null_content
    reply: str = "Score: 7"
    delay_s: float = 0.0
    failures_left: int = 0
    requests: int = 0
    in_flight: int = 0
    max_in_flight: int = 0
    questions: list[str] = field(default_factory=list)
    auth_headers: list[str | None] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # request-shape violations
    images_per_request: list[int] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


class _JudgeHandler(JsonHandler):
    state: JudgeState

    def _validate(self, request: dict[str, Any]) -> str:
        """Checks the OpenAI chat shape; returns the question text."""
        assert self.path == "/v1/chat/completions", self.path
        assert set(request) == {"model", "messages", "max_tokens", "temperature"}, sorted(request)
        assert request["temperature"] == 0 and isinstance(request["max_tokens"], int)
        (message,) = request["messages"]
        assert message["role"] == "user"
        text_part, *image_parts = message["content"]
        assert text_part["type"] == "text" and isinstance(text_part["text"], str)
        assert image_parts  # one image, or the frames of a clip
        with self.state.lock:
            self.state.images_per_request.append(len(image_parts))
        for image_part in image_parts:
            assert image_part["type"] == "image_url"
            url = image_part["image_url"]["url"]
            prefix = "data:image/png;base64,"
            assert url.startswith(prefix), url[:40]
            with Image.open(io.BytesIO(base64.b64decode(url[len(prefix) :], validate=True))) as image:
                assert image.format == "PNG" and image.mode == "RGB"
                image.load()
        return text_part["text"]

    def do_POST(self) -> None:
        state = self.state
        request = self.read_json()
        with state.lock:
            state.requests += 1
            state.in_flight += 1
            state.max_in_flight = max(state.max_in_flight, state.in_flight)
            state.auth_headers.append(self.headers.get("Authorization"))
            fail = state.mode == "fail_then_ok" and state.failures_left > 0
            if fail:
                state.failures_left -= 1
        try:
            if state.delay_s:
                time.sleep(state.delay_s)
            try:
                question = self._validate(request)
            except Exception as exc:  # report shape violations to the test, answer 400
                with state.lock:
                    state.errors.append(repr(exc))
                return self.reply(400, {"error": {"message": f"bad request: {exc!r}"}})
            if state.mode == "unknown_model" or request["model"] != MODEL:
                return self.reply(404, {"error": {"message": f"The model `{request['model']}` does not exist."}})
            if fail:
                return self.reply(500, {"error": {"message": "engine busy"}})
            if state.mode == "not_json":
                return self.reply(200, b"<html>proxy error</html>")
            if state.mode == "garbage":
                return self.reply(200, {"object": "error"})
            with state.lock:
                state.questions.append(question)
            content: str | None = state.reply
            if state.mode == "echo":  # the score is the number in the prompt, e.g. 'p3' -> "3"
                number = re.search(r"p(\d+)", question).group(1)
                content = f"I rate this {number} out of 10"
            if state.mode == "null_content":
                content = None
            self.reply(
                200,
                {
                    "id": "x",
                    "object": "chat.completion",
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": content}}],
                },
            )
        finally:
            with state.lock:
                state.in_flight -= 1


@pytest.fixture
def judge(loopback_no_proxy) -> Iterator[tuple[str, JudgeState]]:
    """The fake judge on 127.0.0.1:<free port>; yields (base_url, state)."""
    state = JudgeState()
    with serve(_JudgeHandler, state) as base_url:
        yield base_url, state
    assert state.errors == [], state.errors  # every request had the expected shape


def make(base_url: str, **kwargs: Any) -> VlmJudgeReward:
    kwargs.setdefault("timeout_s", TIMEOUT)
    kwargs.setdefault("backoff_s", 0.01)
    return build_reward("vlm_judge", base_url=base_url, model=MODEL, **kwargs)


def test_registered_and_built_from_config() -> None:
    assert "vlm_judge" in registered_rewards()
    reward = build_reward_from_config(
        {"name": "vlm_judge", "kwargs": {"base_url": "http://judge:8001", "model": MODEL, "concurrency": 4}}
    )
    assert isinstance(reward, VlmJudgeReward) and reward.endpoint == "http://judge:8001/v1/chat/completions"


def test_endpoint_forms() -> None:
    for base in ("http://h:8001", "http://h:8001/", "http://h:8001/v1", "http://h:8001/v1/chat/completions"):
        assert chat_completions_url(base) == "http://h:8001/v1/chat/completions"


def test_bad_kwargs() -> None:
    with pytest.raises(ValueError, match=r"'vlm_judge'.*'model'"):
        build_reward("vlm_judge", base_url="http://h:1")
    with pytest.raises(ValueError, match="base_url"):
        build_reward("vlm_judge", base_url="h:1", model=MODEL)
    with pytest.raises(ValueError, match="unparseable"):
        build_reward("vlm_judge", base_url="http://h:1", model=MODEL, unparseable="ignore")
    with pytest.raises(ValueError, match="score_regex"):
        build_reward("vlm_judge", base_url="http://h:1", model=MODEL, score_regex="(")
    with pytest.raises(ValueError, match="question_template"):
        build_reward("vlm_judge", base_url="http://h:1", model=MODEL, question_template="no placeholder")


def test_scores_parsed_and_scaled(judge: tuple[str, JudgeState]) -> None:
    url, state = judge
    reward = make(url, api_key="sk-test", question_template="Rate '{prompt}' from 0 to 10. {{literal}}")
    scores = reward(quantised_rand(3, 3, 8, 8), ["a cat", "a dog", "a cow"])
    assert scores.dtype == torch.float32
    torch.testing.assert_close(scores, torch.full((3,), 0.7))
    assert sorted(state.questions) == sorted(
        f"Rate '{p}' from 0 to 10. {{{{literal}}}}" for p in ["a cat", "a dog", "a cow"]
    )
    assert state.auth_headers == ["Bearer sk-test"] * 3

    state.reply = "Score: 4.5 / 5"
    torch.testing.assert_close(make(url, max_score=5)(quantised_rand(1, 3, 8, 8), ["x"]), torch.tensor([0.9]))
    state.reply = "12"  # out of range: clamped to [0, 1]
    assert make(url)(quantised_rand(1, 3, 8, 8), ["x"]).tolist() == [1.0]
    state.reply = "Out of 10, I give it: 3"  # a capture group picks the right number
    assert make(url, score_regex=r"give it:\s*(\d+)")(quantised_rand(1, 3, 8, 8), ["x"]).tolist() == pytest.approx(
        [0.3]
    )


def test_order_preserved_with_concurrency_and_video(judge: tuple[str, JudgeState]) -> None:
    url, state = judge
    state.mode = "echo"
    prompts = [f"p{i}" for i in range(8)]
    scores = make(url, concurrency=4)(quantised_rand(8, 3, 8, 8), prompts)
    torch.testing.assert_close(scores, torch.arange(8, dtype=torch.float32) / 10)
    videos = quantised_rand(2, 3, 2, 8, 8)  # frame by frame, averaged: same prompt -> same score
    torch.testing.assert_close(make(url, concurrency=4)(videos, ["p2", "p5"]), torch.tensor([0.2, 0.5]))


def test_concurrency_limit_respected(judge: tuple[str, JudgeState]) -> None:
    url, state = judge
    state.delay_s = 0.2
    scores = make(url, concurrency=3)(quantised_rand(9, 3, 8, 8), [f"p{i}" for i in range(9)])
    assert scores.shape == (9,) and state.requests == 9
    # three requests were in the server at once (so they overlapped), never more than `concurrency`
    assert state.max_in_flight == 3

    state.max_in_flight = 0
    make(url, concurrency=1)(quantised_rand(3, 3, 8, 8), ["a", "b", "c"])
    assert state.max_in_flight == 1


def test_retries_on_500_then_succeeds(judge: tuple[str, JudgeState]) -> None:
    url, state = judge
    state.mode, state.failures_left = "fail_then_ok", 2
    scores = make(url, max_retries=3)(quantised_rand(1, 3, 8, 8), ["a"])
    assert state.requests == 3 and scores.tolist() == pytest.approx([0.7])


def test_persistent_500_gives_up(judge: tuple[str, JudgeState]) -> None:
    url, state = judge
    state.mode, state.failures_left = "fail_then_ok", 100
    with pytest.raises(RewardServerError, match=r"failed after 2 attempts: HTTP 500.*engine busy") as info:
        make(url, max_retries=2, concurrency=1)(quantised_rand(1, 3, 8, 8), ["a"])
    assert f"{url}/v1/chat/completions" in str(info.value)
    assert state.requests == 2


def test_unreachable_raises_naming_url(loopback_no_proxy) -> None:
    port = find_free_port("127.0.0.1")  # nothing listens there
    reward = make(f"http://127.0.0.1:{port}", max_retries=2, timeout_s=10.0)
    start = time.monotonic()
    with pytest.raises(RewardServerError) as info:
        reward(quantised_rand(2, 3, 8, 8), ["a", "b"])
    assert time.monotonic() - start < 15.0  # refused at once: waiting out timeout_s would take 2 x 10 s
    message = str(info.value)
    assert f"http://127.0.0.1:{port}/v1/chat/completions" in message and "unreachable after 2 attempts" in message
    with pytest.raises(RewardServerError, match=f"127.0.0.1:{port}.*unreachable"):
        reward.check_reachable()


def test_reachable_check_passes(judge: tuple[str, JudgeState]) -> None:
    url, _ = judge
    make(url).check_reachable()


def test_4xx_not_retried(judge: tuple[str, JudgeState]) -> None:
    url, state = judge
    state.mode = "unknown_model"
    with pytest.raises(RewardServerError, match=r"rejected the request: HTTP 404.*does not exist"):
        make(url, max_retries=3)(quantised_rand(1, 3, 8, 8), ["a"])
    assert state.requests == 1


@pytest.mark.parametrize(("mode", "problem"), [("not_json", "not JSON"), ("garbage", "expected {'choices'")])
def test_malformed_response(judge: tuple[str, JudgeState], mode: str, problem: str) -> None:
    url, state = judge
    state.mode = mode
    with pytest.raises(RewardServerError, match="malformed") as info:
        make(url)(quantised_rand(2, 3, 8, 8), ["a", "b"])
    assert url in str(info.value) and problem in str(info.value)


def test_unparseable_error_or_default(judge: tuple[str, JudgeState]) -> None:
    url, state = judge
    state.reply = "I cannot rate this image."
    with pytest.raises(RewardServerError, match=r"gave no score .* 'I cannot rate this image.'") as info:
        make(url)(quantised_rand(2, 3, 8, 8), ["a", "b"])
    assert url in str(info.value)
    scores = make(url, unparseable="default", default_score=0.25)(quantised_rand(2, 3, 8, 8), ["a", "b"])
    assert scores.tolist() == [0.25, 0.25]
    state.mode = "null_content"  # a null content counts as unparseable, not as malformed
    assert make(url, unparseable="default")(quantised_rand(1, 3, 8, 8), ["a"]).tolist() == [0.0]


def test_picklable(judge: tuple[str, JudgeState]) -> None:
    import pickle

    url, _ = judge
    clone = pickle.loads(pickle.dumps(make(url, score_regex=r"Score:\s*(\d+)")))
    assert clone(quantised_rand(1, 3, 8, 8), ["a"]).tolist() == pytest.approx([0.7])


def test_clip_mode_sends_every_frame_in_one_request(judge: tuple[str, JudgeState]) -> None:
    url, state = judge
    videos = quantised_rand(2, 3, 3, 8, 8)
    scores = make(url, video="clip")(videos, ["a", "b"])
    assert scores.tolist() == pytest.approx([0.7, 0.7])
    assert state.requests == 2 and state.images_per_request == [3, 3]
    state.images_per_request.clear()
    make(url)(videos, ["a", "b"])  # the default: frame by frame
    assert state.images_per_request == [1] * 6


def test_unified_reward_template_and_metadata_placeholders(judge: tuple[str, JudgeState]) -> None:
    url, state = judge
    state.reply = "bench (object): 1\nFinal Score: 4"
    reward = make(url, template="unified_reward", max_tokens=512)
    assert reward(quantised_rand(1, 3, 8, 8), ["a bench"]).tolist() == pytest.approx([0.8])  # 4 / 5
    assert "Text Caption: [a bench]" in state.questions[-1]
    state.reply = "Final Score: **3.5**"
    assert reward(quantised_rand(1, 3, 8, 8), ["x"]).tolist() == pytest.approx([0.7])
    # ground truth from the prompt record, by name, in a custom template
    state.reply = "7"
    custom = make(url, question_template="Does '{prompt}' show the text {ground_truth}? {unknown}")
    custom(quantised_rand(2, 3, 8, 8), ["a sign", "a mug"], [{"ground_truth": "OPEN"}, {}])
    assert sorted(state.questions[-2:]) == sorted(
        ["Does 'a sign' show the text OPEN? {unknown}", "Does 'a mug' show the text {ground_truth}? {unknown}"]
    )
    with pytest.raises(ValueError, match="template must be one of default, unified_reward"):
        make(url, template="nope")


def test_the_api_key_never_follows_a_redirect(loopback_no_proxy) -> None:
    seen: list = []

    class Thief(JsonHandler):
        def do_POST(self) -> None:
            seen.append(self.headers.get("Authorization"))
            self.reply(200, {"choices": [{"message": {"content": "10"}}]})

    class Redirect(JsonHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(307)
            self.send_header("Location", self.state + "/v1/chat/completions")
            self.send_header("Content-Length", "0")
            self.end_headers()

    with serve(Thief, None) as thief, serve(Redirect, thief) as url:
        with pytest.raises(RewardServerError, match="redirecting to .* not followed"):
            make(url, api_key="sk-secret")(quantised_rand(1, 3, 8, 8), ["a"])
    assert seen == []
