"""Preference-model rewards (verl_digen.rewards.preference) on tiny random CLIP weights built in
code (``build_tiny_clip``), loaded through the same ``from_pretrained`` / ``torch.load`` code as
real checkpoints; every score is checked against a hand computation from the model's parts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from verl_digen.rewards import build_reward, build_tiny_clip
from verl_digen.rewards.clip_score import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
from verl_digen.rewards.preference import AestheticMLP

from runs import quantised_rand

PROMPTS = ["a red apple", "two dogs playing", "a red apple"]


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory) -> str:
    return build_tiny_clip(tmp_path_factory.mktemp("tiny_clip"), seed=3)


def hand_embeddings(clip_dir: str, images: torch.Tensor, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Image and text features by hand: 32x32 images need no resize or crop (the tiny model's
    size), so preprocessing is (x - mean) / std; then each tower, its projection, L2 norm."""
    from transformers import CLIPModel, CLIPTokenizer

    model = CLIPModel.from_pretrained(clip_dir).eval()
    tokenizer = CLIPTokenizer.from_pretrained(clip_dir)
    mean = torch.tensor(OPENAI_CLIP_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(OPENAI_CLIP_STD).view(1, 3, 1, 1)
    with torch.no_grad():
        pooled = model.vision_model(pixel_values=(images - mean) / std).pooler_output
        image = F.normalize(model.visual_projection(pooled), dim=-1)
        tokens = tokenizer(prompts, padding=True, return_tensors="pt")
        text_pooled = model.text_model(input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"]).pooler_output
        text = F.normalize(model.text_projection(text_pooled), dim=-1)
    return image, text, float(model.logit_scale.exp())


def test_pickscore_matches_hand_computation(clip_dir: str) -> None:
    images = quantised_rand(3, 3, 32, 32, seed=1)
    reward = build_reward("pickscore", model_path=clip_dir, processor_path=clip_dir)
    image, text, scale = hand_embeddings(clip_dir, images, PROMPTS)
    expected = scale * (image * text).sum(-1) / 26.0
    torch.testing.assert_close(reward(images, PROMPTS), expected, atol=1e-5, rtol=1e-4)
    raw = build_reward("pickscore", model_path=clip_dir, processor_path=clip_dir, divisor=1.0)
    torch.testing.assert_close(raw(images, PROMPTS), expected * 26.0, atol=1e-4, rtol=1e-4)


def test_hpsv2_is_the_cosine_without_logit_scale(clip_dir: str) -> None:
    images = quantised_rand(3, 3, 32, 32, seed=2)
    reward = build_reward("hpsv2", model_path=clip_dir)
    image, text, _ = hand_embeddings(clip_dir, images, PROMPTS)
    scores = reward(images, PROMPTS)
    torch.testing.assert_close(scores, (image * text).sum(-1), atol=1e-5, rtol=1e-4)
    assert scores[0] != scores[1]


def test_preference_preprocessing_is_the_checkpoints_clip_processor(clip_dir: str) -> None:
    """A 40x48 image is resized and cropped by the checkpoint's own CLIPProcessor, on 8-bit RGB."""
    from transformers import CLIPModel, CLIPProcessor

    images = quantised_rand(2, 3, 40, 48, seed=3)
    reward = build_reward("hpsv2", model_path=clip_dir)
    model = CLIPModel.from_pretrained(clip_dir).eval()
    processor = CLIPProcessor.from_pretrained(clip_dir)
    arrays = [(img.permute(1, 2, 0) * 255).round().to(torch.uint8).numpy() for img in images]
    inputs = processor(images=arrays, text=PROMPTS[:2], padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = model(**inputs).logits_per_image / model.logit_scale.exp()
    torch.testing.assert_close(reward(images, PROMPTS[:2]), logits.diagonal(), atol=1e-5, rtol=1e-4)


def test_aesthetic_matches_hand_computation_and_loads_tensors_only(clip_dir: str, tmp_path) -> None:
    torch.manual_seed(0)
    head = AestheticMLP(16)  # the tiny CLIP's projection is 16-d (the real head: 768, CLIP ViT-L/14)
    torch.save(head.state_dict(), tmp_path / "head.pth")
    reward = build_reward("aesthetic", head_path=str(tmp_path / "head.pth"), clip_path=clip_dir)
    images = quantised_rand(3, 3, 32, 32, seed=4)
    image, _, _ = hand_embeddings(clip_dir, images, PROMPTS)
    x = image
    for layer in head.layers:  # Linear layers by hand; dropout is the identity at inference
        if isinstance(layer, torch.nn.Linear):
            x = x @ layer.weight.detach().T + layer.bias.detach()
    torch.testing.assert_close(reward(images, PROMPTS), x.squeeze(-1), atol=1e-5, rtol=1e-4)

    class Payload:
        def __reduce__(self):
            return (print, ("code ran",))

    torch.save({"layers.0.weight": Payload()}, tmp_path / "evil.pth")
    with pytest.raises(Exception, match="Weights only load failed|Unsupported global"):
        build_reward("aesthetic", head_path=str(tmp_path / "evil.pth"), clip_path=clip_dir)
    torch.save({"w": torch.zeros(1)}, tmp_path / "other.pth")
    with pytest.raises(ValueError, match="not the aesthetic MLP's state dict"):
        build_reward("aesthetic", head_path=str(tmp_path / "other.pth"), clip_path=clip_dir)


def test_missing_checkpoints_are_named(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match=r"'pickscore': cannot load the CLIP model from .*nowhere"):
        build_reward("pickscore", model_path=str(tmp_path / "nowhere"), processor_path=str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="'hpsv2' is missing required argument"):
        build_reward("hpsv2")
