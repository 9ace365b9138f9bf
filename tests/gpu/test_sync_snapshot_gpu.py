"""The sender's host snapshot on a GPU: its buffers are pinned and reused across versions, the
NCCL sender's device staging carries every buffer bitwise, and a slowly produced stream is
captured bitwise in many buckets. The same on CPU: tests/unit/test_sync_snapshot.py."""

from __future__ import annotations

import pytest
import torch

from verl_digen.sync.snapshot import HostSnapshot, weights_digest
from verl_digen.sync.transport import WeightChannel


@pytest.mark.gpu
def test_pinned_snapshot_and_nccl_send_on_one_gpu() -> None:  # pragma: no cover - GPU only
    """On a GPU: the snapshot's buffers are pinned and reused across versions, the side-stream
    copies land before the host reads them (bitwise), the device digest equals the host one,
    and the NCCL sender's device staging (``WeightChannel._on_device``: pinned -> device,
    non_blocking) is made once and carries every buffer bitwise. (NCCL forbids two ranks on
    one GPU; tests/gpu/test_sync_gpu.py::test_nccl_channel_between_two_gpus runs the wire.)"""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    dev = torch.device("cuda", 0)
    snap = HostSnapshot(bucket_bytes=1 << 20)
    gpu = {k: (torch.randn(512, 1024, device=dev) * (i + 1)).to(torch.bfloat16) for i, k in enumerate("abcd")}
    snap.capture(gpu)
    ptrs, made = snap.buffer_ptrs(), snap.allocations
    assert all(b.is_pinned() for buffers, _ in snap.parts() for b in buffers)
    sender = object.__new__(WeightChannel)  # only the staging path: no process group
    sender.device, sender._staging, sender.staging_allocations = dev, None, 0
    for v in range(3):
        for t in gpu.values():
            t.add_(1)  # the next version, written on the current stream before the capture
        snap.capture(gpu)
        assert snap.buffer_ptrs() == ptrs and snap.allocations == made
        host = snap.state()
        assert all(torch.equal(host[k], gpu[k].cpu()) for k in gpu), v
        assert weights_digest(gpu) == weights_digest(host) == weights_digest(host, device=dev)
        for buffers, _ in snap.parts():
            for buf in buffers:
                staged = sender._on_device(buf)
                assert staged.device == dev and torch.equal(staged.cpu(), buf)
    assert sender.staging_allocations == 1


@pytest.mark.gpu
def test_a_slowly_produced_stream_is_captured_bitwise_in_many_buckets() -> None:  # pragma: no cover - GPU only
    """On a GPU: a producer whose kernels lag far behind the host (a sleep before it writes each
    tensor, on the current stream, as FSDP's all-gathers may) and 4 MiB buckets. A copy that ran
    before its source was written would read the -1s the source starts with; every bucket's
    copies wait for the producer first, so the snapshot is the sources bitwise."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    dev = torch.device("cuda", 0)
    g = torch.Generator(device=dev).manual_seed(0)
    refs = [torch.rand(1 << 18, device=dev, generator=g) for _ in range(64)]  # 1 MiB each
    torch.cuda.synchronize(dev)

    def produce():
        for i, ref in enumerate(refs):
            out = torch.full_like(ref, -1.0)
            torch.cuda._sleep(2_000_000)  # about a millisecond: the host runs far ahead
            out.copy_(ref)
            yield f"w{i:03d}", out

    snap = HostSnapshot(bucket_bytes=4 << 20)
    for _ in range(2):  # fresh pinned buffers, then the same ones reused
        snap.capture(produce())
        host = snap.state()
        assert len(list(snap.parts())) >= 16
        for i, ref in enumerate(refs):
            assert torch.equal(host[f"w{i:03d}"].view(torch.int32), ref.cpu().view(torch.int32)), i
