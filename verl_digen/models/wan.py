"""Wan2.1 text-to-video adapter: the components of diffusers' ``WanPipeline`` behind :class:`DiffusionAdapter`.

Model space is the video VAE latent itself, ``[B, C, F, h, w]`` with ``F = (frames - 1) / 4 + 1``
latent frames for the real VAE (causal: the first frame is encoded on its own); the transformer
patchifies inside. Prompts go through UMT5; the embeddings of padding tokens are zeroed (not
masked: Wan attends to the zero rows, as the pipeline feeds them), so conditioning is a single
``prompt_embeds`` ``[B, T, D]`` tensor of fixed length.

Guidance is ordinary CFG against a negative prompt: ``v_neg + s * (v_pos - v_neg)``.

The schedule is the one the pipeline's scheduler computes: Wan2.1 checkpoints ship a UniPC
scheduler with flow sigmas (``flow_shift``; the tiny model ships the same config); the RL loop
steps those sigmas with its own Euler / SDE steps, and feeds the transformer the scheduler's
integer timesteps. UniPC's first-order predictor without corrector *is* the Euler step, so with
``solver_order=1`` and the corrector disabled the pipeline reproduces an ODE rollout; with a
``FlowMatchEulerDiscreteScheduler`` config the pipeline's loop is the Euler loop as it stands.
"""

from __future__ import annotations

import torch
from diffusers import AutoencoderKLWan, WanTransformer3DModel
from diffusers.pipelines.wan.pipeline_wan import prompt_clean
from transformers import AutoTokenizer, UMT5EncoderModel

from .base import (
    Conditioning,
    DiffusionAdapter,
    SampleSpec,
    SizeRules,
    check_num_steps,
    has_component,
    latent_frames,
    latent_hw,
    prompts_to_encode,
    randn_latents,
    resolve_max_sequence_length,
    to_unit_range,
    unnormalize_latents,
)

DEFAULT_MAX_SEQUENCE_LENGTH = 512  # UMT5 tokens (WanPipeline.__call__ max_sequence_length)


def flow_sigmas(scheduler_config: dict, num_steps: int) -> torch.Tensor:
    """The sigmas a video pipeline's scheduler uses for ``set_timesteps(num_steps)``, as
    ``[num_steps + 1]`` fp32 on CPU ending in 0.

    The scheduler class named in the config is built and asked (so shift, flow_shift,
    shift_terminal, karras/exponential/beta options behave as in the pipeline). Supported:
    ``FlowMatchEulerDiscreteScheduler`` and the flow-sigma multistep schedulers Wan ships
    (``UniPCMultistepScheduler`` / ``DPMSolverMultistepScheduler`` with ``use_flow_sigmas``).
    """
    import diffusers

    name = scheduler_config.get("_class_name", "FlowMatchEulerDiscreteScheduler")
    if name != "FlowMatchEulerDiscreteScheduler" and not scheduler_config.get("use_flow_sigmas", False):
        raise ValueError(
            f"scheduler {name} without use_flow_sigmas is not a flow-matching schedule; "
            "expected FlowMatchEulerDiscreteScheduler or a multistep scheduler with use_flow_sigmas=True"
        )
    scheduler_cls = getattr(diffusers, name, None)
    if scheduler_cls is None:
        raise ValueError(f"unknown scheduler class '{name}' in the scheduler config")
    scheduler = scheduler_cls.from_config(scheduler_config)
    scheduler.set_timesteps(num_steps, device="cpu")
    sigmas = torch.as_tensor(scheduler.sigmas, dtype=torch.float32).cpu()
    if sigmas.shape != (num_steps + 1,):
        raise ValueError(f"scheduler {name} returned {tuple(sigmas.shape)} sigmas for {num_steps} steps")
    if sigmas[-1] != 0:
        # final_sigmas_type="sigma_min": the RL loop always ends on clean latents.
        sigmas[-1] = 0.0
    return sigmas


class WanAdapter(DiffusionAdapter):
    """Wan2.1 text-to-video in diffusers format: UMT5 text encoder, WanTransformer3DModel, Wan VAE."""

    arch = "wan"
    # WanPipeline's components, as from_pretrained loads them.
    component_classes = {
        "transformer": WanTransformer3DModel,
        "vae": AutoencoderKLWan,
        "text_encoder": UMT5EncoderModel,
        "tokenizer": AutoTokenizer,
    }
    # The Wan VAE is usually kept in fp32 (the pipeline examples load it so): decode quality
    # suffers in bf16, and it only runs once per video.
    fp32_components = ("vae",)
    text_encoder_names = ("text_encoder", "tokenizer")
    # CFG batches [cond; uncond] through _transformer_forward(latents, sigma, embeds, spec).
    conditioning_keys = ("prompt_embeds",)

    @classmethod
    def size_rules(cls, vae_config, transformer_config) -> SizeRules:
        patch_t, patch_h, _ = transformer_config["patch_size"]
        return SizeRules("Wan", spatial=int(vae_config["scale_factor_spatial"]), patch=int(patch_h),
                         temporal=int(vae_config["scale_factor_temporal"]), patch_t=int(patch_t))

    def __init__(
        self,
        *,
        transformer: WanTransformer3DModel,
        vae: AutoencoderKLWan,
        text_encoder: UMT5EncoderModel,
        tokenizer,
        scheduler_config: dict,
        max_sequence_length: int | None = None,
        expand_timesteps: bool = False,
    ) -> None:
        self.register_modules(transformer=transformer, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer)
        self.scheduler_config = dict(scheduler_config)
        # Multistep flow schedulers (Wan2.1's UniPC) hand the transformer integer timesteps,
        # int64(sigma * N), truncated; FlowMatchEuler hands it sigma * N as is. Feeding what the
        # pipeline feeds keeps the velocity the pretrained model was sampled with.
        scheduler_name = self.scheduler_config.get("_class_name", "FlowMatchEulerDiscreteScheduler")
        self.integer_timesteps = scheduler_name != "FlowMatchEulerDiscreteScheduler"
        # Wan2.2 TI2V-5B takes one timestep per latent token (all equal for text-to-video).
        self.expand_timesteps = bool(expand_timesteps)

        rules = self.size_rules(vae.config, transformer.config)
        self.vae_scale_factor_temporal = rules.temporal
        self.vae_scale_factor_spatial = rules.spatial
        self.latent_channels = transformer.config.in_channels
        self.patch_size = tuple(transformer.config.patch_size)  # (t, h, w)
        if vae.config.z_dim != self.latent_channels:
            raise ValueError(
                f"VAE z_dim={vae.config.z_dim} does not match the transformer's "
                f"in_channels={transformer.config.in_channels}"
            )
        limit = int(tokenizer.model_max_length)
        self.max_sequence_length = resolve_max_sequence_length(max_sequence_length, DEFAULT_MAX_SEQUENCE_LENGTH, limit)

    @classmethod
    def _init_options(cls, path: str, model_index: dict) -> dict:
        """``expand_timesteps`` (Wan2.2 TI2V) from ``model_index.json``; Wan2.2's two-expert layout
        (``transformer_2``) is refused."""
        if has_component(model_index, "transformer_2"):
            raise ValueError(
                f"model path '{path}' holds a two-expert Wan2.2 pipeline (transformer_2); only "
                "single-transformer Wan pipelines (Wan2.1, Wan2.2 TI2V) are supported"
            )
        return {"expand_timesteps": bool(model_index.get("expand_timesteps", False))}

    # ------------------------------------------------------------------ prompts

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> Conditioning:
        """``prompt_embeds`` [B, T, D]: UMT5 last hidden state, rows past each prompt's length zeroed."""
        prompts = prompts_to_encode(self, prompts)
        prompts = [prompt_clean(p) for p in prompts]  # html-unescape, whitespace (and ftfy if installed)
        tokens = self.tokenizer(
            prompts,
            padding="max_length",
            max_length=self.max_sequence_length,
            truncation=True,
            add_special_tokens=True,
            return_attention_mask=True,
            return_tensors="pt",
        )
        ids, mask = tokens.input_ids, tokens.attention_mask
        device = self.text_encoder.device
        hidden = self.text_encoder(ids.to(device), mask.to(device)).last_hidden_state  # [B, T, D]
        # Zero the padding rows (the pipeline cuts them and pads back with zeros).
        hidden = hidden.masked_fill(~mask.to(device).gt(0).unsqueeze(-1), 0.0)
        return {"prompt_embeds": hidden.to(self.device)}  # [B, T, D]

    # ------------------------------------------------------------------ latents

    def latent_shape(self, spec: SampleSpec) -> tuple[int, int, int]:
        """Latent ``(frames, h, w)`` for a video size; raises for sizes the model cannot take."""
        patch_t, patch_h, _ = self.patch_size
        h, w = latent_hw(spec, model="Wan", vae_scale_factor=self.vae_scale_factor_spatial, patch_size=patch_h)
        frames = latent_frames(spec, model="Wan", temporal_factor=self.vae_scale_factor_temporal, patch_size_t=patch_t)
        return frames, h, w

    def prepare_latents(self, batch_size: int, spec: SampleSpec, generator: torch.Generator) -> torch.Tensor:
        """Noise ``[B, C, F, h, w]`` fp32, drawn exactly as the pipeline draws it."""
        return randn_latents((batch_size, self.latent_channels, *self.latent_shape(spec)), generator, self.device)

    # ------------------------------------------------------------------ schedule

    def sigmas(self, num_steps: int, spec: SampleSpec) -> torch.Tensor:
        """The pipeline's ``scheduler.set_timesteps(num_steps)`` sigmas (fixed shift), then 0 (on CPU)."""
        check_num_steps(num_steps)
        self.latent_shape(spec)  # validate the size here too
        return flow_sigmas(self.scheduler_config, num_steps)

    # ------------------------------------------------------------------ denoiser

    def _timestep(self, sigma: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        t = sigma * self.scheduler_config.get("num_train_timesteps", 1000)  # [B], fp32 as in the pipeline
        if self.integer_timesteps:
            # The scheduler truncates its float64 sigmas * N; from the float32 sigma this differs
            # only when sigma * N lies within ~1e-4 of an integer (then by one timestep).
            t = torch.floor(t)
        if not self.expand_timesteps:
            return t
        # Wan2.2 TI2V: one timestep per latent token, [B, F * h/p * w/p].
        _, _, frames, h, w = latents.shape
        tokens = (frames // self.patch_size[0]) * (h // self.patch_size[1]) * (w // self.patch_size[2])
        return t[:, None].expand(-1, tokens)

    def _transformer_forward(
        self,
        latents: torch.Tensor,  # [B, C, F, h, w]
        sigma: torch.Tensor,  # [B]
        prompt_embeds: torch.Tensor,  # [B, T, D]
        spec: SampleSpec,  # unused: Wan has no guidance embedding
    ) -> torch.Tensor:
        """Velocity ``[B, C, F, h, w]`` fp32 (sigma broadcasting and CFG: ``predict_velocity``)."""
        dtype = self.compute_dtype
        out = self.transformer(
            hidden_states=latents.to(dtype),
            timestep=self._timestep(sigma, latents),
            encoder_hidden_states=prompt_embeds.to(device=latents.device, dtype=dtype),
            return_dict=False,
        )[0]
        return out.float()

    # ------------------------------------------------------------------ pixels

    def decode(self, latents: torch.Tensor, spec: SampleSpec) -> torch.Tensor:
        """Latents ``[B, C, F, h, w]`` -> videos ``[B, 3, frames, H, W]`` in [0, 1] (fp32). Not
        wrapped in no_grad: callers decide."""
        x = unnormalize_latents(latents.to(self.vae.dtype), self.vae.config)  # z = z_model * std + mean
        video = self.vae.decode(x, return_dict=False)[0]  # [B, 3, frames, H, W] in ~[-1, 1]
        return to_unit_range(video)
