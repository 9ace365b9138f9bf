"""A reward from a vision-language model asked to rate each image against its prompt.

The judge is any OpenAI-compatible chat completions endpoint, e.g. what
``vllm serve Qwen/Qwen2.5-VL-7B-Instruct --port 8001`` exposes. For every image one request::

    POST {base_url}/v1/chat/completions
    Authorization: Bearer <api_key>                        (only if api_key is given)

    {"model": <model>,
     "messages": [{"role": "user", "content": [
         {"type": "text", "text": <question_template with {prompt} filled in>},
         {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}]}],
     "max_tokens": <max_tokens>, "temperature": 0}

    200 {"choices": [{"message": {"content": "Score: 7"}}], ...}

The score is the first match of ``score_regex`` in the reply (its first capture group if it
has one; the default matches the first number), divided by ``max_score`` and clamped to
``[0, 1]``. Up to ``concurrency`` requests are in flight at once. Connection errors,
timeouts, HTTP 5xx and 429 are retried with exponential backoff (``backoff_s * 2**k``) up to
``max_retries`` attempts in total; other 4xx answers and malformed responses are not.
Every failure raises :class:`~verl_digen.rewards.http_client.RewardServerError` naming the
endpoint. A reply without a parseable score raises too (``unparseable="error"``) or scores
``default_score`` (``unparseable="default"``).

Video is judged frame by frame and averaged over frames (the base-class behaviour).
"""

from __future__ import annotations

import json
import logging
import math
import re
import urllib.parse
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait

import torch

from verl_digen.rewards.base import RewardFn, register_reward
from verl_digen.rewards.http_client import (
    RewardServerError,
    check_retry_settings,
    check_tcp_reachable,
    encode_images_png_b64,
    load_json_body,
    malformed_response,
    post_with_retries,
    snippet,
)

__all__ = ["VlmJudgeReward", "DEFAULT_QUESTION", "DEFAULT_SCORE_REGEX", "chat_completions_url"]

logger = logging.getLogger(__name__)

DEFAULT_QUESTION = (
    "You are judging an AI-generated image. The image was generated from this prompt:\n"
    '"{prompt}"\n'
    "How well does the image match the prompt, and how good is its visual quality? "
    "Answer with a single integer score from 0 (very poor) to 10 (excellent) and nothing else."
)
DEFAULT_SCORE_REGEX = r"[-+]?\d+(?:\.\d+)?"


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
        question_template: text sent with each image; ``{prompt}`` is replaced by the prompt
            (other braces are left alone).
        max_score: the score the judge gives a perfect image; rewards are ``score / max_score``
            clamped to ``[0, 1]``.
        timeout_s: per-request timeout (connect and each read), seconds.
        max_retries: attempts per image in total, the first one included (>= 1).
        backoff_s: sleep before the first retry; doubles for each further retry.
        concurrency: most requests in flight at once (>= 1).
        api_key: sent as ``Authorization: Bearer <api_key>`` if given (``vllm serve --api-key``).
        score_regex: regex whose first match (first group if it has groups) is the score.
        unparseable: ``"error"`` (raise :class:`RewardServerError`) or ``"default"`` (use
            ``default_score``) when a reply has no score.
        default_score: reward for an unparseable reply, already in ``[0, 1]`` (not divided
            by ``max_score``).
        max_tokens: generation limit for the judge's reply.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        question_template: str = DEFAULT_QUESTION,
        max_score: float = 10.0,
        timeout_s: float = 60.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        concurrency: int = 8,
        api_key: str | None = None,
        score_regex: str = DEFAULT_SCORE_REGEX,
        unparseable: str = "error",
        default_score: float = 0.0,
        max_tokens: int = 16,
    ) -> None:
        def bad(message: str) -> ValueError:
            return ValueError(f"reward 'vlm_judge': {message}")

        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise bad(f"base_url must start with http:// or https://, got {base_url!r}")
        if not isinstance(model, str) or not model:
            raise bad(f"model must be a non-empty string, got {model!r}")
        if not isinstance(question_template, str) or "{prompt}" not in question_template:
            raise bad("question_template must be a string containing '{prompt}'")
        if not (isinstance(max_score, (int, float)) and max_score > 0 and math.isfinite(max_score)):
            raise bad(f"max_score must be a finite number > 0, got {max_score!r}")
        check_retry_settings("vlm_judge", timeout_s=timeout_s, max_retries=max_retries, backoff_s=backoff_s)
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

    # ------------------------------------------------------------------ scoring

    def score_images(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        encoded = encode_images_png_b64(images.detach().cpu())
        bodies = [self._request_body(prompt, image) for prompt, image in zip(prompts, encoded, strict=True)]
        if len(bodies) <= 1 or self.concurrency == 1:
            return torch.tensor([self._judge(body, prompts[i]) for i, body in enumerate(bodies)], dtype=torch.float32)
        pool = ThreadPoolExecutor(max_workers=min(self.concurrency, len(bodies)), thread_name_prefix="vlm-judge")
        try:
            futures = [pool.submit(self._judge, body, prompt) for body, prompt in zip(bodies, prompts, strict=True)]
            done, _ = wait(futures, return_when=FIRST_EXCEPTION)
            for future in futures:  # raise the first failure in batch order, if any
                if future in done and future.exception() is not None:
                    raise future.exception()  # type: ignore[misc]
            return torch.tensor([future.result() for future in futures], dtype=torch.float32)
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    def _request_body(self, prompt: str, image_b64: str) -> bytes:
        question = self.question_template.replace("{prompt}", prompt)
        payload = {
            "model": self.model,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": question},
                        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{image_b64}"}},
                    ],
                }
            ],
            "max_tokens": self.max_tokens,
            "temperature": 0,
        }
        return json.dumps(payload).encode("utf-8")

    def _judge(self, body: bytes, prompt: str) -> float:
        reply = self._completion(body)
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

    def _completion(self, body: bytes) -> str:
        """POST with retries; returns the reply text (``""`` for a null content)."""
        retries = {"timeout_s": self.timeout_s, "max_retries": self.max_retries, "backoff_s": self.backoff_s}
        payload = post_with_retries(self.endpoint, body, self.api_key, **retries, name=self._judge_name)
        return self._parse_reply(payload)

    def _parse_reply(self, payload: bytes) -> str:
        def bad(problem: str) -> RewardServerError:
            return malformed_response(self._judge_name, problem)

        data = load_json_body(payload, self._judge_name)
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
        return f"VlmJudgeReward(endpoint={self.endpoint!r}, model={self.model!r}, concurrency={self.concurrency})"
