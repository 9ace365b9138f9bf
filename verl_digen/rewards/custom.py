"""A reward function from a user's file, the way veRL loads ``reward.custom_reward_function``.

veRL users write ``compute_score(data_source, solution_str, ground_truth, extra_info)`` and
point ``reward.custom_reward_function.path`` / ``.name`` at it. The diffusion form keeps the
call shape, with the generated image in place of the text::

    compute_score(data_source, image, prompt, ground_truth, extra_info, **reward_kwargs) -> float

* ``image``: a ``PIL.Image.Image`` (RGB); for video, a list of frames (PIL images) and the
  function gets ``fps=`` as well when it takes an ``fps`` argument (``extra_info["fps"]`` too);
* ``data_source``, ``ground_truth``, ``extra_info``: the sample's prompt record as the data
  loader read it (veRL parquet: its ``data_source`` column, ``reward_model.ground_truth``,
  ``extra_info``); ``None`` / ``{}`` when the record has none.

The batched form (``reward.reward_manager.name=batch`` in veRL, ``batched=True`` here) gets
lists, one entry per sample, and returns one float per sample::

    compute_score(data_sources, images, prompts, ground_truths, extra_infos, **reward_kwargs) -> list[float]

An exception in the user's function stops the run: :class:`CustomRewardError` carries the
function's own traceback and the prompt of the sample it failed on (batched: the batch's
prompts), and the loop checkpoints the completed steps before it reports it.
"""

from __future__ import annotations

import inspect
import math
import os
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from verl_digen.rewards.base import RewardFn, register_reward
from verl_digen.rewards.jpeg import to_uint8_hwc


class CustomRewardError(RuntimeError):
    """The user's reward function raised or returned something that is not a finite score."""


def load_reward_function(path: str, name: str) -> Callable[..., Any]:
    """``name`` from the Python file ``path``, through veRL's own loader (the one
    ``reward.custom_reward_function`` uses), with errors that name the keys."""
    from verl.utils.import_utils import load_extern_object

    if not path or not os.path.isfile(path):
        raise FileNotFoundError(f"reward.custom_reward_function.path: reward file {path!r} does not exist")
    try:
        fn = load_extern_object(module_path=path, object_name=name)
    except AttributeError:
        raise ValueError(f"reward.custom_reward_function.name: {path} defines no {name!r}") from None
    if not callable(fn):
        raise ValueError(f"reward.custom_reward_function.name: {path}:{name} is not callable")
    return fn


@register_reward("custom")
class CustomFunctionReward(RewardFn):
    """Scores with a user's ``compute_score`` loaded from a file (see the module docstring)."""

    supports_video = True  # the user's function receives the whole clip (frames + fps)

    def __init__(self, path: str, function: str = "compute_score", batched: bool = False,
                 fps: float = 16.0, reward_kwargs: Mapping[str, Any] | None = None) -> None:
        self.path, self.function, self.batched = path, function, bool(batched)
        self.fps = float(fps)
        self.reward_kwargs = dict(reward_kwargs or {})
        self.fn = load_reward_function(path, function)
        params = inspect.signature(self.fn).parameters
        self._takes_fps = "fps" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())

    def score_images(self, images: torch.Tensor, prompts: list[str],
                     metadata: Sequence[Mapping[str, Any]]) -> torch.Tensor:
        media = [_to_pil(x) for x in images]  # [N, 3, H, W] -> PIL; [N, 3, F, H, W] -> list of F PIL frames
        is_video = images.dim() == 5
        fields = [_fields(record, self.fps if is_video else None) for record in metadata]
        extra = dict(self.reward_kwargs)
        if is_video and self._takes_fps:
            extra["fps"] = self.fps
        if self.batched:
            try:
                scores = self.fn([f[0] for f in fields], media, list(prompts), [f[1] for f in fields],
                                 [f[2] for f in fields], **extra)
            except Exception:
                raise self._error(f"on a batch of {len(prompts)} samples, prompts {list(prompts)!r}") from None
            scores = self._score_list(scores)
            if len(scores) != len(prompts):
                raise CustomRewardError(f"{self._where()} returned {len(scores)} scores for {len(prompts)} samples")
        else:
            scores = []
            for i, (item, prompt, (source, truth, info)) in enumerate(zip(media, prompts, fields)):
                try:
                    scores.append(self.fn(source, item, prompt, truth, info, **extra))
                except Exception:
                    raise self._error(f"on sample {i}, prompt {prompt!r}") from None
        out = []
        for i, s in enumerate(scores):
            value = _as_number(s)
            if value is None or not math.isfinite(value):
                raise CustomRewardError(f"{self._where()} returned {s!r} for prompt {prompts[i]!r}; expected a finite float")
            out.append(value)
        return torch.tensor(out, dtype=torch.float32)

    def _score_list(self, scores: Any) -> list[Any]:
        """The batched form's result as a list: a list or tuple, or a 1-d numpy array or tensor."""
        ndim = getattr(scores, "ndim", None)
        if ndim is not None:  # numpy array or torch tensor
            if ndim != 1:
                raise CustomRewardError(f"{self._where()} returned an array of shape {tuple(scores.shape)}; "
                                        "expected one score per sample (a list or a 1-d array)")
            scores = scores.detach().cpu() if isinstance(scores, torch.Tensor) else scores
            return scores.tolist()
        try:
            return list(scores)
        except TypeError:
            raise CustomRewardError(f"{self._where()} returned {scores!r}; expected a list of scores (batched=True)") from None

    def _where(self) -> str:
        return f"reward.custom_reward_function {self.path}:{self.function}"

    def _error(self, sample: str) -> CustomRewardError:
        return CustomRewardError(f"{self._where()} failed {sample}:\n{traceback.format_exc()}")


def _as_number(s: Any) -> float | None:
    """A score as a float: Python, numpy and 0-d torch / numpy numbers (bools are not scores); None
    for anything else."""
    import numpy as np

    if isinstance(s, (bool, np.bool_)):
        return None
    if isinstance(s, torch.Tensor) and s.dim() == 0 and s.dtype != torch.bool and not s.is_complex():
        return float(s.item())
    if isinstance(s, np.ndarray) and s.ndim == 0 and s.dtype.kind in "iuf":
        return float(s)
    if isinstance(s, (int, float, np.integer, np.floating)):
        return float(s)
    return None


def _fields(record: Mapping[str, Any], fps: float | None) -> tuple[Any, Any, dict[str, Any]]:
    """``(data_source, ground_truth, extra_info)`` of a prompt record (veRL's column names)."""
    info = record.get("extra_info")
    info = dict(info) if isinstance(info, Mapping) else ({} if info is None else {"value": info})
    if fps is not None:
        info.setdefault("fps", fps)
    return record.get("data_source"), record.get("ground_truth"), info


def _to_pil(x: torch.Tensor) -> Any:
    """``[3, H, W]`` in [0, 1] -> an RGB PIL image; ``[3, F, H, W]`` -> a list of F of them."""
    from PIL import Image

    frames = to_uint8_hwc(x.permute(1, 0, 2, 3) if x.dim() == 4 else x[None])  # [F or 1, H, W, 3]
    pils = [Image.fromarray(f.numpy(), "RGB") for f in frames]
    return pils if x.dim() == 4 else pils[0]
