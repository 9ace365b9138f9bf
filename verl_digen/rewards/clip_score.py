"""CLIP image-text similarity reward (loads a local ``transformers`` CLIP checkpoint).

The reward is ``scale * cos(image_embedding, text_embedding)``: the cosine similarity of
the projected, L2-normalised CLIP embeddings, in ``[-1, 1]`` for the default ``scale=1``
(no ``logit_scale``; real CLIP ViT-L/14 gives about 0.2-0.35 for matching pairs). The
CLIPScore of Hessel et al. (2021) is ``2.5 * max(cos, 0)``, i.e. ``scale=2.5`` and clipping.

Pixels are preprocessed in torch like ``CLIPImageProcessor`` does, with the settings of
the checkpoint's ``preprocessor_config.json``: resize so the shortest edge equals
``size`` (bicubic, antialiased), centre-crop to ``crop_size`` and normalise with
``image_mean`` / ``image_std``. Without that file, the vision tower's ``image_size`` and
the OpenAI CLIP mean/std are used.

:func:`build_tiny_clip` writes a tiny randomly initialised CLIP checkpoint (model,
tokenizer, preprocessor config) for smoke tests without any download.
"""

from __future__ import annotations

import inspect
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from verl_digen.rewards.base import RewardFn, register_reward

__all__ = ["ClipScoreReward", "ClipPreprocessConfig", "build_tiny_clip"]

# OpenAI CLIP normalisation (transformers.utils.constants.OPENAI_CLIP_MEAN / _STD).
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class ClipPreprocessConfig:
    """How pixels are prepared for the vision tower (mirrors ``CLIPImageProcessor``).

    Resize (``shortest_edge`` keeps the aspect ratio, ``resize_hw`` does not; at most one
    is set), then centre-crop to ``crop_hw`` (an image smaller than the crop is resized up
    to it instead), then normalise with ``mean`` / ``std``.
    """

    shortest_edge: int | None = None
    resize_hw: tuple[int, int] | None = None
    crop_hw: tuple[int, int] | None = None
    mean: tuple[float, ...] = OPENAI_CLIP_MEAN
    std: tuple[float, ...] = OPENAI_CLIP_STD

    @classmethod
    def from_pretrained_dir(cls, model_dir: str | os.PathLike[str], image_size: int) -> "ClipPreprocessConfig":
        """Read ``preprocessor_config.json`` in ``model_dir``; defaults from ``image_size`` if absent."""
        path = Path(model_dir) / "preprocessor_config.json"
        if not path.is_file():
            return cls(shortest_edge=image_size, crop_hw=(image_size, image_size))
        cfg: dict[str, Any] = json.loads(path.read_text())
        shortest_edge, resize_hw, crop_hw = None, None, None
        if cfg.get("do_resize", True):
            size = cfg.get("size", image_size)
            if isinstance(size, int):
                shortest_edge = size
            elif isinstance(size, dict) and "shortest_edge" in size:
                shortest_edge = int(size["shortest_edge"])
            elif isinstance(size, dict) and {"height", "width"} <= set(size):
                resize_hw = (int(size["height"]), int(size["width"]))
            else:
                raise ValueError(f"{path}: unsupported 'size' {size!r}")
        if cfg.get("do_center_crop", True):
            crop = cfg.get("crop_size", image_size)
            crop_hw = (crop, crop) if isinstance(crop, int) else (int(crop["height"]), int(crop["width"]))
        normalize = cfg.get("do_normalize", True)
        mean = tuple(float(v) for v in cfg.get("image_mean", OPENAI_CLIP_MEAN)) if normalize else (0.0, 0.0, 0.0)
        std = tuple(float(v) for v in cfg.get("image_std", OPENAI_CLIP_STD)) if normalize else (1.0, 1.0, 1.0)
        return cls(shortest_edge=shortest_edge, resize_hw=resize_hw, crop_hw=crop_hw, mean=mean, std=std)

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        """``[N, 3, H, W]`` in ``[0, 1]`` -> normalised pixel values for the vision tower."""
        x = images.float()
        height, width = x.shape[-2:]
        target: tuple[int, int] | None = self.resize_hw
        if self.shortest_edge is not None:
            ratio = self.shortest_edge / min(height, width)
            target = (max(1, round(height * ratio)), max(1, round(width * ratio)))
        x = _resize(x, target)
        if self.crop_hw is not None:
            crop_h, crop_w = self.crop_hw
            height, width = x.shape[-2:]
            if height < crop_h or width < crop_w:
                x = _resize(x, self.crop_hw)
            else:
                top, left = (height - crop_h) // 2, (width - crop_w) // 2
                x = x[..., top : top + crop_h, left : left + crop_w]
        mean = torch.tensor(self.mean, dtype=x.dtype, device=x.device).view(1, -1, 1, 1)
        std = torch.tensor(self.std, dtype=x.dtype, device=x.device).view(1, -1, 1, 1)
        return (x - mean) / std


def _resize(x: torch.Tensor, size: tuple[int, int] | None) -> torch.Tensor:
    if size is None or tuple(x.shape[-2:]) == tuple(size):
        return x
    return F.interpolate(x, size=size, mode="bicubic", align_corners=False, antialias=True).clamp(0.0, 1.0)


@register_reward("clip_score")
class ClipScoreReward(RewardFn):
    """``scale * cosine(CLIP image embedding, CLIP text embedding)`` per sample.

    Args:
        model_path: local directory holding a ``transformers`` CLIP checkpoint
            (``config.json`` + weights, tokenizer files, optionally ``preprocessor_config.json``).
        device: where the model runs (``"cpu"``, ``"cuda"``, ``"cuda:1"``...).
        dtype: model dtype name (``"float32"``, ``"bfloat16"``, ``"float16"``).
        scale: multiplies the cosine similarity.
        batch_size: images per forward pass of the vision tower.

    Scores are computed without gradients.
    """

    def __init__(
        self,
        model_path: str,
        device: str = "cpu",
        dtype: str = "float32",
        scale: float = 1.0,
        batch_size: int = 64,
    ) -> None:
        from transformers import AutoTokenizer, CLIPModel

        path = Path(model_path).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(f"reward 'clip_score': CLIP model directory {str(model_path)!r} does not exist")
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"reward 'clip_score': {str(model_path)!r} has no config.json; expected a transformers CLIP checkpoint"
            )
        torch_dtype = getattr(torch, dtype, None)
        if not isinstance(torch_dtype, torch.dtype) or not torch_dtype.is_floating_point:
            raise ValueError(f"reward 'clip_score': dtype must name a floating torch dtype, got {dtype!r}")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"reward 'clip_score': batch_size must be an int >= 1, got {batch_size!r}")

        self.model_path = str(path)
        self.device = torch.device(device)
        self.dtype = torch_dtype
        self.scale = float(scale)
        self.batch_size = batch_size
        self.model = CLIPModel.from_pretrained(self.model_path, local_files_only=True)
        self.model.to(device=self.device, dtype=self.dtype).eval().requires_grad_(False)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path, local_files_only=True)
        self.max_text_length = int(self.model.config.text_config.max_position_embeddings)
        self.preprocess = ClipPreprocessConfig.from_pretrained_dir(path, self.model.config.vision_config.image_size)

    @torch.no_grad()
    def image_embeddings(self, images: torch.Tensor) -> torch.Tensor:
        """L2-normalised projected image embeddings ``[N, D]`` (float32) of ``[N, 3, H, W]`` in ``[0, 1]``."""
        outputs = []
        for start in range(0, images.shape[0], self.batch_size):
            pixels = self.preprocess(images[start : start + self.batch_size].to(self.device))
            vision = self.model.vision_model(pixel_values=pixels.to(self.dtype))
            outputs.append(self.model.visual_projection(vision.pooler_output).float())
        return F.normalize(torch.cat(outputs), dim=-1)

    @torch.no_grad()
    def text_embeddings(self, prompts: list[str]) -> torch.Tensor:
        """L2-normalised projected text embeddings ``[N, D]`` (float32)."""
        tokens = self.tokenizer(
            prompts, padding=True, truncation=True, max_length=self.max_text_length, return_tensors="pt"
        ).to(self.device)
        text = self.model.text_model(input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"])
        return F.normalize(self.model.text_projection(text.pooler_output).float(), dim=-1)

    def score_images(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        # GRPO batches repeat each prompt many times: embed every distinct prompt once.
        position = {prompt: i for i, prompt in enumerate(dict.fromkeys(prompts))}
        text = self.text_embeddings(list(position))
        index = torch.tensor([position[p] for p in prompts], device=text.device)
        image = self.image_embeddings(images)
        return self.scale * (image * text[index]).sum(dim=-1)

    def __repr__(self) -> str:
        return f"ClipScoreReward(model_path={self.model_path!r}, device={str(self.device)!r}, scale={self.scale:g})"


# --------------------------------------------------------------------------- tiny checkpoint


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2 / CLIP byte -> printable unicode character table used by byte-level BPE."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def build_tiny_clip(out_dir: str | os.PathLike[str], *, seed: int = 0) -> str:
    """Write a tiny random CLIP checkpoint (model, tokenizer, preprocessor) to ``out_dir``.

    Vision: 32x32 images, 8x8 patches, hidden 32, 1 layer. Text: byte-level BPE over the
    256 byte symbols (no merges), 16 positions, hidden 32, 1 layer. Projection dim 16.
    Deterministic for a given ``seed`` (the global RNG state is left untouched). Meant
    for smoke tests: the scores are meaningless. Returns ``out_dir`` as a string.
    """
    from transformers import CLIPConfig, CLIPModel, CLIPTokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    symbols = list(_bytes_to_unicode().values())
    vocab = {s: i for i, s in enumerate(symbols)}
    vocab.update({s + "</w>": len(symbols) + i for i, s in enumerate(symbols)})
    bos_id, eos_id = len(vocab), len(vocab) + 1
    vocab["<|startoftext|>"] = bos_id
    vocab["<|endoftext|>"] = eos_id
    max_positions = 16

    if "vocab" in inspect.signature(CLIPTokenizer.__init__).parameters:  # transformers >= 5: in memory
        tokenizer = CLIPTokenizer(vocab=vocab, merges=[], model_max_length=max_positions)
    else:  # transformers 4.x: the (slow) tokenizer reads vocab.json / merges.txt
        (out / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
        (out / "merges.txt").write_text("#version: 0.2\n", encoding="utf-8")
        tokenizer = CLIPTokenizer.from_pretrained(str(out), model_max_length=max_positions)
    tokenizer.save_pretrained(str(out))

    config = CLIPConfig(
        text_config={
            "vocab_size": len(vocab),
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "max_position_embeddings": max_positions,
            "bos_token_id": bos_id,
            "eos_token_id": eos_id,
            "pad_token_id": eos_id,
        },
        vision_config={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "image_size": 32,
            "patch_size": 8,
        },
        projection_dim=16,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = CLIPModel(config)
    model.save_pretrained(str(out))

    # What CLIPImageProcessor.save_pretrained writes, without depending on its class layout.
    preprocessor = {
        "image_processor_type": "CLIPImageProcessor",
        "do_resize": True,
        "size": {"shortest_edge": 32},
        "resample": 3,  # bicubic
        "do_center_crop": True,
        "crop_size": {"height": 32, "width": 32},
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": list(OPENAI_CLIP_MEAN),
        "image_std": list(OPENAI_CLIP_STD),
        "do_convert_rgb": True,
    }
    (out / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2) + "\n")
    return str(out)
