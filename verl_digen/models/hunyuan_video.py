"""HunyuanVideo adapter: the components of diffusers' ``HunyuanVideoPipeline`` behind :class:`DiffusionAdapter`.

Model space is the video VAE latent, ``[B, C, F, h, w]`` with ``F = (frames - 1) / 4 + 1``; the
transformer patchifies inside. Conditioning follows the pipeline: the Llama text encoder reads
the prompt inside a chat template and its hidden state two layers before the last is taken, the
template prefix (95 tokens) cropped, padded (right) to ``max_sequence_length`` with an attention
mask; CLIP's pooled output is the global conditioning vector.

Guidance is HunyuanVideo's *distilled guidance*: the guidance scale enters the transformer as an
embedding (``spec.distilled_guidance``, 6.0 by default as in the pipeline), one forward per step.
True CFG against a negative prompt (the pipeline's ``true_cfg_scale``) is available on top with
``spec.guidance_scale > 1``.

Everything mirrors ``HunyuanVideoPipeline.__call__`` (noise, the shifted schedule, the
transformer call, decoding), so that a rollout with this adapter reproduces its videos.
"""

from __future__ import annotations

import numpy as np
import torch
from diffusers import AutoencoderKLHunyuanVideo, HunyuanVideoTransformer3DModel
from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE
from transformers import AutoTokenizer, CLIPTextModel, CLIPTokenizer, LlamaModel

from .base import (
    Conditioning,
    DiffusionAdapter,
    SampleSpec,
    SizeRules,
    check_num_steps,
    latent_frames,
    latent_hw,
    prompts_to_encode,
    randn_latents,
    resolve_max_sequence_length,
    scheduler_sigmas,
    to_unit_range,
)

DEFAULT_MAX_SEQUENCE_LENGTH = 256  # Llama tokens after the template (HunyuanVideoPipeline.__call__)
DEFAULT_DISTILLED_GUIDANCE = 6.0  # HunyuanVideoPipeline.__call__ guidance_scale
CLIP_MAX_LENGTH = 77  # the pipeline always pads CLIP prompts to 77 tokens
NUM_HIDDEN_LAYERS_TO_SKIP = 2  # the pipeline reads hidden_states[-(2 + 1)]


class HunyuanVideoAdapter(DiffusionAdapter):
    """HunyuanVideo (text-to-video) in diffusers format: Llama + CLIP-L text encoders, dual/single-stream
    transformer with a distilled guidance embedding, causal 3D VAE."""

    arch = "hunyuan_video"

    @classmethod
    def prompt_text(cls, prompt: str) -> str:
        """The default template's text (a model directory's own template is not read here)."""
        return DEFAULT_PROMPT_TEMPLATE["template"].format(prompt)
    # HunyuanVideoPipeline's components, as from_pretrained loads them.
    component_classes = {
        "transformer": HunyuanVideoTransformer3DModel,
        "vae": AutoencoderKLHunyuanVideo,
        "text_encoder": LlamaModel,  # Llama: the token sequence
        "text_encoder_2": CLIPTextModel,  # CLIP-L: pooled vector only
        "tokenizer": AutoTokenizer,
        "tokenizer_2": CLIPTokenizer,
    }
    text_encoder_names = ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2")
    # True CFG (on top of the distilled guidance) batches [cond; uncond] through
    # _transformer_forward(latents, sigma, embeds, mask, pooled, spec).
    conditioning_keys = ("prompt_embeds", "prompt_attention_mask", "pooled_prompt_embeds")

    @classmethod
    def size_rules(cls, vae_config, transformer_config) -> SizeRules:
        return SizeRules("HunyuanVideo", spatial=int(vae_config["spatial_compression_ratio"]),
                         patch=int(transformer_config["patch_size"]),
                         temporal=int(vae_config["temporal_compression_ratio"]),
                         patch_t=int(transformer_config["patch_size_t"]))

    def __init__(
        self,
        *,
        transformer: HunyuanVideoTransformer3DModel,
        vae: AutoencoderKLHunyuanVideo,
        text_encoder: LlamaModel,
        tokenizer,
        text_encoder_2: CLIPTextModel,
        tokenizer_2: CLIPTokenizer,
        scheduler_config: dict,
        max_sequence_length: int | None = None,
        prompt_template: dict | None = None,
    ) -> None:
        self.register_modules(transformer=transformer, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer)
        self.register_modules(text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2)
        self.scheduler_config = dict(scheduler_config)
        self.prompt_template = dict(prompt_template or DEFAULT_PROMPT_TEMPLATE)
        if "{}" not in self.prompt_template.get("template", ""):
            raise ValueError("prompt_template['template'] must contain '{}' where the prompt goes")
        self.crop_start = int(self.prompt_template.get("crop_start") or self._template_length())

        rules = self.size_rules(vae.config, transformer.config)
        self.vae_scale_factor_temporal = rules.temporal
        self.vae_scale_factor_spatial = rules.spatial
        self.latent_channels = transformer.config.in_channels
        self.patch_size = rules.patch
        self.patch_size_t = rules.patch_t
        if vae.config.latent_channels != self.latent_channels:
            raise ValueError(
                f"VAE latent_channels={vae.config.latent_channels} does not match the transformer's "
                f"in_channels={transformer.config.in_channels}"
            )
        # Llama tokens kept after the template: the pipeline's 256, capped by what a (tiny)
        # tokenizer was built for.
        limit = int(tokenizer.model_max_length) - self.crop_start
        self.max_sequence_length = resolve_max_sequence_length(max_sequence_length, DEFAULT_MAX_SEQUENCE_LENGTH, limit)

    def _template_length(self) -> int:
        """Template tokens before the prompt, for a custom template without ``crop_start``: the
        template's tokens minus ``<|eot_id|>`` and the ``{}`` placeholder. (The pipeline pads the
        template to ``max_length`` before counting, which only works for tokenizers whose
        ``model_max_length`` is the template length; the default template gives ``crop_start``.)"""
        ids = self.tokenizer(self.prompt_template["template"], return_attention_mask=False)["input_ids"]
        return len(ids) - 2

    # ------------------------------------------------------------------ prompts

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> Conditioning:
        """``prompt_embeds`` [B, T, D] (Llama, template cropped), ``prompt_attention_mask`` [B, T]
        and ``pooled_prompt_embeds`` [B, D_clip] (CLIP pooled output)."""
        prompts = prompts_to_encode(self, prompts)
        texts = [self.prompt_template["template"].format(p) for p in prompts]
        tokens = self.tokenizer(
            texts,
            max_length=self.max_sequence_length + self.crop_start,
            padding="max_length",
            truncation=True,
            return_tensors="pt",
            return_attention_mask=True,
            # The transformer reads the mask as an effective length: real tokens must come first.
            padding_side="right",
        )
        device = self.text_encoder.device
        mask = tokens.attention_mask.to(device)
        hidden = self.text_encoder(
            input_ids=tokens.input_ids.to(device), attention_mask=mask, output_hidden_states=True
        ).hidden_states[-(NUM_HIDDEN_LAYERS_TO_SKIP + 1)]  # [B, crop + T, D]
        embeds, mask = hidden[:, self.crop_start :], mask[:, self.crop_start :]

        clip_ids = self.tokenizer_2(
            prompts, padding="max_length", max_length=CLIP_MAX_LENGTH, truncation=True, return_tensors="pt"
        ).input_ids
        pooled = self.text_encoder_2(clip_ids.to(self.text_encoder_2.device), output_hidden_states=False).pooler_output
        return {
            "prompt_embeds": embeds.to(self.device),  # [B, T, D]
            "prompt_attention_mask": mask.to(self.device),  # [B, T]
            "pooled_prompt_embeds": pooled.to(self.device),  # [B, D_clip]
        }

    # ------------------------------------------------------------------ latents

    def latent_shape(self, spec: SampleSpec) -> tuple[int, int, int]:
        """Latent ``(frames, h, w)`` for a video size; raises for sizes the model cannot take."""
        model = "HunyuanVideo"
        h, w = latent_hw(spec, model=model, vae_scale_factor=self.vae_scale_factor_spatial, patch_size=self.patch_size)
        frames = latent_frames(
            spec, model=model, temporal_factor=self.vae_scale_factor_temporal, patch_size_t=self.patch_size_t
        )
        return frames, h, w

    def prepare_latents(self, batch_size: int, spec: SampleSpec, generator: torch.Generator) -> torch.Tensor:
        """Noise ``[B, C, F, h, w]`` fp32, drawn exactly as the pipeline draws it."""
        return randn_latents((batch_size, self.latent_channels, *self.latent_shape(spec)), generator, self.device)

    # ------------------------------------------------------------------ schedule

    def sigmas(self, num_steps: int, spec: SampleSpec) -> torch.Tensor:
        """The pipeline's schedule: ``linspace(1, 0, N + 1)[:-1]`` shifted by the scheduler's fixed
        ``shift`` (7.0 for HunyuanVideo), then 0 (on CPU)."""
        check_num_steps(num_steps)
        self.latent_shape(spec)  # validate the size here too
        base = np.linspace(1.0, 0.0, num_steps + 1)[:-1]
        return scheduler_sigmas(self.scheduler_config, num_steps, sigmas=base)

    # ------------------------------------------------------------------ denoiser

    def _transformer_forward(
        self,
        latents: torch.Tensor,  # [B, C, F, h, w]
        sigma: torch.Tensor,  # [B]
        prompt_embeds: torch.Tensor,  # [B, T, D]
        mask: torch.Tensor,  # [B, T]
        pooled: torch.Tensor,  # [B, D_clip]
        spec: SampleSpec,
    ) -> torch.Tensor:
        """Velocity ``[B, C, F, h, w]`` fp32 with the distilled guidance ``spec.distilled_guidance``
        (sigma broadcasting and true CFG on top: ``predict_velocity``)."""
        dtype = self.compute_dtype
        device = latents.device
        scale = DEFAULT_DISTILLED_GUIDANCE if spec.distilled_guidance is None else spec.distilled_guidance
        # As the pipeline builds it: the scale in the model dtype, times 1000.
        guidance = torch.full((latents.shape[0],), float(scale), dtype=dtype, device=device) * 1000.0
        out = self.transformer(
            hidden_states=latents.to(dtype),
            timestep=sigma * self.scheduler_config.get("num_train_timesteps", 1000),  # fp32, like the pipeline
            encoder_hidden_states=prompt_embeds.to(device=device, dtype=dtype),
            encoder_attention_mask=mask.to(device=device, dtype=dtype),
            pooled_projections=pooled.to(device=device, dtype=dtype),
            guidance=guidance,
            return_dict=False,
        )[0]
        return out.float()

    # ------------------------------------------------------------------ pixels

    def decode(self, latents: torch.Tensor, spec: SampleSpec) -> torch.Tensor:
        """Latents ``[B, C, F, h, w]`` -> videos ``[B, 3, frames, H, W]`` in [0, 1] (fp32). Not
        wrapped in no_grad: callers decide."""
        x = latents.to(self.vae.dtype) / self.vae.config.scaling_factor
        video = self.vae.decode(x, return_dict=False)[0]  # [B, 3, frames, H, W] in ~[-1, 1]
        return to_unit_range(video)
