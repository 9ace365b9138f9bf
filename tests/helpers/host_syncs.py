"""Count the host syncs a piece of code makes: the calls that make the CPU wait for the device.

A sync is a device -> host read (``item``, ``float``/``int``/``bool``, ``tolist``, ``numpy``,
``cpu``, ``to`` the host, a device value written into a host tensor), an op whose output size
depends on device values (``nonzero``, ``equal``, ...), or a *blocking* host -> device copy
(PyTorch's blocking copy ends with a stream synchronize: ``memcpy_and_sync``).

Which tensors are "on the device": on a GPU, the ones whose ``.device`` is not the CPU (exact).
On a CPU-only machine every tensor is on the CPU, so the counter follows the data instead: the
``roots`` (the model's parameters), every tensor copied in with ``.to(device)``, every tensor a
factory makes with a ``torch.device`` (``torch.arange(..., device=x.device)``) and every output
of an op with such an input are *device* tensors; the rest are host tensors. On the CPU a
device tensor moved to a ``torch.device`` stays on the device (``x.to(adapter.device)``), one
moved to ``"cpu"`` (or ``.cpu()``) is read back. Tensors made in C++ or by host factories are
missed on the CPU; the gpu test (``tests/gpu/test_gpu.py``) counts with real devices.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

_READS = {"item", "__float__", "__int__", "__bool__", "__index__", "tolist", "numpy", "cpu"}
_SIZE_FROM_VALUES = {"nonzero", "equal", "allclose", "masked_select", "unique", "argwhere"}
_MOVES = {"to", "cuda"}


def _name(func) -> str:
    return getattr(func, "__name__", str(func))


class HostSyncCounter(TorchFunctionMode):
    """``with HostSyncCounter(roots) as c: ...``; then ``c.total`` and ``c.calls`` (name -> count)."""

    def __init__(self, roots: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self._device: WeakIdKeyDictionary = WeakIdKeyDictionary()
        for t in roots:
            self._device[t] = True
        self.calls: Counter[str] = Counter()

    @property
    def total(self) -> int:
        return sum(self.calls.values())

    def on_device(self, t: object) -> bool:
        return isinstance(t, torch.Tensor) and (t.device.type != "cpu" or t in self._device)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _name(func)
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        device_in = any(self.on_device(t) for t in inputs)
        moved_in = False
        if name in _MOVES:
            moved_in = self._move(name, args, kwargs, device_in)
        elif device_in and (name in _READS or name in _SIZE_FROM_VALUES):
            self.calls[name] += 1
        elif name in ("__setitem__", "copy_") and not self.on_device(args[0]) and any(
            self.on_device(t) for t in inputs[1:]
        ):
            self.calls[f"{name} (device into host)"] += 1
        out = func(*args, **kwargs)
        made_on_device = not inputs and isinstance(kwargs.get("device"), torch.device)
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        for t in outputs:
            if (device_in and name not in _READS and name not in _MOVES) or moved_in or made_on_device:
                self._device[t] = True
            elif name in _MOVES or name == "cpu":  # read back (on the CPU: the very same object)
                self._device.pop(t, None)
        return out

    def _move(self, name: str, args, kwargs, device_in: bool) -> bool:
        """A ``to``/``cuda`` call: device -> host is a read; host -> device blocks unless
        ``non_blocking``; returns whether the output is a device tensor."""
        src = args[0]
        target = kwargs.get("device")
        for a in args[1:]:
            if isinstance(a, (str, torch.device)):
                target = a
        if name == "cuda":
            target = "cuda"
        if target is None:  # a dtype change: stays where it is
            return device_in
        target_arg, target = target, torch.device(target)
        if self.on_device(src):
            # On a CPU machine the device is the CPU too: a device tensor moved to a torch.device
            # (``adapter.device``, ``x.device``) stays on the device; to the host is ``"cpu"``.
            to_host = target.type == "cpu" and (src.device.type != "cpu" or not isinstance(target_arg, torch.device))
            if to_host:
                self.calls["to (device to host)"] += 1
                return False
            return True
        if not kwargs.get("non_blocking", False):
            self.calls["to (blocking host to device)"] += 1
        return True
