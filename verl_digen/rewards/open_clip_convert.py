"""Convert an OpenCLIP (``open_clip``) ViT checkpoint's state dict into a ``transformers`` ``CLIPModel``.

HPSv2 / HPSv2.1 publish their fine-tuned OpenCLIP ViT-H-14 as an ``open_clip`` ``.pt`` file
(``HPS_v2.1_compressed.pt``: ``{"state_dict": ...}``); the ``hpsv2`` / ``open_clip`` packages
need ``torchvision``, so this module maps the tensors onto ``transformers``' CLIP instead:

* vision: ``visual.conv1.weight`` (patch embedding, no bias), ``visual.class_embedding``,
  ``visual.positional_embedding``, ``visual.ln_pre``, ``visual.transformer.resblocks.N``,
  ``visual.ln_post`` (on the class token), ``visual.proj`` (``x @ proj``);
* text: ``token_embedding``, ``positional_embedding``, ``transformer.resblocks.N`` (causal),
  ``ln_final``, pooled at the end-of-text token, ``text_projection`` (``x @ text_projection``);
* each residual block: pre-LN ``ln_1`` / ``attn`` (fused ``in_proj_weight`` / ``in_proj_bias``
  split into q, k, v; ``out_proj``) / ``ln_2`` / ``mlp.c_fc``, activation, ``mlp.c_proj``;
* ``logit_scale``.

The shapes give every width, depth, patch and image size; the head counts come from the head
widths (OpenCLIP's ViT-H-14: 80 for the image tower, 64 for the text tower). OpenCLIP's
ViT-H-14 uses exact GELU (``quick_gelu`` is off in its model config), layer norm eps 1e-5.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

__all__ = ["open_clip_to_transformers", "unwrap_state_dict"]


def unwrap_state_dict(checkpoint: Any) -> dict[str, torch.Tensor]:
    """The tensors of an ``open_clip`` / HPS checkpoint: ``{"state_dict": ...}`` or a bare state dict,
    with DDP's ``module.`` prefix removed."""
    state = checkpoint.get("state_dict", checkpoint) if isinstance(checkpoint, Mapping) else None
    if not isinstance(state, Mapping):
        raise ValueError(f"expected a state dict (or {{'state_dict': ...}}), got {type(checkpoint).__name__}")
    out = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            out[key[len("module.") :] if key.startswith("module.") else key] = value
    return out


def _layers(state: Mapping[str, torch.Tensor], prefix: str) -> int:
    n = 0
    while f"{prefix}.resblocks.{n}.ln_1.weight" in state:
        n += 1
    if n == 0:
        raise ValueError(f"no {prefix}.resblocks.0.* tensors: not an open_clip ViT state dict")
    return n


def _blocks(state: Mapping[str, torch.Tensor], src: str, dst: str, layers: int) -> dict[str, torch.Tensor]:
    out = {}
    for i in range(layers):
        s, d = f"{src}.resblocks.{i}", f"{dst}.encoder.layers.{i}"
        q, k, v = state[f"{s}.attn.in_proj_weight"].chunk(3, dim=0)
        qb, kb, vb = state[f"{s}.attn.in_proj_bias"].chunk(3, dim=0)
        for name, w, b in (("q_proj", q, qb), ("k_proj", k, kb), ("v_proj", v, vb)):
            out[f"{d}.self_attn.{name}.weight"], out[f"{d}.self_attn.{name}.bias"] = w, b
        pairs = {
            "attn.out_proj": "self_attn.out_proj",
            "ln_1": "layer_norm1",
            "ln_2": "layer_norm2",
            "mlp.c_fc": "mlp.fc1",
            "mlp.c_proj": "mlp.fc2",
        }
        for a, b in pairs.items():
            out[f"{d}.{b}.weight"] = state[f"{s}.{a}.weight"]
            out[f"{d}.{b}.bias"] = state[f"{s}.{a}.bias"]
    return out


def open_clip_to_transformers(
    state_dict: Mapping[str, torch.Tensor],
    *,
    vision_head_width: int = 80,
    text_head_width: int = 64,
    hidden_act: str = "gelu",
    bos_token_id: int = 49406,
    eos_token_id: int = 49407,
    layer_norm_eps: float = 1e-5,
):
    """A ``transformers`` ``CLIPModel`` (eval mode, float32) with the weights of an ``open_clip``
    ViT state dict (module docstring). ``hidden_act``: ``"gelu"`` (ViT-H-14) or ``"quick_gelu"``
    (OpenAI-pretrained models)."""
    from transformers import CLIPConfig, CLIPModel

    state = unwrap_state_dict(state_dict)
    required = ("visual.conv1.weight", "visual.proj", "token_embedding.weight", "text_projection", "logit_scale")
    missing = [k for k in required if k not in state]
    if missing:
        raise ValueError(f"not an open_clip ViT state dict: missing {missing}")
    conv = state["visual.conv1.weight"]  # [width, 3, patch, patch]
    v_width, patch = conv.shape[0], conv.shape[-1]
    grid = round((state["visual.positional_embedding"].shape[0] - 1) ** 0.5)
    t_width = state["token_embedding.weight"].shape[1]
    v_layers, t_layers = _layers(state, "visual.transformer"), _layers(state, "transformer")
    for width, head in ((v_width, vision_head_width), (t_width, text_head_width)):
        if width % head:
            raise ValueError(f"tower width {width} is not a multiple of the head width {head}")
    config = CLIPConfig(
        text_config={
            "vocab_size": state["token_embedding.weight"].shape[0],
            "hidden_size": t_width,
            "intermediate_size": state["transformer.resblocks.0.mlp.c_fc.weight"].shape[0],
            "num_hidden_layers": t_layers,
            "num_attention_heads": t_width // text_head_width,
            "max_position_embeddings": state["positional_embedding"].shape[0],
            "hidden_act": hidden_act,
            "layer_norm_eps": layer_norm_eps,
            "bos_token_id": bos_token_id,
            "eos_token_id": eos_token_id,
            "pad_token_id": eos_token_id,
        },
        vision_config={
            "hidden_size": v_width,
            "intermediate_size": state["visual.transformer.resblocks.0.mlp.c_fc.weight"].shape[0],
            "num_hidden_layers": v_layers,
            "num_attention_heads": v_width // vision_head_width,
            "image_size": grid * patch,
            "patch_size": patch,
            "hidden_act": hidden_act,
            "layer_norm_eps": layer_norm_eps,
        },
        projection_dim=state["visual.proj"].shape[1],
    )
    new = {
        "vision_model.embeddings.patch_embedding.weight": conv,
        "vision_model.embeddings.class_embedding": state["visual.class_embedding"],
        "vision_model.embeddings.position_embedding.weight": state["visual.positional_embedding"],
        "vision_model.pre_layrnorm.weight": state["visual.ln_pre.weight"],
        "vision_model.pre_layrnorm.bias": state["visual.ln_pre.bias"],
        "vision_model.post_layernorm.weight": state["visual.ln_post.weight"],
        "vision_model.post_layernorm.bias": state["visual.ln_post.bias"],
        "visual_projection.weight": state["visual.proj"].T,
        "text_model.embeddings.token_embedding.weight": state["token_embedding.weight"],
        "text_model.embeddings.position_embedding.weight": state["positional_embedding"],
        "text_model.final_layer_norm.weight": state["ln_final.weight"],
        "text_model.final_layer_norm.bias": state["ln_final.bias"],
        "text_projection.weight": state["text_projection"].T,
        "logit_scale": state["logit_scale"].reshape(()),
    }
    new.update(_blocks(state, "visual.transformer", "vision_model", v_layers))
    new.update(_blocks(state, "transformer", "text_model", t_layers))
    model = CLIPModel(config)
    own = model.state_dict()
    unexpected = sorted(set(new) - set(own))
    missing = sorted(k for k in own if k not in new and not k.endswith("position_ids"))
    if unexpected or missing:
        raise ValueError(f"open_clip conversion mismatch: unexpected {unexpected[:5]}, missing {missing[:5]}")
    for key, value in new.items():
        if own[key].shape != value.shape:
            raise ValueError(f"open_clip conversion: {key} has shape {tuple(value.shape)}, expected {tuple(own[key].shape)}")
    model.load_state_dict({k: v.float().contiguous() for k, v in new.items()}, strict=False)
    return model.float().eval()
