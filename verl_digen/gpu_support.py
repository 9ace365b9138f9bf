"""What the parts of ``python -m verl_digen.gpu_check`` share (:mod:`verl_digen.gpu_check` and
:mod:`verl_digen.gpu_runs`): a subprocess with a time limit, how it ended, the device as the
workers name it, and the error of a part that measured something before it failed."""

from __future__ import annotations

import subprocess
from typing import Any

import torch


def _run(cmd: list[str], timeout: float, env: dict[str, str] | None = None,
         log_path: str | None = None) -> dict[str, Any]:
    """A subprocess with a time limit: return code and the tail of its output (the whole output
    also in ``log_path`` when given)."""
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        out, result = (p.stdout or "") + (p.stderr or ""), {"rc": p.returncode}
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        result = {"rc": None, "timed_out": timeout}
    if log_path:
        with open(log_path, "w", encoding="utf-8") as f:
            f.write(out)
    return {**result, "tail": out[-4000:]}


def _ended(res: dict[str, Any]) -> str:
    """How a :func:`_run` ended, in words: its exit status, or the time limit that stopped it."""
    return f"timed out after {res['timed_out']:g} s" if res["rc"] is None else f"exited {res['rc']}"


def _device(name: str) -> torch.device:
    """``name`` as the workers use it: with its index (``cuda`` -> the current CUDA device), and
    the attention kernels configured as :func:`~verl_digen.workers.worker.compute_device` does."""
    from verl_digen.workers.worker import configure_attention_kernels

    configure_attention_kernels()
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


class _PartFailed(RuntimeError):
    """A part that failed after measuring something: ``partial`` goes into the report."""

    def __init__(self, message: str, partial: dict[str, Any]) -> None:
        super().__init__(message)
        self.partial = partial
