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
from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel
from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

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
    true_cfg,
    unnormalize_latents,
    unpack_2x2,
)

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

    @classmethod
    def prompt_text(cls, prompt: str) -> str:
        return PROMPT_TEMPLATE.format(prompt)
    # QwenImagePipeline's components, as from_pretrained loads them.
    component_classes = {
        "transformer": QwenImageTransformer2DModel,
        "vae": AutoencoderKLQwenImage,
        "text_encoder": Qwen2_5_VLForConditionalGeneration,
        "tokenizer": AutoTokenizer,
    }
    text_encoder_names = ("text_encoder", "tokenizer")
    # CFG batches [cond; uncond] through _transformer_forward(latents, sigma, embeds, mask, spec),
    # each side trimmed to its longest prompt first (_transformer_inputs).
    conditioning_keys = ("prompt_embeds", "prompt_embeds_mask")

    @classmethod
    def size_rules(cls, vae_config, transformer_config) -> SizeRules:
        return SizeRules("Qwen-Image", spatial=2 ** len(vae_config["temperal_downsample"]), patch=2, packed=True)

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
        self.register_modules(transformer=transformer, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer)
        self.scheduler_config = dict(scheduler_config)

        # As in the pipeline: one 2x spatial downsample per temporal-downsample entry (8x for the
        # real VAE); packing then groups 2x2 latent pixels into one token.
        self.vae_scale_factor = self.size_rules(vae.config, transformer.config).spatial
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
        limit = int(tokenizer.model_max_length) - PROMPT_TEMPLATE_DROP
        max_sequence_length = resolve_max_sequence_length(max_sequence_length, DEFAULT_MAX_SEQUENCE_LENGTH, limit)
        if not 1 <= max_sequence_length <= TOKENIZER_MAX_LENGTH:
            raise ValueError(f"max_sequence_length must be in [1, {TOKENIZER_MAX_LENGTH}], got {max_sequence_length}")
        self.max_sequence_length = max_sequence_length

    # ------------------------------------------------------------------ prompts

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> Conditioning:
        """``prompt_embeds`` [B, T, D] (last hidden state of the prompt tokens, zero-padded to
        ``T = max_sequence_length``) and ``prompt_embeds_mask`` [B, T] (1 = token, 0 = padding)."""
        prompts = prompts_to_encode(self, prompts)
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
        hw = latent_hw(spec, model="Qwen-Image", vae_scale_factor=self.vae_scale_factor, patch_size=2, packed=True)
        if spec.num_frames != 1:
            raise ValueError(f"Qwen-Image generates images: num_frames must be 1, got {spec.num_frames}")
        return hw

    def pack_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """``[B, C, h, w]`` (or ``[B, 1, C, h, w]``) -> ``[B, (h/2)*(w/2), C*4]``."""
        return pack_2x2(latents)

    def unpack_latents(self, latents: torch.Tensor, spec: SampleSpec) -> torch.Tensor:
        """Inverse of :meth:`pack_latents`, as the VAE wants it: ``[B, L, C*4]`` -> ``[B, C, 1, h, w]``."""
        return unpack_2x2(latents, *self.latent_size(spec), spec).unsqueeze(2)

    def prepare_latents(self, batch_size: int, spec: SampleSpec, generator: torch.Generator) -> torch.Tensor:
        """Packed noise ``[B, L, C*4]`` fp32, drawn as the pipeline's ``[B, 1, C, h, w]`` then packed."""
        noise = randn_latents((batch_size, 1, self.latent_channels, *self.latent_size(spec)), generator, self.device)
        return self.pack_latents(noise)  # [B, 1, C, h, w] -> [B, L, C*4]

    def img_shapes(self, spec: SampleSpec, batch: int) -> list[list[tuple[int, int, int]]]:
        """The transformer's RoPE layout: one ``(frames=1, h/2, w/2)`` grid per sample."""
        h, w = self.latent_size(spec)
        return [[(1, h // 2, w // 2)]] * batch

    # ------------------------------------------------------------------ schedule

    def sigmas(self, num_steps: int, spec: SampleSpec) -> torch.Tensor:
        """QwenImagePipeline's schedule: ``linspace(1, 1/N, N)`` with the resolution-dependent
        shift ``mu(image tokens)`` (exponential time shift and terminal stretch per the scheduler
        config), then 0 (on CPU)."""
        check_num_steps(num_steps)
        h, w = self.latent_size(spec)
        config = self.scheduler_config
        mu = config_shift(config, (h // 2) * (w // 2))
        if num_steps == 1 and config.get("shift_terminal"):
            # The terminal stretch maps the last sigma to shift_terminal by rescaling 1 - sigma
            # with 1 - sigma_last, which is 0 for a single step (sigma 1): the pipeline gets NaN.
            # Any shift leaves sigma = 1 at 1, so one step is [1, 0].
            return torch.tensor([1.0, 0.0], dtype=torch.float32)
        base = np.linspace(1.0, 1.0 / num_steps, num_steps)
        return scheduler_sigmas(config, num_steps, sigmas=base, mu=mu)

    # ------------------------------------------------------------------ denoiser

    def _transformer_inputs(self, cond: Conditioning) -> tuple[torch.Tensor, torch.Tensor]:
        """``(prompt_embeds [B, T', D], mask [B, T'])`` without the padding columns no sample of the
        batch uses (``T'``: the longest prompt).

        Masked text tokens take no part in attention and the text RoPE positions of real tokens
        do not depend on the padding, so this changes nothing but the cost; it makes the
        transformer's inputs exactly the pipeline's (padded to the longest prompt, mask dropped
        when all ones: :meth:`_transformer_forward`)."""
        valid = cond["prompt_embeds_mask"].bool()
        used = valid.any(dim=0).nonzero()
        length = int(used.max()) + 1 if used.numel() else 1
        return cond["prompt_embeds"][:, :length], valid[:, :length].to(torch.long)

    def _transformer_forward(
        self,
        latents: torch.Tensor,  # [B, L, C*4]
        sigma: torch.Tensor,  # [B]
        prompt_embeds: torch.Tensor,  # [B, T, D]
        mask: torch.Tensor,  # [B, T], 1 = token
        spec: SampleSpec,
    ) -> torch.Tensor:
        """Velocity ``[B, L, C*4]`` fp32 (sigma broadcasting and CFG: ``predict_velocity``)."""
        dtype = self.compute_dtype
        out = self.transformer(
            hidden_states=latents.to(dtype),
            # The pipeline passes t/1000 with t = 1000*sigma cast to the latents' dtype first.
            timestep=(sigma * 1000).to(dtype) / 1000,
            encoder_hidden_states=prompt_embeds.to(device=latents.device, dtype=dtype),
            # As the pipeline: no mask when no prompt of the batch is padded.
            encoder_hidden_states_mask=None if bool(mask.all()) else mask.to(latents.device),
            img_shapes=self.img_shapes(spec, latents.shape[0]),
            return_dict=False,
        )[0]
        return out.float()

    def _combine_guidance(self, v_pos: torch.Tensor, v_neg: torch.Tensor, scale: float) -> torch.Tensor:
        """True CFG (the pipeline's ``true_cfg_scale``) with the norm-preserving rescale, per token:
        ``v = comb * |v_pos| / |comb|`` with ``comb = v_neg + s * (v_pos - v_neg)``."""
        combined = true_cfg(v_pos, v_neg, scale)
        cond_norm = torch.norm(v_pos, dim=-1, keepdim=True)  # [B, L, 1]
        combined_norm = torch.norm(combined, dim=-1, keepdim=True)
        return combined * (cond_norm / combined_norm)

    # ------------------------------------------------------------------ pixels

    def decode(self, latents: torch.Tensor, spec: SampleSpec) -> torch.Tensor:
        """Packed latents -> images ``[B, 3, H, W]`` in [0, 1] (fp32). Not wrapped in no_grad:
        callers decide (rewards usually run under ``torch.no_grad()``)."""
        x = self.unpack_latents(latents, spec).to(self.vae.dtype)  # [B, C, 1, h, w]
        x = unnormalize_latents(x, self.vae.config)  # z = z_model * std + mean
        image = self.vae.decode(x, return_dict=False)[0][:, :, 0]  # [B, 3, H, W] in ~[-1, 1]
        return to_unit_range(image)
