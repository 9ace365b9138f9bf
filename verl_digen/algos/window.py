"""Which sampler steps are stochastic (and trained): the SDE window, and timestep subsampling.

Steps are indexed ``0 .. num_steps-1`` in sampling order (step 0 starts from pure noise).
Steps inside the window are SDE steps whose log-probs are recorded and trained; the others
are plain ODE steps (Flow-GRPO-Fast, MixGRPO).

Modes of :class:`SdeWindowConfig`:

* ``all``: every step (``size`` must be 0 or ``num_steps``).
* ``fixed``: ``[start, start + size)``; ``size = 0`` means ``[start, num_steps)``.
* ``random``: ``size`` consecutive steps whose first index is drawn uniformly from
  ``[start, range_end - size + 1]`` by a ``torch.Generator`` seeded from ``(seed,
  training_step)``: the same window for every sample of a training step, reproducible, and
  independent of any global RNG (Flow-GRPO-Fast / MixGRPO random window).
* ``sliding``: ``size`` consecutive steps whose first index is
  ``start + (training_step * stride) mod P`` with ``P = range_end - size - start + 2`` the
  number of window positions in ``[start, range_end]``: the window moves by ``stride`` each
  training step and wraps around (MixGRPO sliding window).

``random`` and ``sliding`` need ``size >= 1``; their range is ``[start, range_end]``
(``range_end`` defaults to ``num_steps - 1``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["WINDOW_MODES", "SdeWindowConfig", "select_sde_window", "subsample_timesteps"]

WINDOW_MODES: tuple[str, ...] = ("all", "fixed", "random", "sliding")

_MASK64 = (1 << 64) - 1


def _mix_seed(seed: int, training_step: int) -> int:
    """Deterministic 63-bit seed from ``(seed, training_step)`` (splitmix64 finaliser)."""
    z = (seed * 0x9E3779B97F4A7C15 + training_step + 0x632BE59BD9B4E019) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


@dataclass
class SdeWindowConfig:
    """Where the stochastic steps are (see the module docstring for each mode).

    Attributes:
        mode: ``"all"`` | ``"fixed"`` | ``"random"`` | ``"sliding"``.
        size: number of consecutive SDE steps; 0 = all steps (``all``; ``fixed``: up to the
            end). ``random``/``sliding`` need ``size >= 1``.
        start: ``fixed``: first SDE step; ``random``/``sliding``: first step index the window
            may reach (``sliding`` starts there at training step 0).
        stride: ``sliding``: how many steps the window moves per training step (>= 1).
        range_end: ``random``/``sliding``: last step index the window may reach (inclusive);
            ``None`` = ``num_steps - 1``.
    """

    mode: str = "all"
    size: int = 0
    start: int = 0
    stride: int = 1
    range_end: int | None = None

    def _range_end(self, num_steps: int) -> int:
        return num_steps - 1 if self.range_end is None else self.range_end

    def validate(self, num_steps: int) -> None:
        """Raise ``ValueError`` naming the field, its value and what is valid."""
        if not isinstance(num_steps, int) or num_steps < 1:
            raise ValueError(f"num_steps={num_steps!r} must be an integer >= 1")
        if self.mode not in WINDOW_MODES:
            raise ValueError(
                f"sde_window.mode={self.mode!r} is not valid; choose one of {WINDOW_MODES}"
            )
        for name in ("size", "start", "stride"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"sde_window.{name}={value!r} must be an integer")
        if not 0 <= self.size <= num_steps:
            raise ValueError(f"sde_window.size={self.size} must be in [0, num_steps={num_steps}]")
        if self.stride < 1:
            raise ValueError(f"sde_window.stride={self.stride} must be >= 1")
        if not 0 <= self.start < num_steps:
            raise ValueError(
                f"sde_window.start={self.start} must be in [0, num_steps-1={num_steps - 1}]"
            )
        if self.mode == "all":
            if self.size not in (0, num_steps):
                raise ValueError(
                    f"sde_window.size={self.size} has no effect with sde_window.mode='all' "
                    f"(valid: 0 or num_steps={num_steps}); use mode 'fixed', 'random' or "
                    f"'sliding' for a partial window"
                )
        elif self.mode == "fixed":
            if self.start + self.size > num_steps:
                raise ValueError(
                    f"sde_window.start={self.start} + sde_window.size={self.size} must be <= "
                    f"num_steps={num_steps}"
                )
        else:
            if self.size < 1:
                raise ValueError(
                    f"sde_window.size={self.size} must be >= 1 for sde_window.mode={self.mode!r}"
                )
            end = self._range_end(num_steps)
            if self.range_end is not None and (
                not isinstance(self.range_end, int) or not 0 <= self.range_end < num_steps
            ):
                raise ValueError(
                    f"sde_window.range_end={self.range_end!r} must be an integer in "
                    f"[0, num_steps-1={num_steps - 1}] or None"
                )
            if end - self.start + 1 < self.size:
                raise ValueError(
                    f"sde_window.size={self.size} does not fit in the range [start={self.start}, "
                    f"range_end={end}] ({end - self.start + 1} steps); valid sizes are "
                    f"1..{max(end - self.start + 1, 0)}"
                )


def select_sde_window(
    num_steps: int, cfg: SdeWindowConfig, *, training_step: int, seed: int
) -> list[int]:
    """Sorted indices in ``[0, num_steps)`` of the stochastic steps of ``training_step``.

    Deterministic in ``(num_steps, cfg, training_step, seed)``; never touches global RNGs.
    """
    cfg.validate(num_steps)
    if training_step < 0:
        raise ValueError(f"training_step={training_step} must be >= 0")
    if cfg.mode == "all":
        return list(range(num_steps))
    if cfg.mode == "fixed":
        size = cfg.size if cfg.size > 0 else num_steps - cfg.start
        return list(range(cfg.start, cfg.start + size))
    end = cfg._range_end(num_steps)
    positions = end - cfg.size - cfg.start + 2  # window starts in [start, end - size + 1]
    if cfg.mode == "random":
        import torch  # here, not at the top: the config schema imports this module (see algos/__init__)

        g = torch.Generator().manual_seed(_mix_seed(seed, training_step))
        first = cfg.start + int(torch.randint(positions, (1,), generator=g).item())
    else:  # sliding
        first = cfg.start + (training_step * cfg.stride) % positions
    return list(range(first, first + cfg.size))


def subsample_timesteps(
    window: list[int], fraction: float, *, generator: torch.Generator
) -> list[int]:
    """Keep a random subset of the window's steps for training (Flow-GRPO ``timestep_fraction``).

    Keeps ``k = max(1, floor(len(window) * fraction))`` steps (Flow-GRPO's
    ``int(num_steps * timestep_fraction)``, with a 1e-9 tolerance so that e.g. ``100 * 0.29``
    keeps 29, and at least one step), chosen as the first ``k`` of
    ``torch.randperm(len(window), generator=generator)``. Returned sorted.
    """
    if not (isinstance(fraction, (int, float)) and 0.0 < fraction <= 1.0):
        raise ValueError(f"timestep fraction={fraction!r} must be in (0, 1]")
    if len(window) == 0:
        raise ValueError("window is empty: there are no SDE steps to subsample")
    n = len(window)
    k = max(1, math.floor(n * fraction + 1e-9))
    import torch

    perm = torch.randperm(n, generator=generator)[:k].tolist()
    return sorted(window[i] for i in perm)
