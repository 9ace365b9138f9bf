"""ImageReward (verl_digen.rewards.image_reward) on a tiny random checkpoint built in code in the
ORIGINAL ``ImageReward.pt`` layout (``blip.visual_encoder.*``, ``blip.text_encoder.*``,
``mlp.layers.*``), loaded through the real ``torch.load(weights_only=True)`` path and converted
onto transformers' BLIP. The score is checked against an independent forward written in plain
torch ops over the original tensors, and the preprocessing against a plain PIL / numpy one."""

from __future__ import annotations

import inspect
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from verl_digen.rewards import build_reward
from verl_digen.rewards.clip_score import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
from verl_digen.rewards.image_reward import IMAGE_REWARD_MEAN, IMAGE_REWARD_STD, image_reward_preprocess

from runs import quantised_rand

PROMPTS = ["a red apple", "two dogs playing", "a red apple"]
WORDS = ["a", "red", "apple", "two", "dogs", "playing", "cat", "blue"]
V_WIDTH, V_HEADS, PATCH, IMAGE = 32, 2, 8, 32
T_WIDTH, T_HEADS, LAYERS = 24, 2, 2


def tiny_image_reward_state(vocab_size: int, seed: int = 7) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def r(*shape: int, scale: float = 0.2) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    def norm(prefix: str, width: int) -> dict[str, torch.Tensor]:
        return {f"{prefix}.weight": 1 + r(width), f"{prefix}.bias": r(width)}

    def linear(prefix: str, out: int, inp: int) -> dict[str, torch.Tensor]:
        return {f"{prefix}.weight": r(out, inp), f"{prefix}.bias": r(out)}

    v, t = "blip.visual_encoder", "blip.text_encoder"
    grid = IMAGE // PATCH
    state = {
        f"{v}.cls_token": r(1, 1, V_WIDTH),
        f"{v}.pos_embed": r(1, grid * grid + 1, V_WIDTH),
        f"{v}.patch_embed.proj.weight": r(V_WIDTH, 3, PATCH, PATCH),
        f"{v}.patch_embed.proj.bias": r(V_WIDTH),
        **norm(f"{v}.norm", V_WIDTH),
        f"{t}.embeddings.word_embeddings.weight": r(vocab_size, T_WIDTH),
        f"{t}.embeddings.position_embeddings.weight": r(40, T_WIDTH),
        f"{t}.embeddings.position_ids": torch.arange(40).unsqueeze(0),  # a buffer in the original
        **norm(f"{t}.embeddings.LayerNorm", T_WIDTH),
        **linear("blip.vision_proj", 16, V_WIDTH),  # unused by the score: ignored
        **linear("blip.text_proj", 16, T_WIDTH),
    }
    for i in range(LAYERS):
        b = f"{v}.blocks.{i}"
        state |= norm(f"{b}.norm1", V_WIDTH) | norm(f"{b}.norm2", V_WIDTH)
        state |= linear(f"{b}.attn.qkv", 3 * V_WIDTH, V_WIDTH) | linear(f"{b}.attn.proj", V_WIDTH, V_WIDTH)
        state |= linear(f"{b}.mlp.fc1", 2 * V_WIDTH, V_WIDTH) | linear(f"{b}.mlp.fc2", V_WIDTH, 2 * V_WIDTH)
        l = f"{t}.encoder.layer.{i}"
        for att, kv_width in (("attention", T_WIDTH), ("crossattention", V_WIDTH)):
            state |= linear(f"{l}.{att}.self.query", T_WIDTH, T_WIDTH)
            state |= linear(f"{l}.{att}.self.key", T_WIDTH, kv_width) | linear(f"{l}.{att}.self.value", T_WIDTH, kv_width)
            state |= linear(f"{l}.{att}.output.dense", T_WIDTH, T_WIDTH) | norm(f"{l}.{att}.output.LayerNorm", T_WIDTH)
        state |= linear(f"{l}.intermediate.dense", 2 * T_WIDTH, T_WIDTH)
        state |= linear(f"{l}.output.dense", T_WIDTH, 2 * T_WIDTH) | norm(f"{l}.output.LayerNorm", T_WIDTH)
    sizes = [T_WIDTH, 1024, 128, 64, 16, 1]
    for index, (inp, out) in zip((0, 2, 4, 6, 7), zip(sizes, sizes[1:])):
        state |= linear(f"mlp.layers.{index}", out, inp)
    return state


def hand_score(state: dict, pixels: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """BLIP ViT + BERT-with-cross-attention + MLP head in plain torch ops on the original names."""

    def lin(x, p):
        return x @ state[f"{p}.weight"].T + state[f"{p}.bias"]

    def ln(x, p, eps):
        return F.layer_norm(x, x.shape[-1:], state[f"{p}.weight"], state[f"{p}.bias"], eps)

    def attend(q, k, v, heads, bias):
        n, lq, width = q.shape
        split = lambda x: x.reshape(n, x.shape[1], heads, width // heads).transpose(1, 2)  # noqa: E731
        weights = (split(q) @ split(k).transpose(-1, -2) / (width // heads) ** 0.5 + bias).softmax(-1)
        return (weights @ split(v)).transpose(1, 2).reshape(n, lq, width)

    v, t = "blip.visual_encoder", "blip.text_encoder"
    x = F.conv2d(pixels, state[f"{v}.patch_embed.proj.weight"], state[f"{v}.patch_embed.proj.bias"], stride=PATCH)
    x = torch.cat([state[f"{v}.cls_token"].expand(len(x), 1, -1), x.flatten(2).transpose(1, 2)], 1)
    x = x + state[f"{v}.pos_embed"]
    for i in range(LAYERS):
        b = f"{v}.blocks.{i}"
        q, k, val = lin(ln(x, f"{b}.norm1", 1e-6), f"{b}.attn.qkv").chunk(3, dim=-1)
        x = x + lin(attend(q, k, val, V_HEADS, 0.0), f"{b}.attn.proj")
        x = x + lin(F.gelu(lin(ln(x, f"{b}.norm2", 1e-6), f"{b}.mlp.fc1")), f"{b}.mlp.fc2")
    image = ln(x, f"{v}.norm", 1e-6)

    h = state[f"{t}.embeddings.word_embeddings.weight"][ids]
    h = ln(h + state[f"{t}.embeddings.position_embeddings.weight"][: ids.shape[1]], f"{t}.embeddings.LayerNorm", 1e-12)
    pad_bias = (1.0 - mask[:, None, None, :].float()) * -10000.0  # BERT's extended attention mask
    for i in range(LAYERS):
        l = f"{t}.encoder.layer.{i}"
        for att, source, bias in (("attention", None, pad_bias), ("crossattention", image, 0.0)):
            kv = h if source is None else source
            a = attend(lin(h, f"{l}.{att}.self.query"), lin(kv, f"{l}.{att}.self.key"), lin(kv, f"{l}.{att}.self.value"), T_HEADS, bias)
            h = ln(lin(a, f"{l}.{att}.output.dense") + h, f"{l}.{att}.output.LayerNorm", 1e-12)
        ff = lin(F.gelu(lin(h, f"{l}.intermediate.dense")), f"{l}.output.dense")
        h = ln(ff + h, f"{l}.output.LayerNorm", 1e-12)
    r = h[:, 0]
    for index in (0, 2, 4, 6, 7):  # the Linear layers; dropout is the identity at inference
        r = lin(r, f"mlp.layers.{index}")
    return (r.squeeze(-1) - IMAGE_REWARD_MEAN) / IMAGE_REWARD_STD


def reference_preprocess(images: torch.Tensor, size: int) -> torch.Tensor:
    """torchvision's Resize(size, BICUBIC) / CenterCrop(size) / ToTensor / Normalize on PIL images,
    spelled out with PIL's own resize and crop."""
    out = []
    for img in images:
        pil = Image.fromarray((img.permute(1, 2, 0) * 255).round().to(torch.uint8).numpy())
        w, h = pil.size
        scale = size / min(w, h)
        new = (size, int(size * h / w)) if w <= h else (int(size * w / h), size)
        assert abs(new[0] - w * scale) < 1 and abs(new[1] - h * scale) < 1
        pil = pil.resize(new, Image.BICUBIC)
        left, top = int(round((new[0] - size) / 2.0)), int(round((new[1] - size) / 2.0))
        pil = pil.crop((left, top, left + size, top + size))
        x = torch.tensor(np.array(pil), dtype=torch.float32).permute(2, 0, 1) / 255.0
        out.append((x - torch.tensor(OPENAI_CLIP_MEAN)[:, None, None]) / torch.tensor(OPENAI_CLIP_STD)[:, None, None])
    return torch.stack(out)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(model dir with ImageReward.pt + med_config.json, tokenizer dir, original state dict)."""
    from transformers import BertTokenizer

    root = tmp_path_factory.mktemp("image_reward")
    (root / "bert").mkdir()
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
    if "vocab" in inspect.signature(BertTokenizer.__init__).parameters:  # transformers >= 5: in memory
        tokenizer = BertTokenizer(vocab={w: i for i, w in enumerate(words)})
    else:  # transformers 4.x reads vocab.txt
        (root / "bert" / "vocab.txt").write_text("\n".join(words) + "\n")
        tokenizer = BertTokenizer(vocab_file=str(root / "bert" / "vocab.txt"))
    tokenizer.save_pretrained(str(root / "bert"))
    state = tiny_image_reward_state(vocab_size=5 + len(WORDS) + 2)  # + BLIP's [DEC] and [ENC]
    (root / "model").mkdir()
    torch.save(state, root / "model" / "ImageReward.pt")
    config = {"hidden_size": T_WIDTH, "num_attention_heads": T_HEADS, "layer_norm_eps": 1e-12, "add_cross_attention": True}
    (root / "model" / "med_config.json").write_text(json.dumps(config))
    return str(root / "model"), str(root / "bert"), state


def test_image_reward_matches_an_independent_forward_over_the_original_tensors(checkpoint) -> None:
    model_dir, bert_dir, state = checkpoint
    reward = build_reward("imagereward", model_path=model_dir, tokenizer_path=bert_dir, vision_heads=V_HEADS, batch_size=2)
    images = quantised_rand(3, 3, 40, 48, seed=8)  # resized (shorter side 40 -> 32) and centre-cropped
    tokens = reward.tokenizer(PROMPTS, padding="max_length", truncation=True, max_length=35, return_tensors="pt")
    assert tokens["input_ids"].shape == (3, 35) and tokens["input_ids"][0, 0] == reward.tokenizer.cls_token_id
    assert reward.tokenizer.unk_token_id not in tokens["input_ids"].tolist()[1]  # every word in the tiny vocab
    with torch.no_grad():
        expected = hand_score(state, reference_preprocess(images, IMAGE), tokens["input_ids"], tokens["attention_mask"])
    scores = reward(images, PROMPTS)
    torch.testing.assert_close(scores, expected, atol=1e-5, rtol=1e-4)
    assert scores[0] != scores[2]  # same prompt, different image
    # the prompt matters (the text reads the image through cross-attention, and vice versa)
    other = reward(images[:1], ["two dogs playing"])
    assert not torch.allclose(other, scores[:1])


def test_image_reward_preprocessing_is_the_references(checkpoint) -> None:
    for shape in ((250, 300), (300, 250), (224, 224), (100, 101)):
        images = quantised_rand(2, 3, *shape, seed=sum(shape))
        torch.testing.assert_close(image_reward_preprocess(images, 224), reference_preprocess(images, 224), atol=1e-6, rtol=0)


def test_image_reward_loads_tensors_only_from_file_dir_or_hub_cache(checkpoint, tmp_path, monkeypatch) -> None:
    model_dir, bert_dir, _ = checkpoint
    kwargs = {"tokenizer_path": bert_dir, "vision_heads": V_HEADS}
    images = quantised_rand(2, 3, 32, 32, seed=9)
    by_dir = build_reward("imagereward", model_path=model_dir, **kwargs)(images, PROMPTS[:2])
    by_file = build_reward("imagereward", model_path=f"{model_dir}/ImageReward.pt", **kwargs)(images, PROMPTS[:2])
    torch.testing.assert_close(by_dir, by_file)

    import huggingface_hub

    calls = []

    def fake_download(repo_id: str, filename: str, **_: object) -> str:
        calls.append((repo_id, filename))
        return f"{model_dir}/{filename}"

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    by_hub = build_reward("imagereward", model_path="THUDM/ImageReward", **kwargs)(images, PROMPTS[:2])
    assert calls == [("THUDM/ImageReward", "ImageReward.pt")]
    torch.testing.assert_close(by_dir, by_hub)

    class Payload:
        def __reduce__(self):
            return (print, ("code ran",))

    torch.save({"mlp.layers.0.weight": Payload()}, tmp_path / "evil.pt")
    with pytest.raises(Exception, match="Weights only load failed|Unsupported global"):
        build_reward("imagereward", model_path=str(tmp_path / "evil.pt"), **kwargs)
    torch.save({"w": torch.zeros(1)}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="not an ImageReward state dict"):
        build_reward("imagereward", model_path=str(tmp_path / "other.pt"), **kwargs)
    with pytest.raises(FileNotFoundError, match="no ImageReward.pt"):
        build_reward("imagereward", model_path=str(tmp_path), **kwargs)
