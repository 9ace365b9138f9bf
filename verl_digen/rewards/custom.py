"""A reward function from a user's file, called the way veRL and veRL-Omni call it.

veRL users point ``reward.custom_reward_function.path`` / ``.name`` at a ``compute_score`` and
veRL's reward loop calls it **by keyword**, one sample at a time, awaiting it when it is a
coroutine function; veRL-Omni's visual reward manager does the same with the generated image as
``solution_image``. Here a function's parameters are filled **by their names** from these
fields of the sample (a function takes only those it names, or all of them with ``**kwargs``):

==================  ===========================================================================
``solution_image``  the image as veRL-Omni passes it: a uint8 ``torch.Tensor`` ``[3, H, W]``
                    (video: ``[3, F, H, W]``, see below); with ``output_type=latent``
                    the sample's final latents instead (float32, the model's layout)
``image``           the same pixels as an RGB ``PIL.Image.Image`` (video: a list of frames)
``prompt``          the prompt text
``data_source``     the prompt record's ``data_source`` (veRL parquet column), or None
``ground_truth``    the record's ``reward_model.ground_truth``, or None
``extra_info``      the record's ``extra_info`` (a dict; ``fps`` added for video)
``fps``             video only: frames per second
==================  ===========================================================================

Videos go as uint8 ``[3, F, H, W]`` (channels first): the layout veRL-Omni's video scorers read
(HPSv3's and the OCR judge's frame extraction index a 4-D channels-first video as ``[C, F, H,
W]``; ``reward_utils.video_tensor_to_pil_frames`` takes it too). ``video_layout="fchw"`` sends
``[F, 3, H, W]`` instead (veRL-Omni's UnifiedReward client reads frames first).

``output_type`` is veRL-Omni's ``actor_rollout_ref.rollout.pipeline.output_type``: ``image``
(and ``pt``, ``np``, ``pil``: pixels, the default); ``latent``: ``solution_image`` is the
sample's final (clean) latents, float32 in the model's own layout (SD3 ``[16, h, w]``, FLUX and
Qwen-Image packed ``[L, C*4]``, Wan ``[C, F, h, w]``), as veRL-Omni's latent rewards (its DRM
client) read them; ``both``: pixels in ``solution_image`` and the latents in
``extra_info["latents_clean"]``. With either, ``extra_info`` also holds ``latents_clean`` and the
prompt's conditioning tensors the trajectory carries (``prompt_embeds``, SD3/FLUX
``pooled_prompt_embeds``, one sample's rows each), and the rollout carries the final latents
with each trajectory only then (:attr:`CustomFunctionReward.wants_latents`).
``validation_output_type`` (veRL-Omni's ``val_kwargs.pipeline.output_type``; default
``output_type``) is the validation samples' (a call after ``give_sample_tensors(...,
validation=True)``).

plus ``reward.custom_reward_function.reward_kwargs``, passed by keyword too (a setting that
names a sample field, or a parameter the function cannot take, is refused). The batched form
(``reward.reward_manager.name=batch``, ``batched=True``) is called once per batch with the plural
names (``solution_images``, ``images``, ``prompts``, ``data_sources``, ``ground_truths``,
``extra_infos``: one entry per sample; ``fps``) and returns one score per sample.

A score is a finite number, or a dict ``{"score": number, ...}`` as veRL-Omni's scorers return:
its other numeric entries are averaged into per-step metrics ``reward/<key>``; entries that are
not numbers are not logged (they are strings such as a judge's answer). Coroutine functions
(``async def``, veRL-Omni's HTTP and judge clients) are awaited, all samples of a call
concurrently (``asyncio.gather``, as veRL's reward loop does); plain functions run one sample
after another.

``path`` is a file (relative paths are taken from where the job starts), ``file://<file>``, or
``pkg://<package.module>`` (veRL's ``load_module`` forms). The function's signature is checked
when the reward is built, which the job does before Ray starts: a required parameter that no
field or setting fills is named.

An exception in the user's function stops the run: :class:`CustomRewardError` carries the
function's own traceback and the prompt of the sample it failed on (batched: the batch's
prompts), and the loop checkpoints the completed steps before it reports it.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import os
import threading
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from verl_digen.rewards.base import RewardFn, register_reward
from verl_digen.rewards.jpeg import to_uint8_hwc

logger = logging.getLogger(__name__)

# The fields a per-sample function may name; the batched form's are these, plural.
SAMPLE_FIELDS = ("solution_image", "image", "prompt", "data_source", "ground_truth", "extra_info", "fps")
BATCH_FIELDS = ("solution_images", "images", "prompts", "data_sources", "ground_truths", "extra_infos", "fps")
# veRL-Omni's pipeline.output_type values: pixels (its default image, and pt / np / pil), the
# final latents in solution_image (latent), or pixels with the latents in extra_info (both).
PIXEL_OUTPUT_TYPES = ("image", "pt", "np", "pil")
LATENT_OUTPUT_TYPES = ("latent", "both")
VIDEO_LAYOUTS = ("cfhw", "fchw")


def reward_wants_latents(spec: Mapping[str, Any]) -> bool:
    """Whether a reward config (``digen.reward``'s spec: a custom function, or a weighted sum of
    rewards) asks for the samples' final latents: a custom function with ``output_type`` latent or
    both. Read from the config, so that the rollout knows without building the reward."""
    if spec.get("name") == "weighted":
        return any(reward_wants_latents(c) for c in spec.get("components") or ())
    kwargs = spec.get("kwargs") or {}
    return spec.get("name") == "custom" and (kwargs.get("output_type") in LATENT_OUTPUT_TYPES
                                             or kwargs.get("validation_output_type") in LATENT_OUTPUT_TYPES)


class CustomRewardError(RuntimeError):
    """The user's reward function raised or returned something that is not a finite score."""


def load_reward_function(path: str, name: str, where: str = "reward.custom_reward_function") -> Callable[..., Any]:
    """``name`` from ``path`` (a file, ``file://<file>`` or ``pkg://<module>``), through veRL's
    own loader (the one ``reward.custom_reward_function`` uses), with errors that name the keys
    (``<where>.path``, ``<where>.name``)."""
    from verl.utils.import_utils import load_extern_object

    key = f"{where}.path"
    if not path:
        raise FileNotFoundError(f"{key}: no reward file given")
    if path.startswith("pkg://"):
        module = path[len("pkg://"):].replace("/", ".")
        import importlib.util

        try:
            found, why = importlib.util.find_spec(module) is not None, ""
        except (ImportError, ValueError) as e:  # a parent package failed to import: say why
            found, why = False, f": importing it failed with {type(e).__name__}: {e}"
        if not found:
            raise FileNotFoundError(f"{key}: reward module {module!r} ({path}) is not importable here{why}")
    elif not os.path.isfile(path.removeprefix("file://")):
        raise FileNotFoundError(f"{key}: reward file {path!r} does not exist")
    try:
        fn = load_extern_object(module_path=path, object_name=name)
    except AttributeError:
        raise ValueError(f"{where}.name: {path} defines no {name!r}") from None
    if not callable(fn):
        raise ValueError(f"{where}.name: {path}:{name} is not callable")
    return fn


def _plan_call(fn: Callable[..., Any], fields: Sequence[str], settings: Mapping[str, Any], where: str) -> tuple[set[str], bool]:
    """Which sample ``fields`` ``fn`` takes (by name; all with ``**kwargs``) and whether it is a
    coroutine function; raises ``ValueError`` naming what cannot be filled."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        raise ValueError(f"{where}: cannot read the function's signature") from None
    taken = set(settings) & set(fields)
    if taken:
        raise ValueError(f"{where}: reward_kwargs {sorted(taken)} name sample fields the call fills itself "
                         f"({', '.join(fields)})")
    var_kw = any(p.kind is p.VAR_KEYWORD for p in params.values())
    named = {n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    for n, p in params.items():
        if p.kind is p.POSITIONAL_ONLY:
            raise ValueError(f"{where}: parameter {n!r} is positional-only; reward functions are called by keyword")
        if p.kind is p.VAR_POSITIONAL and not (named or var_kw):
            raise ValueError(f"{where}: takes only *{n}; reward functions are called by keyword "
                             f"(name the fields: {', '.join(fields)})")
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.default is p.empty \
                and n not in fields and n not in settings:
            raise ValueError(f"{where}: cannot fill parameter {n!r}: it is neither a sample field "
                             f"({', '.join(fields)}) nor in reward.custom_reward_function.reward_kwargs")
    unknown = sorted(set(settings) - named) if not var_kw else []
    if unknown:
        raise ValueError(f"{where}: reward_kwargs {unknown} are not parameters of the function")
    wanted = set(fields) if var_kw else named & set(fields)
    is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))
    return wanted, is_async


_LOOP: asyncio.AbstractEventLoop | None = None
_LOOP_LOCK = threading.Lock()


def _reward_loop() -> asyncio.AbstractEventLoop:
    """The process's one event loop for users' coroutines, running on a daemon thread.

    One loop for the life of the process, as veRL's reward loop worker keeps one: veRL-Omni's HTTP
    clients cache an ``aiohttp`` session on the function, and a session is bound to the loop it
    was made on, so a fresh loop per batch (``asyncio.run``) breaks them from the second batch on."""
    global _LOOP
    with _LOOP_LOCK:
        if _LOOP is None or _LOOP.is_closed():
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="digen-reward-loop", daemon=True).start()
            _LOOP = loop
        return _LOOP


def _run_coroutines(coros: list[Any]) -> list[Any]:
    """Await ``coros`` concurrently (``asyncio.gather``) on the process's reward loop; results in
    order, an exception in the place of a coroutine that raised."""

    async def gather() -> list[Any]:
        return await asyncio.gather(*coros, return_exceptions=True)

    return asyncio.run_coroutine_threadsafe(gather(), _reward_loop()).result()


def _awaited(value: Any) -> Any:
    """An awaitable's result (a callable object with an ``async __call__``, an ``async`` batched
    form), awaited here, its exception raised; anything else as it is."""
    if inspect.isawaitable(value):
        (value,) = _run_coroutines([value])
        if isinstance(value, Exception):
            raise value
    return value


@register_reward("custom")
class CustomFunctionReward(RewardFn):
    """Scores with a user's ``compute_score`` loaded from a file (see the module docstring)."""

    supports_video = True  # the user's function receives the whole clip (frames + fps)

    def __init__(self, path: str, function: str = "compute_score", batched: bool = False,
                 fps: float = 16.0, reward_kwargs: Mapping[str, Any] | None = None, required: bool = True,
                 where: str = "reward.custom_reward_function", output_type: str = "image",
                 video_layout: str = "cfhw", validation_output_type: str | None = None) -> None:
        """``required=False`` (veRL-Omni's multi-reward entries): a sample the function fails on
        scores 0, counted in the ``failed`` metric and logged with its traceback, instead of
        stopping the run. ``where``: the config key errors name."""
        self.path, self.function, self.batched = path, function, bool(batched)
        self.fps = float(fps)
        self.reward_kwargs = dict(reward_kwargs or {})
        self.required, self.where = bool(required), where
        validation_output_type = output_type if validation_output_type is None else validation_output_type
        for key, value in (("pipeline", output_type), ("val_kwargs.pipeline", validation_output_type)):
            if value not in PIXEL_OUTPUT_TYPES + LATENT_OUTPUT_TYPES:
                raise ValueError(f"actor_rollout_ref.rollout.{key}.output_type={value!r}: valid here "
                                 f"{', '.join(PIXEL_OUTPUT_TYPES + LATENT_OUTPUT_TYPES)} (latent: the final latents "
                                 "as solution_image; both: pixels, the latents in extra_info['latents_clean'])")
        if video_layout not in VIDEO_LAYOUTS:
            raise ValueError(f"digen.reward.kwargs.video_layout={video_layout!r}: valid {', '.join(VIDEO_LAYOUTS)} "
                             "(cfhw: [3, F, H, W], fchw: [F, 3, H, W])")
        self.output_type, self.video_layout = output_type, video_layout
        self.training_output_type, self.validation_output_type = output_type, validation_output_type
        self.wants_latents = output_type in LATENT_OUTPUT_TYPES or validation_output_type in LATENT_OUTPUT_TYPES
        self._tensors: dict[str, torch.Tensor] = {}
        self._next_type = output_type
        self.fn = load_reward_function(path, function, where)
        self.fields = BATCH_FIELDS if self.batched else SAMPLE_FIELDS
        self.wanted, self.is_async = _plan_call(self.fn, self.fields, self.reward_kwargs, self._where())
        self._extras: dict[str, torch.Tensor] = {}

    def score_images(self, images: torch.Tensor, prompts: list[str],
                     metadata: Sequence[Mapping[str, Any]]) -> torch.Tensor:
        is_video = images.dim() == 5
        tensors, self._tensors = self._tensors, {}
        # this call's output_type (give_sample_tensors(validation=True) set the validation one); the next: training's
        self.output_type, self._next_type = self._next_type, self.training_output_type
        if self.output_type in LATENT_OUTPUT_TYPES and "latents_clean" not in tensors:
            raise CustomRewardError(f"{self._where()}: output_type={self.output_type} hands the function the samples' "
                                    "final latents, and this call received none (a rollout that did not carry them)")
        for name, t in tensors.items():
            if t.shape[0] != len(prompts):
                raise ValueError(f"{self._where()}: {name} has {t.shape[0]} rows for {len(prompts)} samples")
        rows = [self._sample_fields(x, p, record, is_video, {k: t[i] for k, t in tensors.items()})
                for i, (x, p, record) in enumerate(zip(images, prompts, metadata))]
        if self.batched:
            values = {plural: [r[single] for r in rows] for single, plural in zip(SAMPLE_FIELDS, BATCH_FIELDS)
                      if single != "fps"}
            if is_video:
                values["fps"] = self.fps
            kwargs = {k: v for k, v in values.items() if k in self.wanted}
            try:
                scores = self._score_list(_awaited(self.fn(**kwargs, **self.reward_kwargs)))
                if len(scores) != len(prompts):
                    raise CustomRewardError(f"{self._where()} returned {len(scores)} scores for {len(prompts)} samples")
            except Exception as e:
                error = e if isinstance(e, CustomRewardError) else \
                    self._error(f"on a batch of {len(prompts)} samples, prompts {list(prompts)!r}")
                scores = [self._failed(error)] * len(prompts)
        else:
            calls = [{k: v for k, v in r.items() if k in self.wanted} for r in rows]
            if self.is_async:
                scores = _run_coroutines([self.fn(**kw, **self.reward_kwargs) for kw in calls])
                for i, result in enumerate(scores):  # the first sample that failed, with its own traceback
                    if isinstance(result, Exception):
                        scores[i] = self._failed(self._error(f"on sample {i}, prompt {prompts[i]!r}", result))
            else:
                scores = []
                for i, kw in enumerate(calls):
                    try:
                        scores.append(_awaited(self.fn(**kw, **self.reward_kwargs)))
                    except Exception:
                        scores.append(self._failed(self._error(f"on sample {i}, prompt {prompts[i]!r}")))
        out, extras, failures = [], {}, {}
        for i, s in enumerate(scores):
            if not isinstance(s, CustomRewardError):
                try:
                    value, extra = self._split(s, prompts[i])
                except CustomRewardError as e:
                    s = self._failed(e)
            if isinstance(s, CustomRewardError):
                failures[i] = s
                value, extra = 0.0, {}
            out.append(value)
            for k, v in extra.items():
                extras.setdefault(k, [math.nan] * len(scores))[i] = v
        if not self.required:
            extras["failed"] = [float(i in failures) for i in range(len(scores))]
            if failures:
                logger.warning("%s (required=false) failed on %d of %d samples, each scored 0; the first:\n%s",
                               self._where(), len(failures), len(scores), next(iter(failures.values())))
        self._extras = {k: torch.tensor(v, dtype=torch.float32) for k, v in extras.items()}
        return torch.tensor(out, dtype=torch.float32)

    def give_sample_tensors(self, tensors: Mapping[str, torch.Tensor] | None, validation: bool = False) -> None:
        """The next call's final latents and conditioning (name -> ``[B, ...]``); kept only when the
        function asks for latents (its ``output_type``, or ``validation_output_type`` with
        ``validation``, is latent or both)."""
        self._next_type = self.validation_output_type if validation else self.training_output_type
        self._tensors = dict(tensors or {}) if self._next_type in LATENT_OUTPUT_TYPES else {}

    def take_extras(self) -> dict[str, torch.Tensor]:
        extras, self._extras = self._extras, {}
        return extras

    def _sample_fields(self, x: torch.Tensor, prompt: str, record: Mapping[str, Any], is_video: bool,
                       tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        source, truth, info = _fields(record, self.fps if is_video else None)
        info.update(tensors)  # latents_clean, prompt_embeds, ... (output_type latent / both)
        frames = to_uint8_hwc(x.permute(1, 0, 2, 3) if is_video else x[None])  # [F or 1, H, W, 3]
        # uint8 [3, H, W]; video [3, F, H, W] (veRL-Omni's scorers' channels-first video) or [F, 3, H, W]
        pixels = frames.permute(3, 0, 1, 2) if self.video_layout == "cfhw" else frames.permute(0, 3, 1, 2)
        pixels = pixels.contiguous() if is_video else frames[0].permute(2, 0, 1).contiguous()
        if self.output_type == "latent":
            pixels = tensors["latents_clean"]
        out = {"solution_image": pixels, "prompt": prompt, "data_source": source,
               "ground_truth": truth, "extra_info": info}
        if "image" in self.wanted or "images" in self.wanted:
            pils = _to_pil(frames)
            out["image"] = pils if is_video else pils[0]
        else:
            out["image"] = None
        if is_video:
            out["fps"] = self.fps
        return out

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
        return f"{self.where} {self.path}:{self.function}"

    def _failed(self, error: CustomRewardError) -> CustomRewardError:
        """``error`` raised when the function is required (the run stops); else returned, to score
        its samples 0 (``required=False``)."""
        if self.required:
            raise error from None
        return error

    def _error(self, sample: str, exc: BaseException | None = None) -> CustomRewardError:
        """The user's failure ``exc`` (default: the one being handled), with its traceback."""
        trace = traceback.format_exc() if exc is None else "".join(traceback.format_exception(exc))
        return CustomRewardError(f"{self._where()} failed {sample}:\n{trace}")

    def _split(self, s: Any, prompt: str) -> tuple[float, dict[str, float]]:
        """(score, numeric extras) of one result: a number, or a dict with a ``score``."""
        extra: dict[str, float] = {}
        if isinstance(s, Mapping):
            if "score" not in s:
                raise CustomRewardError(f"{self._where()} returned a dict without 'score' ({sorted(s)}) for prompt "
                                        f"{prompt!r}; expected a number or {{'score': number, ...}}")
            for k, v in s.items():
                number = _as_number(v) if k != "score" else None
                if number is not None:
                    extra[str(k)] = number
            s = s["score"]
        value = _as_number(s)
        if value is None or not math.isfinite(value):
            raise CustomRewardError(f"{self._where()} returned {s!r} for prompt {prompt!r}; expected a finite float")
        return value, extra

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


def _to_pil(frames: torch.Tensor) -> list[Any]:
    """uint8 ``[F, H, W, 3]`` -> F RGB PIL images."""
    from PIL import Image

    return [Image.fromarray(f.numpy(), "RGB") for f in frames]
