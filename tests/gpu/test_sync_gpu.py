"""Weight sync trainer -> rollout over NCCL, between two GPUs (GPU machines only). The gloo channel
and the packing: tests/unit/test_sync.py."""

from __future__ import annotations

import pytest
import torch

from verl_digen.sync import WeightChannel, find_free_port, load_trainable_state, state_digest, trainable_state
from test_sync import make_lora_denoiser
from test_sync_e2e import perturb


# ----------------------------------------------------------------------------------------
# NCCL (GPU machines only; deselected by default through `-m 'not gpu'`)
# ----------------------------------------------------------------------------------------


def _nccl_endpoint(rank: int, world_size: int, port: int, queue) -> None:  # pragma: no cover - GPU only
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    model = make_lora_denoiser(seed=rank).to(device)
    # bucket_bytes=4096 splits the LoRA state into several messages over NCCL.
    channel = WeightChannel("nccl", rank, world_size, "127.0.0.1", port, device=device, timeout_s=60, bucket_bytes=4096)
    with channel as ch:
        if rank == 0:
            perturb(model, lora_only=True, seed=123)
            stats = ch.send(trainable_state(model, lora_only=True), version=3)
            version = 3
        else:
            state, version, stats = ch.recv()
            assert all(t.device == device for t in state.values())
            load_trainable_state(model, state, lora_only=True)
    queue.put((rank, version, stats.nbytes, state_digest(trainable_state(model, lora_only=True))))


@pytest.mark.gpu
@pytest.mark.e2e
def test_nccl_channel_between_two_gpus() -> None:  # pragma: no cover - GPU only
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("NCCL weight channel needs 2 CUDA devices (NCCL forbids two ranks on one GPU)")
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = find_free_port()
    procs = [ctx.Process(target=_nccl_endpoint, args=(r, 2, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    results = sorted(queue.get() for _ in range(2))
    assert results[0][1:] == results[1][1:]
    assert results[0][1] == 3
