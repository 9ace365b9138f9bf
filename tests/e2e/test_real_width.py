"""Every family's denoiser at real width, through our adapter, forward and backward on CPU.

The tiny models prove the loop's logic at widths of a few dozen; only FLUX's transformer has
run at real size. Here each family's transformer is built from its shipped real config
(``verl_digen/models/configs/<family>/transformer``) with every block type cut to the fewest
layers that still hold it, and every width (hidden size, heads, head dim, channels, text
widths, RoPE axes) as published. It is called through the adapter's own transformer call
(:func:`~verl_digen.workers.sampling.velocity_in_chunks`, what rollout and trainer run: packing,
masks, guidance, timesteps, CFG) with the preset's LoRA, on tiny latents and short, padded
text, and must:

* give the latents' shape, finite, and gradients that reach every LoRA parameter but those the
  architecture leaves dead (DEAD_BY_ARCHITECTURE);
* give the same gradients with activation checkpointing (the presets turn it on) as without,
  with the blocks really recomputed in backward;
* for a full fine-tune (the ``*_full_disaggregated`` presets), reach every parameter but those
  the architecture leaves dead;
* where the family masks its text (Qwen-Image, HunyuanVideo), give a padded prompt the
  velocity it has alone, unpadded, whatever the padding rows hold;
* in bf16 (the presets' weights on GPUs), a finite velocity near the fp32 one.

In fp32 a reduced model is 0.38 to 0.71 billion parameters, 1.5 to 2.8 GB (Wan 14B's width is
5120), so one family is built at a time and freed before the next. Marked e2e and slow: the fast lane
does not build these.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import time
import types

import pytest
import torch
import yaml
from torch.overrides import TorchFunctionMode

from verl_digen.config.schema import LoraConfigSpec
from verl_digen.models.base import SampleSpec
from verl_digen.models.real_configs import FAMILIES, build_on_meta, component_config, scheduler_config
from verl_digen.models.registry import ADAPTERS
from verl_digen.workers.fsdp import enable_gradient_checkpointing
from verl_digen.workers.sampling import velocity_in_chunks
from verl_digen.workers.training import add_lora

# One thread: these calls move weights, not arithmetic (a few dozen tokens against a block's
# 0.2-0.35 billion weights), and a second thread on the shared cores mostly spins (measured:
# 3.3 s of CPU for the two LoRA passes of SD3 with one thread, 9.9 s with two).
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

PRESETS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs")

# The depth keys of each real config, cut to the fewest layers that still hold every block
# type: the rest of the config (every width) is the shipped one.
REDUCED_DEPTH = {
    "flux": {"num_layers": 1, "num_single_layers": 1},  # one double-stream, one single-stream
    # SD3's last joint block is context_pre_only (no text output, no text MLP): a second
    # block keeps one of each. SD3.5 Large has no dual-attention (x_block_self_attn) layers.
    "sd3": {"num_layers": 2},
    "qwen_image": {"num_layers": 1},
    "wan": {"num_layers": 1},
    "hunyuan_video": {"num_layers": 1, "num_single_layers": 1, "num_refiner_layers": 1},
}
# Batch of two rows, the second padded: its prompt is PADDED_TOKENS of TEXT_TOKENS.
TEXT_TOKENS, PADDED_TOKENS = 6, 3
SIZES = {"image": dict(height=32, width=64), "video": dict(height=32, width=64, num_frames=5)}
SIGMA = (0.7, 0.4)

# Parameters no gradient reaches, by the architecture and not by the reduction: the text stream's
# output of the last block is discarded, so what only feeds it (the text queries, and in
# Qwen-Image, whose every block returns a text stream, the text output projection and MLP) is
# dead in the full-depth model too. SD3's last block (context_pre_only) has no text output
# projection or MLP to begin with, but still projects text queries.
DEAD_BY_ARCHITECTURE = {
    "sd3": ("transformer_blocks.1.attn.add_q_proj.", "transformer_blocks.1.attn.norm_added_q."),
    "qwen_image": ("transformer_blocks.0.attn.add_q_proj.", "transformer_blocks.0.attn.norm_added_q.",
                   "transformer_blocks.0.attn.to_add_out.", "transformer_blocks.0.txt_mlp."),
}
# The families whose transformer masks text padding (the others attend to every text token:
# FLUX and SD3 to T5's padding as their pipelines do, Wan to zeroed padding rows).
MASKED_TEXT = ("qwen_image", "hunyuan_video")


def dead(family: str, names) -> set[str]:
    return {n for n in names if n.startswith(DEAD_BY_ARCHITECTURE.get(family, ()))}


def preset(family: str) -> dict:
    """The family's colocated preset (its LoRA and guidance settings), as shipped."""
    with open(os.path.join(PRESETS, f"{family}_colocated.yaml"), encoding="utf-8") as f:
        return yaml.safe_load(f)["digen"]


def lora_spec(family: str) -> LoraConfigSpec:
    lora = dict(preset(family)["model"]["lora"])
    lora.pop("enable", None)
    return LoraConfigSpec(**lora)


class _SkipParameterDraws(TorchFunctionMode):
    """While a module is built: random draws into its parameters are skipped (each parameter is
    filled by :func:`fill_parameters` after). torch's default init draws every weight one by one,
    about 10 s of CPU for the half billion weights of one family here; buffers (RoPE tables,
    position embeddings) are computed as usual."""

    # torch.nn.init's draws and the tensor methods they end in, by name (torch.nn.init's
    # functions reach a mode as themselves, the methods as torch._C.TensorBase's).
    DRAWS = {"uniform_", "normal_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_",
             "xavier_uniform_", "xavier_normal_"}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = args[0] if args else kwargs.get("tensor")
        if getattr(func, "__name__", None) in self.DRAWS and isinstance(target, torch.nn.Parameter):
            return target
        return func(*args, **kwargs)


def fill_parameters(module: torch.nn.Module, seed: int, period: int = 1_000_003) -> None:
    """Every parameter from one seeded draw of ``period`` (prime) normal values, tiled from a
    different offset per parameter, at the spread of torch's default init (weights
    1/sqrt(3 fan-in), which keeps activations at their size through the blocks; 1-D weights,
    the norm gains, near 1; biases near 0). Tiling costs a copy per weight, not a draw."""
    source = torch.randn(period, generator=torch.Generator().manual_seed(seed))
    offset = 0
    with torch.no_grad():
        for name, p in module.named_parameters():
            values = torch.roll(source, offset)
            offset += 7919
            flat = p.view(-1)
            rows = flat.numel() // period
            flat[: rows * period].view(rows, period).copy_(values.expand(rows, period))
            flat[rows * period:].copy_(values[: flat.numel() - rows * period])
            if p.dim() >= 2:
                p.mul_((3 * p[0].numel()) ** -0.5)
            elif name.endswith("weight"):
                p.mul_(0.01).add_(1.0)
            else:
                p.mul_(0.01)


def real_width_adapter(family: str):
    """The family's adapter around its real-width, reduced-depth transformer (fp32, CPU, seeded).

    Text encoders are left out and tokenizers are stand-ins with a length limit: the
    transformer call this test exercises reads neither (conditioning is given at the real text
    widths). The VAE is the real config on the meta device: the adapter reads only its config
    (latent channels, compression factors), which sets the latents' real layout."""
    import diffusers

    adapter_cls = ADAPTERS[family]
    config = component_config(family, "transformer")
    config.update(REDUCED_DEPTH[family])
    with _SkipParameterDraws():
        transformer = getattr(diffusers, config["_class_name"]).from_config(config)
    fill_parameters(transformer, seed=0)
    components = {}
    for name in adapter_cls.component_classes:
        if name == "transformer":
            components[name] = transformer
        elif name == "vae":
            components[name] = build_on_meta(family, "vae", dtype=torch.float32)
        elif name.startswith("tokenizer"):
            components[name] = types.SimpleNamespace(model_max_length=1024)
        else:
            components[name] = None
    adapter = adapter_cls(**components, scheduler_config=scheduler_config(family))
    adapter.compute_dtype = torch.float32
    return adapter


def text_width(config: dict) -> int:
    for key in ("joint_attention_dim", "text_dim", "text_embed_dim"):
        if key in config:
            return config[key]
    raise KeyError(f"no text width in {sorted(config)}")


def conditioning(adapter, config: dict, generator: torch.Generator, tokens: int = TEXT_TOKENS) -> dict:
    """Conditioning as ``encode_prompts`` returns it, at the real widths: two rows, the second
    padded after ``PADDED_TOKENS`` (mask 0; Wan zeroes its padding rows, as its encoder does)."""
    mask = torch.ones(2, tokens, dtype=torch.long)
    mask[1, PADDED_TOKENS:] = 0
    embeds = torch.randn(2, tokens, text_width(config), generator=generator)
    out = {}
    for key in adapter.conditioning_keys:
        if key == "prompt_embeds":
            if adapter.arch == "wan":
                embeds = embeds * mask[..., None]
            out[key] = embeds
        elif key in ("prompt_embeds_mask", "prompt_attention_mask"):
            out[key] = mask
        elif key == "pooled_prompt_embeds":
            out[key] = torch.randn(2, config["pooled_projection_dim"], generator=generator)
        else:
            raise KeyError(f"{adapter.arch}: no test input for conditioning key '{key}'")
    return out


def sample_spec(family: str, adapter) -> SampleSpec:
    sampling = preset(family)["sampling"]
    size = SIZES["video" if hasattr(adapter, "latent_shape") else "image"]
    return SampleSpec(**size, guidance_scale=float(sampling["guidance_scale"]),
                      distilled_guidance=sampling.get("distilled_guidance"))


def velocity(adapter, latents, cond, spec, negative) -> torch.Tensor:
    sigma = torch.tensor(SIGMA)
    return velocity_in_chunks(adapter, latents, sigma, cond, spec, negative, rows=0)


def lora_params(transformer) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in transformer.named_parameters() if "lora_" in n}


def loss_and_grads(adapter, latents, cond, spec, negative, weights, keep: dict) -> tuple[torch.Tensor, dict]:
    """The velocity and the gradients of a fixed projection of it: copies of those of ``keep``'s
    parameters, and under ``"reached"`` the names of every parameter with a nonzero one (all
    finite). Gradients are freed after: a full fine-tune's are as large as the weights."""
    transformer = adapter.transformer
    transformer.zero_grad(set_to_none=True)
    v = velocity(adapter, latents, cond, spec, negative)
    (v * weights).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in keep.items() if p.grad is not None}
    reached = set()
    for name, p in transformer.named_parameters():
        if p.grad is not None:
            assert torch.isfinite(p.grad).all(), name
            if p.grad.any():
                reached.add(name)
    transformer.zero_grad(set_to_none=True)
    return v.detach(), grads | {"reached": reached}


def count_calls(transformer) -> tuple[dict[str, int], list]:
    """Counters of calls into the transformer and into its blocks (the members of its own
    ModuleLists, what diffusers checkpoints; HunyuanVideo's token refiner, nested in the text
    embedder, is not): checkpointing calls each block again in backward."""
    counts = {"transformer": 0, "blocks": 0}
    blocks = [b for _, m in transformer.named_children() if isinstance(m, torch.nn.ModuleList) for b in m]

    def hook(key):
        return lambda *_: counts.__setitem__(key, counts[key] + 1)

    handles = [transformer.register_forward_pre_hook(hook("transformer"))]
    handles += [b.register_forward_pre_hook(hook("blocks")) for b in blocks]
    counts["per_call"] = len(blocks)
    return counts, handles


@pytest.fixture
def free_memory():
    """Each family's modules freed before the next is built (a few GB in fp32)."""
    yield
    gc.collect()


@pytest.mark.parametrize("family", FAMILIES)
def test_real_width_forward_backward_through_the_adapter(family, free_memory, record_property):
    start = time.process_time()
    adapter = real_width_adapter(family)
    transformer = adapter.transformer
    config = dict(transformer.config)
    full = component_config(family, "transformer")
    # Every depth of the real config is cut (a block type the table forgot would run at full
    # depth), and nothing else differs from it: every width is the real one.
    assert {k for k in full if k.startswith("num_") and k.endswith("layers")} == set(REDUCED_DEPTH[family])
    expected = {k: v for k, v in full.items() if not k.startswith("_")} | REDUCED_DEPTH[family]
    assert json.loads(json.dumps({k: config[k] for k in expected})) == expected

    generator = torch.Generator().manual_seed(1)
    spec = sample_spec(family, adapter)
    cond = conditioning(adapter, config, generator)
    negative = None
    if spec.guidance_scale > 1:
        # One empty-prompt row, as the pipelines encode the negative prompt (shorter than the prompts).
        negative = {k: v[1:] for k, v in conditioning(adapter, config, generator).items()}
    latents = adapter.prepare_latents(2, spec, generator)

    add_lora(adapter, lora_spec(family))
    lora = lora_params(transformer)
    assert lora, family
    with torch.no_grad():
        # LoRA's B starts at zero, which stops every gradient to A: as after a first step, B is not zero.
        for name, p in lora.items():
            if "lora_B" in name:
                p.normal_(0.0, 0.02, generator=generator)
    weights = torch.randn(latents.shape, generator=generator)
    built = time.process_time()

    # Without checkpointing, every parameter trainable (a full fine-tune, as the
    # *_full_disaggregated presets run; LoRA's gradients do not depend on whether the base
    # weights train): the velocity's shape, finite, and a finite gradient for every parameter
    # but the dead ones.
    transformer.requires_grad_(True)
    counts, handles = count_calls(transformer)
    v_plain, g_plain = loss_and_grads(adapter, latents, cond, spec, negative, weights, keep=lora)
    assert v_plain.shape == latents.shape
    assert torch.isfinite(v_plain).all()
    assert counts["blocks"] == counts["transformer"] * counts["per_call"] > 0, counts
    names = [n for n, _ in transformer.named_parameters()]
    assert set(names) - g_plain.pop("reached") == dead(family, names)
    assert set(lora) - {n for n, g in g_plain.items() if g.any()} == dead(family, lora)

    # LoRA as the presets train it: base frozen, activation checkpointing on. The same velocity
    # and LoRA gradients, every block called again in backward.
    transformer.requires_grad_(False)
    for p in lora.values():
        p.requires_grad_(True)
    assert enable_gradient_checkpointing(transformer)
    counts.update(transformer=0, blocks=0)
    v_ckpt, g_ckpt = loss_and_grads(adapter, latents, cond, spec, negative, weights, keep=lora)
    for h in handles:
        h.remove()
    assert counts["blocks"] == 2 * counts["transformer"] * counts["per_call"] > 0, counts
    torch.testing.assert_close(v_ckpt, v_plain, rtol=0, atol=0)
    assert g_ckpt.pop("reached") == {n for n, g in g_plain.items() if g.any()}
    for name in g_plain:
        torch.testing.assert_close(g_ckpt[name], g_plain[name], rtol=1e-5, atol=1e-7, msg=name)
    del g_ckpt, g_plain
    timed = time.process_time()

    if family in MASKED_TEXT:
        # The padded row's velocity is the one it has alone, unpadded: the padding rows hold
        # random values (as the text encoder's states of pad tokens do), so only the mask keeps
        # them out.
        plain = dataclasses.replace(spec, guidance_scale=1.0)
        alone = {k: v[1:, :PADDED_TOKENS] if v.dim() > 1 and k != "pooled_prompt_embeds" else v[1:]
                 for k, v in cond.items()}
        with torch.no_grad():
            batched = velocity(adapter, latents, cond, plain, None)[1:]
            single = velocity_in_chunks(adapter, latents[1:], torch.tensor(SIGMA[1:]), alone, plain, None, rows=0)
        torch.testing.assert_close(batched, single, rtol=1e-4, atol=1e-4 * float(single.abs().max()))
    masked = time.process_time()

    # bf16, as the presets load the weights on GPUs (LoRA and the class's fp32 modules, Wan's
    # norms and modulation tables, stay fp32, as from_pretrained and add_lora keep them): the
    # adapter's casts hold up, and the velocity stays near the fp32 one (bf16 rounding through
    # the blocks: measured 1 to 5% of its norm).
    keep = tuple(getattr(transformer, "_keep_in_fp32_modules", None) or ())
    for name, p in transformer.named_parameters():
        if "lora_" not in name and not any(part in keep for part in name.split(".")):
            p.data = p.data.to(torch.bfloat16)
    adapter.compute_dtype = torch.bfloat16
    with torch.no_grad():
        v_bf16 = velocity(adapter, latents, cond, spec, negative)
    assert v_bf16.dtype == torch.float32 and torch.isfinite(v_bf16).all()
    assert (v_bf16 - v_plain).norm() < 0.1 * v_plain.norm()
    record_property("cpu_seconds", {"build": round(built - start, 1), "passes": round(timed - built, 1),
                                    "mask": round(masked - timed, 1), "bf16": round(time.process_time() - masked, 1)})
