"""FSDP2 (fully_shard) of the denoiser, without a process group: block lists, gradient
checkpointing, the unsharded state stream, argument checks; and the tiny models the rank tests
share. Exactness against single-process training and the sync state, on ranks:
tests/e2e/test_fsdp_e2e.py; on one GPU: tests/gpu/test_fsdp_gpu.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from verl_digen.workers.fsdp import (
    apply_fsdp2,
    block_modules,
    enable_gradient_checkpointing,
    stream_full_state,
)


DIM = 5  # odd on purpose: 5 rows over 2 ranks is an uneven shard (3 + 2)
IN = 4


# ---------------------------------------------------------------------- models and data


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.proj = nn.Linear(d, d)
        self.act = nn.GELU()
        self.out = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(self.act(self.proj(x)))


class TinyDenoiser(nn.Module):
    def __init__(self, d: int = DIM, n_blocks: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(IN, d)
        self.transformer_blocks = nn.ModuleList(Block(d) for _ in range(n_blocks))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, IN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.transformer_blocks:
            h = block(h)
        return self.head(self.norm(h))


def make_lora_model(seed: int = 0, *, train_head: bool = False) -> nn.Module:
    from peft import LoraConfig, inject_adapter_in_model

    torch.manual_seed(seed)
    model = TinyDenoiser()
    # init_lora_weights=False: A and B both random, so both get a gradient at the first step.
    # r=3 over 2 ranks: uneven shards of lora_A too.
    model = inject_adapter_in_model(
        LoraConfig(r=3, lora_alpha=3, target_modules=["proj", "out"], init_lora_weights=False), model
    )
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name or (train_head and name.startswith("head.")))
    return model


def _tiny_flux(seed: int = 0, *, lora: bool = True):
    from diffusers import FluxTransformer2DModel
    from peft import LoraConfig

    torch.manual_seed(seed)
    model = FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=24,
        guidance_embeds=False,
        axes_dims_rope=(4, 6, 6),
    )
    if not lora:
        return model
    torch.manual_seed(seed + 1)
    model.add_adapter(
        LoraConfig(r=4, lora_alpha=4, init_lora_weights=False, target_modules=["to_q", "to_k", "to_v", "to_out.0"])
    )
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
    return model


# ---------------------------------------------------------------------- tests: no process group


def test_block_modules_finds_every_block_list() -> None:
    model = TinyDenoiser(n_blocks=3)
    assert block_modules(model) == list(model.transformer_blocks)
    flux = _tiny_flux()
    blocks = block_modules(flux)
    assert blocks == list(flux.transformer_blocks) + list(flux.single_transformer_blocks)
    assert block_modules(nn.Linear(2, 2)) == []

    class Generic(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(2, 2) for _ in range(2))
            self.other = nn.Sequential(nn.ModuleList([nn.Linear(2, 2)]))  # nested: not a block list

    g = Generic()
    assert block_modules(g) == list(g.blocks)


def test_enable_gradient_checkpointing() -> None:
    assert enable_gradient_checkpointing(TinyDenoiser()) is False
    flux = _tiny_flux()
    assert enable_gradient_checkpointing(flux) is True
    assert flux.is_gradient_checkpointing


def test_stream_full_state_unsharded_equals_trainable_state() -> None:
    from verl_digen.sync.state import trainable_state

    model = make_lora_model()
    for lora_only in (True, False):
        got = list(stream_full_state(model, lora_only=lora_only))
        want = trainable_state(model, lora_only=lora_only)
        assert [n for n, _ in got] == list(want)
        assert all(torch.equal(t, want[n]) for n, t in got)
    with pytest.raises(ValueError, match="lora_only"):
        list(stream_full_state(TinyDenoiser(), lora_only=True))


def test_apply_fsdp2_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="grad_reduce"):
        apply_fsdp2(TinyDenoiser(), grad_reduce="avg")  # type: ignore[arg-type]
