"""A Flow-GRPO reward factory from a user's file, loaded as it is.

Flow-GRPO's rewards (its ``rewards.py``) are factories: ``pickscore_score(device)`` builds its
scorer once and returns ``_fn(images, prompts, metadata) -> (scores, info)``, called on every
batch with ``images`` a float ``[N, 3, H, W]`` tensor in ``[0, 1]``, ``prompts`` the texts and
``metadata`` one dict per sample (the prompt's record); ``scores`` holds one number per sample
(a list, a NumPy array or a tensor). ``digen.reward.name=factory`` builds one::

    digen.reward.name=factory +digen.reward.kwargs.path=flow_grpo/rewards.py
    +digen.reward.kwargs.factory=pickscore_score

``kwargs.path`` is a file, ``file://<file>`` or ``pkg://<module>`` (veRL's loader, as for a custom
function), ``kwargs.factory`` the factory's name, ``kwargs.factory_kwargs`` its keyword arguments
(Flow-GRPO's ``multi_score(device, score_dict)`` takes ``score_dict`` there). A factory that takes
``device`` gets the worker's device, as Flow-GRPO hands it ``accelerator.device``. The factory
runs where the reward is built (the scoring worker, and once before Ray when the job checks its
reward). Entries of ``info`` holding one number per sample are logged as ``reward/<key>``.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from verl_digen.rewards.base import RewardFn, register_reward
from verl_digen.rewards.custom import load_reward_function

WHERE = "digen.reward.kwargs"


@register_reward("factory")
class RewardFactoryReward(RewardFn):
    """Scores with the function a Flow-GRPO-style factory returns (see the module docstring)."""

    def __init__(self, path: str, factory: str, factory_kwargs: Mapping[str, Any] | None = None,
                 device: str | None = None) -> None:
        make, kwargs = self.checked_factory(path, factory, factory_kwargs, device)
        self.path, self.factory = path, factory
        self.fn = make(**kwargs)
        if not callable(self.fn):
            raise ValueError(f"{WHERE}.factory: {path}:{factory}(...) returned {type(self.fn).__name__}, not the "
                             "scoring function a Flow-GRPO reward factory returns")
        self._extras: dict[str, torch.Tensor] = {}

    @staticmethod
    def checked_factory(path: str, factory: str, factory_kwargs: Mapping[str, Any] | None = None,
                        device: str | None = None) -> tuple[Any, dict[str, Any]]:
        """The factory loaded and the keyword arguments it will get, checked against its signature,
        without calling it (the job's check before Ray: a factory may load a model)."""
        try:
            make = load_reward_function(path, factory, WHERE)
        except ValueError as e:  # the loader names <where>.name; here it is the factory key
            raise ValueError(str(e).replace(f"{WHERE}.name", f"{WHERE}.factory")) from None
        kwargs = dict(factory_kwargs or {})
        params = inspect.signature(make).parameters
        if "device" in params and "device" not in kwargs:
            kwargs["device"] = device or "cpu"
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        unknown = [k for k in kwargs if k not in params and not takes_any]
        missing = [n for n, p in params.items() if p.default is inspect.Parameter.empty
                   and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
                   and n not in kwargs]
        if unknown or missing:
            raise ValueError(f"{WHERE}.factory_kwargs: {path}:{factory}{inspect.signature(make)} "
                             + (f"takes no {unknown}" if unknown else f"needs {missing}"))
        return make, kwargs

    def score_images(self, images: torch.Tensor, prompts: list[str],
                     metadata: Sequence[Mapping[str, Any]]) -> torch.Tensor:
        out = self.fn(images, list(prompts), [dict(m) for m in metadata])
        scores, info = out if isinstance(out, tuple) and len(out) == 2 else (out, {})
        n = len(prompts)
        values = _numbers(scores)
        if values is None or values.shape != (n,):
            raise ValueError(f"{self.path}:{self.factory}: its scoring function returned {_shape(scores)} for {n} "
                             "samples; a Flow-GRPO reward returns one number per sample (and an info dict)")
        per_sample = {str(k): _numbers(v) for k, v in (info or {}).items()} if isinstance(info, Mapping) else {}
        self._extras = {k: torch.from_numpy(v) for k, v in per_sample.items() if v is not None and v.shape == (n,)}
        return torch.from_numpy(values)

    def take_extras(self) -> dict[str, torch.Tensor]:
        extras, self._extras = self._extras, {}
        return extras


def _numbers(value: Any) -> np.ndarray | None:
    """``value`` as a float32 vector (a tensor, an array or a list of numbers), else None."""
    if torch.is_tensor(value):
        value = value.detach().float().cpu().numpy()
    try:
        array = np.asarray(value, dtype=np.float32)
    except (TypeError, ValueError):
        return None
    return array.reshape(-1) if array.ndim <= 1 else None


def _shape(value: Any) -> str:
    shape = getattr(value, "shape", None)
    return f"{type(value).__name__} of shape {tuple(shape)}" if shape is not None else type(value).__name__
