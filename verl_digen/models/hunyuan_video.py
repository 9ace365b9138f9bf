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
from diffusers import AutoencoderKLHunyuanVideo, FlowMatchEulerDiscreteScheduler, HunyuanVideoTransformer3DModel
from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE
from diffusers.utils.torch_utils import randn_tensor
from transformers import AutoTokenizer, CLIPTextModel, CLIPTokenizer, LlamaModel

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
from .flux import scheduler_sigmas

DEFAULT_MAX_SEQUENCE_LENGTH = 256  # Llama tokens after the template (HunyuanVideoPipeline.__call__)
DEFAULT_DISTILLED_GUIDANCE = 6.0  # HunyuanVideoPipeline.__call__ guidance_scale
CLIP_MAX_LENGTH = 77  # the pipeline always pads CLIP prompts to 77 tokens
NUM_HIDDEN_LAYERS_TO_SKIP = 2  # the pipeline reads hidden_states[-(2 + 1)]


class HunyuanVideoAdapter(DiffusionAdapter):
    """HunyuanVideo (text-to-video) in diffusers format: Llama + CLIP-L text encoders, dual/single-stream
    transformer with a distilled guidance embedding, causal 3D VAE."""

    arch = "hunyuan_video"

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
        self.transformer = transformer
        self.vae = vae
        self.text_encoder = text_encoder
        self.tokenizer = tokenizer
        self.text_encoder_2 = text_encoder_2
        self.tokenizer_2 = tokenizer_2
        self.scheduler_config = dict(scheduler_config)
        self.prompt_template = dict(prompt_template or DEFAULT_PROMPT_TEMPLATE)
        if "{}" not in self.prompt_template.get("template", ""):
            raise ValueError("prompt_template['template'] must contain '{}' where the prompt goes")
        self.crop_start = int(self.prompt_template.get("crop_start") or self._template_length())

        self.vae_scale_factor_temporal = int(vae.temporal_compression_ratio)
        self.vae_scale_factor_spatial = int(vae.spatial_compression_ratio)
        self.latent_channels = transformer.config.in_channels
        self.patch_size = int(transformer.config.patch_size)
        self.patch_size_t = int(transformer.config.patch_size_t)
        if vae.config.latent_channels != self.latent_channels:
            raise ValueError(
                f"VAE latent_channels={vae.config.latent_channels} does not match the transformer's "
                f"in_channels={transformer.config.in_channels}"
            )
        # Llama tokens kept after the template: the pipeline's 256, capped by what a (tiny)
        # tokenizer was built for.
        if max_sequence_length is None:
            limit = int(tokenizer.model_max_length) - self.crop_start
            max_sequence_length = min(DEFAULT_MAX_SEQUENCE_LENGTH, limit) if limit > 0 else DEFAULT_MAX_SEQUENCE_LENGTH
        self.max_sequence_length = int(max_sequence_length)

    def _template_length(self) -> int:
        """Template tokens before the prompt, for a custom template without ``crop_start``: the
        template's tokens minus ``<|eot_id|>`` and the ``{}`` placeholder. (The pipeline pads the
        template to ``max_length`` before counting, which only works for tokenizers whose
        ``model_max_length`` is the template length; the default template gives ``crop_start``.)"""
        ids = self.tokenizer(self.prompt_template["template"], return_attention_mask=False)["input_ids"]
        return len(ids) - 2

    @classmethod
    def from_pretrained(
        cls,
        path: str,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        max_sequence_length: int | None = None,
    ) -> "HunyuanVideoAdapter":
        """Load a HunyuanVideoPipeline directory (``model_index.json`` + one subfolder per component)."""
        read_model_index(path)  # clear FileNotFoundError for a wrong path
        transformer = HunyuanVideoTransformer3DModel.from_pretrained(path, subfolder="transformer", torch_dtype=dtype)
        vae = AutoencoderKLHunyuanVideo.from_pretrained(path, subfolder="vae", torch_dtype=dtype)
        text_encoder = LlamaModel.from_pretrained(path, subfolder="text_encoder", dtype=dtype)
        text_encoder_2 = CLIPTextModel.from_pretrained(path, subfolder="text_encoder_2", dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(path, subfolder="tokenizer")
        tokenizer_2 = CLIPTokenizer.from_pretrained(path, subfolder="tokenizer_2")
        scheduler_config = FlowMatchEulerDiscreteScheduler.load_config(path, subfolder="scheduler")

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
        """``prompt_embeds`` [B, T, D] (Llama, template cropped), ``prompt_attention_mask`` [B, T]
        and ``pooled_prompt_embeds`` [B, D_clip] (CLIP pooled output)."""
        require_text_encoders(self)
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
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
        multiple = self.vae_scale_factor_spatial * self.patch_size
        if spec.height % multiple or spec.width % multiple:
            raise ValueError(
                f"HunyuanVideo needs height and width divisible by {multiple} (VAE factor "
                f"{self.vae_scale_factor_spatial} x patch size {self.patch_size}), got {spec.height}x{spec.width}"
            )
        t = self.vae_scale_factor_temporal
        if spec.num_frames < 1 or (spec.num_frames - 1) % t:
            raise ValueError(
                f"HunyuanVideo needs num_frames = {t} * k + 1 (causal VAE, temporal factor {t}), "
                f"got {spec.num_frames}"
            )
        frames = (spec.num_frames - 1) // t + 1
        if frames % self.patch_size_t:
            raise ValueError(f"{frames} latent frames are not divisible by the temporal patch {self.patch_size_t}")
        return frames, spec.height // self.vae_scale_factor_spatial, spec.width // self.vae_scale_factor_spatial

    def prepare_latents(self, batch_size: int, spec: SampleSpec, generator: torch.Generator) -> torch.Tensor:
        """Noise ``[B, C, F, h, w]`` fp32, drawn exactly as the pipeline draws it."""
        frames, h, w = self.latent_shape(spec)
        shape = (batch_size, self.latent_channels, frames, h, w)
        return randn_tensor(shape, generator=generator, device=self.device, dtype=torch.float32)

    # ------------------------------------------------------------------ schedule

    def sigmas(self, num_steps: int, spec: SampleSpec) -> torch.Tensor:
        """The pipeline's schedule: ``linspace(1, 0, N + 1)[:-1]`` shifted by the scheduler's fixed
        ``shift`` (7.0 for HunyuanVideo), then 0 (on CPU)."""
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
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
        dtype = self.transformer.dtype
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

    def predict_velocity(
        self,
        latents: torch.Tensor,
        sigma: torch.Tensor,
        cond: Conditioning,
        spec: SampleSpec,
        negative_cond: Conditioning | None = None,
    ) -> torch.Tensor:
        """Velocity ``[B, C, F, h, w]`` fp32 at noise level ``sigma`` ``[B]``, with the distilled
        guidance ``spec.distilled_guidance``; true CFG on top when ``spec.guidance_scale > 1`` and
        ``negative_cond`` is given."""
        batch = latents.shape[0]
        sigma = batch_sigma(sigma, batch, latents.device)
        embeds, mask, pooled = cond["prompt_embeds"], cond["prompt_attention_mask"], cond["pooled_prompt_embeds"]
        if not (spec.guidance_scale > 1.0 and negative_cond is not None):
            return self._transformer_forward(latents, sigma, embeds, mask, pooled, spec)

        neg_embeds = expand_batch(negative_cond["prompt_embeds"], batch).to(embeds)
        neg_mask = expand_batch(negative_cond["prompt_attention_mask"], batch).to(mask)
        neg_pooled = expand_batch(negative_cond["pooled_prompt_embeds"], batch).to(pooled)
        both = self._transformer_forward(
            torch.cat([latents, latents]),
            torch.cat([sigma, sigma]),
            torch.cat([embeds, neg_embeds]),
            torch.cat([mask, neg_mask]),
            torch.cat([pooled, neg_pooled]),
            spec,
        )
        v_pos, v_neg = both.chunk(2)
        return v_neg + spec.guidance_scale * (v_pos - v_neg)

    # ------------------------------------------------------------------ pixels

    def decode(self, latents: torch.Tensor, spec: SampleSpec) -> torch.Tensor:
        """Latents ``[B, C, F, h, w]`` -> videos ``[B, 3, frames, H, W]`` in [0, 1] (fp32). Not
        wrapped in no_grad: callers decide."""
        x = latents.to(self.vae.dtype) / self.vae.config.scaling_factor
        video = self.vae.decode(x, return_dict=False)[0]  # [B, 3, frames, H, W] in ~[-1, 1]
        return (video.float() / 2 + 0.5).clamp(0, 1)
