"""Human-preference rewards on CLIP backbones: PickScore, HPSv2.1 and the LAION aesthetic predictor.

Each loads with ``transformers`` (``CLIPModel`` / ``CLIPProcessor.from_pretrained``) from a local
directory or a hub id, and preprocesses exactly as its reference implementation does: the
checkpoint's ``CLIPProcessor`` on 8-bit RGB images (resize the shortest edge, bicubic; centre
crop; normalise), prompts tokenised with padding and truncation to the text tower's length.

* ``pickscore`` (Kirstain et al., 2023; Flow-GRPO's preference reward): ``exp(logit_scale) *
  cos(text, image) / divisor``, with ``divisor=26`` as Flow-GRPO uses it to bring the score
  near ``[0, 1]`` (``divisor=1``: raw PickScore). Defaults: model ``yuvalkirstain/PickScore_v1``,
  processor ``laion/CLIP-ViT-H-14-laion2B-s32B-b79K`` (what PickScore's own code loads).
* ``hpsv2`` (HPSv2 / v2.1, Wu et al., 2023): ``cos(image, text)`` of the fine-tuned OpenCLIP
  ViT-H-14 (HPSv2's ``image_features @ text_features.T`` diagonal, features L2-normalised; no
  logit scale). ``model_path``: the original open_clip checkpoint file (``HPS_v2.1_compressed.pt``,
  read with ``torch.load(weights_only=True)`` and converted in memory by
  :mod:`verl_digen.rewards.open_clip_convert`; ``processor_path`` then names the CLIP processor,
  e.g. ``laion/CLIP-ViT-H-14-laion2B-s32B-b79K``, whose tokenizer and 224 px bicubic resize /
  centre crop / OpenAI normalisation are open_clip's) or a ``transformers`` CLIP directory / hub
  id. The ``hpsv2`` / ``open_clip`` packages need ``torchvision`` and pin old ``pytest`` /
  ``protobuf`` versions, which do not install next to this package's pinned CPU ``torch``.
* ``aesthetic`` (LAION improved aesthetic predictor, ``sac+logos+ava1-l14-linearMSE.pth``):
  the MLP ``Linear(768, 1024), Dropout, Linear(1024, 128), Dropout, Linear(128, 64), Dropout,
  Linear(64, 16), Linear(16, 1)`` on the L2-normalised CLIP ViT-L/14 image embedding (the
  DDPO / Flow-GRPO ``aesthetic_scorer``); scores are on the AVA 1-10 scale. The head file is
  read with ``torch.load(weights_only=True)`` (tensors only) or as safetensors.

All are pure functions of the pixels and the prompt, computed without gradients.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from verl_digen.rewards.base import RewardFn, register_reward
from verl_digen.rewards.jpeg import to_uint8_hwc

__all__ = ["PickScoreReward", "HpsV2Reward", "AestheticReward", "AestheticMLP"]


def _dtype(reward: str, dtype: str) -> torch.dtype:
    value = getattr(torch, dtype, None) if isinstance(dtype, str) else None
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise ValueError(f"reward {reward!r}: dtype must name a floating torch dtype, got {dtype!r}")
    return value


def _load_clip(reward: str, model_path: str, processor_path: str | None, device: str, dtype: torch.dtype):
    from transformers import CLIPModel, CLIPProcessor

    def load(loader: Any, path: str, what: str) -> Any:
        local = Path(path).expanduser()
        if local.exists() and not local.is_dir():
            raise FileNotFoundError(f"reward {reward!r}: {what} {path!r} is a file, expected a directory or hub id")
        looks_local = local.is_absolute() or path.startswith((".", "~")) or path.count("/") > 1
        if looks_local and not local.is_dir():  # not a hub id ("name" or "org/name"): no hub lookup
            raise FileNotFoundError(f"reward {reward!r}: cannot load the {what} from {path!r}: no such directory")
        try:
            return loader.from_pretrained(str(local) if local.is_dir() else path)
        except OSError as exc:
            raise FileNotFoundError(
                f"reward {reward!r}: cannot load the {what} from {path!r} (a local transformers CLIP directory, "
                f"or a hub id when the hub is reachable): {exc}"
            ) from None

    model = load(CLIPModel, model_path, "CLIP model")
    processor = load(CLIPProcessor, processor_path or model_path, "CLIP processor")
    model.to(device=torch.device(device), dtype=dtype).eval().requires_grad_(False)
    return model, processor


def checkpoint_file(reward: str, model_path: str, filename: str | None) -> Path:
    """``model_path`` itself when it is a file; else ``filename`` inside the directory
    ``model_path`` or, for a hub id (``org/name``), fetched through the ``huggingface_hub`` cache."""
    path = Path(model_path).expanduser()
    if path.is_file():
        return path
    if not filename:
        raise FileNotFoundError(f"reward {reward!r}: {model_path!r} is not a file (name the checkpoint file inside it)")
    if path.is_dir():
        if not (path / filename).is_file():
            raise FileNotFoundError(f"reward {reward!r}: no {filename} in {model_path!r}")
        return path / filename
    if path.is_absolute() or model_path.startswith((".", "~")) or model_path.count("/") != 1:
        raise FileNotFoundError(f"reward {reward!r}: {model_path!r} is not a file, a directory or a hub id")
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download(repo_id=model_path, filename=filename))
    except Exception as exc:  # offline, missing repo or file: name what was asked for
        raise FileNotFoundError(f"reward {reward!r}: cannot fetch {filename} from hub id {model_path!r}: {exc}") from None


def _load_open_clip(
    reward: str, model_path: str, processor_path: str | None, device: str, dtype: torch.dtype, head_widths: tuple[int, int]
):
    """An ``open_clip`` ``.pt`` checkpoint file (tensors only), converted to a ``transformers``
    CLIPModel; the tokenizer and image preprocessing come from ``processor_path`` (a CLIP processor)."""
    from transformers import CLIPProcessor

    from verl_digen.rewards.open_clip_convert import open_clip_to_transformers

    if not processor_path:
        raise ValueError(
            f"reward {reward!r}: an open_clip checkpoint needs processor_path (a CLIP processor, e.g. "
            "laion/CLIP-ViT-H-14-laion2B-s32B-b79K for HPSv2.1)"
        )
    checkpoint = torch.load(str(model_path), map_location="cpu", weights_only=True)
    try:
        processor = CLIPProcessor.from_pretrained(processor_path)
    except OSError as exc:
        raise FileNotFoundError(f"reward {reward!r}: cannot load the CLIP processor from {processor_path!r}: {exc}") from None
    tokenizer = processor.tokenizer
    model = open_clip_to_transformers(
        checkpoint,
        vision_head_width=head_widths[0],
        text_head_width=head_widths[1],
        bos_token_id=int(tokenizer.bos_token_id),
        eos_token_id=int(tokenizer.eos_token_id),
    )
    model.to(device=torch.device(device), dtype=dtype).eval().requires_grad_(False)
    return model, processor


class _ClipReward(RewardFn):
    """Shared CLIP plumbing: the reference preprocessing and the L2-normalised embeddings."""

    def _is_open_clip_file(self, model_path: str) -> bool:
        return False

    def _setup(self, model_path: str, processor_path: str | None, device: str, dtype: str, batch_size: int) -> None:
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"reward {self.name!r}: batch_size must be an int >= 1, got {batch_size!r}")
        self.device = torch.device(device)
        self.dtype = _dtype(self.name, dtype)
        self.batch_size = batch_size
        self.model_path = model_path
        if self._is_open_clip_file(model_path):
            self.model, self.processor = _load_open_clip(
                self.name, model_path, processor_path, device, self.dtype, self.head_widths
            )
        else:
            self.model, self.processor = _load_clip(self.name, model_path, processor_path, device, self.dtype)
        self.max_text_length = int(self.model.config.text_config.max_position_embeddings)

    @torch.no_grad()
    def image_embeddings(self, images: torch.Tensor) -> torch.Tensor:
        """L2-normalised image features ``[N, D]`` (float32) of ``[N, 3, H, W]`` images in ``[0, 1]``."""
        arrays = list(to_uint8_hwc(images).numpy())  # the reference feeds 8-bit RGB images
        out = []
        for start in range(0, len(arrays), self.batch_size):
            pixels = self.processor(images=arrays[start : start + self.batch_size], return_tensors="pt")["pixel_values"]
            features = self.model.get_image_features(pixel_values=pixels.to(self.device, self.dtype))
            out.append(_features(features).float())
        return F.normalize(torch.cat(out), dim=-1)

    @torch.no_grad()
    def text_embeddings(self, prompts: list[str]) -> torch.Tensor:
        """L2-normalised text features ``[N, D]`` (float32)."""
        tokens = self.processor(
            text=prompts, padding=True, truncation=True, max_length=self.max_text_length, return_tensors="pt"
        )
        features = self.model.get_text_features(
            input_ids=tokens["input_ids"].to(self.device), attention_mask=tokens["attention_mask"].to(self.device)
        )
        return F.normalize(_features(features).float(), dim=-1)

    def cosine(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        """``cos(image_i, text_i)`` per sample (each distinct prompt embedded once)."""
        position = {prompt: i for i, prompt in enumerate(dict.fromkeys(prompts))}
        text = self.text_embeddings(list(position))
        index = torch.tensor([position[p] for p in prompts], device=text.device)
        return (self.image_embeddings(images) * text[index]).sum(dim=-1).cpu()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(model_path={self.model_path!r}, device={str(self.device)!r})"


def _features(output: Any) -> torch.Tensor:
    """``get_*_features`` returns a tensor (transformers 4) or an output with ``pooler_output`` (5)."""
    return output if isinstance(output, torch.Tensor) else output.pooler_output


@register_reward("pickscore")
class PickScoreReward(_ClipReward):
    """PickScore: ``exp(logit_scale) * cos(text, image) / divisor`` (module docstring)."""

    def __init__(
        self,
        model_path: str = "yuvalkirstain/PickScore_v1",
        processor_path: str | None = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K",
        divisor: float = 26.0,
        device: str = "cpu",
        dtype: str = "float32",
        batch_size: int = 32,
    ) -> None:
        if isinstance(divisor, bool) or not isinstance(divisor, (int, float)) or not divisor > 0:
            raise ValueError(f"reward 'pickscore': divisor must be a number > 0, got {divisor!r}")
        self.divisor = float(divisor)
        self._setup(model_path, processor_path, device, dtype, batch_size)

    def score_images(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        scale = float(self.model.logit_scale.detach().float().exp())
        return scale * self.cosine(images, prompts) / self.divisor


@register_reward("hpsv2")
class HpsV2Reward(_ClipReward):
    """HPSv2.1: ``cos(image, text)`` of the HPS-fine-tuned CLIP (module docstring).

    ``model_path``: the open_clip checkpoint file; or, with ``filename``
    (``HPS_v2.1_compressed.pt``), a directory or hub id (``xswu/HPSv2``) holding it; or, without,
    a ``transformers`` CLIP directory / hub id.
    """

    def __init__(
        self,
        model_path: str,
        processor_path: str | None = None,
        device: str = "cpu",
        dtype: str = "float32",
        batch_size: int = 32,
        filename: str | None = None,
        vision_head_width: int = 80,
        text_head_width: int = 64,
    ) -> None:
        self.head_widths = (vision_head_width, text_head_width)  # open_clip ViT-H-14's (checkpoint files only)
        if filename is not None or Path(model_path).expanduser().is_file():
            model_path = str(checkpoint_file(self.name, model_path, filename))
        self._setup(model_path, processor_path, device, dtype, batch_size)

    def _is_open_clip_file(self, model_path: str) -> bool:
        return Path(model_path).is_file()

    def score_images(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        return self.cosine(images, prompts)


class AestheticMLP(torch.nn.Module):
    """The LAION improved aesthetic predictor's head (``layers.*`` keys of its ``.pth``)."""

    def __init__(self, input_dim: int = 768) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(
            torch.nn.Linear(input_dim, 1024),
            torch.nn.Dropout(0.2),
            torch.nn.Linear(1024, 128),
            torch.nn.Dropout(0.2),
            torch.nn.Linear(128, 64),
            torch.nn.Dropout(0.1),
            torch.nn.Linear(64, 16),
            torch.nn.Linear(16, 1),
        )

    def forward(self, embedding: torch.Tensor) -> torch.Tensor:
        return self.layers(embedding)


@register_reward("aesthetic")
class AestheticReward(_ClipReward):
    """LAION aesthetic score of the image (the prompt is not used; module docstring).

    Args:
        head_path: the MLP's weights (``sac+logos+ava1-l14-linearMSE.pth`` or a safetensors file).
        clip_path: CLIP ViT-L/14 (directory or hub id).
    """

    reads_prompts = False

    def __init__(
        self,
        head_path: str,
        clip_path: str = "openai/clip-vit-large-patch14",
        device: str = "cpu",
        dtype: str = "float32",
        batch_size: int = 32,
    ) -> None:
        self._setup(clip_path, None, device, dtype, batch_size)
        path = Path(head_path).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"reward 'aesthetic': head_path {head_path!r} is not a file")
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(path))
        else:
            state = torch.load(str(path), map_location="cpu", weights_only=True)  # tensors only, never code
        if not isinstance(state, dict) or "layers.0.weight" not in state:
            keys = sorted(state)[:6] if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"reward 'aesthetic': {head_path!r} is not the aesthetic MLP's state dict (keys {keys})")
        embed_dim = int(self.model.config.projection_dim)
        if state["layers.0.weight"].shape[1] != embed_dim:
            raise ValueError(
                f"reward 'aesthetic': the head takes {state['layers.0.weight'].shape[1]}-d embeddings but the CLIP "
                f"model at {clip_path!r} gives {embed_dim}-d ones (the LAION head needs CLIP ViT-L/14)"
            )
        self.head = AestheticMLP(embed_dim)
        self.head.load_state_dict(state)
        self.head.to(self.device).eval().requires_grad_(False)
        self.head_path = str(path)

    @torch.no_grad()
    def score_images(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        embeddings = self.image_embeddings(images).to(self.device)
        return self.head(embeddings).squeeze(-1).float().cpu()
