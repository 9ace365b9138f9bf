"""Qwen-Image adapter: the components of diffusers' ``QwenImagePipeline`` behind :class:`DiffusionAdapter`.

Model space is the *packed* token sequence the transformer consumes, as for FLUX: the VAE
latent ``[B, C, 1, h, w]`` (Qwen-Image's VAE is a one-frame video VAE) is cut into 2x2 patches
and flattened to ``[B, (h/2)*(w/2), C*4]``; :meth:`QwenImageAdapter.decode` unpacks it.

Prompts go through Qwen2.5-VL inside a chat template; the hidden states of the template's
system prefix (the first 34 tokens) are dropped, the rest (the prompt and the closing chat
tokens) is the conditioning, with a mask for padding. Conditioning is stored padded to a fixed
``max_sequence_length`` so that batches from different calls concatenate; every transformer call
trims it to the longest prompt of its batch first, which is what the pipeline feeds (it pads to
the longest prompt), so no compute is spent on padding.

Guidance is Qwen-Image's *true CFG*: ``v = v_neg + s * (v_pos - v_neg)`` followed by the
pipeline's norm-preserving rescale (each token's velocity is rescaled to the norm of the
conditional velocity). Qwen-Image is not guidance-distilled: ``spec.distilled_guidance`` is
ignored, as the pipeline ignores ``guidance_scale`` for such models.

Everything mirrors ``QwenImagePipeline.__call__`` (noise, the dynamically shifted schedule, the
transformer call, CFG, decoding), so that a rollout with this adapter reproduces its images.
"""

from __future__ import annotations

import numpy as np
import torch
from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
from diffusers.utils.torch_utils import randn_tensor
from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

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
from .flux import calculate_shift, scheduler_sigmas

# QwenImagePipeline's prompt template and the number of template tokens it drops
# (prompt_template_encode / prompt_template_encode_start_idx).
PROMPT_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
    "<|im_start|>assistant\n"
)
PROMPT_TEMPLATE_DROP = 34
TOKENIZER_MAX_LENGTH = 1024  # QwenImagePipeline.tokenizer_max_length (text tokens after the drop)
DEFAULT_MAX_SEQUENCE_LENGTH = 512  # QwenImagePipeline.__call__ max_sequence_length


class QwenImageAdapter(DiffusionAdapter):
    """Qwen-Image (and fine-tunes) in diffusers format: Qwen2.5-VL text encoder, MMDiT, Qwen-Image VAE."""

    arch = "qwen_image"

    def __init__(
        self,
        *,
        transformer: QwenImageTransformer2DModel,
        vae: AutoencoderKLQwenImage,
        text_encoder: Qwen2_5_VLForConditionalGeneration,
        tokenizer,
        scheduler_config: dict,
        max_sequence_length: int | None = None,
    ) -> None:
        self.transformer = transformer
        self.vae = vae
        self.text_encoder = text_encoder
        self.tokenizer = tokenizer
        self.scheduler_config = dict(scheduler_config)

        # As in the pipeline: one 2x spatial downsample per temporal-downsample entry (8x for the
        # real VAE); packing then groups 2x2 latent pixels into one token.
        self.vae_scale_factor = 2 ** len(vae.temperal_downsample)
        self.latent_channels = transformer.config.in_channels // 4
        if vae.config.z_dim != self.latent_channels:
            raise ValueError(
                f"VAE z_dim={vae.config.z_dim} does not match the transformer's in_channels="
                f"{transformer.config.in_channels} (Qwen-Image expects in_channels = 4 * z_dim)"
            )
        if transformer.config.guidance_embeds:
            raise ValueError(
                "guidance-distilled QwenImageTransformer2DModel (guidance_embeds=True) is not supported: "
                "diffusers has no working guidance embedding for it; use true CFG (guidance_scale > 1)"
            )
        # Text tokens kept after the template drop: the pipeline's 512, capped by what a (tiny)
        # tokenizer was built for.
        if max_sequence_length is None:
            limit = int(tokenizer.model_max_length) - PROMPT_TEMPLATE_DROP
            max_sequence_length = min(DEFAULT_MAX_SEQUENCE_LENGTH, limit) if limit > 0 else DEFAULT_MAX_SEQUENCE_LENGTH
        if not 1 <= max_sequence_length <= TOKENIZER_MAX_LENGTH:
            raise ValueError(f"max_sequence_length must be in [1, {TOKENIZER_MAX_LENGTH}], got {max_sequence_length}")
        self.max_sequence_length = int(max_sequence_length)

    @classmethod
    def from_pretrained(
        cls,
        path: str,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        max_sequence_length: int | None = None,
    ) -> "QwenImageAdapter":
        """Load a QwenImagePipeline directory (``model_index.json`` + one subfolder per component).

        ``max_sequence_length`` is the number of prompt tokens kept (the pipeline's
        ``max_sequence_length``, 512 by default, at most 1024).
        """
        read_model_index(path)  # clear FileNotFoundError for a wrong path
        transformer = QwenImageTransformer2DModel.from_pretrained(path, subfolder="transformer", torch_dtype=dtype)
        vae = AutoencoderKLQwenImage.from_pretrained(path, subfolder="vae", torch_dtype=dtype)
        text_encoder = Qwen2_5_VLForConditionalGeneration.from_pretrained(path, subfolder="text_encoder", dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(path, subfolder="tokenizer")
        scheduler_config = FlowMatchEulerDiscreteScheduler.load_config(path, subfolder="scheduler")

        # Frozen parts: eval mode and no grads; the trainer decides what of the transformer trains.
        for module in (vae, text_encoder):
            module.requires_grad_(False)
        for module in (transformer, vae, text_encoder):
            module.to(device).eval()
        return cls(
            transformer=transformer,
            vae=vae,
            text_encoder=text_encoder,
            tokenizer=tokenizer,
            scheduler_config=scheduler_config,
            max_sequence_length=max_sequence_length,
        )

    # ------------------------------------------------------------------ prompts

    def release_text_encoders(self) -> int:
        """Drop the text encoders and tokenizers (the prompt cache serves the embeddings from
        now on); returns the parameter bytes freed. ``encode_prompts`` raises afterwards."""
        return release_modules(self, ("text_encoder", "tokenizer"))

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> Conditioning:
        """``prompt_embeds`` [B, T, D] (last hidden state of the prompt tokens, zero-padded to
        ``T = max_sequence_length``) and ``prompt_embeds_mask`` [B, T] (1 = token, 0 = padding)."""
        require_text_encoders(self)
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        texts = [PROMPT_TEMPLATE.format(p) for p in prompts]
        tokens = self.tokenizer(
            texts,
            max_length=TOKENIZER_MAX_LENGTH + PROMPT_TEMPLATE_DROP,
            padding=True,
            truncation=True,
            return_tensors="pt",
        ).to(self.text_encoder.device)
        hidden = self.text_encoder(
            input_ids=tokens.input_ids, attention_mask=tokens.attention_mask, output_hidden_states=True
        ).hidden_states[-1]  # [B, L_tok, D]
        batch, length = len(prompts), self.max_sequence_length
        embeds = hidden.new_zeros(batch, length, hidden.shape[-1])
        mask = torch.zeros(batch, length, dtype=torch.long, device=hidden.device)
        for i in range(batch):
            # The real tokens of prompt i (wherever the padding is), without the template prefix.
            valid = hidden[i][tokens.attention_mask[i].bool()][PROMPT_TEMPLATE_DROP:][:length]
            embeds[i, : valid.shape[0]] = valid
            mask[i, : valid.shape[0]] = 1
        return {
            "prompt_embeds": embeds.to(self.device),  # [B, T, D]
            "prompt_embeds_mask": mask.to(self.device),  # [B, T]
        }

    # ------------------------------------------------------------------ latents

    def latent_size(self, spec: SampleSpec) -> tuple[int, int]:
        """Unpacked latent height and width ``(h, w)`` for a pixel size; both even (2x2 packing)."""
        multiple = self.vae_scale_factor * 2
        if spec.height % multiple or spec.width % multiple:
            raise ValueError(
                f"Qwen-Image needs height and width divisible by {multiple} (VAE factor {self.vae_scale_factor} "
                f"x 2 for packing), got {spec.height}x{spec.width}"
            )
        if spec.num_frames != 1:
            raise ValueError(f"Qwen-Image generates images: num_frames must be 1, got {spec.num_frames}")
        return spec.height // self.vae_scale_factor, spec.width // self.vae_scale_factor

    def pack_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """``[B, C, h, w]`` (or ``[B, 1, C, h, w]``) -> ``[B, (h/2)*(w/2), C*4]``."""
        b, c, h, w = latents.shape[0], latents.shape[-3], latents.shape[-2], latents.shape[-1]
        x = latents.reshape(b, c, h // 2, 2, w // 2, 2)
        x = x.permute(0, 2, 4, 1, 3, 5)  # [B, h/2, w/2, C, 2, 2]
        return x.reshape(b, (h // 2) * (w // 2), c * 4)

    def unpack_latents(self, latents: torch.Tensor, spec: SampleSpec) -> torch.Tensor:
        """Inverse of :meth:`pack_latents`, as the VAE wants it: ``[B, L, C*4]`` -> ``[B, C, 1, h, w]``."""
        b, length, packed_c = latents.shape
        h, w = self.latent_size(spec)
        if length != (h // 2) * (w // 2):
            raise ValueError(f"{length} latent tokens do not match a {spec.height}x{spec.width} image")
        x = latents.reshape(b, h // 2, w // 2, packed_c // 4, 2, 2)
        x = x.permute(0, 3, 1, 4, 2, 5)  # [B, C, h/2, 2, w/2, 2]
        return x.reshape(b, packed_c // 4, 1, h, w)

    def prepare_latents(self, batch_size: int, spec: SampleSpec, generator: torch.Generator) -> torch.Tensor:
        """Packed noise ``[B, L, C*4]`` fp32, drawn as the pipeline's ``[B, 1, C, h, w]`` then packed."""
        h, w = self.latent_size(spec)
        noise = randn_tensor(
            (batch_size, 1, self.latent_channels, h, w), generator=generator, device=self.device, dtype=torch.float32
        )
        return self.pack_latents(noise)

    def img_shapes(self, spec: SampleSpec, batch: int) -> list[list[tuple[int, int, int]]]:
        """The transformer's RoPE layout: one ``(frames=1, h/2, w/2)`` grid per sample."""
        h, w = self.latent_size(spec)
        return [[(1, h // 2, w // 2)]] * batch

    # ------------------------------------------------------------------ schedule

    def sigmas(self, num_steps: int, spec: SampleSpec) -> torch.Tensor:
        """QwenImagePipeline's schedule: ``linspace(1, 1/N, N)`` with the resolution-dependent
        shift ``mu(image tokens)`` (exponential time shift and terminal stretch per the scheduler
        config), then 0 (on CPU)."""
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
        if num_steps == 1 and config.get("shift_terminal"):
            # The terminal stretch maps the last sigma to shift_terminal by rescaling 1 - sigma
            # with 1 - sigma_last, which is 0 for a single step (sigma 1): the pipeline gets NaN.
            # Any shift leaves sigma = 1 at 1, so one step is [1, 0].
            return torch.tensor([1.0, 0.0], dtype=torch.float32)
        base = np.linspace(1.0, 1.0 / num_steps, num_steps)
        return scheduler_sigmas(config, num_steps, sigmas=base, mu=mu)

    # ------------------------------------------------------------------ denoiser

    @staticmethod
    def _trim(embeds: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Drop the padding columns no sample of the batch uses; ``None`` mask when nothing is padded.

        Masked text tokens take no part in attention and the text RoPE positions of real tokens
        do not depend on the padding, so this changes nothing but the cost; it makes the
        transformer's inputs exactly the pipeline's (padded to the longest prompt, mask dropped
        when all ones)."""
        valid = mask.bool()
        used = valid.any(dim=0).nonzero()
        length = int(used.max()) + 1 if used.numel() else 1
        embeds, valid = embeds[:, :length], valid[:, :length]
        return embeds, (None if bool(valid.all()) else valid.to(torch.long))

    def _transformer_forward(
        self,
        latents: torch.Tensor,  # [B, L, C*4]
        sigma: torch.Tensor,  # [B]
        prompt_embeds: torch.Tensor,  # [B, T, D]
        mask: torch.Tensor | None,  # [B, T] or None
        spec: SampleSpec,
    ) -> torch.Tensor:
        dtype = self.transformer.dtype
        out = self.transformer(
            hidden_states=latents.to(dtype),
            # The pipeline passes t/1000 with t = 1000*sigma cast to the latents' dtype first.
            timestep=(sigma * 1000).to(dtype) / 1000,
            encoder_hidden_states=prompt_embeds.to(device=latents.device, dtype=dtype),
            encoder_hidden_states_mask=None if mask is None else mask.to(latents.device),
            img_shapes=self.img_shapes(spec, latents.shape[0]),
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
        """Velocity ``[B, L, C*4]`` fp32 at noise level ``sigma`` ``[B]``.

        With ``spec.guidance_scale > 1`` and ``negative_cond``: true CFG (the pipeline's
        ``true_cfg_scale``) with the norm-preserving rescale, per token:
        ``v = comb * |v_pos| / |comb|`` with ``comb = v_neg + s * (v_pos - v_neg)``.
        """
        batch = latents.shape[0]
        sigma = batch_sigma(sigma, batch, latents.device)
        embeds, mask = self._trim(cond["prompt_embeds"], cond["prompt_embeds_mask"])
        if not (spec.guidance_scale > 1.0 and negative_cond is not None):
            return self._transformer_forward(latents, sigma, embeds, mask, spec)

        neg_embeds, neg_mask = self._trim(
            expand_batch(negative_cond["prompt_embeds"], batch).to(embeds),
            expand_batch(negative_cond["prompt_embeds_mask"], batch),
        )
        if neg_embeds.shape == embeds.shape:
            # One forward over [cond; uncond] (same maths as two, fewer kernel launches).
            ones = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
            both_mask = None
            if mask is not None or neg_mask is not None:
                both_mask = torch.cat([ones if mask is None else mask, ones if neg_mask is None else neg_mask])
            both = self._transformer_forward(
                torch.cat([latents, latents]),
                torch.cat([sigma, sigma]),
                torch.cat([embeds, neg_embeds]),
                both_mask,
                spec,
            )
            v_pos, v_neg = both.chunk(2)
        else:
            v_pos = self._transformer_forward(latents, sigma, embeds, mask, spec)
            v_neg = self._transformer_forward(latents, sigma, neg_embeds, neg_mask, spec)
        combined = v_neg + spec.guidance_scale * (v_pos - v_neg)
        cond_norm = torch.norm(v_pos, dim=-1, keepdim=True)  # [B, L, 1]
        combined_norm = torch.norm(combined, dim=-1, keepdim=True)
        return combined * (cond_norm / combined_norm)

    # ------------------------------------------------------------------ pixels

    def decode(self, latents: torch.Tensor, spec: SampleSpec) -> torch.Tensor:
        """Packed latents -> images ``[B, 3, H, W]`` in [0, 1] (fp32). Not wrapped in no_grad:
        callers decide (rewards usually run under ``torch.no_grad()``)."""
        x = self.unpack_latents(latents, spec).to(self.vae.dtype)  # [B, C, 1, h, w]
        config = self.vae.config
        # Undo the per-channel normalisation z_model = (z - mean) / std (computed as the pipeline does).
        mean = torch.tensor(config.latents_mean).view(1, config.z_dim, 1, 1, 1).to(x.device, x.dtype)
        inv_std = 1.0 / torch.tensor(config.latents_std).view(1, config.z_dim, 1, 1, 1).to(x.device, x.dtype)
        x = x / inv_std + mean
        image = self.vae.decode(x, return_dict=False)[0][:, :, 0]  # [B, 3, H, W] in ~[-1, 1]
        return (image.float() / 2 + 0.5).clamp(0, 1)
