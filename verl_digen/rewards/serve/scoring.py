"""The served reward's calls: serialised under one lock (rewards are not assumed thread-safe), a
request's samples scored in chunks of at most ``score_chunk_pixels``, each converted to float32
under that lock (one float chunk at a time, whatever the concurrency), and the reward's failures
answered as 422 (it would fail again) or 503 (out of memory: that passes)."""

from __future__ import annotations

import logging
import math
import threading
from typing import Any

import torch

from verl_digen.rewards.base import RewardFn
from verl_digen.rewards.serve.errors import RequestError
from verl_digen.rewards.serve.images import ScoreRequest, decode_request, to_float

logger = logging.getLogger("verl_digen.rewards.serve")


def decode_and_score(
    reward: RewardFn, lock: threading.Lock, request: ScoreRequest, score_chunk_pixels: int
) -> list[float]:
    """Decode into uint8, then score chunks of at most ``score_chunk_pixels``, each converted
    to float32 under the reward lock (one float chunk at a time, whatever the concurrency)."""
    pixels = decode_request(request)
    count = len(request.prompts)
    frames, height, width = request.sample_shape
    step = max(1, score_chunk_pixels // (frames * height * width))
    frames_first = request.video and not reward.supports_video
    scores: list[float] = []
    for start in range(0, count, step):
        stop = min(count, start + step)
        with lock:
            images = to_float(pixels[start:stop], video=request.video, frames_first=frames_first)
            try:
                scores += call_reward(reward, images, request.prompts[start:stop], request.metadata[start:stop])
            finally:
                del images
    return scores


def call_reward(
    reward: RewardFn, images: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]] | None
) -> list[float]:
    """One call of ``reward`` (the caller holds the lock): its scores as floats, or
    :class:`RequestError` 422 / 503."""
    if len(prompts) == 0:
        return []
    try:
        with torch.inference_mode():
            scores = reward(images, prompts, metadata)
    except (MemoryError, torch.cuda.OutOfMemoryError) as exc:
        logger.exception("reward %r ran out of memory", reward.name)
        raise RequestError(503, f"reward {reward.name!r} ran out of memory ({type(exc).__name__}: {exc}); "
                                "retry later or send smaller batches", headers={"Retry-After": "1"}) from None
    except Exception as exc:
        logger.exception("reward %r raised", reward.name)
        raise RequestError(422, f"reward {reward.name!r} failed: {type(exc).__name__}: {exc}") from None
    if not isinstance(scores, torch.Tensor) or scores.shape != (len(prompts),):
        got = tuple(scores.shape) if isinstance(scores, torch.Tensor) else type(scores).__name__
        raise RequestError(422, f"reward {reward.name!r} returned {got}, expected ({len(prompts)},)")
    values = [float(v) for v in scores.detach().float().cpu().tolist()]
    bad = [i for i, v in enumerate(values) if not math.isfinite(v)]
    if bad:
        raise RequestError(422, f"reward {reward.name!r} returned non-finite values at indices {bad[:10]}")
    return values
