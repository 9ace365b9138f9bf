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


def tiny_open_clip_state(seed: int = 5) -> dict[str, torch.Tensor]:
    """A random open_clip ViT state dict (the HPSv2 ``.pt`` layout) sized like the tiny CLIP:
    32x32 images, 8x8 patches, widths 32, 2 layers per tower, 16 text positions, 514+2 tokens."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape: int, scale: float = 0.2) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    state = {
        "visual.conv1.weight": r(32, 3, 8, 8),
        "visual.class_embedding": r(32),
        "visual.positional_embedding": r(17, 32),
        "visual.ln_pre.weight": 1 + r(32),
        "visual.ln_pre.bias": r(32),
        "visual.ln_post.weight": 1 + r(32),
        "visual.ln_post.bias": r(32),
        "visual.proj": r(32, 16),
        "token_embedding.weight": r(514, 32),
        "positional_embedding": r(16, 32),
        "ln_final.weight": 1 + r(32),
        "ln_final.bias": r(32),
        "text_projection": r(32, 16),
        "logit_scale": torch.tensor(2.5),
    }
    for tower in ("visual.transformer", "transformer"):
        for i in range(2):
            p = f"{tower}.resblocks.{i}"
            state |= {
                f"{p}.ln_1.weight": 1 + r(32), f"{p}.ln_1.bias": r(32),
                f"{p}.attn.in_proj_weight": r(96, 32), f"{p}.attn.in_proj_bias": r(96),
                f"{p}.attn.out_proj.weight": r(32, 32), f"{p}.attn.out_proj.bias": r(32),
                f"{p}.ln_2.weight": 1 + r(32), f"{p}.ln_2.bias": r(32),
                f"{p}.mlp.c_fc.weight": r(64, 32), f"{p}.mlp.c_fc.bias": r(64),
                f"{p}.mlp.c_proj.weight": r(32, 64), f"{p}.mlp.c_proj.bias": r(32),
            }  # fmt: skip
    return state


def open_clip_forward(state: dict, images: torch.Tensor, tokens: torch.Tensor, heads: int = 2) -> torch.Tensor:
    """open_clip's ViT maths in plain torch ops on its own tensor names: pre-LN residual blocks
    with a fused-qkv attention and exact GELU, class-token / end-of-text pooling, ``x @ proj``;
    returns the HPS score ``cos(image, text)``."""

    def ln(x, p):
        return F.layer_norm(x, x.shape[-1:], state[f"{p}.weight"], state[f"{p}.bias"], 1e-5)

    def tower(x, prefix, causal):
        n, length, width = x.shape
        mask = torch.full((length, length), float("-inf")).triu(1) if causal else torch.zeros(length, length)
        for i in range(2):
            p = f"{prefix}.resblocks.{i}"
            h = ln(x, f"{p}.ln_1") @ state[f"{p}.attn.in_proj_weight"].T + state[f"{p}.attn.in_proj_bias"]
            q, k, v = (t.reshape(n, length, heads, width // heads).transpose(1, 2) for t in h.split(width, dim=-1))
            att = ((q @ k.transpose(-1, -2)) / (width // heads) ** 0.5 + mask).softmax(-1) @ v
            att = att.transpose(1, 2).reshape(n, length, width)
            x = x + att @ state[f"{p}.attn.out_proj.weight"].T + state[f"{p}.attn.out_proj.bias"]
            h = F.gelu(ln(x, f"{p}.ln_2") @ state[f"{p}.mlp.c_fc.weight"].T + state[f"{p}.mlp.c_fc.bias"])
            x = x + h @ state[f"{p}.mlp.c_proj.weight"].T + state[f"{p}.mlp.c_proj.bias"]
        return x

    x = F.conv2d(images, state["visual.conv1.weight"], stride=8).flatten(2).transpose(1, 2)
    cls = state["visual.class_embedding"].expand(x.shape[0], 1, -1)
    x = ln(torch.cat([cls, x], dim=1) + state["visual.positional_embedding"], "visual.ln_pre")
    image = ln(tower(x, "visual.transformer", causal=False)[:, 0], "visual.ln_post") @ state["visual.proj"]
    t = state["token_embedding.weight"][tokens] + state["positional_embedding"]
    t = ln(tower(t, "transformer", causal=True), "ln_final")
    text = t[torch.arange(len(tokens)), tokens.argmax(dim=-1)] @ state["text_projection"]
    return (F.normalize(image, dim=-1) * F.normalize(text, dim=-1)).sum(-1)


def test_hpsv2_from_an_open_clip_checkpoint_matches_open_clip_maths(clip_dir: str, tmp_path, monkeypatch) -> None:
    """The original HPS ``.pt`` layout ({"state_dict": open_clip tensors}) is converted on load;
    the score equals an independent plain-torch open_clip forward over the original tensors."""
    from transformers import CLIPTokenizer

    state = tiny_open_clip_state()
    torch.save({"state_dict": {f"module.{k}": v for k, v in state.items()}}, tmp_path / "HPS_tiny.pt")
    kwargs = {"processor_path": clip_dir, "vision_head_width": 16, "text_head_width": 16}  # 2 heads per tower
    reward = build_reward("hpsv2", model_path=str(tmp_path / "HPS_tiny.pt"), **kwargs)
    images = quantised_rand(3, 3, 32, 32, seed=6)
    mean = torch.tensor(OPENAI_CLIP_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(OPENAI_CLIP_STD).view(1, 3, 1, 1)
    # open_clip pads every prompt to the context length (16 here) after the end-of-text token
    tokens = CLIPTokenizer.from_pretrained(clip_dir)(PROMPTS, padding="max_length", max_length=16, return_tensors="pt")
    with torch.no_grad():
        expected = open_clip_forward(state, (images - mean) / std, tokens["input_ids"])
    scores = reward(images, PROMPTS)
    torch.testing.assert_close(scores, expected, atol=1e-5, rtol=1e-4)
    assert scores[0] != scores[1]

    # the same file named inside a directory, or inside a hub id (through the huggingface_hub cache)
    by_dir = build_reward("hpsv2", model_path=str(tmp_path), filename="HPS_tiny.pt", **kwargs)
    torch.testing.assert_close(by_dir(images, PROMPTS), scores)
    import huggingface_hub

    calls = []

    def fake_download(repo_id: str, filename: str, **_: object) -> str:
        calls.append((repo_id, filename))
        return str(tmp_path / filename)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    by_hub = build_reward("hpsv2", model_path="xswu/HPSv2", filename="HPS_tiny.pt", **kwargs)
    assert calls == [("xswu/HPSv2", "HPS_tiny.pt")]
    torch.testing.assert_close(by_hub(images, PROMPTS), scores)
    with pytest.raises(FileNotFoundError, match="no HPS_v2.1_compressed.pt in"):
        build_reward("hpsv2", model_path=str(tmp_path), filename="HPS_v2.1_compressed.pt", **kwargs)

    class Payload:
        def __reduce__(self):
            return (print, ("code ran",))

    torch.save({"state_dict": {"visual.proj": Payload()}}, tmp_path / "evil.pt")
    with pytest.raises(Exception, match="Weights only load failed|Unsupported global"):
        build_reward("hpsv2", model_path=str(tmp_path / "evil.pt"), **kwargs)
    torch.save({"state_dict": {"w": torch.zeros(1)}}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="not an open_clip ViT state dict"):
        build_reward("hpsv2", model_path=str(tmp_path / "other.pt"), **kwargs)
