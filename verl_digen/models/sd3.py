"""Stable Diffusion 3 / 3.5 adapter: the components of diffusers' ``StableDiffusion3Pipeline``.

Model space is the VAE latent itself, ``[B, C, h, w]`` (the transformer patchifies inside).
Conditioning follows the pipeline: the two CLIP encoders' penultimate hidden states are
concatenated on the feature axis, zero-padded to the T5 width and stacked with the T5 tokens
on the sequence axis; their projected pooled outputs are concatenated.

Everything mirrors ``StableDiffusion3Pipeline.__call__`` (noise, schedule, timestep scale,
CFG, decoding), so that a rollout with this adapter reproduces the pipeline's images.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from diffusers import AutoencoderKL, SD3Transformer2DModel
from transformers import CLIPTextModelWithProjection, CLIPTokenizer, T5EncoderModel, T5TokenizerFast

from .base import (
    Conditioning,
    DiffusionAdapter,
    SampleSpec,
    SizeRules,
    check_num_steps,
    config_shift,
    has_component,
    latent_hw,
    prompts_to_encode,
    randn_latents,
    resolve_max_sequence_length,
    scheduler_sigmas,
    to_unit_range,
    unscale_latents,
)

DEFAULT_MAX_SEQUENCE_LENGTH = 256  # T5 tokens (StableDiffusion3Pipeline.__call__ max_sequence_length)


class SD3Adapter(DiffusionAdapter):
    """SD3 / SD3.5 in diffusers format: CLIP-L + CLIP-G (+ optional T5) encoders, MMDiT, VAE."""

    arch = "sd3"
    length_tokenizer = "tokenizer_3"  # T5 (the CLIPs read fixed 77-token windows)
    # StableDiffusion3Pipeline's components, as from_pretrained loads them (T5 optional).
    component_classes = {
        "transformer": SD3Transformer2DModel,
        "vae": AutoencoderKL,
        "text_encoder": CLIPTextModelWithProjection,  # CLIP-L
        "text_encoder_2": CLIPTextModelWithProjection,  # CLIP-G
        "tokenizer": CLIPTokenizer,
        "tokenizer_2": CLIPTokenizer,
        "text_encoder_3": T5EncoderModel,
        "tokenizer_3": T5TokenizerFast,
    }
    text_encoder_names = ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2", "text_encoder_3", "tokenizer_3")
    # Standard SD3 CFG: one forward over [uncond; cond] like the pipeline, through
    # _transformer_forward(latents, sigma, embeds, pooled, spec).
    conditioning_keys = ("prompt_embeds", "pooled_prompt_embeds")
    cfg_uncond_first = True

    @classmethod
    def size_rules(cls, vae_config, transformer_config) -> SizeRules:
        most = transformer_config.get("pos_embed_max_size")
        return SizeRules("SD3", spatial=2 ** (len(vae_config["block_out_channels"]) - 1),
                         patch=int(transformer_config["patch_size"]), max_patches=None if most is None else int(most))

    def __init__(
        self,
        *,
        transformer: SD3Transformer2DModel,
        vae: AutoencoderKL,
        text_encoder: CLIPTextModelWithProjection,
        tokenizer: CLIPTokenizer,
        text_encoder_2: CLIPTextModelWithProjection,
        tokenizer_2: CLIPTokenizer,
        text_encoder_3: T5EncoderModel | None,
        tokenizer_3: T5TokenizerFast | None,
        scheduler_config: dict,
        max_sequence_length: int | None = None,
    ) -> None:
        self.register_modules(transformer=transformer, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer)
        self.register_modules(text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2)
        # SD3 runs without T5 (the pipeline then feeds zeros in its place).
        self.register_modules(text_encoder_3=text_encoder_3, tokenizer_3=tokenizer_3)
        self.scheduler_config = dict(scheduler_config)

        rules = self.size_rules(vae.config, transformer.config)
        self.vae_scale_factor = rules.spatial
        self.latent_channels = transformer.config.in_channels
        self.patch_size = rules.patch
        if vae.config.latent_channels != self.latent_channels:
            raise ValueError(
                f"VAE latent_channels={vae.config.latent_channels} does not match the transformer's "
                f"in_channels={transformer.config.in_channels}"
            )
        self.clip_max_length = int(tokenizer.model_max_length)
        limit = int(tokenizer_3.model_max_length) if tokenizer_3 is not None else None
        self.max_sequence_length = resolve_max_sequence_length(max_sequence_length, DEFAULT_MAX_SEQUENCE_LENGTH, limit)

    @classmethod
    def _components_to_load(cls, model_index: dict) -> dict[str, type | None]:
        """All of ``component_classes``, but T5 only when the directory has it (SD3 runs without:
        ``text_encoder_3`` absent or null in ``model_index.json``)."""
        classes = dict(cls.component_classes)
        if not has_component(model_index, "text_encoder_3"):
            classes.update(text_encoder_3=None, tokenizer_3=None)
        return classes

    # ------------------------------------------------------------------ prompts

    def _clip_embeds(
        self, encoder: CLIPTextModelWithProjection, tokenizer: CLIPTokenizer, prompts: list[str]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ids = tokenizer(
            prompts, padding="max_length", max_length=self.clip_max_length, truncation=True, return_tensors="pt"
        ).input_ids
        out = encoder(ids.to(encoder.device), output_hidden_states=True)
        # SD3 conditions on the penultimate layer (clip_skip=None in the pipeline) and the
        # projected pooled vector.
        return out.hidden_states[-2], out.text_embeds  # [B, 77, D_i], [B, P_i]

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> Conditioning:
        """``prompt_embeds`` [B, T_clip + T_t5, D_t5] and ``pooled_prompt_embeds`` [B, P_1 + P_2]."""
        prompts = prompts_to_encode(self, prompts)
        hidden_1, pooled_1 = self._clip_embeds(self.text_encoder, self.tokenizer, prompts)
        hidden_2, pooled_2 = self._clip_embeds(self.text_encoder_2, self.tokenizer_2, prompts)
        clip_embeds = torch.cat([hidden_1, hidden_2.to(hidden_1.device)], dim=-1)  # [B, 77, D_1 + D_2]

        if self.text_encoder_3 is not None:
            t5_ids = self.tokenizer_3(
                prompts,
                padding="max_length",
                max_length=self.max_sequence_length,
                truncation=True,
                add_special_tokens=True,
                return_tensors="pt",
            ).input_ids
            t5_embeds = self.text_encoder_3(t5_ids.to(self.text_encoder_3.device))[0]  # [B, T_t5, D_t5]
        else:
            # Without T5 the pipeline feeds zeros of the transformer's text width.
            t5_embeds = torch.zeros(
                len(prompts),
                self.max_sequence_length,
                self.transformer.config.joint_attention_dim,
                device=clip_embeds.device,
                dtype=clip_embeds.dtype,
            )
        t5_embeds = t5_embeds.to(clip_embeds.device)
        # Zero-pad the CLIP features up to the T5 width so both can share one token sequence.
        clip_embeds = F.pad(clip_embeds, (0, t5_embeds.shape[-1] - clip_embeds.shape[-1]))
        prompt_embeds = torch.cat([clip_embeds, t5_embeds.to(clip_embeds.dtype)], dim=-2)
        pooled = torch.cat([pooled_1, pooled_2.to(pooled_1.device)], dim=-1)
        return {
            "prompt_embeds": prompt_embeds.to(self.device),  # [B, T, D]
            "pooled_prompt_embeds": pooled.to(self.device),  # [B, P]
        }

    # ------------------------------------------------------------------ latents

    def latent_size(self, spec: SampleSpec) -> tuple[int, int]:
        """Latent height and width ``(h, w)`` for a pixel size; both multiples of the patch size."""
        return latent_hw(spec, model="SD3", vae_scale_factor=self.vae_scale_factor, patch_size=self.patch_size)

    def prepare_latents(self, batch_size: int, spec: SampleSpec, generator: torch.Generator) -> torch.Tensor:
        """Noise ``[B, C, h, w]`` fp32, drawn exactly as the pipeline draws it."""
        return randn_latents((batch_size, self.latent_channels, *self.latent_size(spec)), generator, self.device)

    # ------------------------------------------------------------------ schedule

    def sigmas(self, num_steps: int, spec: SampleSpec) -> torch.Tensor:
        """The pipeline's schedule: the scheduler's own ``set_timesteps(num_steps)`` (fixed
        ``shift``, or a resolution-dependent ``mu`` when the config asks for dynamic shifting),
        with the final 0 the scheduler appends."""
        check_num_steps(num_steps)
        config = self.scheduler_config
        mu = None
        if config.get("use_dynamic_shifting", False):
            h, w = self.latent_size(spec)
            mu = config_shift(config, (h // self.patch_size) * (w // self.patch_size), max_shift=1.16)
        return scheduler_sigmas(config, num_steps, mu=mu)

    # ------------------------------------------------------------------ denoiser

    def _transformer_forward(
        self,
        latents: torch.Tensor,  # [B, C, h, w]
        sigma: torch.Tensor,  # [B]
        prompt_embeds: torch.Tensor,  # [B, T, D]
        pooled: torch.Tensor,  # [B, P]
        spec: SampleSpec,  # unused: SD3 has no guidance embedding
    ) -> torch.Tensor:
        """Velocity ``[B, C, h, w]`` fp32 (sigma broadcasting and CFG: ``predict_velocity``)."""
        dtype = self.compute_dtype
        out = self.transformer(
            hidden_states=latents.to(dtype),
            # SD3 takes the scheduler's timestep t = 1000 * sigma (kept in fp32, as the pipeline does).
            timestep=sigma * self.scheduler_config.get("num_train_timesteps", 1000),
            encoder_hidden_states=prompt_embeds.to(device=latents.device, dtype=dtype),
            pooled_projections=pooled.to(device=latents.device, dtype=dtype),
            return_dict=False,
        )[0]
        return out.float()

    # ------------------------------------------------------------------ pixels

    def decode(self, latents: torch.Tensor, spec: SampleSpec) -> torch.Tensor:
        """Latents ``[B, C, h, w]`` -> images ``[B, 3, H, W]`` in [0, 1] (fp32). Not wrapped in
        no_grad: callers decide."""
        x = unscale_latents(latents, self.vae.config)  # z = z_model / scale + shift
        image = self.vae.decode(x.to(self.vae.dtype), return_dict=False)[0]  # [B, 3, H, W] in ~[-1, 1]
        return to_unit_range(image)
