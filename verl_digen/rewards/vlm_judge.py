"""A reward from a vision-language model asked to rate each image against its prompt.

The judge is any OpenAI-compatible chat completions endpoint, e.g. what
``vllm serve Qwen/Qwen2.5-VL-7B-Instruct --port 8001`` exposes. For every image one request::

    POST {base_url}/v1/chat/completions
    Authorization: Bearer <api_key>                        (only if api_key is given)

    {"model": <model>,
     "messages": [{"role": "user", "content": [
         {"type": "text", "text": <question_template, placeholders filled in>},
         {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}]}],
     "max_tokens": <max_tokens>, "temperature": 0}

    200 {"choices": [{"message": {"content": "Score: 7"}}], ...}

``{prompt}`` in the template is the sample's prompt; ``{<field>}`` is that field of the sample's
prompt record (its metadata, e.g. ``{ground_truth}``), when the record has it. The score is the
first match of ``score_regex`` in the reply (its first capture group if it has one; the default
matches the first number), divided by ``max_score`` and clamped to ``[0, 1]``. Up to
``concurrency`` requests are in flight at once.

Video: judged frame by frame and averaged over frames (``video="frames"``, the default), or
one request per clip with every frame as an image part, in order (``video="clip"``; the
template should say the images are frames of one video, and vLLM needs
``--limit-mm-per-prompt`` to allow that many images).

Templates: :data:`DEFAULT_QUESTION` (a 0-10 integer) and :data:`UNIFIED_REWARD_QUESTION`
(UnifiedReward's point-wise image judging, ``template="unified_reward"``: score 1-5 after
``Final Score:``).

Transport (:mod:`verl_digen.rewards.transport`, shared with the ``http`` reward): a total
deadline per attempt, no redirects (the API key never reaches another host), a response size
cap, retries of connection errors, timeouts, 5xx and 429 with exponential backoff; other 4xx
answers and malformed responses are not retried. Every failure raises
:class:`~verl_digen.rewards.transport.RewardServerError` naming the endpoint. A reply without
a parseable score raises too (``unparseable="error"``) or scores ``default_score``
(``unparseable="default"``).
"""

from __future__ import annotations

import json
import logging
import math
import re
import urllib.parse
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from verl_digen.rewards.base import RewardFn, check_metadata, register_reward
from verl_digen.rewards.http_client import encode_images_png_b64
from verl_digen.rewards.transport import (
    Endpoint,
    RewardServerError,
    check_retry_settings,
    check_tcp_reachable,
    malformed_response,
    parse_json_answer,
    snippet,
)

__all__ = [
    "VlmJudgeReward",
    "DEFAULT_QUESTION",
    "DEFAULT_SCORE_REGEX",
    "UNIFIED_REWARD_QUESTION",
    "TEMPLATES",
    "chat_completions_url",
]

logger = logging.getLogger(__name__)

DEFAULT_QUESTION = (
    "You are judging an AI-generated image. The image was generated from this prompt:\n"
    '"{prompt}"\n'
    "How well does the image match the prompt, and how good is its visual quality? "
    "Answer with a single integer score from 0 (very poor) to 10 (excellent) and nothing else."
)
DEFAULT_SCORE_REGEX = r"[-+]?\d+(?:\.\d+)?"

# UnifiedReward (point-wise image generation judging): the model is asked for a 1-5 score on
# alignment and quality, ending with "Final Score: X".
UNIFIED_REWARD_QUESTION = (
    "You are given a text caption and a generated image based on that caption. Your task is to evaluate "
    "this image based on two key criteria:\n"
    "1. Alignment with the Caption: Assess how well this image aligns with the provided caption. Consider the "
    "accuracy of depicted objects, their relationships, and attributes as described in the caption.\n"
    "2. Overall Image Quality: Examine the visual quality of this image, including clarity, detail "
    "preservation, color accuracy, and overall aesthetic appeal.\n"
    "Extract key elements from the provided text caption, evaluate their presence in the generated image "
    "using the format: 'element (type): value' (where value=0 means not generated, and value=1 means "
    "generated), and assign a score from 1 to 5 after 'Final Score:'.\n"
    "Your task is provided as follows:\nText Caption: [{prompt}]"
)

#: Named templates: ``template=<name>`` sets the question, the score regex and ``max_score``.
TEMPLATES: dict[str, dict[str, Any]] = {
    "default": {"question_template": DEFAULT_QUESTION, "score_regex": DEFAULT_SCORE_REGEX, "max_score": 10.0},
    "unified_reward": {
        "question_template": UNIFIED_REWARD_QUESTION,
        "score_regex": r"Final Score:\s*\**\s*([-+]?\d+(?:\.\d+)?)",
        "max_score": 5.0,
    },
}


def chat_completions_url(base_url: str) -> str:
    """``http://host:8001``, ``http://host:8001/v1`` or the full endpoint -> the full endpoint."""
    base = base_url.rstrip("/")
    if base.endswith("/chat/completions"):
        return base
    if base.endswith("/v1"):
        return base + "/chat/completions"
    return base + "/v1/chat/completions"


@register_reward("vlm_judge")
class VlmJudgeReward(RewardFn):
    """Scores each (image, prompt) with a VLM behind an OpenAI-compatible chat endpoint.

    Args:
        base_url: server root (``http://host:8001``); a trailing ``/v1`` or the full
            ``.../v1/chat/completions`` endpoint is accepted too.
        model: model name the server serves (``vllm serve <model>`` or its ``--served-model-name``).
        question_template: text sent with each image; ``{prompt}`` is replaced by the prompt and
            ``{<field>}`` by that field of the sample's prompt record (other braces are left
            alone). Default: the ``template``'s.
        max_score: the score the judge gives a perfect image; rewards are ``score / max_score``
            clamped to ``[0, 1]``. Default: the ``template``'s (10, UnifiedReward 5).
        timeout_s: total deadline of one attempt (connect, send, the whole answer), seconds.
        max_retries: attempts per image in total, the first one included (>= 1).
        backoff_s: sleep before the first retry; doubles for each further retry.
        concurrency: most requests in flight at once (>= 1).
        api_key: sent as ``Authorization: Bearer <api_key>`` if given (``vllm serve --api-key``).
        score_regex: regex whose first match (first group if it has groups) is the score.
            Default: the ``template``'s.
        unparseable: ``"error"`` (raise :class:`RewardServerError`) or ``"default"`` (use
            ``default_score``) when a reply has no score.
        default_score: reward for an unparseable reply, already in ``[0, 1]`` (not divided
            by ``max_score``).
        max_tokens: generation limit for the judge's reply (UnifiedReward explains itself
            before its final score: give it a few hundred tokens).
        template: ``"default"`` or ``"unified_reward"`` (:data:`TEMPLATES`).
        video: ``"frames"`` (each frame judged, scores averaged) or ``"clip"`` (one request per
            clip with all its frames).
        max_response_mb: largest answer accepted, MiB.
    """

    supports_video = True  # handled here: frame by frame or whole clips

    def __init__(
        self,
        base_url: str,
        model: str,
        question_template: str | None = None,
        max_score: float | None = None,
        timeout_s: float = 60.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        concurrency: int = 8,
        api_key: str | None = None,
        score_regex: str | None = None,
        unparseable: str = "error",
        default_score: float = 0.0,
        max_tokens: int = 16,
        template: str = "default",
        video: str = "frames",
        max_response_mb: float = 4.0,
    ) -> None:
        def bad(message: str) -> ValueError:
            return ValueError(f"reward 'vlm_judge': {message}")

        if template not in TEMPLATES:
            raise bad(f"template must be one of {', '.join(TEMPLATES)}, got {template!r}")
        preset = TEMPLATES[template]
        question_template = preset["question_template"] if question_template is None else question_template
        score_regex = preset["score_regex"] if score_regex is None else score_regex
        max_score = preset["max_score"] if max_score is None else max_score
        if video not in ("frames", "clip"):
            raise bad(f"video must be 'frames' or 'clip', got {video!r}")

        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise bad(f"base_url must start with http:// or https://, got {base_url!r}")
        if not isinstance(model, str) or not model:
            raise bad(f"model must be a non-empty string, got {model!r}")
        if not isinstance(question_template, str) or "{prompt}" not in question_template:
            raise bad("question_template must be a string containing '{prompt}'")
        if not (isinstance(max_score, (int, float)) and max_score > 0 and math.isfinite(max_score)):
            raise bad(f"max_score must be a finite number > 0, got {max_score!r}")
        check_retry_settings(
            "vlm_judge", timeout_s=timeout_s, max_retries=max_retries, backoff_s=backoff_s, max_response_mb=max_response_mb
        )
        if not isinstance(concurrency, int) or concurrency < 1:
            raise bad(f"concurrency must be an int >= 1, got {concurrency!r}")
        if unparseable not in ("error", "default"):
            raise bad(f"unparseable must be 'error' or 'default', got {unparseable!r}")
        if not (isinstance(default_score, (int, float)) and math.isfinite(default_score)):
            raise bad(f"default_score must be a finite number, got {default_score!r}")
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise bad(f"max_tokens must be an int >= 1, got {max_tokens!r}")
        try:
            pattern = re.compile(score_regex)
        except (re.error, TypeError) as exc:
            raise bad(f"score_regex {score_regex!r} is not a valid regex: {exc}") from None
        self.base_url = base_url
        self.endpoint = chat_completions_url(base_url)
        self.model = model
        self.question_template = question_template
        self.max_score = float(max_score)
        self.timeout_s = float(timeout_s)
        self.max_retries = max_retries
        self.backoff_s = float(backoff_s)
        self.concurrency = concurrency
        self.api_key = api_key or None
        self.score_regex = pattern
        self.unparseable = unparseable
        self.default_score = float(default_score)
        self.max_tokens = max_tokens
        self.template = template
        self.video = video
        self.max_response_bytes = int(max_response_mb * 1024 * 1024)

    # ------------------------------------------------------------------ scoring

    def score_images(
        self, images: torch.Tensor, prompts: list[str], metadata: Sequence[Mapping[str, Any]] | None = None
    ) -> torch.Tensor:
        records = check_metadata(self.name, metadata, len(prompts))
        images = images.detach().cpu()
        if images.dim() == 5 and self.video == "frames":
            batch, _, frames = images.shape[:3]
            flat = images.permute(0, 2, 1, 3, 4).reshape(batch * frames, 3, *images.shape[3:])
            per_frame = self.score_images(
                flat, [p for p in prompts for _ in range(frames)], [r for r in records for _ in range(frames)]
            )
            return per_frame.view(batch, frames).mean(dim=1)
        replies = self.replies(images, prompts, records)
        return torch.tensor([self._judge_reply(reply, p) for reply, p in zip(replies, prompts)], dtype=torch.float32)

    def replies(
        self, images: torch.Tensor, prompts: list[str], metadata: Sequence[Mapping[str, Any]] | None = None
    ) -> list[str]:
        """The judge's raw reply for each ``[N, 3, H, W]`` image (or ``[N, 3, F, H, W]`` clip, its
        frames in one request), with the question filled in from each prompt and record."""
        records = check_metadata(self.name, metadata, len(prompts))
        images = images.detach().cpu()
        if images.dim() == 5:  # one request per clip, its frames as image parts in order
            parts = [encode_images_png_b64(clip.permute(1, 0, 2, 3)) for clip in images]
        else:
            parts = [[image] for image in encode_images_png_b64(images)]
        bodies = [self._request_body(self.question(p, r), frames) for p, r, frames in zip(prompts, records, parts)]
        return [self._parse_reply(payload) for payload in self._endpoint().post_many(bodies, "application/json")]

    def question(self, prompt: str, record: Mapping[str, Any] | None = None) -> str:
        """The template with ``{prompt}`` and the record's ``{<field>}`` placeholders filled in
        (other braces are left alone)."""
        text = self.question_template.replace("{prompt}", prompt)
        for key, value in (record or {}).items():
            if key != "prompt" and isinstance(key, str) and "{" + key + "}" in text:
                shown = value if isinstance(value, str) else json.dumps(value, default=str)
                text = text.replace("{" + key + "}", shown)
        return text

    def _request_body(self, question: str, images_b64: list[str]) -> bytes:
        content: list[dict[str, Any]] = [{"type": "text", "text": question}]
        content += [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64}"}} for b64 in images_b64]
        payload = {
            "model": self.model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": self.max_tokens,
            "temperature": 0,
        }
        return json.dumps(payload).encode("utf-8")

    def _endpoint(self) -> Endpoint:
        return Endpoint(
            self.endpoint,
            name=self._judge_name,
            token=self.api_key,
            timeout_s=self.timeout_s,
            max_retries=self.max_retries,
            backoff_s=self.backoff_s,
            max_response_bytes=self.max_response_bytes,
            concurrency=self.concurrency,
        )

    def _judge_reply(self, reply: str, prompt: str) -> float:
        score = self.parse_score(reply)
        if score is None:
            if self.unparseable == "default":
                logger.warning(
                    "VLM judge at %s: no score in reply %r; using default_score=%g",
                    self.endpoint,
                    reply[:200],
                    self.default_score,
                )
                return self.default_score
            raise RewardServerError(
                f"VLM judge at {self.endpoint} gave no score matching {self.score_regex.pattern!r} "
                f"in its reply {reply[:200]!r} (prompt {prompt[:80]!r}); set unparseable='default' to "
                "score such replies with default_score"
            )
        return min(1.0, max(0.0, score / self.max_score))

    def parse_score(self, text: str) -> float | None:
        """The raw score in ``text`` (before scaling), or None when there is none."""
        match = self.score_regex.search(text)
        if match is None:
            return None
        token = match.group(1) if self.score_regex.groups else match.group(0)
        try:
            value = float(token)
        except (TypeError, ValueError):
            return None
        return value if math.isfinite(value) else None

    # ------------------------------------------------------------------ transport

    @property
    def _judge_name(self) -> str:
        """How errors name the judge."""
        return f"VLM judge at {self.endpoint}"

    def _parse_reply(self, payload: bytes) -> str:
        """The reply text of a chat completion (``""`` for a null content)."""

        def bad(problem: str) -> RewardServerError:
            return malformed_response(self._judge_name, problem)

        data = parse_json_answer(payload, self._judge_name)
        try:
            message = data["choices"][0]["message"]
        except (KeyError, IndexError, TypeError):
            raise bad(f"expected {{'choices': [{{'message': ...}}]}}, got {snippet(payload)!r}") from None
        if not isinstance(message, dict):
            raise bad(f"'message' must be an object, got {type(message).__name__}")
        content = message.get("content")
        if content is None:
            return ""
        if isinstance(content, list):  # content parts: keep the text ones
            content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
        if not isinstance(content, str):
            raise bad(f"'content' must be a string, got {type(content).__name__}")
        return content

    def check_reachable(self) -> None:
        """Open (and close) a TCP connection to the judge, with the same retries and backoff.

        For a pre-flight check before a run starts; raises :class:`RewardServerError` naming
        the endpoint.
        """
        parsed = urllib.parse.urlsplit(self.endpoint)
        if not parsed.hostname:
            raise RewardServerError(f"VLM judge URL {self.endpoint!r} has no host")
        check_tcp_reachable(
            parsed, self._judge_name, timeout_s=self.timeout_s, max_retries=self.max_retries, backoff_s=self.backoff_s
        )

    def __repr__(self) -> str:
        return (
            f"VlmJudgeReward(endpoint={self.endpoint!r}, model={self.model!r}, template={self.template!r}, "
            f"video={self.video!r}, concurrency={self.concurrency})"
        )
