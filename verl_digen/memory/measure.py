"""What a worker process has held so far, measured: the numbers the plan's figures are checked
against (``workers.json`` records them after loading, :mod:`verl_digen.gpu_check` per phase, and
every training step's metrics per pool, ``memory/<pool>/*``, from :func:`interval_peaks`).

Host: the process's resident high-water mark (``getrusage``'s ``ru_maxrss``, KiB on Linux), what
:func:`verl_digen.memory.plan.worker_host_bytes` plans for a worker at load. Device, on CUDA only:
the caching allocator's peaks of allocated and of reserved bytes; the plan's ``overhead`` holds
the gap between them (``RESERVE_FRACTION``), so both are recorded, never allocated alone.
"""

from __future__ import annotations

import resource
import sys

import torch

GIB = 1 << 30


def memory_peaks(device: torch.device) -> dict[str, float]:
    """``host_peak_gib`` of this process, and on a CUDA ``device`` its ``device_max_allocated_gib``
    and ``device_max_reserved_gib`` since the process started (or the last peak reset)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = {"host_peak_gib": rss * (1 if sys.platform == "darwin" else 1024) / GIB}  # macOS reports bytes
    if device.type == "cuda":
        out["device_max_allocated_gib"] = torch.cuda.max_memory_allocated(device) / GIB
        out["device_max_reserved_gib"] = torch.cuda.max_memory_reserved(device) / GIB
    return out


def interval_peaks(device: torch.device) -> dict[str, float]:
    """:func:`memory_peaks` since the previous call (or the process's start), then the device's
    peaks reset (``torch.cuda.reset_peak_memory_stats``) so that the next call measures the next
    interval: a worker reports one with each task result, and the controller takes a step's max
    (``memory/<pool>/*``). ``host_peak_gib`` is not reset (Linux keeps one high-water mark per
    process): it is the process's peak so far, which a step's can only raise."""
    out = memory_peaks(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    return out


def max_peaks(*reports: dict[str, float]) -> dict[str, float]:
    """Key by key, the largest figure of several reports (a key absent from all: absent)."""
    out: dict[str, float] = {}
    for report in reports:
        for key, value in report.items():
            out[key] = max(out.get(key, value), value)
    return out
