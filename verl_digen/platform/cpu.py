"""A CPU platform for veRL's platform registry.

veRL 0.9 resolves its platform once per process by probing the registered platforms
(``nvidia``, ``npu``, ``rocm``) and falls back to ``nvidia`` when none answers. On a machine
without accelerators that fallback makes every ``get_device_name()`` say ``cuda``. Registering
this class (it is probed last, so any real accelerator wins) lets veRL's own code run on CPU
slots: gloo for collectives, ``CPU`` as the Ray resource.
"""

from __future__ import annotations

import contextlib
import os
from types import ModuleType
from typing import Any, Optional

import torch

from verl.plugin.platform import PlatformBase, PlatformRegistry


class _CpuDeviceModule:
    """The few ``torch.cuda``-like calls veRL makes on its device module, for CPU."""

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def set_device(index: int) -> None:
        return None

    @staticmethod
    def synchronize(device: Any = None) -> None:
        return None

    @staticmethod
    def empty_cache() -> None:
        return None

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)

    @staticmethod
    def manual_seed_all(seed: int) -> None:
        torch.manual_seed(seed)

    @staticmethod
    def memory_allocated(device: Any = None) -> int:
        return 0

    @staticmethod
    def max_memory_allocated(device: Any = None) -> int:
        return 0

    @staticmethod
    def memory_reserved(device: Any = None) -> int:
        return 0

    @staticmethod
    def get_rng_state() -> torch.Tensor:
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state: torch.Tensor) -> None:
        torch.set_rng_state(state)


class PlatformCPU(PlatformBase):
    """CPU slots as veRL devices: one Ray ``CPU`` per worker, gloo collectives."""

    _device_module = _CpuDeviceModule()

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> ModuleType:
        return self._device_module  # type: ignore[return-value]

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        # Probed after the accelerator platforms: only reached when none of them answered.
        return not torch.cuda.is_available()

    def current_device(self) -> int:
        return 0

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: Optional[int] = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> tuple[Optional[int], Optional[int]]:
        return (None, None)

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextlib.contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "CPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def ray_resource_options(self, num_gpus: float) -> dict[str, Any]:
        # A CPU-slot pool already reserves its CPUs in the placement-group bundle.
        return {}

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None


def register_cpu_platform() -> None:
    """Add ``cpu`` to veRL's platform registry (idempotent)."""
    if PlatformRegistry.get("cpu") is None:
        PlatformRegistry.register(platform="cpu")(PlatformCPU)
    os.environ.setdefault("VERL_DIGEN_CPU_PLATFORM", "registered")
