"""The sender's host snapshot (reused, pinned on a GPU) and the device-side weights digest.

The FSDP trainer used to copy every tensor to fresh pageable host memory each step, then pack it
back onto the device to send; the start-up and end-of-run checks hashed the full state with a
sha256 on one CPU core. These tests pin down what replaced that (sync/snapshot.py); on a GPU
(pinned buffers, the NCCL sender's staging, a slowly produced stream):
tests/gpu/test_sync_snapshot_gpu.py."""

from __future__ import annotations

import threading

import pytest
import torch
from torch.overrides import TorchFunctionMode

from verl_digen.sync.snapshot import HostSnapshot, SideStreams, WeightsDigest, weights_digest
from verl_digen.sync.buckets import CAPTURE_DEVICE_BUCKETS
from verl_digen.sync.state import state_digest, state_nbytes, trainable_state
from verl_digen.sync.transport import WeightChannel, find_free_port


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a.weight": torch.randn(64, 33, generator=g).to(torch.bfloat16),
        "b.bias": torch.randn(7, generator=g),
        "c.scale": torch.randn((), generator=g),
        "d.count": torch.randint(0, 255, (5,), generator=g, dtype=torch.uint8),
    }


class _CountCalls(TorchFunctionMode):
    def __init__(self, names: set[str]) -> None:
        super().__init__()
        self.names, self.calls = names, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in self.names:
            self.calls += 1
        return func(*args, **(kwargs or {}))


def test_snapshot_reuses_its_host_buffers_for_every_version() -> None:
    """Version after version the same host buffers hold the weights (no fresh allocation per
    step), in the wire's buckets, bitwise."""
    snap = HostSnapshot(bucket_bytes=4096)
    snap.capture(_state(1))
    ptrs, made = snap.buffer_ptrs(), snap.allocations
    assert len(list(snap.parts())) > 1  # several buckets
    for seed in (2, 3):
        snap.capture(_state(seed))
        assert snap.buffer_ptrs() == ptrs and snap.allocations == made
        assert state_digest(snap.state()) == state_digest(_state(seed))
    assert snap.nbytes == state_nbytes(_state(3))


def test_a_worker_sends_each_version_from_the_same_host_buffers() -> None:
    """DiffusionWorker._sync_snapshot (the background send's copy) reuses one snapshot; the
    old code made a fresh host copy of every tensor per version."""
    from verl_digen.config import digen_config_from_dict
    from verl_digen.sim.deadlines import Deadlines
    from verl_digen.workers.worker import DiffusionWorker

    from test_sync import make_full_denoiser

    worker = object.__new__(DiffusionWorker)  # only the snapshot path runs: no Ray, no group
    worker.cfg, worker.role, worker.fsdp, worker._snapshot = digen_config_from_dict({"model": {"lora": {"enable": False}}}), "trainer", False, None
    worker.adapter = type("A", (), {"transformer": make_full_denoiser(3)})()
    worker.deadlines = Deadlines.floor(worker.cfg.task_timeout_s)  # what __init__ sets before the plan's
    first = worker._sync_snapshot()
    ptrs = [t.data_ptr() for t in first.state().values()]
    with torch.no_grad():
        for p in worker.adapter.transformer.parameters():
            p.add_(1.0)
    second = worker._sync_snapshot()
    assert [t.data_ptr() for t in second.state().values()] == ptrs
    want = trainable_state(worker.adapter.transformer, lora_only=False)
    assert state_digest(second.state()) == state_digest(want)


def test_a_snapshot_goes_over_the_channel_as_packed_and_arrives_bitwise() -> None:
    """The sender broadcasts the snapshot's buckets as they are: no repacking (flatten_state is
    not called), and the receiver gets every tensor bitwise, in several messages."""
    import verl_digen.sync.transport as transport

    port = find_free_port()
    state = _state(5)
    snap = HostSnapshot(bucket_bytes=4096)
    snap.capture(state)
    got: dict[int, object] = {}
    packs = []
    real_flatten = transport.flatten_state

    def counting_flatten(*a, **k):
        packs.append(1)
        return real_flatten(*a, **k)

    def endpoint(rank: int) -> None:
        ch = WeightChannel("gloo", rank, 2, "127.0.0.1", port, timeout_s=30)
        try:
            got[rank] = ch.send(snap, 4) if rank == 0 else ch.recv()
        finally:
            ch.close()

    transport.flatten_state = counting_flatten
    try:
        threads = [threading.Thread(target=endpoint, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        transport.flatten_state = real_flatten
    received, version, _ = got[1]
    assert version == 4 and state_digest(received) == state_digest(state)
    assert got[0].nbytes == state_nbytes(state) and not packs


def test_weights_digest_matches_bitwise_equal_states_and_catches_any_changed_word() -> None:
    state = _state(7)
    d = weights_digest(state)
    relaid = {k: v.t().contiguous().t() if v.ndim == 2 else v.clone() for k, v in state.items()}  # strided copy
    assert weights_digest(relaid) == d
    assert weights_digest(list(sorted(state.items()))) == d
    for name in state:
        for pos in (0, state[name].numel() - 1):
            changed = {k: v.clone() for k, v in state.items()}
            raw = changed[name].reshape(-1).view(torch.uint8)
            raw[pos * state[name].element_size()] ^= 1  # one bit of one element
            assert weights_digest(changed) != d, (name, pos)
    assert weights_digest({"x" + k: v for k, v in state.items()}) != d  # names count
    assert weights_digest({**state, "b.bias": state["b.bias"].double()}) != d  # dtypes count


def test_weights_digest_brings_one_small_tensor_to_the_host_per_state() -> None:
    """The old digest moved every tensor to the host (.cpu() per tensor) and hashed its bytes
    there; this one sums on the device and moves the sums once."""
    state = {f"t{i}": torch.randn(100) for i in range(12)}
    with _CountCalls({"cpu", "numpy"}) as mode:
        weights_digest(state)
    assert mode.calls == 1


def test_weights_digest_chunks_large_tensors_exactly() -> None:
    """Chunk sums are exact int64 (no overflow for the largest words and weights), so a tensor
    past one chunk digests the same as its bitwise copy and differs from a changed one."""
    from verl_digen.sync import snapshot

    big = torch.full((snapshot._DIGEST_CHUNK_WORDS + 5,), -32768, dtype=torch.int16)
    d = WeightsDigest()
    d.update("big", big)
    once = d.hexdigest()
    assert weights_digest({"big": big.clone()}) == once
    big[-1] = 0
    assert weights_digest({"big": big}) != once


class _Stepper:
    """The updater's part of an optimizer step: every trained weight changes (as Adam's would)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module, self.opt_params = module, list(module.parameters())

    def optimizer_step(self, group) -> dict:
        with torch.no_grad():
            for p in self.opt_params:
                p.add_(0.5)
        return {}


def _fsdp_worker(monkeypatch, placement: str):
    """A real one-rank FSDP trainer's worker (no Ray, no group: the module stays unsharded, which
    ``stream_full_state`` streams as it would the shards) and the list of its state streams."""
    import verl_digen.workers.fsdp as fsdp
    from verl_digen.config import digen_config_from_dict
    from verl_digen.workers.worker import DiffusionWorker

    from test_sync import make_full_denoiser

    for key, value in {"WORLD_SIZE": "1", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(key, value)
    cfg = digen_config_from_dict({"placement": placement, "fsdp": {"enable": True}, "model": {"lora": {"enable": False}}})
    worker = DiffusionWorker("trainer" if placement == "disaggregated" else "fused", cfg, "unused")
    worker.adapter = type("A", (), {"transformer": make_full_denoiser(3)})()
    worker.updater = _Stepper(worker.adapter.transformer)
    streams = []
    real = fsdp.stream_full_state

    def counted(*args, **kwargs):
        streams.append(worker.policy_version)
        return real(*args, **kwargs)

    monkeypatch.setattr(fsdp, "stream_full_state", counted)
    return worker, streams


def test_a_colocated_fsdp_trainer_gathers_its_full_state_only_when_it_is_read(monkeypatch, tmp_path) -> None:
    """Colocated FSDP (no weight-sync sender): optimizer steps stream nothing to the host (the
    old code gathered and copied the whole model every step); the stale snapshot is refused, not
    saved as the final weights; refresh_full_state streams once, and the saved weights are the
    trained ones."""
    from safetensors.torch import load_file

    worker, streams = _fsdp_worker(monkeypatch, "colocated")
    for _ in range(3):
        worker.optimizer_step()
    assert worker.policy_version == 3 and streams == []
    with pytest.raises(RuntimeError, match="holds weights version None but this rank trained version 3"):
        worker.save_final_weights(str(tmp_path / "stale.safetensors"))
    assert worker.refresh_full_state() == 3 and worker.refresh_full_state() == 3
    assert streams == [3]  # once: the second call found this version streamed already
    saved = load_file(worker.save_final_weights(str(tmp_path / "final.safetensors")))
    assert state_digest(saved) == state_digest(trainable_state(worker.adapter.transformer, lora_only=False))
    worker.optimizer_step()
    with pytest.raises(RuntimeError, match="holds weights version 3 but this rank trained version 4"):
        worker.weights_digest()


def test_a_disaggregated_fsdp_trainer_streams_every_version_for_its_sender(monkeypatch) -> None:
    """The weight-sync sender sends each version from the snapshot: every step streams it, and
    refresh_full_state (finish_weights) then has nothing left to gather."""
    worker, streams = _fsdp_worker(monkeypatch, "disaggregated")
    for _ in range(2):
        worker.optimizer_step()
    assert streams == [1, 2] and worker.refresh_full_state() == 2 and streams == [1, 2]
    want = trainable_state(worker.adapter.transformer, lora_only=False)
    assert weights_digest(worker._full_state()) == weights_digest(want)


class _RecordedStreams(SideStreams):
    """:class:`SideStreams` without CUDA: the tensors a producer marks count as on a device,
    their copies run at once on the host, and every wait, copy and event lands in ``log`` next
    to the producer's own entries, in the order the capture issues them (events are numbered:
    ``("copies", "3")`` is the fourth event recorded after copies)."""

    def __init__(self, log: list[tuple[str, str]]) -> None:
        super().__init__()
        self.log, self.names = log, {}  # names: data_ptr of a marked source -> its name

    def mark(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        self.names[tensor.data_ptr()] = name
        return tensor

    def on_device(self, tensor: torch.Tensor) -> bool:
        return tensor.data_ptr() in self.names

    def host_buffer(self, numel: int, dtype: torch.dtype, *, pinned: bool) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype)  # no pinned memory without CUDA

    def wait_for_producer(self, device: torch.device) -> None:
        self.log.append(("wait", str(device)))

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.log.append(("copy", self.names[src.data_ptr()]))
        dst.copy_(src.reshape(-1))

    def copies_enqueued(self, device: torch.device):
        n = sum(entry[0] == "copies" for entry in self.log)
        self.log.append(("copies", str(n)))
        return type("Landed", (), {"n": n, "synchronize": lambda self: None})()

    def producer_waits(self, device: torch.device, copies) -> None:
        self.log.append(("producer waits", str(copies.n)))


def _lazy_capture(n: int = 12) -> tuple[HostSnapshot, list[tuple[str, str]], dict[str, torch.Tensor]]:
    """A capture, in 2 KiB buckets, of ``n`` 1 KiB tensors and a host one, produced lazily
    (one at a time, as a generator of gathered tensors does), recorded."""
    log: list[tuple[str, str]] = []
    streams = _RecordedStreams(log)
    sources = {f"w{i:02d}": torch.full((256,), float(i)) for i in range(n)}
    sources["w05.count"] = torch.arange(7, dtype=torch.uint8)  # stays on the host

    def produce():
        for name in sorted(sources):
            log.append(("produce", name))
            t = sources[name].clone()
            yield name, (t if name.endswith("count") else streams.mark(name, t))

    snap = HostSnapshot(bucket_bytes=3000, streams=streams)  # two 1 KiB tensors a bucket
    snap.capture(produce())
    return snap, log, sources


def test_each_bucket_of_a_lazily_produced_stream_is_copied_after_a_wait_that_follows_its_production() -> None:
    """FSDP produces a version bucket by bucket (its all-gathers enqueued while the capture is
    already copying). The side stream must wait for the producer after each bucket has been
    produced and before that bucket's copies: once per capture (the old code) let the copies of
    every bucket but the first read sources not yet written. Host tensors in the stream are
    copied at once, with no wait of their own."""
    snap, log, sources = _lazy_capture()
    buckets = [[s.name for s in layout.slots] for _, layout in snap.parts()]
    assert len(buckets) >= 5
    for names in buckets:
        on_device = [n for n in names if not n.endswith("count")]
        produced = max(log.index(("produce", n)) for n in names)
        first_copy = min(log.index(("copy", n)) for n in on_device)
        waits = [i for i, entry in enumerate(log) if entry[0] == "wait" and produced < i < first_copy]
        assert waits, (names, log)
    assert sum(entry[0] == "wait" for entry in log) == len(buckets)
    assert ("copy", "w05.count") not in log
    assert state_digest(snap.state()) == state_digest(sources)


def test_a_lazily_produced_stream_writes_while_at_most_one_bucket_is_being_copied() -> None:
    """record_stream keeps a freed source's memory until its copy has run, so a producer faster
    than the copies (NVLink all-gathers, PCIe copies) would hold nearly the whole state on the
    device. The producer's work waits for bucket k-1's copies once bucket k's are enqueued:
    whenever it produces, at most one bucket's copies have not been waited for; and its work
    after the capture waits for the last copies, which are what the host waits for too."""
    snap, log, _ = _lazy_capture(n=16)
    buckets = len(list(snap.parts()))
    assert buckets >= 8
    enqueued, waited = 0, 0  # buckets whose copies are enqueued / the producer has waited for
    for kind, arg in log:
        if kind == "copies":
            enqueued += 1
        elif kind == "producer waits":
            waited = max(waited, int(arg) + 1)
        elif kind == "produce":
            # on the device: the buckets being copied, the one produced now and the tensor read
            # ahead of it: what the memory plan charges the sender's sync phase
            assert enqueued - waited <= 1 and (enqueued - waited) + 2 <= CAPTURE_DEVICE_BUCKETS, log
    assert enqueued == buckets and log[-1] == ("producer waits", str(buckets - 1))
