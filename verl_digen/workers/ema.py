"""Exponential moving average (EMA) of the trainable parameters, for validation and export.

Usage on a trainer rank::

    ema = EMA(named_trainable_parameters(adapter.transformer), decay=0.999)
    ...
    trainer.optimizer_step(); ema.update()        # after every optimizer step
    with ema.swapped_in():                         # EMA weights live, briefly
        run_validation(adapter, ...)
    ckpt["ema"] = ema.state_dict()                 # and ema.load_state_dict(ckpt["ema"])

Update rule, with ``n`` the number of updates already applied (0 at the first update)::

    d = min(decay, (1 + n) / (10 + n))   if warmup else decay
    shadow = d * shadow + (1 - d) * param

Warmup makes early updates track the fast-moving weights (d = 0.1, 0.18, 0.25, ... at the
first updates) instead of averaging in the initial weights for thousands of steps; it reaches
``decay`` after ``n >= (10 * decay - 1) / (1 - decay)`` updates (8990 for 0.999). This is the
``(1 + n) / (10 + n)`` warmup of diffusers' ``EMAModel`` (``use_ema_warmup=False``).

Shadows are float32 whatever the parameters' dtype (bf16 weights would lose small updates),
on the parameters' device unless ``device`` is given (e.g. ``"cpu"`` to save GPU memory).
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["EMA", "named_trainable_parameters"]


def named_trainable_parameters(module: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """``(name, parameter)`` for every parameter of ``module`` with ``requires_grad``."""
    return [(n, p) for n, p in module.named_parameters() if p.requires_grad]


class EMA:
    """fp32 shadow copies of named parameters, averaged after each optimizer step."""

    def __init__(
        self,
        named_params: Iterable[tuple[str, torch.nn.Parameter]],
        decay: float = 0.999,
        warmup: bool = True,
        *,
        device: torch.device | str | None = None,
    ) -> None:
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
        self.decay = decay
        self.warmup = bool(warmup)
        self.num_updates = 0
        self._names = names
        self._params = [p for _, p in named]
        with torch.no_grad():
            self._shadow = [
                p.detach().to(device=p.device if device is None else device, dtype=torch.float32, copy=True)
                for p in self._params
            ]

    # ------------------------------------------------------------------ averaging

    @property
    def names(self) -> list[str]:
        return list(self._names)

    def current_decay(self) -> float:
        """The decay the next :meth:`update` will use."""
        if not self.warmup:
            return self.decay
        n = self.num_updates
        return min(self.decay, (1.0 + n) / (10.0 + n))

    @torch.no_grad()
    def update(self) -> float:
        """Fold the live parameters into the shadows (call after each optimizer step).

        Returns the decay used.
        """
        d = self.current_decay()
        for shadow, p in zip(self._shadow, self._params):
            live = p.detach().to(device=shadow.device, dtype=torch.float32)
            shadow.mul_(d).add_(live, alpha=1.0 - d)
        self.num_updates += 1
        return d

    def shadow(self, name: str) -> torch.Tensor:
        """The fp32 shadow of parameter ``name`` (the tensor itself, not a copy)."""
        try:
            return self._shadow[self._names.index(name)]
        except ValueError:
            raise KeyError(f"no EMA parameter named {name!r}") from None

    @torch.no_grad()
    def copy_to_params(self) -> None:
        """Overwrite the live parameters with the shadows (cast to their dtype), permanently."""
        for shadow, p in zip(self._shadow, self._params):
            p.copy_(shadow.to(device=p.device, dtype=p.dtype))

    @contextmanager
    def swapped_in(self):
        """Temporarily load the shadows into the live parameters.

        The live values are saved first and restored bitwise on exit (even on error), so an
        optimizer step after the block sees exactly the weights it would have seen without it.
        Do not train inside the block.
        """
        with torch.no_grad():
            backup = [p.detach().clone() for p in self._params]
            self.copy_to_params()
        try:
            yield self
        finally:
            with torch.no_grad():
                for p, saved in zip(self._params, backup):
                    p.copy_(saved)

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """``{"num_updates", "decay", "warmup", "shadow": {name: fp32 tensor (CPU copy)}}``."""
        return {
            "num_updates": self.num_updates,
            "decay": self.decay,
            "warmup": self.warmup,
            "shadow": {n: s.detach().cpu().clone() for n, s in zip(self._names, self._shadow)},
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
        for name, shadow in zip(self._names, self._shadow):
            src = shadows[name]
            if tuple(src.shape) != tuple(shadow.shape):
                raise ValueError(
                    f"EMA state for {name!r} has shape {tuple(src.shape)}, parameter has {tuple(shadow.shape)}"
                )
        for name, shadow in zip(self._names, self._shadow):
            shadow.copy_(shadows[name].to(device=shadow.device, dtype=torch.float32))
        self.num_updates = int(state["num_updates"])

    def __repr__(self) -> str:
        return (
            f"EMA(params={len(self._params)}, decay={self.decay}, warmup={self.warmup}, "
            f"num_updates={self.num_updates})"
        )
