"""ImageReward (Xu et al., 2023) on ``transformers``' BLIP, without the ``image-reward`` package.

The model is BLIP's ViT image encoder and its BERT ("med") text encoder, whose self-attention
layers are each followed by a cross-attention to the image tokens. The prompt's ``[CLS]`` output
(the text read in the light of the image) goes through an MLP head (``Linear(768, 1024), Dropout,
Linear(1024, 128), Dropout, Linear(128, 64), Dropout, Linear(64, 16), Linear(16, 1)``), and the
score is ``(r - 0.16717362830052426) / 1.0333394966054072`` (the reference's published
normalisation).

Preprocessing as the reference's: 8-bit RGB image, bicubic resize of the shorter side to 224 (the
longer one ``int(224 * long / short)``), centre crop 224 (offsets ``round((size - 224) / 2)``),
``/ 255``, normalise with the OpenAI CLIP mean / std; the prompt tokenised by the BERT tokenizer
(``bert-base-uncased`` plus BLIP's ``[DEC]`` / ``[ENC]`` special tokens), padded to 35 tokens and
truncated there.

The checkpoint is the original ``ImageReward.pt`` (read with ``torch.load(weights_only=True)``:
tensors only), whose keys are ``blip.visual_encoder.*`` (``patch_embed.proj``, ``cls_token``,
``pos_embed``, ``blocks.N.{norm1, attn.qkv, attn.proj, norm2, mlp.fc1, mlp.fc2}``, ``norm``),
``blip.text_encoder.*`` (BERT names: ``embeddings.*``, ``encoder.layer.N.{attention,
crossattention, intermediate, output}.*``) and ``mlp.layers.*``; :func:`convert_image_reward`
maps them onto ``BlipVisionModel`` / ``BlipTextModel`` (the same fused-qkv / BERT naming) and the
head. The shapes give every size; the head counts (ViT-L: 16, BERT-base: 12) and the layer-norm
epsilons (1e-6 in BLIP's ViT, 1e-12 in BERT) are not in the tensors.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch
from PIL import Image

from verl_digen.rewards.base import RewardFn, register_reward
from verl_digen.rewards.clip_score import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
from verl_digen.rewards.jpeg import to_uint8_hwc
from verl_digen.rewards.preference import AestheticMLP, _dtype, checkpoint_file

__all__ = [
    "IMAGE_REWARD_MEAN",
    "IMAGE_REWARD_STD",
    "ImageRewardModel",
    "ImageRewardReward",
    "convert_image_reward",
    "image_reward_preprocess",
]

IMAGE_REWARD_MEAN = 0.16717362830052426
IMAGE_REWARD_STD = 1.0333394966054072
MAX_TEXT_LENGTH = 35


class ImageRewardModel(torch.nn.Module):
    """BLIP image encoder, image-grounded text encoder and the MLP head; ``forward`` gives the
    normalised ImageReward score ``[N]`` (float32)."""

    def __init__(self, vision: torch.nn.Module, text: torch.nn.Module, head: AestheticMLP) -> None:
        super().__init__()
        self.vision, self.text, self.head = vision, text, head

    def forward(self, pixel_values: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        image = self.vision(pixel_values=pixel_values).last_hidden_state
        image_mask = torch.ones(image.shape[:-1], dtype=torch.long, device=image.device)
        text = self.text(
            input_ids=input_ids,
            attention_mask=attention_mask,
            encoder_hidden_states=image,
            encoder_attention_mask=image_mask,
            is_decoder=False,  # bidirectional self-attention, as BLIP's text encoder
        ).last_hidden_state
        reward = self.head(text[:, 0].float()).squeeze(-1)
        return (reward - IMAGE_REWARD_MEAN) / IMAGE_REWARD_STD


def _count(state: Mapping[str, torch.Tensor], pattern: str) -> int:
    n = 0
    while pattern.format(n) in state:
        n += 1
    return n


def convert_image_reward(
    state_dict: Mapping[str, Any],
    *,
    vision_heads: int = 16,
    text_heads: int = 12,
    vision_layer_norm_eps: float = 1e-6,
    text_layer_norm_eps: float = 1e-12,
) -> ImageRewardModel:
    """An :class:`ImageRewardModel` (eval mode, float32) with the weights of an original
    ``ImageReward.pt`` state dict (module docstring)."""
    from transformers import BlipTextConfig, BlipVisionConfig
    from transformers.models.blip.modeling_blip import BlipVisionModel
    from transformers.models.blip.modeling_blip_text import BlipTextModel

    state = {k: v for k, v in state_dict.items() if isinstance(v, torch.Tensor)}
    required = ("blip.visual_encoder.patch_embed.proj.weight", "blip.text_encoder.embeddings.word_embeddings.weight")
    missing = [k for k in required + ("mlp.layers.0.weight",) if k not in state]
    if missing:
        raise ValueError(f"not an ImageReward state dict: missing {missing}")
    v, t = "blip.visual_encoder", "blip.text_encoder"
    conv = state[f"{v}.patch_embed.proj.weight"]
    v_width, patch = conv.shape[0], conv.shape[-1]
    grid = round((state[f"{v}.pos_embed"].shape[1] - 1) ** 0.5)
    v_layers = _count(state, f"{v}.blocks.{{}}.norm1.weight")
    t_layers = _count(state, f"{t}.encoder.layer.{{}}.attention.self.query.weight")
    words = state[f"{t}.embeddings.word_embeddings.weight"]
    if not v_layers or not t_layers:
        raise ValueError("not an ImageReward state dict: no vision blocks or text layers")
    if f"{t}.encoder.layer.0.crossattention.self.query.weight" not in state:
        raise ValueError("not an ImageReward state dict: the text encoder has no cross-attention")
    vision = BlipVisionModel(
        BlipVisionConfig(
            hidden_size=v_width,
            intermediate_size=state[f"{v}.blocks.0.mlp.fc1.weight"].shape[0],
            num_hidden_layers=v_layers,
            num_attention_heads=vision_heads,
            image_size=grid * patch,
            patch_size=patch,
            hidden_act="gelu",
            layer_norm_eps=vision_layer_norm_eps,
        )
    )
    text = BlipTextModel(
        BlipTextConfig(
            vocab_size=words.shape[0],
            hidden_size=words.shape[1],
            intermediate_size=state[f"{t}.encoder.layer.0.intermediate.dense.weight"].shape[0],
            num_hidden_layers=t_layers,
            num_attention_heads=text_heads,
            max_position_embeddings=state[f"{t}.embeddings.position_embeddings.weight"].shape[0],
            encoder_hidden_size=v_width,
            hidden_act="gelu",
            layer_norm_eps=text_layer_norm_eps,
            is_decoder=True,  # builds the cross-attention layers; the forward runs bidirectionally
            bos_token_id=None,
            eos_token_id=None,
            sep_token_id=None,
            pad_token_id=0,
        ),
        add_pooling_layer=False,
    )
    vision_state = {
        "embeddings.class_embedding": state[f"{v}.cls_token"],
        "embeddings.position_embedding": state[f"{v}.pos_embed"],
        "embeddings.patch_embedding.weight": conv,
        "embeddings.patch_embedding.bias": state[f"{v}.patch_embed.proj.bias"],
        "post_layernorm.weight": state[f"{v}.norm.weight"],
        "post_layernorm.bias": state[f"{v}.norm.bias"],
    }
    names = {"attn.qkv": "self_attn.qkv", "attn.proj": "self_attn.projection", "norm1": "layer_norm1",
             "norm2": "layer_norm2", "mlp.fc1": "mlp.fc1", "mlp.fc2": "mlp.fc2"}  # fmt: skip
    for i in range(v_layers):
        for a, b in names.items():
            for p in ("weight", "bias"):
                vision_state[f"encoder.layers.{i}.{b}.{p}"] = state[f"{v}.blocks.{i}.{a}.{p}"]
    text_state = {k[len(t) + 1 :]: val for k, val in state.items() if k.startswith(f"{t}.")}
    text_state.pop("embeddings.position_ids", None)  # a buffer in BLIP's BertEmbeddings, not a weight
    head_state = {k[len("mlp.") :]: val for k, val in state.items() if k.startswith("mlp.")}
    head = AestheticMLP(words.shape[1])  # the same head layout as the LAION aesthetic predictor's
    for module, new, what in ((vision, vision_state, "vision"), (text, text_state, "text"), (head, head_state, "head")):
        own = module.state_dict()
        unexpected = sorted(set(new) - set(own))
        absent = sorted(k for k in own if k not in new and not k.endswith("position_ids"))
        if unexpected or absent:
            raise ValueError(f"ImageReward {what} conversion mismatch: unexpected {unexpected[:5]}, missing {absent[:5]}")
        for key, value in new.items():
            if own[key].shape != value.shape:
                raise ValueError(f"ImageReward {what}: {key} has shape {tuple(value.shape)}, expected {tuple(own[key].shape)}")
        module.load_state_dict({k: val.float().contiguous() for k, val in new.items()}, strict=False)
    return ImageRewardModel(vision, text, head).float().eval()


def image_reward_preprocess(images: torch.Tensor, size: int = 224) -> torch.Tensor:
    """``[N, 3, H, W]`` images in ``[0, 1]`` -> the reference's normalised ``[N, 3, size, size]``
    (module docstring)."""
    mean = np.asarray(OPENAI_CLIP_MEAN, dtype=np.float32)
    std = np.asarray(OPENAI_CLIP_STD, dtype=np.float32)
    out = []
    for array in to_uint8_hwc(images).numpy():
        h, w = array.shape[:2]
        short, long = (h, w) if h <= w else (w, h)
        new_long = int(size * long / short)
        new_h, new_w = (size, new_long) if h <= w else (new_long, size)
        resized = np.asarray(Image.fromarray(array).resize((new_w, new_h), Image.BICUBIC))
        top, left = int(round((new_h - size) / 2.0)), int(round((new_w - size) / 2.0))
        crop = resized[top : top + size, left : left + size].astype(np.float32) / 255.0
        out.append(torch.from_numpy(((crop - mean) / std).transpose(2, 0, 1).copy()))
    return torch.stack(out)


def _load_tokenizer(tokenizer_path: str):
    from transformers import BertTokenizer

    try:
        tokenizer = BertTokenizer.from_pretrained(tokenizer_path)
    except OSError as exc:
        raise FileNotFoundError(f"reward 'imagereward': cannot load the BERT tokenizer from {tokenizer_path!r}: {exc}") from None
    tokenizer.add_special_tokens({"bos_token": "[DEC]"})  # BLIP's tokenizer (ids 30522, 30523 in bert-base-uncased)
    tokenizer.add_special_tokens({"additional_special_tokens": ["[ENC]"]})
    return tokenizer


@register_reward("imagereward")
class ImageRewardReward(RewardFn):
    """ImageReward score of each (image, prompt) pair (module docstring).

    Args:
        model_path: ``ImageReward.pt``, a directory holding it, or a hub id (``THUDM/ImageReward``,
            through the ``huggingface_hub`` cache).
        tokenizer_path: the BERT tokenizer (directory or hub id).
        vision_heads / text_heads: attention heads (ViT-L 16, BERT-base 12); a ``med_config.json``
            next to the checkpoint supplies ``text_heads`` and the text layer-norm epsilon.
    """

    def __init__(
        self,
        model_path: str = "THUDM/ImageReward",
        tokenizer_path: str = "bert-base-uncased",
        device: str = "cpu",
        dtype: str = "float32",
        batch_size: int = 32,
        vision_heads: int = 16,
        text_heads: int = 12,
    ) -> None:
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"reward 'imagereward': batch_size must be an int >= 1, got {batch_size!r}")
        self.device = torch.device(device)
        self.dtype = _dtype(self.name, dtype)
        self.batch_size = batch_size
        self.model_path = model_path
        path = checkpoint_file(self.name, model_path, "ImageReward.pt")
        text_eps = 1e-12
        med = path.parent / "med_config.json"
        if med.is_file():
            config = json.loads(med.read_text(encoding="utf-8"))
            text_heads = int(config.get("num_attention_heads", text_heads))
            text_eps = float(config.get("layer_norm_eps", text_eps))
        state = torch.load(str(path), map_location="cpu", weights_only=True)  # tensors only, never code
        if isinstance(state, Mapping) and "state_dict" in state:
            state = state["state_dict"]
        if not isinstance(state, Mapping):
            raise ValueError(f"reward 'imagereward': {str(path)!r} does not hold a state dict")
        model = convert_image_reward(state, vision_heads=vision_heads, text_heads=text_heads, text_layer_norm_eps=text_eps)
        self.model = model.to(self.device).eval().requires_grad_(False)
        self.model.vision.to(self.dtype)
        self.model.text.to(self.dtype)
        self.image_size = int(model.vision.config.image_size)
        self.tokenizer = _load_tokenizer(tokenizer_path)

    @torch.no_grad()
    def score_images(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        out = []
        for start in range(0, len(prompts), self.batch_size):
            chunk = slice(start, start + self.batch_size)
            pixels = image_reward_preprocess(images[chunk], self.image_size)
            tokens = self.tokenizer(
                prompts[chunk], padding="max_length", truncation=True, max_length=MAX_TEXT_LENGTH, return_tensors="pt"
            )
            out.append(
                self.model(
                    pixel_values=pixels.to(self.device, self.dtype),
                    input_ids=tokens["input_ids"].to(self.device),
                    attention_mask=tokens["attention_mask"].to(self.device),
                ).cpu()
            )
        return torch.cat(out)

    def __repr__(self) -> str:
        return f"ImageRewardReward(model_path={self.model_path!r}, device={str(self.device)!r})"
