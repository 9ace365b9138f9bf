"""The adapter interface every diffusion architecture implements.

An adapter wraps the diffusers components of one architecture (text encoders, tokenizers,
the denoising transformer, the VAE, the scheduler config) behind the few calls the RL loop
needs. Latents live in *model space* throughout rollout and training (packed tokens for
FLUX, ``[B, C, h, w]`` for SD3); only :meth:`decode` turns them into pixels.

Flow-matching convention (diffusers, Flow-GRPO): ``x_sigma = (1 - sigma) * x0 + sigma * noise``,
the model predicts ``velocity = noise - x0`` and an Euler step is
``x_next = x + (sigma_next - sigma) * velocity``.

Below the interface are the pieces every adapter shares, so that each architecture's file holds
only what is its own: component loading (:func:`load_components`), the schedule
(:func:`scheduler_sigmas`, :func:`config_shift`), latent sizes, noise and 2x2 packing, true CFG
(:meth:`DiffusionAdapter.predict_velocity` over the adapter's ``_transformer_forward``) and
decoding. This module imports torch only; diffusers is imported where a helper needs it.
"""

from __future__ import annotations

import abc
import functools
import json
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

import numpy as np
import torch

# Conditioning for a batch: every tensor is batch-first ([B, ...]) so it can ride in a
# DataProto next to the latents and be sliced per sample.
Conditioning = dict[str, torch.Tensor]


@dataclass(frozen=True)
class SampleSpec:
    """What to sample: pixel size (and frames for video) and the guidance settings."""

    height: int
    width: int
    num_frames: int = 1
    guidance_scale: float = 1.0  # true CFG scale (> 1 runs the negative branch)
    distilled_guidance: float | None = None  # FLUX.1-dev style guidance embedding


@dataclass(frozen=True)
class SizeRules:
    """How an architecture maps pixels to latents: the sizes it can sample are multiples of
    ``spatial * patch`` (and, for video, ``temporal * k + 1`` frames whose latent frames split
    into patches of ``patch_t``)."""

    model: str
    spatial: int  # the VAE's spatial compression
    patch: int  # the transformer's spatial patch (2 for 2x2 token packing)
    packed: bool = False
    temporal: int | None = None  # video: the VAE's temporal compression
    patch_t: int = 1
    max_patches: int | None = None  # the most patches per side its position embedding covers (SD3)

    def check(self, spec: "SampleSpec") -> None:
        """Raise ``ValueError`` naming the model and the valid sizes unless it can sample ``spec``."""
        latent_hw(spec, model=self.model, vae_scale_factor=self.spatial, patch_size=self.patch, packed=self.packed)
        if self.max_patches is not None:
            most = self.max_patches * self.spatial * self.patch
            if max(spec.height, spec.width) > most:
                raise ValueError(f"{self.model}'s position embedding covers {self.max_patches} patches per side "
                                 f"(transformer pos_embed_max_size): at most {most} x {most} pixels")
        if self.temporal is None:
            if spec.num_frames != 1:
                raise ValueError(f"{self.model} generates images: num_frames must be 1, got {spec.num_frames}")
        else:
            latent_frames(spec, model=self.model, temporal_factor=self.temporal, patch_size_t=self.patch_t)


class DiffusionAdapter(abc.ABC):
    """One architecture's diffusers components behind the RL loop's calls."""

    arch: ClassVar[str]
    #: The tokenizer (subfolder) whose tokens are a prompt's length: the one read to
    #: ``max_sequence_length``, and what veRL's ``data.max_prompt_length`` limits.
    length_tokenizer: ClassVar[str] = "tokenizer"

    @classmethod
    def prompt_text(cls, prompt: str) -> str:
        """The text :attr:`length_tokenizer` reads for ``prompt`` (with the chat template where
        the pipeline applies one, as veRL counts a prompt's tokens with its chat template)."""
        return prompt

    @classmethod
    def prompt_token_counts(cls, path: str, prompts: list[str]) -> list[int]:
        """Tokens of each prompt as the length tokenizer of the model at ``path`` reads it, special
        tokens included, before any truncation."""
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path, subfolder=cls.length_tokenizer)
        ids = tokenizer([cls.prompt_text(p) for p in prompts], add_special_tokens=True)["input_ids"]
        return [len(i) for i in ids]

    @classmethod
    def size_rules(cls, vae_config: Mapping[str, Any], transformer_config: Mapping[str, Any]) -> SizeRules | None:
        """The architecture's :class:`SizeRules`, from its VAE's and transformer's configs only
        (so a size can be checked before any weight is loaded); None: not known up front."""
        return None

    @classmethod
    def check_sample_size(cls, path: str, spec: "SampleSpec") -> None:
        """Check that the model at ``path`` can sample ``spec``, reading only its config files."""
        import os

        def config(sub: str) -> dict[str, Any]:
            return read_json(os.path.join(path, sub, "config.json"))

        rules = cls.size_rules(config("vae"), config("transformer"))
        if rules is not None:
            rules.check(spec)

    # The trainable denoiser (FluxTransformer2DModel, SD3Transformer2DModel, ...).
    transformer: torch.nn.Module

    # The dtype the denoiser computes in (what :meth:`from_pretrained` loaded it in). Adapters
    # cast the transformer's inputs to it explicitly, rather than reading ``transformer.dtype``:
    # under FSDP2 or with fp32 LoRA / master weights the parameters' storage dtype is not the
    # compute dtype, and rollout and trainer must cast every input the same way.
    _compute_dtype: torch.dtype | None = None

    @property
    def compute_dtype(self) -> torch.dtype:
        return self._compute_dtype if self._compute_dtype is not None else self.transformer.dtype

    @compute_dtype.setter
    def compute_dtype(self, dtype: torch.dtype) -> None:
        self._compute_dtype = dtype

    # Subfolder -> class of each component :meth:`from_pretrained` loads (in this order); the
    # adapter's ``__init__`` takes them under these names.
    component_classes: ClassVar[dict[str, type]] = {}
    # Components loaded in float32 whatever ``dtype`` :meth:`from_pretrained` is given.
    fp32_components: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def from_pretrained(
        cls,
        path: str,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        max_sequence_length: int | None = None,
    ) -> "DiffusionAdapter":
        """Load every component from a local diffusers-format directory (``model_index.json`` +
        one subfolder per component of ``component_classes``): models in ``dtype`` on ``device``
        in eval mode, all but the transformer frozen (:func:`load_components`).

        ``max_sequence_length``: text tokens kept per prompt (None: the pipeline's default,
        capped by what the tokenizer was built for).
        """
        if not cls.component_classes:
            raise NotImplementedError(f"{cls.__name__} implements neither from_pretrained nor component_classes")
        index = read_model_index(path)  # clear FileNotFoundError for a wrong path
        options = cls._init_options(path, index)
        components = load_components(
            path, cls._components_to_load(index), device=device, dtype=dtype, keep_fp32=cls.fp32_components
        )
        adapter = cls(**components, max_sequence_length=max_sequence_length, **options)
        adapter.compute_dtype = dtype
        return adapter

    @classmethod
    def _components_to_load(cls, model_index: dict) -> dict[str, type | None]:
        """``component_classes`` for a directory with this ``model_index.json`` (``None``: an
        optional component the directory lacks)."""
        return dict(cls.component_classes)

    @classmethod
    def _init_options(cls, path: str, model_index: dict) -> dict:
        """More ``__init__`` arguments read from ``model_index.json``; raises for layouts the
        adapter does not support. Called before anything is loaded."""
        return {}

    @abc.abstractmethod
    def encode_prompts(self, prompts: list[str]) -> Conditioning:
        """Text encoders -> conditioning tensors, each ``[B, ...]``. No grad."""

    @abc.abstractmethod
    def prepare_latents(self, batch_size: int, spec: SampleSpec, generator: torch.Generator) -> torch.Tensor:
        """Initial noise in model space, ``[B, ...]``, fp32, drawn from ``generator``."""

    @abc.abstractmethod
    def sigmas(self, num_steps: int, spec: SampleSpec) -> torch.Tensor:
        """Noise levels ``[num_steps + 1]`` (fp32, decreasing, last is 0) as the pipeline uses them."""

    # The conditioning tensors :meth:`_transformer_forward` reads, in the order it takes them.
    conditioning_keys: ClassVar[tuple[str, ...]] = ("prompt_embeds",)
    # Batch order of the one CFG forward: [cond; uncond], or [uncond; cond] (SD3's pipeline) when set.
    cfg_uncond_first: ClassVar[bool] = False

    def predict_velocity(
        self,
        latents: torch.Tensor,
        sigma: torch.Tensor,
        cond: Conditioning,
        spec: SampleSpec,
        negative_cond: Conditioning | None = None,
    ) -> torch.Tensor:
        """Velocity ``[B, ...]`` (same shape as ``latents``, fp32) at noise level ``sigma`` ``[B]``.

        With ``spec.guidance_scale > 1`` and ``negative_cond`` given (one row, or one per
        sample), runs true CFG: ``v_neg + scale * (v_pos - v_neg)`` (see
        :meth:`_combine_guidance`). Differentiable w.r.t. the transformer.

        Adapters implement :meth:`_transformer_forward` (one transformer call) and name the
        tensors it reads in ``conditioning_keys``; the CFG branch runs one forward over
        ``[cond; uncond]`` when both sides have the same shapes (same maths as two forwards,
        fewer kernel launches), two forwards otherwise.
        """
        batch = latents.shape[0]
        sigma = batch_sigma(sigma, batch, latents.device)
        inputs = self._transformer_inputs(cond)
        if not (spec.guidance_scale > 1.0 and negative_cond is not None):
            return self._transformer_forward(latents, sigma, *inputs, spec=spec)

        negative_cond = {
            key: expand_batch(negative_cond[key], batch).to(cond[key]) for key in self.conditioning_keys
        }
        neg_inputs = self._transformer_inputs(negative_cond)
        if all(pos.shape == neg.shape for pos, neg in zip(inputs, neg_inputs, strict=True)):
            first, second = (neg_inputs, inputs) if self.cfg_uncond_first else (inputs, neg_inputs)
            both = self._transformer_forward(
                torch.cat([latents, latents]),  # [2B, ...]
                torch.cat([sigma, sigma]),  # [2B]
                *(torch.cat([a, b]) for a, b in zip(first, second, strict=True)),
                spec=spec,
            )
            v_first, v_second = both.chunk(2)
            v_pos, v_neg = (v_second, v_first) if self.cfg_uncond_first else (v_first, v_second)
        else:
            v_pos = self._transformer_forward(latents, sigma, *inputs, spec=spec)
            v_neg = self._transformer_forward(latents, sigma, *neg_inputs, spec=spec)
        return self._combine_guidance(v_pos, v_neg, spec.guidance_scale)

    def _transformer_inputs(self, cond: Conditioning) -> tuple[torch.Tensor, ...]:
        """The tensors of ``cond`` that :meth:`_transformer_forward` takes, in its order."""
        return tuple(cond[key] for key in self.conditioning_keys)

    def _transformer_forward(
        self, latents: torch.Tensor, sigma: torch.Tensor, *inputs: torch.Tensor, spec: SampleSpec
    ) -> torch.Tensor:
        """One transformer call: fp32 velocity ``[B, ...]`` for ``latents`` at ``sigma`` ``[B]``
        given the conditioning tensors ``inputs`` (``conditioning_keys``, batch-first)."""
        raise NotImplementedError(f"{type(self).__name__} implements neither predict_velocity nor _transformer_forward")

    def _combine_guidance(self, v_pos: torch.Tensor, v_neg: torch.Tensor, scale: float) -> torch.Tensor:
        """CFG from the conditional and unconditional velocities (plain true CFG by default)."""
        return true_cfg(v_pos, v_neg, scale)

    @abc.abstractmethod
    def decode(self, latents: torch.Tensor, spec: SampleSpec) -> torch.Tensor:
        """Model-space latents -> pixels ``[B, 3, H, W]`` (``[B, 3, F, H, W]`` for video) in [0, 1]."""

    # Where the transformer computes when that is not where its parameters live: under FSDP2's
    # host offload (digen.fsdp.param_offload) the shards stay on the host and each unit computes
    # on the GPU, so inputs, noise and the SDE maths belong there (set by the worker).
    compute_device: torch.device | None = None

    @property
    def device(self) -> torch.device:
        """The device the transformer computes on: its parameters' unless :attr:`compute_device` says."""
        if self.compute_device is not None:
            return self.compute_device
        return next(self.transformer.parameters()).device

    def register_modules(self, **modules: object) -> None:
        """Store the components (as ``DiffusionPipeline.register_modules``): ``self.<name> = module``."""
        for name, module in modules.items():
            setattr(self, name, module)

    # Set by :meth:`release_text_encoders`; :meth:`encode_prompts` then raises.
    text_encoders_released: bool = False
    # The attributes (text encoders, tokenizers) :meth:`release_text_encoders` drops.
    text_encoder_names: ClassVar[tuple[str, ...]] = ()

    # Components kept on CPU between uses (:meth:`offload_to_cpu`), moved to the device by
    # :func:`onloaded` only while they run.
    offloaded: tuple[str, ...] = ()

    def offload_to_cpu(self, names: tuple[str, ...]) -> int:
        """Keep the modules ``names`` (text encoders, the VAE) on CPU, to be moved to the device
        only while they encode or decode (:func:`onloaded`): what a training GPU does not need
        between uses. Returns the bytes of parameters and buffers moved off the device."""
        moved = 0
        for name in names:
            module = getattr(self, name, None)
            if isinstance(module, torch.nn.Module):
                moved += sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers())
                             if t.device.type not in ("cpu", "meta"))
                module.to("cpu")
        self.offloaded = tuple(dict.fromkeys((*self.offloaded, *names)))
        if moved and torch.cuda.is_available():
            torch.cuda.empty_cache()
        return moved

    def release_text_encoders(self) -> int:
        """Drop the text encoders and tokenizers (once every prompt the run needs is in a
        :class:`~verl_digen.models.prompt_cache.PromptEmbeddingCache`); returns the bytes of
        parameters and buffers freed. :meth:`encode_prompts` raises ``RuntimeError`` afterwards."""
        if not self.text_encoder_names:
            raise NotImplementedError(f"{type(self).__name__} does not implement release_text_encoders")
        return release_modules(self, self.text_encoder_names)


TEXT_ENCODERS_RELEASED_MESSAGE = "text encoders were released; use the prompt cache"


@contextmanager
def onloaded(adapter: DiffusionAdapter, names: tuple[str, ...]):
    """Within the block, the offloaded modules among ``names`` are on the adapter's device;
    they go back to CPU afterwards (even on error). Modules not offloaded are left alone, and so
    are modules already on the device: a nested block (the prompt cache encoding its misses
    inside a sampling call's block) neither moves them again nor sends them back early."""
    device = adapter.device
    modules = [m for n in names if n in adapter.offloaded and isinstance(m := getattr(adapter, n, None), torch.nn.Module)
               and _tensor_device(m) != device]
    if device.type == "cpu" or not modules:
        yield
        return
    for m in modules:
        m.to(device)
    try:
        yield
    finally:
        for m in modules:
            m.to("cpu")


def _tensor_device(module: torch.nn.Module) -> torch.device | None:
    """The device of the module's first parameter or buffer (None: it has neither)."""
    for t in (*module.parameters(), *module.buffers()):
        return t.device
    return None


def release_modules(adapter: DiffusionAdapter, names: tuple[str, ...]) -> int:
    """Set the attributes ``names`` of ``adapter`` (text encoders, tokenizers) to ``None`` after
    counting the parameter and buffer bytes of those that are modules; mark the adapter released.

    The memory is returned to the allocator once nothing else references the modules (the CUDA
    cache is emptied when any of them lived on a GPU). Returns the bytes counted; releasing
    twice frees nothing the second time and returns 0."""
    import gc

    freed, on_cuda, seen = 0, False, set()
    for name in names:
        module = getattr(adapter, name, None)
        if isinstance(module, torch.nn.Module):
            for t in (*module.parameters(), *module.buffers()):
                if t.device.type != "meta" and id(t) not in seen:
                    seen.add(id(t))
                    freed += t.numel() * t.element_size()
                    on_cuda |= t.is_cuda
        setattr(adapter, name, None)
    adapter.text_encoders_released = True
    gc.collect()
    if on_cuda and torch.cuda.is_available():
        torch.cuda.empty_cache()
    return freed


def require_text_encoders(adapter: DiffusionAdapter) -> None:
    """Raise a clear ``RuntimeError`` when ``adapter``'s text encoders were released."""
    if adapter.text_encoders_released:
        raise RuntimeError(
            f"{type(adapter).__name__}.encode_prompts: {TEXT_ENCODERS_RELEASED_MESSAGE} "
            "(PromptEmbeddingCache.encode serves the prompts warmed before the release)"
        )


def prompts_to_encode(adapter: DiffusionAdapter, prompts: list[str] | str) -> list[str]:
    """The prompts an ``encode_prompts`` call was given, as a list (a single string is one
    prompt); raises ``RuntimeError`` first when the text encoders were released."""
    require_text_encoders(adapter)
    return [prompts] if isinstance(prompts, str) else list(prompts)


# ---------------------------------------------------------------------- loading

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def resolve_dtype(name: str, device: torch.device | str, *, key: str = "digen.model.dtype") -> torch.dtype:
    """The torch dtype of a ``digen.model.dtype`` value: ``auto`` is bf16 on CUDA, fp32 elsewhere."""
    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ValueError(f"{key}={name!r}; valid: auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def read_model_index(path: str) -> dict:
    """The ``model_index.json`` of a local diffusers-format directory, as a dict.

    Raises ``FileNotFoundError`` naming the path when the directory or the file is missing, so
    a typo in a config fails here rather than deep inside ``from_pretrained``.
    """
    import os

    if not os.path.isdir(path):
        raise FileNotFoundError(f"model path '{path}' does not exist (expected a local diffusers-format directory)")
    index_file = os.path.join(path, "model_index.json")
    if not os.path.isfile(index_file):
        raise FileNotFoundError(
            f"no model_index.json in model path '{path}': expected a diffusers-format directory "
            "(e.g. written by DiffusionPipeline.save_pretrained or downloaded from the Hub)"
        )
    return read_json(index_file)


def read_json(file: str) -> Any:
    """The JSON value of ``file``, parsed afresh on every call (callers may change what they get),
    from text read once per version of the file (its path, mtime and size): the memory planner
    reads the same few config files tens of thousands of times in one planner search."""
    import os

    st = os.stat(file)
    return json.loads(_file_text(os.path.abspath(file), st.st_mtime_ns, st.st_size))


@functools.lru_cache(maxsize=256)
def _file_text(file: str, mtime_ns: int, size: int) -> str:
    with open(file, encoding="utf-8") as f:
        return f.read()


def has_component(model_index: dict, name: str) -> bool:
    """Whether ``model_index.json`` lists component ``name`` (a ``[null, null]`` entry means dropped)."""
    entry = model_index.get(name)
    return isinstance(entry, (list, tuple)) and len(entry) == 2 and entry[0] is not None and entry[1] is not None


def resolve_max_sequence_length(max_sequence_length: int | None, default: int, tokenizer_limit: int | None) -> int:
    """Text tokens to keep: ``max_sequence_length`` when given, else the pipeline's ``default``
    capped by what the tokenizer was built for (``tokenizer_limit``; tiny models use short
    prompts; ``None`` or <= 0: no cap)."""
    if max_sequence_length is None:
        capped = tokenizer_limit is not None and tokenizer_limit > 0
        max_sequence_length = min(default, tokenizer_limit) if capped else default
    return int(max_sequence_length)


def load_scheduler_config(path: str) -> dict:
    """The ``scheduler/scheduler_config.json`` of a pipeline directory, as a dict."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return dict(FlowMatchEulerDiscreteScheduler.load_config(path, subfolder="scheduler"))


def load_component(component_cls: type, path: str, subfolder: str, dtype: torch.dtype | None = None,
                   device: torch.device | str | None = None):
    """``component_cls.from_pretrained(path, subfolder=subfolder)`` in ``dtype`` (models only:
    diffusers models take it as ``torch_dtype``, transformers models as ``dtype``; tokenizers none),
    straight onto ``device`` when given.

    Straight onto the device: the library builds the model on the meta device and assigns each
    checkpoint shard's tensors to ``device`` as it reads them (``device_map``; diffusers also
    needs ``low_cpu_mem_usage=True``, transformers always loads so), so the host holds about one
    shard at a time, not the whole model and then a copy on its way to the GPU: eight workers of
    a node loading a 40 GB transformer would otherwise need 320 GB of host RAM at once. The memory
    planner charges a shard per worker (memory/plan.py: LOAD_SHARD_BYTES). The tensors are the
    same ones the checkpoint holds, cast to ``dtype`` as before.

    Raises ``FileNotFoundError`` naming the component when ``path`` has no such subfolder,
    rather than the loaders' "no file named ... in directory <path>".
    """
    import os

    from diffusers import ModelMixin

    if not os.path.isdir(os.path.join(path, subfolder)):
        raise FileNotFoundError(
            f"model path '{path}' has no '{subfolder}' folder: the {component_cls.__name__} component "
            "is missing (expected a complete diffusers-format directory)"
        )
    if not issubclass(component_cls, torch.nn.Module):
        return component_cls.from_pretrained(path, subfolder=subfolder)
    placed = {} if device is None else {"device_map": str(torch.device(device))}
    if issubclass(component_cls, ModelMixin):
        if placed:
            placed["low_cpu_mem_usage"] = True
        if dtype is None:
            return component_cls.from_pretrained(path, subfolder=subfolder, **placed)
        return component_cls.from_pretrained(path, subfolder=subfolder, torch_dtype=dtype, **placed)
    if dtype is None:
        return component_cls.from_pretrained(path, subfolder=subfolder, **placed)
    return component_cls.from_pretrained(path, subfolder=subfolder, dtype=dtype, **placed)


def load_components(
    path: str,
    classes: dict[str, type | None],
    *,
    device: torch.device | str,
    dtype: torch.dtype,
    keep_fp32: tuple[str, ...] = (),
) -> dict[str, object]:
    """The components of the pipeline directory ``path``, as the adapter's ``__init__`` takes them:
    each ``{subfolder: class}`` of ``classes`` loaded with :func:`load_component` (in order), plus
    ``scheduler_config``.

    A ``None`` class is an absent optional component (its value is ``None``). Models are loaded
    in ``dtype`` (those named in ``keep_fp32`` in float32) straight onto ``device`` and put in
    eval mode; every model but the ``transformer`` is frozen (no grads). The transformer keeps
    ``requires_grad`` as loaded: the trainer decides what to train (full, LoRA, ...).
    """
    components: dict[str, object] = {}
    for name, component_cls in classes.items():
        if component_cls is None:
            components[name] = None
            continue
        is_model = issubclass(component_cls, torch.nn.Module)
        module_dtype = (torch.float32 if name in keep_fp32 else dtype) if is_model else None
        module = load_component(component_cls, path, name, module_dtype, device if is_model else None)
        if is_model:
            if name != "transformer":
                module.requires_grad_(False)
            module.to(device).eval()  # a no-op for what device_map placed; buffers made outside the checkpoint too
        components[name] = module
    components["scheduler_config"] = load_scheduler_config(path)
    return components


# ---------------------------------------------------------------------- schedule


def check_num_steps(num_steps: int) -> None:
    """Raise ``ValueError`` unless ``num_steps >= 1``."""
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")


def calculate_shift(
    image_seq_len: int,
    base_seq_len: int = 256,
    max_seq_len: int = 4096,
    base_shift: float = 0.5,
    max_shift: float = 1.15,
) -> float:
    """Resolution-dependent shift ``mu``: linear in the number of image tokens.

    Two points define the line: ``base_shift`` at ``base_seq_len`` tokens and ``max_shift`` at
    ``max_seq_len`` tokens (the same rule FluxPipeline and SD3 with dynamic shifting use).
    """
    slope = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    intercept = base_shift - slope * base_seq_len
    # Evaluated as slope * x + intercept, the pipeline's order, so float rounding matches too.
    return image_seq_len * slope + intercept


def config_shift(scheduler_config: dict, image_seq_len: int, *, max_shift: float = 1.15) -> float:
    """:func:`calculate_shift` with the line of ``scheduler_config`` (``base_image_seq_len``,
    ``max_image_seq_len``, ``base_shift``, ``max_shift``), the pipelines' defaults for missing keys
    (``max_shift``: 1.15 for FLUX / Qwen-Image, SD3's pipeline uses 1.16)."""
    return calculate_shift(
        image_seq_len,
        scheduler_config.get("base_image_seq_len", 256),
        scheduler_config.get("max_image_seq_len", 4096),
        scheduler_config.get("base_shift", 0.5),
        scheduler_config.get("max_shift", max_shift),
    )


def scheduler_sigmas(
    scheduler_config: dict, num_steps: int, *, sigmas: np.ndarray | None = None, mu: float | None = None
) -> torch.Tensor:
    """Run the scheduler's own ``set_timesteps`` and return its sigmas ``[num_steps + 1]`` (fp32, CPU).

    A fresh scheduler is built from the config every call: ``set_timesteps`` mutates the
    scheduler, and the adapter may be used from several threads. Going through the scheduler
    (rather than re-deriving the formula) keeps every option of a real model's config
    (shift_terminal, karras/exponential/beta sigmas, ...) behaving as in the pipeline.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler.from_config(scheduler_config)
    kwargs = {} if mu is None else {"mu": mu}
    if sigmas is not None:
        scheduler.set_timesteps(sigmas=sigmas, device="cpu", **kwargs)
    else:
        scheduler.set_timesteps(num_steps, device="cpu", **kwargs)
    return scheduler.sigmas.to(torch.float32)


# ---------------------------------------------------------------------- latents


def latent_hw(
    spec: SampleSpec, *, model: str, vae_scale_factor: int, patch_size: int, packed: bool = False
) -> tuple[int, int]:
    """Latent ``(h, w)`` of ``spec``'s pixel size; raises ``ValueError`` naming ``model`` unless
    both sides are multiples of ``vae_scale_factor * patch_size`` (``packed``: 2x2 token packing)."""
    multiple = vae_scale_factor * patch_size
    if spec.height % multiple or spec.width % multiple:
        why = "2 for packing" if packed else f"patch size {patch_size}"
        raise ValueError(
            f"{model} needs height and width divisible by {multiple} (VAE factor {vae_scale_factor} x {why}), "
            f"got {spec.height}x{spec.width}"
        )
    return spec.height // vae_scale_factor, spec.width // vae_scale_factor


def latent_frames(spec: SampleSpec, *, model: str, temporal_factor: int, patch_size_t: int) -> int:
    """Latent frames of a causal video VAE, ``(num_frames - 1) / t + 1`` (``t``: the VAE's
    ``temporal_factor``); raises ``ValueError`` naming ``model`` unless ``num_frames = t * k + 1``
    and the latent frames split into temporal patches of ``patch_size_t``."""
    t = temporal_factor
    if spec.num_frames < 1 or (spec.num_frames - 1) % t:
        raise ValueError(
            f"{model} needs num_frames = {t} * k + 1 (causal VAE, temporal factor {t}), got {spec.num_frames}"
        )
    frames = (spec.num_frames - 1) // t + 1
    if frames % patch_size_t:
        raise ValueError(f"{frames} latent frames are not divisible by the temporal patch {patch_size_t}")
    return frames


def randn_latents(shape: tuple[int, ...], generator: torch.Generator, device: torch.device | str) -> torch.Tensor:
    """fp32 noise of ``shape`` from ``generator``, drawn as the pipelines draw it (``randn_tensor``)."""
    from diffusers.utils.torch_utils import randn_tensor

    return randn_tensor(shape, generator=generator, device=device, dtype=torch.float32)


def pack_2x2(latents: torch.Tensor) -> torch.Tensor:
    """``[B, C, h, w]`` (or ``[B, 1, C, h, w]``) -> ``[B, (h/2)*(w/2), C*4]``: each 2x2 patch becomes one token."""
    b, c, h, w = latents.shape[0], latents.shape[-3], latents.shape[-2], latents.shape[-1]
    x = latents.reshape(b, c, h // 2, 2, w // 2, 2)
    x = x.permute(0, 2, 4, 1, 3, 5)  # [B, h/2, w/2, C, 2, 2]
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_2x2(latents: torch.Tensor, h: int, w: int, spec: SampleSpec) -> torch.Tensor:
    """Inverse of :func:`pack_2x2`: ``[B, L, C*4]`` -> ``[B, C, h, w]`` (``spec`` names the image in errors)."""
    b, length, packed_c = latents.shape
    if length != (h // 2) * (w // 2):
        raise ValueError(f"{length} latent tokens do not match a {spec.height}x{spec.width} image")
    x = latents.reshape(b, h // 2, w // 2, packed_c // 4, 2, 2)
    x = x.permute(0, 3, 1, 4, 2, 5)  # [B, C, h/2, 2, w/2, 2]
    return x.reshape(b, packed_c // 4, h, w)


# ---------------------------------------------------------------------- denoiser


def true_cfg(v_pos: torch.Tensor, v_neg: torch.Tensor, scale: float) -> torch.Tensor:
    """Classifier-free guidance ``v_neg + scale * (v_pos - v_neg)`` (the pipelines' order of operations)."""
    return v_neg + scale * (v_pos - v_neg)


def batch_sigma(sigma: torch.Tensor | float, batch: int, device: torch.device | str) -> torch.Tensor:
    """Sigma as a float32 ``[B]`` tensor; a python float, 0-d or ``[1]`` tensor is broadcast."""
    sigma = torch.as_tensor(sigma, dtype=torch.float32, device=device).reshape(-1)
    if sigma.numel() == 1 and batch != 1:
        sigma = sigma.expand(batch)
    if sigma.shape != (batch,):
        raise ValueError(f"sigma must have shape [{batch}] (one per sample), got {tuple(sigma.shape)}")
    return sigma


def expand_batch(x: torch.Tensor, batch: int) -> torch.Tensor:
    """Broadcast a batch-of-1 tensor (e.g. one encoded negative prompt) to ``batch`` rows."""
    if x.shape[0] == batch:
        return x
    if x.shape[0] == 1:
        return x.expand(batch, *x.shape[1:])
    raise ValueError(f"conditioning has batch {x.shape[0]}, expected 1 or {batch}")


# ---------------------------------------------------------------------- pixels


def unscale_latents(latents: torch.Tensor, vae_config) -> torch.Tensor:
    """Undo ``z_model = (z - shift_factor) * scaling_factor`` (FLUX / SD3 VAEs), in the latents' dtype."""
    shift = vae_config.shift_factor or 0.0
    return latents / vae_config.scaling_factor + shift


def unnormalize_latents(x: torch.Tensor, vae_config) -> torch.Tensor:
    """Undo the per-channel ``z_model = (z - mean) / std`` of Wan-style VAEs (Wan, Qwen-Image) on
    ``[B, C, F, h, w]`` latents, computed as the pipelines do (multiplying by ``1 / (1 / std)``)."""
    z_dim = vae_config.z_dim
    mean = torch.tensor(vae_config.latents_mean).view(1, z_dim, 1, 1, 1).to(x.device, x.dtype)
    inv_std = 1.0 / torch.tensor(vae_config.latents_std).view(1, z_dim, 1, 1, 1).to(x.device, x.dtype)
    return x / inv_std + mean


def to_unit_range(pixels: torch.Tensor) -> torch.Tensor:
    """VAE output in ~[-1, 1] -> fp32 in [0, 1]."""
    return (pixels.float() / 2 + 0.5).clamp(0, 1)


def pixels_to_uint8(pixels: torch.Tensor) -> torch.Tensor:
    """fp32 pixels in [0, 1] -> uint8 in [0, 255] (rounded, as PIL and the reward servers store
    them): what images and videos cross processes as (4x smaller than fp32)."""
    return (pixels.float().clamp(0, 1) * 255).round().to(torch.uint8)


def pixels_from_uint8(pixels: torch.Tensor) -> torch.Tensor:
    """uint8 pixels -> fp32 in [0, 1] (fp32 input is returned as it is)."""
    return pixels.float() / 255 if pixels.dtype == torch.uint8 else pixels
