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
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
from diffusers.utils.torch_utils import randn_tensor
from transformers import CLIPTextModel, CLIPTokenizer, T5EncoderModel, T5TokenizerFast

from .base import (
    Conditioning,
    DiffusionAdapter,
    SampleSpec,
    batch_sigma,
    expand_batch,
    read_model_index,
    release_modules,
    require_text_encoders,
)

# FluxPipeline's defaults, used when a spec or a directory does not say otherwise.
DEFAULT_MAX_SEQUENCE_LENGTH = 512  # T5 tokens (FluxPipeline.__call__ max_sequence_length)
DEFAULT_DISTILLED_GUIDANCE = 3.5  # FluxPipeline.__call__ guidance_scale (guidance-distilled models)


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


def scheduler_sigmas(
    scheduler_config: dict, num_steps: int, *, sigmas: np.ndarray | None = None, mu: float | None = None
) -> torch.Tensor:
    """Run the scheduler's own ``set_timesteps`` and return its sigmas ``[num_steps + 1]`` (fp32, CPU).

    A fresh scheduler is built from the config every call: ``set_timesteps`` mutates the
    scheduler, and the adapter may be used from several threads. Going through the scheduler
    (rather than re-deriving the formula) keeps every option of a real model's config
    (shift_terminal, karras/exponential/beta sigmas, ...) behaving as in the pipeline.
    """
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(scheduler_config)
    kwargs = {} if mu is None else {"mu": mu}
    if sigmas is not None:
        scheduler.set_timesteps(sigmas=sigmas, device="cpu", **kwargs)
    else:
        scheduler.set_timesteps(num_steps, device="cpu", **kwargs)
    return scheduler.sigmas.to(torch.float32)


class FluxAdapter(DiffusionAdapter):
    """FLUX.1 (dev / schnell / fine-tunes) in diffusers format: CLIP-L + T5 text encoders, MMDiT, VAE."""

    arch = "flux"

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
        self.transformer = transformer
        self.vae = vae
        self.text_encoder = text_encoder
        self.tokenizer = tokenizer
        self.text_encoder_2 = text_encoder_2
        self.tokenizer_2 = tokenizer_2
        self.scheduler_config = dict(scheduler_config)

        # Every VAE block but the last downsamples 2x (8x for the real FLUX VAE); packing then
        # groups 2x2 latent pixels into one token.
        self.vae_scale_factor = 2 ** (len(vae.config.block_out_channels) - 1)
        self.latent_channels = transformer.config.in_channels // 4
        if vae.config.latent_channels != self.latent_channels:
            raise ValueError(
                f"VAE latent_channels={vae.config.latent_channels} does not match the transformer's "
                f"in_channels={transformer.config.in_channels} (FLUX expects in_channels = 4 * latent_channels)"
            )
        # CLIP reads a fixed-length window (77 for real models); T5 reads max_sequence_length
        # tokens, capped by what its tokenizer was built for (tiny models use short prompts).
        self.clip_max_length = int(tokenizer.model_max_length)
        if max_sequence_length is None:
            max_sequence_length = min(DEFAULT_MAX_SEQUENCE_LENGTH, int(tokenizer_2.model_max_length))
        self.max_sequence_length = int(max_sequence_length)

    @classmethod
    def from_pretrained(
        cls,
        path: str,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        max_sequence_length: int | None = None,
    ) -> "FluxAdapter":
        """Load a FluxPipeline directory (``model_index.json`` + one subfolder per component).

        ``max_sequence_length`` overrides the T5 length (FluxPipeline uses 512; FLUX.1-schnell
        users often pass 256).
        """
        read_model_index(path)  # clear FileNotFoundError for a wrong path
        transformer = FluxTransformer2DModel.from_pretrained(path, subfolder="transformer", torch_dtype=dtype)
        vae = AutoencoderKL.from_pretrained(path, subfolder="vae", torch_dtype=dtype)
        text_encoder = CLIPTextModel.from_pretrained(path, subfolder="text_encoder", dtype=dtype)
        text_encoder_2 = T5EncoderModel.from_pretrained(path, subfolder="text_encoder_2", dtype=dtype)
        tokenizer = CLIPTokenizer.from_pretrained(path, subfolder="tokenizer")
        tokenizer_2 = T5TokenizerFast.from_pretrained(path, subfolder="tokenizer_2")
        scheduler_config = FlowMatchEulerDiscreteScheduler.load_config(path, subfolder="scheduler")

        # Frozen parts: eval mode and no grads. The transformer keeps requires_grad as loaded;
        # the trainer decides what to train (full, LoRA, ...).
        for module in (vae, text_encoder, text_encoder_2):
            module.requires_grad_(False)
        for module in (transformer, vae, text_encoder, text_encoder_2):
            module.to(device).eval()
        return cls(
            transformer=transformer,
            vae=vae,
            text_encoder=text_encoder,
            tokenizer=tokenizer,
            text_encoder_2=text_encoder_2,
            tokenizer_2=tokenizer_2,
            scheduler_config=scheduler_config,
            max_sequence_length=max_sequence_length,
        )

    # ------------------------------------------------------------------ prompts

    def release_text_encoders(self) -> int:
        """Drop the text encoders and tokenizers (the prompt cache serves the embeddings from
        now on); returns the parameter bytes freed. ``encode_prompts`` raises afterwards."""
        return release_modules(self, ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2"))

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> Conditioning:
        """``prompt_embeds`` [B, T, D] from T5 and ``pooled_prompt_embeds`` [B, D_clip] from CLIP."""
        require_text_encoders(self)
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
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
        multiple = self.vae_scale_factor * 2
        if spec.height % multiple or spec.width % multiple:
            raise ValueError(
                f"FLUX needs height and width divisible by {multiple} (VAE factor {self.vae_scale_factor} x 2 "
                f"for packing), got {spec.height}x{spec.width}"
            )
        return spec.height // self.vae_scale_factor, spec.width // self.vae_scale_factor

    def pack_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """``[B, C, h, w]`` -> ``[B, (h/2)*(w/2), C*4]``: each 2x2 patch becomes one token."""
        b, c, h, w = latents.shape
        x = latents.reshape(b, c, h // 2, 2, w // 2, 2)
        x = x.permute(0, 2, 4, 1, 3, 5)  # [B, h/2, w/2, C, 2, 2]
        return x.reshape(b, (h // 2) * (w // 2), c * 4)

    def unpack_latents(self, latents: torch.Tensor, spec: SampleSpec) -> torch.Tensor:
        """Inverse of :meth:`pack_latents`: ``[B, L, C*4]`` -> ``[B, C, h, w]``."""
        b, length, packed_c = latents.shape
        h, w = self.latent_size(spec)
        if length != (h // 2) * (w // 2):
            raise ValueError(f"{length} latent tokens do not match a {spec.height}x{spec.width} image")
        x = latents.reshape(b, h // 2, w // 2, packed_c // 4, 2, 2)
        x = x.permute(0, 3, 1, 4, 2, 5)  # [B, C, h/2, 2, w/2, 2]
        return x.reshape(b, packed_c // 4, h, w)

    def prepare_latents(self, batch_size: int, spec: SampleSpec, generator: torch.Generator) -> torch.Tensor:
        """Packed noise ``[B, L, C*4]`` fp32. Drawn as ``[B, C, h, w]`` then packed, like the pipeline,
        so the same generator gives FluxPipeline's starting noise."""
        h, w = self.latent_size(spec)
        noise = randn_tensor(
            (batch_size, self.latent_channels, h, w), generator=generator, device=self.device, dtype=torch.float32
        )
        return self.pack_latents(noise)

    def image_ids(self, spec: SampleSpec) -> torch.Tensor:
        """RoPE positions of the image tokens ``[L, 3]``: (0, row, col) per 2x2 patch."""
        h, w = self.latent_size(spec)
        rows = torch.arange(h // 2, dtype=torch.float32)[:, None].expand(h // 2, w // 2)
        cols = torch.arange(w // 2, dtype=torch.float32)[None, :].expand(h // 2, w // 2)
        ids = torch.stack([torch.zeros_like(rows), rows, cols], dim=-1)  # [h/2, w/2, 3]
        return ids.reshape(-1, 3).to(self.device)

    # ------------------------------------------------------------------ schedule

    def sigmas(self, num_steps: int, spec: SampleSpec) -> torch.Tensor:
        """FluxPipeline's schedule: ``linspace(1, 1/N, N)`` shifted by ``mu(image tokens)``, then 0 (on CPU)."""
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        h, w = self.latent_size(spec)
        config = self.scheduler_config
        mu = calculate_shift(
            (h // 2) * (w // 2),
            config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5),
            config.get("max_shift", 1.15),
        )
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
        dtype = self.transformer.dtype
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

    def predict_velocity(
        self,
        latents: torch.Tensor,
        sigma: torch.Tensor,
        cond: Conditioning,
        spec: SampleSpec,
        negative_cond: Conditioning | None = None,
    ) -> torch.Tensor:
        """Velocity ``[B, L, C*4]`` fp32 at noise level ``sigma`` ``[B]`` (true CFG when asked)."""
        batch = latents.shape[0]
        sigma = batch_sigma(sigma, batch, latents.device)
        embeds, pooled = cond["prompt_embeds"], cond["pooled_prompt_embeds"]
        if not (spec.guidance_scale > 1.0 and negative_cond is not None):
            return self._transformer_forward(latents, sigma, embeds, pooled, spec)

        neg_embeds = expand_batch(negative_cond["prompt_embeds"], batch).to(embeds)
        neg_pooled = expand_batch(negative_cond["pooled_prompt_embeds"], batch).to(pooled)
        if neg_embeds.shape == embeds.shape:
            # One forward over [cond; uncond] instead of two: same maths, fewer kernel launches.
            both = self._transformer_forward(
                torch.cat([latents, latents]),
                torch.cat([sigma, sigma]),
                torch.cat([embeds, neg_embeds]),
                torch.cat([pooled, neg_pooled]),
                spec,
            )
            v_pos, v_neg = both.chunk(2)
        else:
            v_pos = self._transformer_forward(latents, sigma, embeds, pooled, spec)
            v_neg = self._transformer_forward(latents, sigma, neg_embeds, neg_pooled, spec)
        return v_neg + spec.guidance_scale * (v_pos - v_neg)

    # ------------------------------------------------------------------ pixels

    def decode(self, latents: torch.Tensor, spec: SampleSpec) -> torch.Tensor:
        """Packed latents -> images ``[B, 3, H, W]`` in [0, 1] (fp32). Not wrapped in no_grad:
        callers decide (rewards usually run under ``torch.no_grad()``)."""
        x = self.unpack_latents(latents, spec)  # [B, C, h, w]
        # Undo the normalisation applied to VAE latents in training: z_model = (z - shift) * scale.
        shift = self.vae.config.shift_factor or 0.0
        x = x / self.vae.config.scaling_factor + shift
        image = self.vae.decode(x.to(self.vae.dtype), return_dict=False)[0]  # [B, 3, H, W] in ~[-1, 1]
        return (image.float() / 2 + 0.5).clamp(0, 1)

