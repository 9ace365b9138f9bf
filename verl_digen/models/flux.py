"""FLUX.1 adapter: the components of diffusers' ``FluxPipeline`` behind :class:`DiffusionAdapter`.

Model space is the *packed* token sequence the transformer consumes: the VAE latent
``[B, C, h, w]`` is cut into 2x2 patches and flattened to ``[B, (h/2)*(w/2), C*4]``. The RL loop
only ever sees packed latents; :meth:`FluxAdapter.decode` unpacks them.

Everything here mirrors what ``FluxPipeline.__call__`` does (noise drawing order, the shifted
sigma schedule, the transformer call, decoding), so that a rollout with this adapter and the
pipeline produce the same images from the same generator.
"""

from __future__ import annotations

import numpy as np
import torch
from diffusers import AutoencoderKL, FluxTransformer2DModel
from transformers import CLIPTextModel, CLIPTokenizer, T5EncoderModel, T5TokenizerFast

from .base import (
    Conditioning,
    DiffusionAdapter,
    SampleSpec,
    SizeRules,
    check_num_steps,
    config_shift,
    latent_hw,
    pack_2x2,
    prompts_to_encode,
    randn_latents,
    resolve_max_sequence_length,
    scheduler_sigmas,
    to_unit_range,
    unpack_2x2,
    unscale_latents,
)

# FluxPipeline's defaults, used when a spec or a directory does not say otherwise.
DEFAULT_MAX_SEQUENCE_LENGTH = 512  # T5 tokens (FluxPipeline.__call__ max_sequence_length)
DEFAULT_DISTILLED_GUIDANCE = 3.5  # FluxPipeline.__call__ guidance_scale (guidance-distilled models)


class FluxAdapter(DiffusionAdapter):
    """FLUX.1 (dev / schnell / fine-tunes) in diffusers format: CLIP-L + T5 text encoders, MMDiT, VAE."""

    arch = "flux"
    length_tokenizer = "tokenizer_2"  # T5 (CLIP reads a fixed 77-token window)
    # FluxPipeline's components, as from_pretrained loads them.
    component_classes = {
        "transformer": FluxTransformer2DModel,
        "vae": AutoencoderKL,
        "text_encoder": CLIPTextModel,  # CLIP-L: pooled vector only
        "text_encoder_2": T5EncoderModel,  # T5-XXL: the token sequence
        "tokenizer": CLIPTokenizer,
        "tokenizer_2": T5TokenizerFast,
    }
    text_encoder_names = ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2")
    # CFG batches [cond; uncond] through _transformer_forward(latents, sigma, embeds, pooled, spec).
    conditioning_keys = ("prompt_embeds", "pooled_prompt_embeds")

    @classmethod
    def size_rules(cls, vae_config, transformer_config) -> SizeRules:
        return SizeRules("FLUX", spatial=2 ** (len(vae_config["block_out_channels"]) - 1), patch=2, packed=True)

    def __init__(
        self,
        *,
        transformer: FluxTransformer2DModel,
        vae: AutoencoderKL,
        text_encoder: CLIPTextModel,
        tokenizer: CLIPTokenizer,
        text_encoder_2: T5EncoderModel,
        tokenizer_2: T5TokenizerFast,
        scheduler_config: dict,
        max_sequence_length: int | None = None,
    ) -> None:
        self.register_modules(transformer=transformer, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer)
        self.register_modules(text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2)
        self.scheduler_config = dict(scheduler_config)

        # Every VAE block but the last downsamples 2x (8x for the real FLUX VAE); packing then
        # groups 2x2 latent pixels into one token.
        self.vae_scale_factor = self.size_rules(vae.config, transformer.config).spatial
        self.latent_channels = transformer.config.in_channels // 4
        if vae.config.latent_channels != self.latent_channels:
            raise ValueError(
                f"VAE latent_channels={vae.config.latent_channels} does not match the transformer's "
                f"in_channels={transformer.config.in_channels} (FLUX expects in_channels = 4 * latent_channels)"
            )
        # CLIP reads a fixed-length window (77 for real models); T5 reads max_sequence_length
        # tokens (FluxPipeline: 512; FLUX.1-schnell users often pass 256), capped by what its
        # tokenizer was built for (tiny models use short prompts).
        self.clip_max_length = int(tokenizer.model_max_length)
        self.max_sequence_length = resolve_max_sequence_length(
            max_sequence_length, DEFAULT_MAX_SEQUENCE_LENGTH, int(tokenizer_2.model_max_length)
        )

    # ------------------------------------------------------------------ prompts

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> Conditioning:
        """``prompt_embeds`` [B, T, D] from T5 and ``pooled_prompt_embeds`` [B, D_clip] from CLIP."""
        prompts = prompts_to_encode(self, prompts)
        # CLIP: only the pooled (end-of-text) vector is used, as a global conditioning.
        clip_ids = self.tokenizer(
            prompts, padding="max_length", max_length=self.clip_max_length, truncation=True, return_tensors="pt"
        ).input_ids
        pooled = self.text_encoder(clip_ids.to(self.text_encoder.device), output_hidden_states=False).pooler_output
        # T5: the per-token sequence the transformer attends to, padded to a fixed length so that
        # every prompt (and the negative prompt) has the same shape and can be batched.
        t5_ids = self.tokenizer_2(
            prompts, padding="max_length", max_length=self.max_sequence_length, truncation=True, return_tensors="pt"
        ).input_ids
        prompt_embeds = self.text_encoder_2(t5_ids.to(self.text_encoder_2.device), output_hidden_states=False)[0]
        return {
            "prompt_embeds": prompt_embeds.to(self.device),  # [B, T, D]
            "pooled_prompt_embeds": pooled.to(self.device),  # [B, D_clip]
        }

    # ------------------------------------------------------------------ latents

    def latent_size(self, spec: SampleSpec) -> tuple[int, int]:
        """Unpacked latent height and width ``(h, w)`` for a pixel size; both even (2x2 packing)."""
        return latent_hw(spec, model="FLUX", vae_scale_factor=self.vae_scale_factor, patch_size=2, packed=True)

    def pack_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """``[B, C, h, w]`` -> ``[B, (h/2)*(w/2), C*4]``: each 2x2 patch becomes one token."""
        return pack_2x2(latents)

    def unpack_latents(self, latents: torch.Tensor, spec: SampleSpec) -> torch.Tensor:
        """Inverse of :meth:`pack_latents`: ``[B, L, C*4]`` -> ``[B, C, h, w]``."""
        return unpack_2x2(latents, *self.latent_size(spec), spec)

    def prepare_latents(self, batch_size: int, spec: SampleSpec, generator: torch.Generator) -> torch.Tensor:
        """Packed noise ``[B, L, C*4]`` fp32. Drawn as ``[B, C, h, w]`` then packed, like the pipeline,
        so the same generator gives FluxPipeline's starting noise."""
        noise = randn_latents((batch_size, self.latent_channels, *self.latent_size(spec)), generator, self.device)
        return self.pack_latents(noise)  # [B, C, h, w] -> [B, L, C*4]

    def image_ids(self, spec: SampleSpec) -> torch.Tensor:
        """RoPE positions of the image tokens ``[L, 3]``: (0, row, col) per 2x2 patch."""
        h, w = self.latent_size(spec)
        # Made on the device: built on the host, the copy in would be a host sync at every call.
        rows = torch.arange(h // 2, dtype=torch.float32, device=self.device)[:, None].expand(h // 2, w // 2)
        cols = torch.arange(w // 2, dtype=torch.float32, device=self.device)[None, :].expand(h // 2, w // 2)
        ids = torch.stack([torch.zeros_like(rows), rows, cols], dim=-1)  # [h/2, w/2, 3]
        return ids.reshape(-1, 3)

    # ------------------------------------------------------------------ schedule

    def sigmas(self, num_steps: int, spec: SampleSpec) -> torch.Tensor:
        """FluxPipeline's schedule: ``linspace(1, 1/N, N)`` shifted by ``mu(image tokens)``, then 0 (on CPU)."""
        check_num_steps(num_steps)
        h, w = self.latent_size(spec)
        config = self.scheduler_config
        mu = config_shift(config, (h // 2) * (w // 2))
        base = np.linspace(1.0, 1.0 / num_steps, num_steps)
        if config.get("use_flow_sigmas", False):
            base = None  # the scheduler derives its own flow sigmas (as in FluxPipeline)
        # The pipeline passes mu whatever the config says; the scheduler ignores it unless
        # use_dynamic_shifting is set (FLUX.1-schnell uses a fixed shift instead).
        return scheduler_sigmas(config, num_steps, sigmas=base, mu=mu)

    # ------------------------------------------------------------------ denoiser

    def _transformer_forward(
        self,
        latents: torch.Tensor,  # [B, L, C*4]
        sigma: torch.Tensor,  # [B]
        prompt_embeds: torch.Tensor,  # [B, T, D]
        pooled: torch.Tensor,  # [B, D_clip]
        spec: SampleSpec,
    ) -> torch.Tensor:
        """Velocity ``[B, L, C*4]`` fp32 (sigma broadcasting and true CFG: ``predict_velocity``)."""
        dtype = self.compute_dtype
        guidance = None
        if self.transformer.config.guidance_embeds:
            # Guidance-distilled models (FLUX.1-dev) take the guidance scale as an input embedding.
            scale = DEFAULT_DISTILLED_GUIDANCE if spec.distilled_guidance is None else spec.distilled_guidance
            guidance = torch.full((latents.shape[0],), float(scale), device=latents.device, dtype=torch.float32)
        text_ids = torch.zeros(prompt_embeds.shape[1], 3, device=latents.device, dtype=torch.float32)
        out = self.transformer(
            hidden_states=latents.to(dtype),
            # FluxPipeline passes t/1000 with t = 1000*sigma (rounded to the model dtype first),
            # i.e. sigma; computing it the same way keeps bf16 runs bit-identical to the pipeline.
            timestep=(sigma * 1000).to(dtype) / 1000,
            guidance=guidance,
            pooled_projections=pooled.to(device=latents.device, dtype=dtype),
            encoder_hidden_states=prompt_embeds.to(device=latents.device, dtype=dtype),
            txt_ids=text_ids,
            img_ids=self.image_ids(spec),
            return_dict=False,
        )[0]
        return out.float()

    # ------------------------------------------------------------------ pixels

    def decode(self, latents: torch.Tensor, spec: SampleSpec) -> torch.Tensor:
        """Packed latents -> images ``[B, 3, H, W]`` in [0, 1] (fp32). Not wrapped in no_grad:
        callers decide (rewards usually run under ``torch.no_grad()``)."""
        x = self.unpack_latents(latents, spec)  # [B, C, h, w]
        x = unscale_latents(x, self.vae.config)  # z = z_model / scale + shift
        image = self.vae.decode(x.to(self.vae.dtype), return_dict=False)[0]  # [B, 3, H, W] in ~[-1, 1]
        return to_unit_range(image)

