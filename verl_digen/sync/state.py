"""What gets synced from trainer to rollout, and how it is packed for the wire.

A weight sync moves either the LoRA adapter tensors (peft-injected modules, whose state-dict
names contain ``lora_``) or the full state dict of the denoiser. Both sides address tensors by
their state-dict names, so trainer and rollout must wrap the synced module the same way (same
peft injection, no extra ``_orig_mod.`` / ``base_model.model.`` prefix on one side only).

For the wire, a state is packed into one contiguous buffer per dtype (:func:`flatten_state`):
a sync is then a handful of large collectives instead of one per tensor, which matters for
LoRA states made of hundreds of tiny matrices. The layout travels as a small, picklable
:class:`FlatMetadata`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

# peft names every adapter tensor ``...lora_A...``, ``lora_B``, ``lora_embedding_A/B`` or
# ``lora_magnitude_vector`` (DoRA); the base layer's own weights never carry this marker.
LORA_MARKER = "lora_"


def _is_lora_name(name: str) -> bool:
    return LORA_MARKER in name


def trained_entries(state: Mapping[str, Any], *, lora_only: bool, owner: str) -> dict[str, Any]:
    """The entries of a state dict that a weight sync and a checkpoint carry, in sorted name
    order: those named ``*lora_*`` when ``lora_only``, else all of them.

    Raises:
        ValueError: ``lora_only`` is set but ``owner`` (the module's class name, for the message)
            holds no LoRA tensors (a sync that silently moves nothing would hide a misconfigured
            adapter).
    """
    names = sorted(n for n in state if not lora_only or _is_lora_name(n))
    if lora_only and not names:
        raise ValueError(f"lora_only=True but {owner} has no tensor named '*{LORA_MARKER}*'")
    return {name: state[name] for name in names}


def trainable_state(module: torch.nn.Module, *, lora_only: bool) -> dict[str, torch.Tensor]:
    """The tensors a weight sync carries (:func:`trained_entries` of the module's state dict).

    The returned tensors are detached views of the module's live storage (no copy): pack or
    clone them before the module is updated again.
    """
    full = module.state_dict(keep_vars=False)
    picked = trained_entries(full, lora_only=lora_only, owner=type(module).__name__)
    return {name: t.detach() for name, t in picked.items()}


@torch.no_grad()
def load_trainable_state(
    module: torch.nn.Module, state: Mapping[str, torch.Tensor], *, lora_only: bool, partial: bool = False
) -> None:
    """Copy ``state`` into the module's tensors in place.

    Strict: the names must be exactly those :func:`trainable_state` reports for this module
    (``partial``: a subset of them, one bucket of a streamed sync), and every shape must match.
    Dtype and device may differ (``copy_`` converts), so a bf16 rollout can take fp32 trainer
    weights.

    Raises:
        ValueError: names missing from or unknown to the module, or a shape mismatch.
    """
    target = trainable_state(module, lora_only=lora_only)
    unknown = sorted(set(state) - set(target))
    if partial:
        target = {n: target[n] for n in state if n in target}
    missing = sorted(set(target) - set(state))
    if missing or unknown:
        raise ValueError(f"state does not match module (lora_only={lora_only}): missing={missing} unknown={unknown}")
    bad_shapes = [
        f"{name}: module {tuple(target[name].shape)} vs state {tuple(state[name].shape)}"
        for name in target
        if target[name].shape != state[name].shape
    ]
    if bad_shapes:
        raise ValueError("shape mismatch: " + "; ".join(bad_shapes))
    # The state_dict tensors share storage with the parameters/buffers, so copying into them
    # updates the module without replacing any Parameter object (optimizers, hooks and
    # compiled graphs holding references keep working).
    for name, dst in target.items():
        dst.copy_(state[name])


def state_nbytes(state: Mapping[str, torch.Tensor]) -> int:
    """Total payload bytes of a state (what a sync moves, headers excluded)."""
    return sum(t.numel() * t.element_size() for t in state.values())


def state_digest(state: Mapping[str, torch.Tensor]) -> str:
    """sha256 over names, dtypes, shapes and raw bytes, in sorted name order.

    Two processes holding bitwise-identical states get the same digest, so tests and sanity
    checks can compare weights across the cluster by exchanging 64 characters.
    """
    h = hashlib.sha256()
    for name in sorted(state):
        digest_update(h, name, state[name])
    return h.hexdigest()


def digest_update(h: "hashlib._Hash", name: str, tensor: torch.Tensor) -> None:
    """Fold one named tensor into a sha256: :func:`state_digest` one tensor at a time (call in
    sorted name order), for states streamed bucket by bucket and never held whole."""
    t = tensor.detach()
    h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
    # reshape(-1) first: a 0-d tensor cannot be reinterpreted as bytes directly.
    h.update(t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


# --------------------------------------------------------------------------------------
# Flat packing
# --------------------------------------------------------------------------------------


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of ``str(dtype)`` without the ``torch.`` prefix (e.g. ``"bfloat16"``)."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown torch dtype {name!r}")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class TensorSlot:
    """Where one tensor lives inside the flat buffers."""

    name: str
    shape: tuple[int, ...]
    buffer: int  # index into the buffer list
    offset: int  # in elements of the buffer's dtype
    numel: int


@dataclass(frozen=True)
class FlatMetadata:
    """Layout of a flattened state: plain Python values only, so it pickles small and safe."""

    buffer_dtypes: tuple[str, ...]  # dtype name of each buffer
    buffer_numels: tuple[int, ...]
    slots: tuple[TensorSlot, ...]  # sorted by name

    @property
    def nbytes(self) -> int:
        return sum(n * dtype_from_name(d).itemsize for d, n in zip(self.buffer_dtypes, self.buffer_numels))

    def empty_buffers(self, device: torch.device | str = "cpu") -> list[torch.Tensor]:
        """Receive-side buffers for this layout."""
        return [
            torch.empty(n, dtype=dtype_from_name(d), device=device)
            for d, n in zip(self.buffer_dtypes, self.buffer_numels)
        ]


def plan_layout(state: Mapping[str, torch.Tensor]) -> FlatMetadata:
    """One buffer per dtype (in order of first appearance over sorted names), tensors packed back to back."""
    buffer_index: dict[torch.dtype, int] = {}
    numels: list[int] = []
    slots: list[TensorSlot] = []
    for name in sorted(state):
        t = state[name]
        idx = buffer_index.setdefault(t.dtype, len(numels))
        if idx == len(numels):
            numels.append(0)
        slots.append(TensorSlot(name=name, shape=tuple(t.shape), buffer=idx, offset=numels[idx], numel=t.numel()))
        numels[idx] += t.numel()
    dtypes = sorted(buffer_index, key=buffer_index.__getitem__)
    return FlatMetadata(
        buffer_dtypes=tuple(dtype_name(d) for d in dtypes),
        buffer_numels=tuple(numels),
        slots=tuple(slots),
    )


@torch.no_grad()
def flatten_state(
    state: Mapping[str, torch.Tensor], *, device: torch.device | str = "cpu"
) -> tuple[list[torch.Tensor], FlatMetadata]:
    """Pack a state into one contiguous buffer per dtype on ``device``.

    The copy also moves the tensors to the transport's device (e.g. GPU weights into a CPU
    buffer for gloo, or CPU weights into a CUDA buffer for NCCL) in the same pass.
    """
    metadata = plan_layout(state)
    buffers = metadata.empty_buffers(device)
    for slot in metadata.slots:
        buffers[slot.buffer][slot.offset : slot.offset + slot.numel].copy_(state[slot.name].reshape(-1))
    return buffers, metadata


def unflatten_state(buffers: list[torch.Tensor], metadata: FlatMetadata) -> dict[str, torch.Tensor]:
    """Inverse of :func:`flatten_state`, in sorted name order.

    The tensors are views into ``buffers`` (no copy); they stay valid as long as the buffers
    are not reused.
    """
    if len(buffers) != len(metadata.buffer_numels):
        raise ValueError(f"expected {len(metadata.buffer_numels)} buffers, got {len(buffers)}")
    for i, (buf, d, n) in enumerate(zip(buffers, metadata.buffer_dtypes, metadata.buffer_numels)):
        if buf.dtype != dtype_from_name(d) or buf.numel() != n:
            raise ValueError(f"buffer {i}: expected {n} x {d}, got {buf.numel()} x {dtype_name(buf.dtype)}")
    return {
        slot.name: buffers[slot.buffer][slot.offset : slot.offset + slot.numel].view(slot.shape)
        for slot in metadata.slots
    }


def iter_buckets(
    named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[dict[str, torch.Tensor]]:
    """Group a stream of named tensors into sub-states of at most ``bucket_bytes`` each.

    Lets a sender stream a large model with one bucket of staging memory instead of a packed
    copy of the whole model. A tensor larger than the bucket travels alone (tensors are never
    split). Always yields at least one (possibly empty) bucket, so an empty state still makes
    a well-formed message.

    Reads one tensor ahead: a bucket is yielded when the next tensor would not fit, so a lazy
    stream has produced that tensor too (FSDP: enqueued the all-gather of its group) before the
    consumer sees the bucket. A consumer that orders device work after a bucket's sources
    (:meth:`~verl_digen.sync.snapshot.HostSnapshot.capture`) does so when the bucket arrives,
    which covers them all.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    bucket: dict[str, torch.Tensor] = {}
    size = 0
    yielded = False
    for name, tensor in items:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            yielded = True
            bucket, size = {}, 0
        if name in bucket:
            raise ValueError(f"duplicate tensor name {name!r}")
        bucket[name] = tensor
        size += nbytes
    if bucket or not yielded:
        yield bucket
