"""The reward interface and the reward registry.

A reward maps a batch of generated images (or videos), their prompts and, optionally, each
sample's prompt record (its *metadata*: ground truth and any other field of the prompt file)
to one scalar per sample::

    reward(images, prompts, metadata=None) -> Tensor[B] (float32)

``metadata`` is a list of ``B`` mappings, one per sample: the record of the sample's prompt as
the data loader read it (``{"prompt": ..., "ground_truth": ..., ...}``, see
:func:`verl_digen.data.load_prompt_records`). Rewards that need it (OCR, GenEval, anything
scored against a reference) declare a ``metadata`` parameter on :meth:`RewardFn.score_images`;
the others keep ``score_images(images, prompts)`` and never see it.

``images`` are float tensors with values in ``[0, 1]``:

* images: ``[B, 3, H, W]``
* videos: ``[B, 3, F, H, W]``

Concrete rewards subclass :class:`RewardFn` and implement :meth:`RewardFn.score_images`,
which only ever sees ``[N, 3, H, W]`` images. :meth:`RewardFn.__call__` validates the
input and, for video, scores every frame separately and averages over frames (each frame
gets its sample's prompt and metadata), so every image reward works on video unchanged. A
reward that understands video natively sets ``supports_video = True`` and receives the 5-D
tensor as is.

The built-in rewards register themselves when their modules are imported, which the package's
``__init__`` does; Python runs it before this module, so this module imports none of them (no
import circle between the interface and its implementations).

Rewards are registered by name with :func:`register_reward` and built from code
(:func:`build_reward`) or from a config (:func:`build_reward_from_config`)::

    {"name": "jpeg_compressibility", "kwargs": {"quality": 95}}

    {"name": "weighted", "components": [
        {"name": "clip_score", "weight": 1.0, "kwargs": {"model_path": "/ckpt/clip"}},
        {"name": "colorfulness", "weight": 0.1},
    ]}

    [  # a bare list is a weighted sum
        {"name": "brightness", "weight": 0.5},
        {"name": "jpeg_incompressibility", "weight": 0.01},
    ]
"""

from __future__ import annotations

import abc
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, TypeVar

import torch

__all__ = [
    "RewardFn",
    "UnknownRewardError",
    "register_reward",
    "build_reward",
    "build_reward_from_config",
    "registered_rewards",
    "reward_class",
    "check_metadata",
    "with_device",
]


class UnknownRewardError(ValueError):
    """A reward name that is not in the registry."""


class RewardFn(abc.ABC):
    """Scores generated images (or videos) against their prompts; one float32 per sample."""

    #: Registry name, set by :func:`register_reward` (``"<unregistered>"`` otherwise).
    name: ClassVar[str] = "<unregistered>"
    #: True when :meth:`score_images` accepts ``[B, 3, F, H, W]`` video directly. When
    #: False (the default), video is scored frame by frame and averaged over frames.
    supports_video: ClassVar[bool] = False

    #: True when :meth:`score_images` takes a ``metadata`` argument (set automatically from
    #: its signature when the subclass is defined).
    takes_metadata: ClassVar[bool] = False

    #: False on a reward that scores the pixels alone and never reads its prompts (brightness,
    #: JPEG size, the aesthetic head, ...): the reward server then scores requests that carry
    #: no prompts, as Flow-GRPO's DeQA client sends them (docs/reward_server.md).
    reads_prompts: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.takes_metadata = "metadata" in inspect.signature(cls.score_images).parameters

    @abc.abstractmethod
    def score_images(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        """Score ``[N, 3, H, W]`` images in ``[0, 1]`` (``N == len(prompts)``); returns ``[N]``.

        A subclass that needs each sample's prompt record declares
        ``score_images(self, images, prompts, metadata)``; ``metadata`` is then a list of ``N``
        mappings (empty ones when the caller had none)."""

    def __call__(
        self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]] | None = None
    ) -> torch.Tensor:
        """Score a batch of images ``[B, 3, H, W]`` or videos ``[B, 3, F, H, W]``.

        ``metadata``: one mapping per sample (its prompt record), or None.
        Returns a float32 tensor ``[B]`` on the device of ``images``.
        """
        prompts = _check_inputs(self.name, images, prompts)
        records = check_metadata(self.name, metadata, len(prompts))
        batch = images.shape[0]
        if images.dim() == 5 and not self.supports_video:
            _, channels, frames, height, width = images.shape
            # [B, 3, F, H, W] -> [B, F, 3, H, W] -> [B*F, 3, H, W]; prompt and record repeated per frame.
            flat = images.permute(0, 2, 1, 3, 4).reshape(batch * frames, channels, height, width)
            frame_prompts = [p for p in prompts for _ in range(frames)]
            frame_records = [r for r in records for _ in range(frames)]
            per_frame = self._checked_scores(self._call_score_images(flat, frame_prompts, frame_records), batch * frames)
            scores = per_frame.view(batch, frames).mean(dim=1)
        else:
            scores = self._checked_scores(self._call_score_images(images, prompts, records), batch)
        return scores.to(device=images.device, dtype=torch.float32)

    def give_sample_tensors(self, tensors: Mapping[str, torch.Tensor] | None, validation: bool = False) -> None:
        """Per-sample tensors for the next call only (name -> ``[B, ...]``, the call's samples in
        order): the final latents (``latents_clean``) and the prompt's conditioning, which a custom
        function asks for with veRL-Omni's ``pipeline.output_type=latent`` / ``both``
        (:attr:`wants_latents`); ``validation``: the next call scores validation samples
        (veRL-Omni's ``val_kwargs.pipeline.output_type``). Most rewards score pixels and ignore them."""

    #: True when the reward reads the samples' final latents (:meth:`give_sample_tensors`): the
    #: rollout then carries them with the trajectory (they cost object-store bytes otherwise spared).
    wants_latents: bool = False

    def take_extras(self) -> dict[str, torch.Tensor]:
        """Per-sample numbers the last call produced besides the scores (name -> ``[B]`` float32,
        NaN where a sample has none), handed over once: a custom function's ``{"score": ...,
        key: value}`` results. The worker sends them with the rewards; the loop logs their
        means as ``reward/<name>``. Most rewards have none."""
        return {}

    def _call_score_images(self, images: torch.Tensor, prompts: list[str], metadata: list[Mapping[str, Any]]) -> torch.Tensor:
        if self.takes_metadata:
            return self.score_images(images, prompts, metadata=metadata)  # type: ignore[call-arg]
        return self.score_images(images, prompts)

    def _checked_scores(self, scores: torch.Tensor, expected: int) -> torch.Tensor:
        if not isinstance(scores, torch.Tensor) or scores.shape != (expected,):
            got = tuple(scores.shape) if isinstance(scores, torch.Tensor) else type(scores).__name__
            raise RuntimeError(f"reward {self.name!r} returned {got}, expected a tensor of shape ({expected},)")
        return scores.float()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def _check_inputs(name: str, images: torch.Tensor, prompts: Sequence[str]) -> list[str]:
    if not isinstance(images, torch.Tensor):
        raise TypeError(f"reward {name!r}: images must be a torch.Tensor, got {type(images).__name__}")
    if images.dim() not in (4, 5) or images.shape[1] != 3:
        raise ValueError(
            f"reward {name!r}: images must be [B, 3, H, W] or [B, 3, F, H, W], got shape {tuple(images.shape)}"
        )
    if not images.is_floating_point():
        raise ValueError(f"reward {name!r}: images must be a float tensor in [0, 1], got dtype {images.dtype}")
    if isinstance(prompts, str):
        raise TypeError(f"reward {name!r}: prompts must be a list of strings, not a single string")
    prompts = list(prompts)
    if len(prompts) != images.shape[0]:
        raise ValueError(f"reward {name!r}: got {images.shape[0]} images but {len(prompts)} prompts")
    return prompts


def check_metadata(name: str, metadata: Sequence[Mapping[str, Any]] | None, batch: int) -> list[Mapping[str, Any]]:
    """``metadata`` as a list of ``batch`` mappings (``[{}] * batch`` for None); a ValueError naming
    the reward otherwise."""
    if metadata is None:
        return [{} for _ in range(batch)]
    if isinstance(metadata, (str, bytes, Mapping)):
        raise TypeError(f"reward {name!r}: metadata must be a list with one mapping per sample, got a {type(metadata).__name__}")
    records = list(metadata)
    if len(records) != batch:
        raise ValueError(f"reward {name!r}: got {batch} samples but {len(records)} metadata records")
    for index, record in enumerate(records):
        if record is None:
            records[index] = {}
        elif not isinstance(record, Mapping):
            raise TypeError(f"reward {name!r}: metadata record {index} must be a mapping, got {type(record).__name__}")
    return records


# --------------------------------------------------------------------------- registry

_REGISTRY: dict[str, type[RewardFn]] = {}

R = TypeVar("R", bound=type[RewardFn])


def register_reward(name: str) -> Callable[[R], R]:
    """Class decorator: register a :class:`RewardFn` subclass under ``name``."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"reward name must be a non-empty string, got {name!r}")

    def decorator(cls: R) -> R:
        if not (isinstance(cls, type) and issubclass(cls, RewardFn)):
            raise TypeError(f"@register_reward({name!r}) must decorate a RewardFn subclass, got {cls!r}")
        existing = _REGISTRY.get(name)
        if existing is not None and existing.__qualname__ != cls.__qualname__:
            raise ValueError(f"reward name {name!r} is already registered to {existing.__module__}.{existing.__qualname__}")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return decorator


def registered_rewards() -> list[str]:
    """Sorted names of every registered reward."""
    return sorted(_REGISTRY)


def reward_class(name: str) -> type[RewardFn]:
    """The class registered under ``name``; :class:`UnknownRewardError` if there is none."""
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        known = ", ".join(sorted(_REGISTRY)) or "(none)"
        raise UnknownRewardError(f"unknown reward {name!r}; registered rewards: {known}") from None


def build_reward(name: str, **kwargs: Any) -> RewardFn:
    """Instantiate the reward registered under ``name`` with ``kwargs``.

    Raises :class:`UnknownRewardError` for an unknown name and :class:`ValueError` naming the
    reward and the argument for an unexpected or missing keyword argument.
    """
    cls = reward_class(name)
    _check_kwargs(name, cls, kwargs)
    return cls(**kwargs)


def _check_kwargs(name: str, cls: type[RewardFn], kwargs: Mapping[str, Any]) -> None:
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]  # drop self
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return
    accepted = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    unknown = [k for k in kwargs if k not in accepted]
    if unknown:
        raise ValueError(
            f"reward {name!r} got unexpected argument(s) {', '.join(map(repr, unknown))}; "
            f"accepted arguments: {', '.join(accepted) or '(none)'}"
        )
    missing = [
        p.name
        for p in params
        if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in kwargs
    ]
    if missing:
        raise ValueError(f"reward {name!r} is missing required argument(s) {', '.join(map(repr, missing))}")


def build_reward_from_config(cfg: Any, device: Any = None) -> RewardFn:
    """Build a reward from a config (plain dict/list/str or an OmegaConf node).

    ``device``: where rewards with a model put it (and its inputs): the worker's device, so a
    reward pool's GPUs (or a rollout worker's) score instead of CPU threads. It reaches every
    reward whose constructor takes ``device`` (the weighted sum hands it to its components)
    unless the reward's own ``kwargs`` name one, which wins. None: each reward's default.

    Accepted forms:

    * ``"brightness"``: a reward name without arguments;
    * ``{"name": ..., "kwargs": {...}}``: one reward (``kwargs`` optional);
    * ``{"name": "weighted", "components": [...]}``: weighted sum of components, each
      ``{"name": ..., "weight": 1.0, "kwargs": {...}, "label": optional}``;
    * a list of components: same as ``{"name": "weighted", "components": [...]}``.
    """
    cfg = _to_container(cfg)
    if isinstance(cfg, str):
        return build_reward(cfg, **with_device(cfg, {}, device))
    if isinstance(cfg, list):
        return build_reward("weighted", **with_device("weighted", {"components": cfg}, device))
    if not isinstance(cfg, Mapping):
        raise ValueError(f"reward config must be a name, a mapping or a list of components, got {type(cfg).__name__}")
    allowed = {"name", "kwargs", "components"}
    extra = sorted(set(cfg) - allowed)
    if extra:
        raise ValueError(f"reward config has unknown key(s) {extra}; allowed keys: {sorted(allowed)}")
    if "name" not in cfg:
        raise ValueError(f"reward config needs a 'name' key, got keys {sorted(cfg)}")
    name = cfg["name"]
    kwargs = dict(cfg.get("kwargs") or {})
    if "components" in cfg:
        if "components" in kwargs:
            raise ValueError(f"reward config for {name!r} gives 'components' both at top level and in 'kwargs'")
        kwargs["components"] = cfg["components"]
    return build_reward(name, **with_device(name, kwargs, device))


def with_device(name: str, kwargs: dict[str, Any], device: Any) -> dict[str, Any]:
    """``kwargs`` plus ``device`` (as a string) when the reward registered under ``name`` takes
    one and ``kwargs`` names none; ``kwargs`` as they are otherwise (rewards without a model:
    rule-based, remote, scikit-learn, onnxruntime on CPU)."""
    if device is None or "device" in kwargs:
        return kwargs
    params = inspect.signature(reward_class(name).__init__).parameters
    return {**kwargs, "device": str(device)} if "device" in params else kwargs


def _to_container(cfg: Any) -> Any:
    """OmegaConf nodes -> plain Python containers (omegaconf is imported only if needed)."""
    if type(cfg).__module__.startswith("omegaconf"):
        from omegaconf import OmegaConf

        return OmegaConf.to_container(cfg, resolve=True)
    return cfg

