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
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
from diffusers.utils.torch_utils import randn_tensor
from transformers import CLIPTextModelWithProjection, CLIPTokenizer, T5EncoderModel, T5TokenizerFast

from .base import (
    Conditioning,
    DiffusionAdapter,
    SampleSpec,
    batch_sigma,
    expand_batch,
    has_component,
    read_model_index,
    release_modules,
    require_text_encoders,
)
from .flux import calculate_shift, scheduler_sigmas

DEFAULT_MAX_SEQUENCE_LENGTH = 256  # T5 tokens (StableDiffusion3Pipeline.__call__ max_sequence_length)


class SD3Adapter(DiffusionAdapter):
    """SD3 / SD3.5 in diffusers format: CLIP-L + CLIP-G (+ optional T5) encoders, MMDiT, VAE."""

    arch = "sd3"

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
        self.transformer = transformer
        self.vae = vae
        self.text_encoder = text_encoder
        self.tokenizer = tokenizer
        self.text_encoder_2 = text_encoder_2
        self.tokenizer_2 = tokenizer_2
        # SD3 runs without T5 (the pipeline then feeds zeros in its place).
        self.text_encoder_3 = text_encoder_3
        self.tokenizer_3 = tokenizer_3
        self.scheduler_config = dict(scheduler_config)

        self.vae_scale_factor = 2 ** (len(vae.config.block_out_channels) - 1)
        self.latent_channels = transformer.config.in_channels
        self.patch_size = transformer.config.patch_size
        if vae.config.latent_channels != self.latent_channels:
            raise ValueError(
                f"VAE latent_channels={vae.config.latent_channels} does not match the transformer's "
                f"in_channels={transformer.config.in_channels}"
            )
        self.clip_max_length = int(tokenizer.model_max_length)
        if max_sequence_length is None:
            t5_limit = int(tokenizer_3.model_max_length) if tokenizer_3 is not None else DEFAULT_MAX_SEQUENCE_LENGTH
            max_sequence_length = min(DEFAULT_MAX_SEQUENCE_LENGTH, t5_limit)
        self.max_sequence_length = int(max_sequence_length)

    @classmethod
    def from_pretrained(
        cls,
        path: str,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        max_sequence_length: int | None = None,
    ) -> "SD3Adapter":
        """Load a StableDiffusion3Pipeline directory; ``text_encoder_3`` may be absent or null."""
        index = read_model_index(path)
        transformer = SD3Transformer2DModel.from_pretrained(path, subfolder="transformer", torch_dtype=dtype)
        vae = AutoencoderKL.from_pretrained(path, subfolder="vae", torch_dtype=dtype)
        text_encoder = CLIPTextModelWithProjection.from_pretrained(path, subfolder="text_encoder", dtype=dtype)
        text_encoder_2 = CLIPTextModelWithProjection.from_pretrained(path, subfolder="text_encoder_2", dtype=dtype)
        tokenizer = CLIPTokenizer.from_pretrained(path, subfolder="tokenizer")
        tokenizer_2 = CLIPTokenizer.from_pretrained(path, subfolder="tokenizer_2")
        text_encoder_3 = tokenizer_3 = None
        if has_component(index, "text_encoder_3"):
            text_encoder_3 = T5EncoderModel.from_pretrained(path, subfolder="text_encoder_3", dtype=dtype)
            tokenizer_3 = T5TokenizerFast.from_pretrained(path, subfolder="tokenizer_3")
        scheduler_config = FlowMatchEulerDiscreteScheduler.load_config(path, subfolder="scheduler")

        frozen = [m for m in (vae, text_encoder, text_encoder_2, text_encoder_3) if m is not None]
        for module in frozen:
            module.requires_grad_(False)
        for module in [transformer, *frozen]:
            module.to(device).eval()
        return cls(
            transformer=transformer,
            vae=vae,
            text_encoder=text_encoder,
            tokenizer=tokenizer,
            text_encoder_2=text_encoder_2,
            tokenizer_2=tokenizer_2,
            text_encoder_3=text_encoder_3,
            tokenizer_3=tokenizer_3,
            scheduler_config=scheduler_config,
            max_sequence_length=max_sequence_length,
        )

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

    def release_text_encoders(self) -> int:
        """Drop the text encoders and tokenizers (the prompt cache serves the embeddings from
        now on); returns the parameter bytes freed. ``encode_prompts`` raises afterwards."""
        names = ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2", "text_encoder_3", "tokenizer_3")
        return release_modules(self, names)

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> Conditioning:
        """``prompt_embeds`` [B, T_clip + T_t5, D_t5] and ``pooled_prompt_embeds`` [B, P_1 + P_2]."""
        require_text_encoders(self)
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
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
        multiple = self.vae_scale_factor * self.patch_size
        if spec.height % multiple or spec.width % multiple:
            raise ValueError(
                f"SD3 needs height and width divisible by {multiple} (VAE factor {self.vae_scale_factor} x "
                f"patch size {self.patch_size}), got {spec.height}x{spec.width}"
            )
        return spec.height // self.vae_scale_factor, spec.width // self.vae_scale_factor

    def prepare_latents(self, batch_size: int, spec: SampleSpec, generator: torch.Generator) -> torch.Tensor:
        """Noise ``[B, C, h, w]`` fp32, drawn exactly as the pipeline draws it."""
        h, w = self.latent_size(spec)
        return randn_tensor(
            (batch_size, self.latent_channels, h, w), generator=generator, device=self.device, dtype=torch.float32
        )

    # ------------------------------------------------------------------ schedule

    def sigmas(self, num_steps: int, spec: SampleSpec) -> torch.Tensor:
        """The pipeline's schedule: the scheduler's own ``set_timesteps(num_steps)`` (fixed
        ``shift``, or a resolution-dependent ``mu`` when the config asks for dynamic shifting),
        with the final 0 the scheduler appends."""
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        config = self.scheduler_config
        mu = None
        if config.get("use_dynamic_shifting", False):
            h, w = self.latent_size(spec)
            mu = calculate_shift(
                (h // self.patch_size) * (w // self.patch_size),
                config.get("base_image_seq_len", 256),
                config.get("max_image_seq_len", 4096),
                config.get("base_shift", 0.5),
                config.get("max_shift", 1.16),
            )
        return scheduler_sigmas(config, num_steps, mu=mu)

    # ------------------------------------------------------------------ denoiser

    def _transformer_forward(
        self,
        latents: torch.Tensor,  # [B, C, h, w]
        sigma: torch.Tensor,  # [B]
        prompt_embeds: torch.Tensor,  # [B, T, D]
        pooled: torch.Tensor,  # [B, P]
    ) -> torch.Tensor:
        dtype = self.transformer.dtype
        out = self.transformer(
            hidden_states=latents.to(dtype),
            # SD3 takes the scheduler's timestep t = 1000 * sigma (kept in fp32, as the pipeline does).
            timestep=sigma * self.scheduler_config.get("num_train_timesteps", 1000),
            encoder_hidden_states=prompt_embeds.to(device=latents.device, dtype=dtype),
            pooled_projections=pooled.to(device=latents.device, dtype=dtype),
            return_dict=False,
        )[0]
        return out.float()

    def predict_velocity(
        self,
        latents: torch.Tensor,
        sigma: torch.Tensor,
        cond: Conditioning,
        spec: SampleSpec,
        negative_cond: Conditioning | None = None,
    ) -> torch.Tensor:
        """Velocity ``[B, C, h, w]`` fp32 at noise level ``sigma`` ``[B]``.

        Standard SD3 CFG when ``spec.guidance_scale > 1`` and ``negative_cond`` is given
        (usually the encoded empty prompt); one forward over ``[uncond; cond]`` like the pipeline.
        """
        batch = latents.shape[0]
        sigma = batch_sigma(sigma, batch, latents.device)
        embeds, pooled = cond["prompt_embeds"], cond["pooled_prompt_embeds"]
        if not (spec.guidance_scale > 1.0 and negative_cond is not None):
            return self._transformer_forward(latents, sigma, embeds, pooled)

        neg_embeds = expand_batch(negative_cond["prompt_embeds"], batch).to(embeds)
        neg_pooled = expand_batch(negative_cond["pooled_prompt_embeds"], batch).to(pooled)
        both = self._transformer_forward(
            torch.cat([latents, latents]),
            torch.cat([sigma, sigma]),
            torch.cat([neg_embeds, embeds]),
            torch.cat([neg_pooled, pooled]),
        )
        v_neg, v_pos = both.chunk(2)
        return v_neg + spec.guidance_scale * (v_pos - v_neg)

    # ------------------------------------------------------------------ pixels

    def decode(self, latents: torch.Tensor, spec: SampleSpec) -> torch.Tensor:
        """Latents ``[B, C, h, w]`` -> images ``[B, 3, H, W]`` in [0, 1] (fp32). Not wrapped in
        no_grad: callers decide."""
        shift = self.vae.config.shift_factor or 0.0
        x = latents / self.vae.config.scaling_factor + shift
        image = self.vae.decode(x.to(self.vae.dtype), return_dict=False)[0]  # [B, 3, H, W] in ~[-1, 1]
        return (image.float() / 2 + 0.5).clamp(0, 1)
