"""Exponential moving average (EMA) of the trainable parameters, for validation and export.

Usage on a trainer rank::

    ema = EMA(named_trainable_parameters(adapter.transformer), decay=0.999)
    ...
    updater.optimizer_step(); ema.update()        # after every optimizer step
    with ema.swapped_in():                         # EMA weights live, briefly
        run_validation(adapter, ...)
    ckpt["ema"] = ema.state_dict()                 # and ema.load_state_dict(ckpt["ema"])

The averaging, the decay schedule, the swap (``store`` / ``copy_to`` / ``restore``) are
diffusers' :class:`~diffusers.training_utils.EMAModel`; this class adds what the worker needs
around it: parameter names (checkpoints keyed by name, checked on load), fp32 shadows and the
``digen.ema.*`` semantics. With ``n`` the number of updates already applied (0 at the first)::

    d = min(decay, (1 + n) / (10 + n))   if warmup else decay
    shadow = shadow - (1 - d) * (shadow - param)

Warmup makes early updates track the fast-moving weights (d = 0.1, 0.18, 0.25, ... at the
first updates) instead of averaging in the initial weights for thousands of steps; it reaches
``decay`` after ``n >= (10 * decay - 1) / (1 - decay)`` updates (8990 for 0.999). That is
EMAModel's ``use_ema_warmup`` schedule ``1 - (1 + step / inv_gamma) ** -power`` with
``inv_gamma=9, power=1`` and ``update_after_step=-1`` (so ``step = n + 1``); EMAModel's
``use_ema_warmup=False`` schedule is the same curve one update late, with a first update that
copies the weights (d = 0), which is why it is not used. Without warmup, ``min_decay = decay``
pins d to ``decay``.

Shadows are float32 whatever the parameters' dtype (bf16 weights would lose small updates),
on the parameters' device. Only parameters that require grad can be averaged (EMAModel copies
the others instead).

FSDP2 (sharded ``DTensor`` parameters): each rank averages its own shards. :meth:`state_dict`
gathers full tensors (a collective: every rank calls it, as checkpoints do) so one rank's
state is the whole EMA, and :meth:`load_state_dict` takes this rank's shards of it.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import contextmanager
from typing import Any

import torch
from diffusers.training_utils import EMAModel

__all__ = ["EMA", "named_trainable_parameters"]


def named_trainable_parameters(module: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """``(name, parameter)`` for every parameter of ``module`` with ``requires_grad``."""
    return [(n, p) for n, p in module.named_parameters() if p.requires_grad]


class EMA:
    """fp32 shadow copies of named parameters (a diffusers ``EMAModel``), averaged after each optimizer step."""

    def __init__(
        self,
        named_params: Iterable[tuple[str, torch.nn.Parameter]],
        decay: float = 0.999,
        warmup: bool = True,
        offload: bool = False,
    ) -> None:
        """``offload``: keep the shadows on CPU (``digen.ema.offload``); each update copies the live
        parameters to the host first. Sharded (FSDP2) shadows stay on the device, each rank
        holding only its shards (already 1/N of the memory)."""
        decay = float(decay)
        if not 0.0 < decay < 1.0:
            raise ValueError(f"EMA decay must be in (0, 1) (exclusive), got {decay}")
        named = list(named_params)
        if not named:
            raise ValueError("EMA needs at least one (name, parameter) pair")
        names = [n for n, _ in named]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"EMA parameter names must be unique; duplicated: {dupes}")
        for name, p in named:
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"EMA parameter {name!r} is a {type(p).__name__}, expected a tensor")
            if not p.is_floating_point():
                raise TypeError(f"EMA parameter {name!r} has non-float dtype {p.dtype}")
            if not p.requires_grad:
                raise ValueError(f"EMA parameter {name!r} does not require grad (it would be copied, not averaged)")
        self.decay = decay
        self.warmup = bool(warmup)
        self._names = names
        self._params = [p for _, p in named]
        with torch.no_grad():
            self._model = EMAModel(
                self._params,
                decay=decay,
                min_decay=0.0 if self.warmup else decay,  # no warmup: d = decay at every update
                update_after_step=-1,  # EMAModel's step = n + 1 at the update after n updates
                use_ema_warmup=True,  # 1 - (1 + step / 9) ** -1 = (1 + n) / (10 + n)
                inv_gamma=9,
                power=1,
            )
            self._model.to(dtype=torch.float32)
        from torch.distributed.tensor import DTensor

        self.offloaded = bool(offload) and not any(isinstance(p, DTensor) for p in self._params)
        if self.offloaded:
            self._model.to(device="cpu")

    # ------------------------------------------------------------------ averaging

    @property
    def names(self) -> list[str]:
        return list(self._names)

    @property
    def num_updates(self) -> int:
        """Updates applied so far (EMAModel's ``optimization_step``)."""
        return self._model.optimization_step

    @num_updates.setter
    def num_updates(self, value: int) -> None:
        self._model.optimization_step = int(value)

    def update(self) -> float:
        """Fold the live parameters into the shadows (call after each optimizer step).

        Returns the decay used.
        """
        if self.offloaded:
            # Host copies that still "require grad": EMAModel copies (not averages) the others.
            with torch.no_grad():
                live = [p.detach().to("cpu", torch.float32).requires_grad_(True) for p in self._params]
            self._model.step(live)
        else:
            self._model.step(self._params)
        return self._model.cur_decay_value

    def shadow(self, name: str) -> torch.Tensor:
        """The fp32 shadow of parameter ``name`` (the tensor itself, not a copy)."""
        try:
            return self._model.shadow_params[self._names.index(name)]
        except ValueError:
            raise KeyError(f"no EMA parameter named {name!r}") from None

    @torch.no_grad()
    def copy_to_params(self) -> None:
        """Overwrite the live parameters with the shadows (cast to their dtype), permanently."""
        self._model.copy_to(self._params)

    @contextmanager
    def swapped_in(self):
        """Temporarily load the shadows into the live parameters.

        The live values are saved first (on CPU) and restored bitwise on exit (even on error),
        so an optimizer step after the block sees exactly the weights it would have seen
        without it. Do not train inside the block.
        """
        with torch.no_grad():
            self._model.store(self._params)
        try:
            self.copy_to_params()
            yield self
        finally:
            with torch.no_grad():
                self._model.restore(self._params)

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """``{"num_updates", "decay", "warmup", "shadow": {name: full fp32 tensor (CPU copy)}}``.

        Sharded (FSDP2) shadows are gathered: a collective, so every rank must call it.
        """
        from torch.distributed.tensor import DTensor

        def full(t: torch.Tensor) -> torch.Tensor:
            return t.full_tensor() if isinstance(t, DTensor) else t

        return {
            "num_updates": self.num_updates,
            "decay": self.decay,
            "warmup": self.warmup,
            "shadow": {n: full(s.detach()).cpu().clone() for n, s in zip(self._names, self._model.shadow_params)},
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore shadows and ``num_updates`` from :meth:`state_dict`.

        The names must match this EMA's exactly, and every shape must agree. ``decay`` and
        ``warmup`` stay as constructed (they are configuration, not state).
        """
        if not isinstance(state, dict) or "shadow" not in state or "num_updates" not in state:
            raise ValueError("EMA state must be a dict with 'shadow' and 'num_updates' (from EMA.state_dict())")
        shadows = state["shadow"]
        missing = [n for n in self._names if n not in shadows]
        unexpected = [n for n in shadows if n not in self._names]
        if missing or unexpected:
            raise KeyError(f"EMA state does not match the parameters: missing {missing}, unexpected {unexpected}")
        from torch.distributed.tensor import DTensor, distribute_tensor

        current = self._model.shadow_params
        for name, shadow in zip(self._names, current):
            src = shadows[name]
            if isinstance(src, DTensor):
                raise ValueError(
                    f"EMA state for {name!r} is sharded (a checkpoint written before EMA states were gathered "
                    "under FSDP holds only rank 0's shards); resume it with digen.ema.enable=false"
                )
            if tuple(src.shape) != tuple(shadow.shape):
                raise ValueError(
                    f"EMA state for {name!r} has shape {tuple(src.shape)}, parameter has {tuple(shadow.shape)}"
                )

        def local(src: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
            src = src.to(device=like.device, dtype=torch.float32)
            if isinstance(like, DTensor):  # this rank's shards of the full tensor (no communication)
                return distribute_tensor(src, like.device_mesh, like.placements, src_data_rank=None)
            return src

        self._model.load_state_dict(
            {
                "optimization_step": int(state["num_updates"]),
                "shadow_params": [local(shadows[n], s) for n, s in zip(self._names, current)],
            }
        )

    def __repr__(self) -> str:
        return (
            f"EMA(params={len(self._params)}, decay={self.decay}, warmup={self.warmup}, "
            f"num_updates={self.num_updates})"
        )
