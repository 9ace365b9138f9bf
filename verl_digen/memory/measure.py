"""What a worker process has held so far, measured: the numbers the plan's figures are checked
against (``workers.json`` records them after loading, :mod:`verl_digen.gpu_check` per phase).

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
