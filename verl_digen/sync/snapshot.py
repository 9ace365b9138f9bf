"""A weight-sync sender's host copy of a version, and a cheap digest of weights where they are.

The one-step-off pipeline (TCSS) sends version ``v`` while the trainers already train on:
the sender needs a copy that training does not change, and the device has no room for a
second full model (12-19 B parameters). :class:`HostSnapshot` is that copy: host memory laid
out as the wire's flat buckets (one buffer per dtype per bucket), allocated once and reused
for every version (PINNED when the weights come from a GPU, so the device-to-host copies run
asynchronously at the link's speed on a side stream, and the send's host-to-device copies
too); the sender broadcasts its buckets as they are (:meth:`WeightChannel.send`), without
packing them again.

:class:`WeightsDigest` fingerprints a state on the device that holds it (or one it is told
to use): integer sums over the raw 16-bit words, exact on any device, so a rollout GPU's
weights and a trainer's host copy give the same 64 characters; the only host traffic is one
small tensor of sums per state. A sha256 over the bytes (:func:`~verl_digen.sync.state.state_digest`)
would pull the whole model through one CPU core (tens of seconds for a full fine-tune).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from verl_digen.sync.state import FlatMetadata, dtype_from_name, iter_buckets, plan_layout, unflatten_state

# 16-bit words per reduction: x (|x| < 2^16) times a weight below 2^20, summed over 2^22 words,
# stays below 2^58: every partial sum is exact in int64, whatever the device's reduction order.
_DIGEST_CHUNK_WORDS = 1 << 22
_WEIGHT_MODULUS = 1_048_573  # a prime below 2^20
_CHUNK_MODULUS = (1 << 61) - 1  # a Mersenne prime: per-chunk multipliers, in Python integers


def _word_weights(device: torch.device) -> torch.Tensor:
    """Pseudo-random weights in [1, 2^20) for each word position of a chunk (int64)."""
    idx = torch.arange(_DIGEST_CHUNK_WORDS, dtype=torch.int64, device=device)
    return (idx * 40503 + 12345) % _WEIGHT_MODULUS + 1


def _words(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's raw bytes as 16-bit words (bytes for 1-byte dtypes), flat, without a copy
    when the tensor is contiguous."""
    flat = tensor.detach().contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    return flat.view(torch.int16) if flat.element_size() % 2 == 0 else flat.view(torch.uint8)


class WeightsDigest:
    """Incremental fingerprint of named tensors (call :meth:`update` in sorted name order).

    Bitwise-identical states give the same :meth:`hexdigest` on any device; a changed word
    changes its chunk's sum (weights are non-zero and sums exact). Not cryptographic: it
    checks that two copies of the weights agree, cheaply, not that nobody forged them.

    ``device``: where the sums run (``None``: where each tensor is). A trainer's host snapshot
    is digested on its GPU (pinned chunks go over at the link's speed).
    """

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = torch.device(device) if device is not None else None
        self._headers: list[str] = []
        self._sums: list[torch.Tensor] = []  # one int64 vector of chunk sums per tensor
        self._weights: dict[torch.device, torch.Tensor] = {}

    def update(self, name: str, tensor: torch.Tensor) -> None:
        words = _words(tensor)
        device = self.device or words.device
        weights = self._weights.get(device)
        if weights is None:
            weights = self._weights[device] = _word_weights(device)
        sums = [torch.zeros((), dtype=torch.int64, device=device)]
        for start in range(0, words.numel(), _DIGEST_CHUNK_WORDS):
            chunk = words[start : start + _DIGEST_CHUNK_WORDS].to(device, non_blocking=True).to(torch.int64)
            sums.append((chunk * weights[: chunk.numel()]).sum())
        self._headers.append(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|{len(sums)}")
        self._sums.append(torch.stack(sums))

    def hexdigest(self) -> str:
        h = hashlib.sha256()
        for header, sums in zip(self._headers, self._host_sums()):
            folded = sum(s * pow(3, k + 1, _CHUNK_MODULUS) for k, s in enumerate(sums))
            h.update(f"{header}|{folded}\n".encode())
        return h.hexdigest()

    def _host_sums(self) -> list[list[int]]:
        """Every tensor's chunk sums as Python integers: one host transfer per device."""
        out: list[list[int]] = [[] for _ in self._sums]
        by_device: dict[torch.device, list[int]] = {}
        for i, s in enumerate(self._sums):
            by_device.setdefault(s.device, []).append(i)
        for indices in by_device.values():
            flat = torch.cat([self._sums[i] for i in indices]).cpu().tolist()
            start = 0
            for i in indices:
                n = self._sums[i].numel()
                out[i], start = flat[start : start + n], start + n
        return out


def weights_digest(state: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                   device: torch.device | str | None = None) -> str:
    """:class:`WeightsDigest` of a whole state (sorted by name when a mapping)."""
    d = WeightsDigest(device)
    items = sorted(state.items()) if isinstance(state, Mapping) else state
    for name, t in items:
        d.update(name, t)
    return d.hexdigest()


class SideStreams:
    """The CUDA calls of a :class:`HostSnapshot` capture, in one place: a side stream per
    device for the device-to-host copies, the waits that order them after the producer's
    writes and before its next work, and the pinned host buffers they copy into.

    They are the whole of the capture's ordering, so a test can replace them with a recorder
    (``tests/unit/test_sync_snapshot.py``) and check on a CPU where the waits fall among a lazily
    produced stream's tensors and the copies that read them.
    """

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def on_device(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is copied on a side stream (a GPU's), not by the host at once."""
        return tensor.is_cuda

    def host_buffer(self, numel: int, dtype: torch.dtype, *, pinned: bool) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, pin_memory=pinned)

    def _side(self, device: torch.device) -> torch.cuda.Stream:
        side = self._streams.get(device)
        if side is None:
            side = self._streams[device] = torch.cuda.Stream(device)
        return side

    def wait_for_producer(self, device: torch.device) -> None:
        """The side stream's next copies come after all work enqueued so far on the device's
        current stream (which writes the sources)."""
        self._side(device).wait_stream(torch.cuda.current_stream(device))

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst <- src`` (flat, host, pinned) on the side stream, asynchronously."""
        side = self._side(src.device)
        with torch.cuda.stream(side):
            dst.copy_(src.reshape(-1), non_blocking=True)
        # The caching allocator hands src's memory out again (the next bucket's all-gather, say)
        # only after the side stream has passed this point, whenever the producer frees it.
        src.record_stream(side)

    def copies_enqueued(self, device: torch.device) -> torch.cuda.Event:
        """An event that completes when every copy enqueued so far on the device has landed."""
        event = torch.cuda.Event()
        event.record(self._side(device))
        return event

    def producer_waits(self, device: torch.device, copies: torch.cuda.Event) -> None:
        """The device's current stream (the producer's) runs its next work after ``copies``."""
        torch.cuda.current_stream(device).wait_event(copies)


class HostSnapshot:
    """A reused host copy of a sync state, in the wire's flat buckets (see the module doc).

    :meth:`capture` copies a stream of ``(name, tensor)`` into it: GPU tensors are copied
    ``non_blocking`` into pinned buffers on a side stream of their device. Before each bucket's
    copies the side stream waits for the producing stream, so a stream that produces its
    tensors lazily, bucket by bucket (FSDP's all-gathers, ``workers/fsdp.py:
    stream_full_state``), has written every source before it is read; the producer runs at most
    two buckets ahead of the copies, so such a stream holds a few buckets on the device, not the
    whole state; after the last bucket the producing stream waits for the copies before its next
    work, so the weights are not changed under them; the sources are kept alive for the copies
    with ``record_stream``. The host waits for the copies only when it reads the snapshot
    (:meth:`parts`, :meth:`state`): the sender's thread, a digest, a save.

    The buffers of a bucket are reused when the bucket's layout is the one they were made
    for (the same model: every version); :attr:`allocations` counts host buffers made.
    ``streams``: the CUDA calls (:class:`SideStreams`; a test's recorder in their stead).
    """

    def __init__(self, bucket_bytes: int, streams: SideStreams | None = None) -> None:
        self.bucket_bytes = bucket_bytes
        self.allocations = 0
        self._parts: list[tuple[list[torch.Tensor], FlatMetadata]] = []
        self._pinned: list[bool] = []  # whether each bucket's buffers are pinned
        self._pending: list[torch.cuda.Event] = []
        self._cuda = streams if streams is not None else SideStreams()

    @torch.no_grad()
    def capture(self, named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy a state in (the caller makes sure nobody reads the previous one meanwhile).

        A lazy stream may free a source once it has yielded it (``record_stream``: its memory
        is handed out again only after its copy has run), but must not write into it again
        before this returns: the copy may not have run yet, and :func:`iter_buckets` reads one
        tensor ahead.

        ``record_stream`` alone keeps a freed source's memory busy until its copy has run, so a
        producer faster than the copies (an all-gather over NVLink against a copy over PCIe)
        would hold nearly every bucket at once. Once bucket ``k``'s copies are enqueued, the
        producer's next work waits for bucket ``k - 1``'s: it writes bucket ``k + 1`` (and the
        tensor read ahead of it) while bucket ``k`` is copied, so gathers and copies still
        overlap, with bucket ``k - 1``'s memory free again.
        """
        self.wait()
        parts: list[tuple[list[torch.Tensor], FlatMetadata]] = []
        pinned: list[bool] = []
        copied: dict[torch.device, torch.cuda.Event] = {}  # per device: the last bucket's copies
        for k, bucket in enumerate(iter_buckets(named_tensors, self.bucket_bytes)):
            # Every source of this bucket has been produced (its writes enqueued on the current
            # stream) by now, and so has the next bucket's first (iter_buckets reads one ahead):
            # the side stream waits for all of it, once per bucket. One wait per capture let the
            # copies of a lazily gathered stream overtake the all-gathers of its later buckets.
            devices = sorted({t.device for t in bucket.values() if self._cuda.on_device(t)}, key=str)
            for device in devices:
                self._cuda.wait_for_producer(device)
            layout = plan_layout(bucket)
            buffers = self._buffers_for(k, layout, pin=bool(devices))
            for slot in layout.slots:
                src, dst = bucket[slot.name], buffers[slot.buffer][slot.offset : slot.offset + slot.numel]
                if self._cuda.on_device(src):
                    self._cuda.copy(dst, src)
                else:
                    dst.copy_(src.reshape(-1))
            parts.append((buffers, layout))
            pinned.append(bool(devices))
            for device in devices:
                if device in copied:
                    self._cuda.producer_waits(device, copied[device])
                copied[device] = self._cuda.copies_enqueued(device)
        self._parts, self._pinned = parts, pinned
        for device, copies in copied.items():  # the producer's next work waits for every copy (they read its weights)
            self._cuda.producer_waits(device, copies)
            self._pending.append(copies)

    def _buffers_for(self, k: int, layout: FlatMetadata, *, pin: bool) -> list[torch.Tensor]:
        if k < len(self._parts):
            buffers, old = self._parts[k]
            if old == layout and self._pinned[k] == pin:
                return buffers
        buffers = [self._cuda.host_buffer(n, dtype_from_name(d), pinned=pin)
                   for d, n in zip(layout.buffer_dtypes, layout.buffer_numels)]
        self.allocations += len(buffers)
        return buffers

    def wait(self) -> None:
        """Block the host until every copy of the last capture has landed."""
        for event in self._pending:
            event.synchronize()
        self._pending = []

    def parts(self) -> Iterator[tuple[list[torch.Tensor], FlatMetadata]]:
        """The buckets as the wire sends them: (one flat buffer per dtype, their layout)."""
        self.wait()
        return iter(list(self._parts))

    def state(self) -> dict[str, torch.Tensor]:
        """The snapshot as named tensors: views of the host buffers, sorted by name."""
        self.wait()
        out: dict[str, torch.Tensor] = {}
        for buffers, layout in self._parts:
            out.update(unflatten_state(buffers, layout))
        return dict(sorted(out.items()))

    @property
    def nbytes(self) -> int:
        return sum(layout.nbytes for _, layout in self._parts)

    def buffer_ptrs(self) -> list[Any]:
        """Host addresses of the buffers (tests: the same across versions when reused)."""
        return [b.data_ptr() for buffers, _ in self._parts for b in buffers]
