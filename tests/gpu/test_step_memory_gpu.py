"""Each step's memory peaks on a GPU: :func:`verl_digen.memory.measure.interval_peaks` measures the
device's reserved and allocated peaks of each interval (reset after each). The host's peaks and
their aggregation per pool: tests/unit/test_step_memory.py."""

from __future__ import annotations

import pytest
import torch

from verl_digen.memory.measure import interval_peaks

DEVICE_KEYS = ("device_max_reserved_gib", "device_max_allocated_gib")


# ---------------------------------------------------------------------------- on a GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_interval_peaks_on_cuda_measure_each_interval():
    device = torch.device("cuda", torch.cuda.current_device())
    interval_peaks(device)  # whatever came before
    big = torch.empty(256 << 20, dtype=torch.uint8, device=device)  # 256 MiB
    first = interval_peaks(device)
    assert set(DEVICE_KEYS) <= set(first)
    assert first["device_max_reserved_gib"] >= first["device_max_allocated_gib"] >= 0.25
    del big
    torch.cuda.empty_cache()
    second = interval_peaks(device)  # the peaks were reset: the freed tensor is not in this interval
    assert second["device_max_allocated_gib"] < first["device_max_allocated_gib"] - 0.2
    assert second["device_max_reserved_gib"] >= second["device_max_allocated_gib"]
