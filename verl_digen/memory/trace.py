"""What one forward of a real-size denoiser keeps in memory, measured on the meta device.

The meta device has shapes and dtypes but no bytes, so a 12-20B transformer at its real
resolution runs in seconds on a CPU. Two measurements are taken on it, for one row (one sample,
one CFG branch) of the batch; both scale linearly with the rows of a forward:

* **saved for backward** (training): every tensor autograd keeps for the backward pass passes
  through :func:`torch.autograd.graph.saved_tensors_hooks`; they are counted once per storage
  (a view of a saved tensor costs nothing more), parameters and buffers excluded. Each is
  attributed to the top-level transformer block running when it was saved (the unit diffusers'
  gradient checkpointing recomputes), and the tensors each block receives are recorded too, so
  the checkpointed footprint follows: block inputs + what lives outside the blocks + one block
  recomputed in backward.
* **live during a no-grad forward** (rollout): a :class:`TorchDispatchMode` sees every op's
  outputs and counts each new storage until the last tensor referring to it is gone; the peak
  of that count is the inference working set.

Attention runs through a stand-in for ``scaled_dot_product_attention`` that keeps what the
GPU's fused (flash / memory-efficient) kernels keep: q, k, v, the output and a float32
log-sum-exp per query. The CPU's math kernel would keep the ``L x L`` probabilities instead,
which no GPU run pays. Activation checkpointing itself is not run here: diffusers checkpoints
each top-level block, and what that keeps is composed from the per-block measurements
(:meth:`TransformerTrace.training_bytes`).
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from verl_digen.models.families import family_spec
from verl_digen.models.family import TraceLayout
from verl_digen.models.real_configs import build_on_meta, component_config


@dataclass(frozen=True)
class TransformerTrace:
    """Per-row activation bytes of one transformer forward (measured on the meta device).

    Attributes:
        saved_bytes: everything autograd keeps for backward, no checkpointing.
        outside_bytes: the part saved outside the top-level blocks (embedders, final layer).
        block_input_bytes: the tensors the blocks receive (shared ones, e.g. the timestep
            embedding or RoPE tables, once): what checkpointing keeps instead of the blocks.
        max_block_bytes: the most one block saves (recomputed in backward with checkpointing).
        max_block_input_bytes: the largest single block's inputs (gradient transients).
        inference_peak_bytes: peak live bytes of a no-grad forward.
        tokens: image/video tokens of one row; text_tokens: text tokens of one row.
    """

    saved_bytes: int
    outside_bytes: int
    block_input_bytes: int
    max_block_bytes: int
    max_block_input_bytes: int
    inference_peak_bytes: int
    tokens: int
    text_tokens: int

    def training_bytes(self, rows: int, *, checkpointing: bool) -> int:
        """Peak activation bytes of a forward + backward over ``rows`` rows.

        Without checkpointing every saved tensor lives until backward reaches it. With it,
        only the block inputs and the tensors outside the blocks stay; backward recomputes one
        block at a time. Either way backward adds gradient transients: the gradient arriving at
        a block, the one leaving it and one intermediate of the same size (3x the largest block
        input, an estimate)."""
        transient = 3 * self.max_block_input_bytes
        if checkpointing:
            kept = self.outside_bytes + self.block_input_bytes + self.max_block_bytes
        else:
            kept = self.saved_bytes
        return rows * (kept + transient)

    def inference_bytes(self, rows: int) -> int:
        return rows * self.inference_peak_bytes


# ---------------------------------------------------------------------- attention stand-in


class _FusedAttention(torch.autograd.Function):
    """Shapes of ``scaled_dot_product_attention``; saves what the fused GPU kernels save."""

    @staticmethod
    def forward(ctx, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        out = query.new_empty(*query.shape[:-1], value.shape[-1])  # [B, H, Lq, Dv]
        logsumexp = query.new_empty(query.shape[:-1], dtype=torch.float32)  # [B, H, Lq]
        ctx.save_for_backward(query, key, value, out, logsumexp)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # pragma: no cover - never run (no backward on meta here)
        query, key, value, _, _ = ctx.saved_tensors
        return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


def _fused_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    return _FusedAttention.apply(query, key, value)


class _patched_sdpa:
    """Within the block, ``torch.nn.functional.scaled_dot_product_attention`` is the stand-in
    (diffusers looks the function up at call time)."""

    def __enter__(self):
        self._orig = torch.nn.functional.scaled_dot_product_attention
        torch.nn.functional.scaled_dot_product_attention = _fused_sdpa
        return self

    def __exit__(self, *exc):
        torch.nn.functional.scaled_dot_product_attention = self._orig
        return False


# ---------------------------------------------------------------------- counting


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _storage_bytes(t: torch.Tensor) -> int:
    return int(t.untyped_storage().nbytes())


class _LiveBytes(TorchDispatchMode):
    """Peak bytes of the storages op outputs allocate, each counted until no tensor the mode
    has seen refers to it (in a no-grad forward nothing else holds intermediates)."""

    def __init__(self, exclude: set[int]) -> None:
        super().__init__()
        self.exclude = exclude
        self.refs: dict[int, list[int]] = {}  # storage -> [live tensors, bytes]
        self.live = 0
        self.peak = 0

    def _release(self, key: int) -> None:
        entry = self.refs.get(key)
        if entry is not None:
            entry[0] -= 1
            if entry[0] == 0:
                self.live -= entry[1]
                del self.refs[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            key = _storage_key(t)
            if key in self.exclude:
                continue
            entry = self.refs.get(key)
            if entry is None:
                entry = self.refs[key] = [0, _storage_bytes(t)]
                self.live += entry[1]
                self.peak = max(self.peak, self.live)
            entry[0] += 1
            weakref.finalize(t, self._release, key)
        return out


def _tensors(obj: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor)]


def _block_lists(model: torch.nn.Module) -> list[tuple[str, torch.nn.ModuleList]]:
    """The model's own ModuleLists: the stacks of blocks diffusers checkpoints one by one."""
    return [(name, child) for name, child in model.named_children() if isinstance(child, torch.nn.ModuleList)]


def _measure(model: torch.nn.Module, inputs: dict[str, Any], *, keep_blocks: int | None = 2,
             depth: dict[str, int] | None = None) -> tuple[dict[str, int], int]:
    """(saved-for-backward accounting, no-grad live peak) of ``model(**inputs)``.

    ``keep_blocks``: run only the first blocks of each stack (the rest are identical: same
    config, same input shapes) and extrapolate each stack's sums to its full depth with its
    largest kept block; None runs every block. Meta-device ops are slow (tens of ms each in
    Python), and a 40-60 block forward twice would take a minute per model. ``depth``: each
    stack's full depth when the caller already cut the stacks (:func:`_cut_stacks`; None: the
    model's own)."""
    frozen = {_storage_key(t) for t in (*model.parameters(), *model.buffers())}
    trainable = [p for p in model.parameters() if p.requires_grad]
    stacks = _block_lists(model)
    if depth is None:
        depth = _stack_depths(model)
    if keep_blocks is not None:
        _cut_stacks(model, keep_blocks)
    try:
        return _measure_kept(model, inputs, frozen, depth, trainable)
    finally:
        for name, blocks in stacks:
            setattr(model, name, blocks)


def _stack_depths(model: torch.nn.Module) -> dict[str, int]:
    return {name: len(blocks) for name, blocks in _block_lists(model)}


def _cut_stacks(model: torch.nn.Module, keep_blocks: int) -> None:
    """Keep only the first ``keep_blocks`` blocks of each stack of ``model`` (:func:`_measure`
    puts the stacks back after its trace; :func:`_measure_as_trained` cuts for good)."""
    for name, blocks in _block_lists(model):
        setattr(model, name, torch.nn.ModuleList(list(blocks)[:keep_blocks]))


def _measure_as_trained(model: torch.nn.Module, inputs: dict[str, Any], *, lora_rank: int = 0,
                        lora_targets: tuple[str, ...] = (), keep_blocks: int | None = 2) -> tuple[dict[str, int], int]:
    """:func:`_measure` of ``model`` as the job trains it: every parameter trainable (a full
    fine-tune, ``lora_rank`` 0), or frozen with fp32 LoRA adapters of ``lora_rank`` on
    ``lora_targets`` (:func:`_add_lora_on_meta`). ``model`` is changed (and, with
    ``keep_blocks``, cut to the blocks the trace runs).

    With LoRA the stacks are cut to their first ``keep_blocks`` blocks before the adapters go
    in: peft's injection costs about a millisecond per layer and the blocks past the kept ones
    never run in the trace, so their adapters are never seen (the targets are still matched
    against the whole model, and the extrapolation uses the uncut depths): the same measurement
    as adapters on every block (tests/unit/test_memory.py), in a fraction of the time."""
    model.requires_grad_(not lora_rank)
    depth = _stack_depths(model)
    if lora_rank:
        present = _lora_targets_present(model, lora_targets)
        if keep_blocks is not None:
            _cut_stacks(model, keep_blocks)
        _add_lora_on_meta(model, lora_rank, present)
    return _measure(model, inputs, keep_blocks=keep_blocks, depth=depth)


def _measure_kept(model, inputs, frozen: set[int], depth: dict[str, int],
                  trainable: list[torch.Tensor]) -> tuple[dict[str, int], int]:
    kept = [(name, i, block) for name, blocks in _block_lists(model) for i, block in enumerate(blocks)]
    current: list[int | None] = [None]
    saved: dict[int, int] = {}  # storage -> bytes
    saved_in: dict[int, int | None] = {}  # storage -> block (index into kept) that saved it first; None: outside
    block_inputs: dict[int, int] = {}  # storage -> bytes, over all blocks (shared inputs once)
    new_inputs: dict[int, int] = {}  # block -> bytes of the input storages no earlier block received
    all_inputs: dict[int, int] = {}  # block -> bytes of all its input storages
    keep: list[torch.Tensor] = []  # keeps storages alive, so their keys stay unique

    def pre_hook(index: int):
        def hook(module, args, kwargs):
            current[0] = index
            seen: dict[int, int] = {}
            new = 0
            for t in _tensors((args, kwargs)):
                keep.append(t)
                key = _storage_key(t)
                seen[key] = _storage_bytes(t)
                if key not in block_inputs:
                    block_inputs[key] = seen[key]
                    new += seen[key]
            new_inputs[index] = new
            all_inputs[index] = sum(seen.values())

        return hook

    def post_hook(module, args, kwargs, output):
        current[0] = None

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key not in frozen:
            keep.append(t)
            if key not in saved:
                saved[key] = _storage_bytes(t)
                saved_in[key] = current[0]
        return t

    handles = []
    for i, (_, _, block) in enumerate(kept):
        handles.append(block.register_forward_pre_hook(pre_hook(i), with_kwargs=True))
        handles.append(block.register_forward_hook(post_hook, with_kwargs=True))
    try:
        model.requires_grad_(False)
        for p in trainable:  # the parameters the job trains (all of them, or the LoRA adapters)
            p.requires_grad_(True)
        with _patched_sdpa(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(**inputs)
    finally:
        for h in handles:
            h.remove()
    by_block = {i: 0 for i in range(len(kept))}
    outside = 0
    for key, nbytes in saved.items():
        if saved_in[key] is None:
            outside += nbytes
        else:
            by_block[saved_in[key]] += nbytes
    input_keys = {_storage_key(t) for t in _tensors(inputs)}
    block_input_total = sum(b for k, b in block_inputs.items() if k not in input_keys)
    keep.clear()

    # Extrapolate each stack from its kept blocks to its depth: every missing block saves and
    # receives as much new as the stack's last kept one (the first block also takes the first
    # saves of tensors all blocks share, so it is not the typical one).
    saved_total = sum(saved.values())
    for name, n in depth.items():
        indices = [i for i, (stack, _, _) in enumerate(kept) if stack == name]
        if indices and n > len(indices):
            saved_total += (n - len(indices)) * by_block[indices[-1]]
            block_input_total += (n - len(indices)) * new_inputs[indices[-1]]

    with torch.no_grad(), _patched_sdpa(), _LiveBytes(frozen) as live:
        out = model(**inputs)
        del out
    return (
        {
            "saved_bytes": saved_total,
            "outside_bytes": outside,
            "block_input_bytes": block_input_total,
            "max_block_bytes": max(by_block.values(), default=0),
            "max_block_input_bytes": max(all_inputs.values(), default=0),
        },
        live.peak,
    )


# ---------------------------------------------------------------------- the families' inputs


@dataclass(frozen=True)
class TraceShape:
    """What to trace: the family, where its configs are (None: shipped), the compute dtype and
    the sample size."""

    family: str
    config_path: str | None
    dtype: str  # "bf16" | "fp32"
    height: int
    width: int
    num_frames: int
    # LoRA as the workers train it (frozen base, fp32 adapters of this rank on these modules);
    # 0: a full fine-tune, every parameter trainable. What autograd keeps differs: a frozen
    # linear keeps no input for a weight gradient, while each LoRA layer keeps its own fp32 copy.
    lora_rank: int = 0
    lora_targets: tuple[str, ...] = ()
    max_sequence_length: int | None = None  # text tokens per prompt (None: the pipeline's default)


def latent_layout(shape: TraceShape) -> dict[str, int]:
    """Latent sizes of one sample: ``h``, ``w``, ``frames``, ``channels`` and the transformer's
    ``tokens`` (from the family's VAE and transformer configs and its adapter's size rules)."""
    from verl_digen.models.base import SampleSpec
    from verl_digen.models.registry import ADAPTERS

    vae = component_config(shape.family, "vae", shape.config_path)
    transformer = component_config(shape.family, "transformer", shape.config_path)
    rules = ADAPTERS[shape.family].size_rules(vae, transformer)
    spec = SampleSpec(shape.height, shape.width, shape.num_frames)
    rules.check(spec)
    h, w = shape.height // rules.spatial, shape.width // rules.spatial
    frames = 1 if rules.temporal is None else (shape.num_frames - 1) // rules.temporal + 1
    tokens = (h // rules.patch) * (w // rules.patch) * (frames // rules.patch_t)
    channels = int(transformer.get("out_channels") or transformer["in_channels"])
    if rules.packed:
        channels = int(transformer["in_channels"]) // 4
    return {"h": h, "w": w, "frames": frames, "channels": channels, "tokens": tokens}


def text_tokens(family: str, max_sequence_length: int | None = None) -> int:
    """Text tokens per prompt the transformer sees with prompts encoded to
    ``max_sequence_length`` tokens (None: the pipeline's default; SD3 adds its 77 CLIP tokens to
    the joint sequence): the family's registration says."""
    return family_spec(family).text_tokens(max_sequence_length)


def _inputs(shape: TraceShape, config: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    """One row's transformer keyword arguments on the meta device, shaped as the adapter's
    ``_transformer_forward`` passes them (the family module's ``trace_inputs``)."""
    spec = family_spec(shape.family)
    lay = latent_layout(shape)
    layout = TraceLayout(h=lay["h"], w=lay["w"], frames=lay["frames"], channels=lay["channels"],
                         text_tokens=text_tokens(shape.family, shape.max_sequence_length))
    return spec.trace_inputs(layout, config, dtype)


def torch_dtype(name: str) -> torch.dtype:
    return torch.float32 if name == "fp32" else torch.bfloat16


@functools.lru_cache(maxsize=64)
def trace_transformer(shape: TraceShape) -> TransformerTrace:
    """Measure one row of the family's transformer at ``shape`` on the meta device (cached)."""
    dtype = torch_dtype(shape.dtype)
    model = build_on_meta(shape.family, "transformer", path=shape.config_path, dtype=dtype)
    config = component_config(shape.family, "transformer", shape.config_path)
    inputs = _inputs(shape, config, dtype)
    saved, inference_peak = _measure_as_trained(model, inputs, lora_rank=shape.lora_rank, lora_targets=shape.lora_targets)
    input_bytes = sum(_storage_bytes(t) for t in _tensors(inputs))
    return TransformerTrace(
        **saved,
        inference_peak_bytes=inference_peak + input_bytes,
        tokens=latent_layout(shape)["tokens"],
        text_tokens=text_tokens(shape.family, shape.max_sequence_length),
    )


def _add_lora_on_meta(model: torch.nn.Module, rank: int, targets: tuple[str, ...]) -> None:
    """peft's LoRA on the meta model, as :func:`verl_digen.workers.training.add_lora` injects it
    (the modules of ``targets`` the model has, fp32 adapters), the adapters the only trainable
    parameters."""
    from peft import LoraConfig

    present = _lora_targets_present(model, targets)
    with torch.device("meta"):
        model.add_adapter(LoraConfig(r=rank, lora_alpha=rank, init_lora_weights="gaussian", target_modules=present))
    for name, p in model.named_parameters():
        if "lora_" in name:
            p.data = p.data.float()
            p.requires_grad_(True)


def _lora_targets_present(model: torch.nn.Module, targets: tuple[str, ...]) -> list[str]:
    """The entries of ``targets`` that name a module of ``model`` (its last or last two dotted parts)."""
    names = {n.split(".")[-1] for n, _ in model.named_modules()} | {".".join(n.split(".")[-2:]) for n, _ in model.named_modules()}
    present = [t for t in targets if t in names]
    if not present:
        raise ValueError(f"LoRA targets {list(targets)} match no module of {type(model).__name__}")
    return present


def module_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's parameters and buffers (each storage once)."""
    seen: dict[int, int] = {}
    for t in (*module.parameters(), *module.buffers()):
        seen.setdefault(_storage_key(t), _storage_bytes(t))
    return sum(seen.values())


def largest_block_bytes(module: torch.nn.Module) -> int:
    """Parameter bytes of the largest top-level block (the FSDP all-gather unit)."""
    from verl_digen.workers.fsdp import block_modules  # the FSDP units whose gather this bounds

    return max((module_bytes(b) for b in block_modules(module)), default=module_bytes(module))

