"""FSDP2 (fully_shard) of the denoiser on one GPU over NCCL: bf16 training with checkpointing, and
the KL reference built from the policy's shards without a dense copy. The scenarios the rank
runs, and their CPU versions on 2 gloo ranks: tests/e2e/test_fsdp_e2e.py."""

from __future__ import annotations

import pytest
import torch

from test_fsdp_e2e import _check_bf16, _check_kl_reference, run_distributed


@pytest.mark.gpu
@pytest.mark.e2e
def test_fsdp2_bf16_one_gpu_nccl() -> None:  # pragma: no cover - GPU only
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    r = run_distributed("bf16", world=1, backend="nccl")[0]
    assert r["device"].startswith("cuda")
    _check_bf16(r)


@pytest.mark.gpu
@pytest.mark.e2e
def test_kl_reference_is_built_from_the_policys_shards_one_gpu_nccl() -> None:  # pragma: no cover - GPU only
    """On the device: the reference is materialised on the GPU by to_empty and filled from the
    policy's shards; memory grows by the policy's shards and the reference's (one rank: each a
    whole model), never by a dense copy on top of the dense policy."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    r = run_distributed("kl_reference", world=1, backend="nccl")[0]
    assert r["device"].startswith("cuda")
    _check_kl_reference(r, world=1)
    # One rank: the policy's shards and the reference are a whole model each; the allocator's
    # rounding of the tiny model's many small tensors gets 8 MiB.
    assert r["peak_growth"] <= 2.5 * r["dense"] + (8 << 20), r
