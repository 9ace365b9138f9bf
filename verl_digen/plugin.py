"""veRL plugin entry point (``verl.plugins`` group, name ``digen``).

veRL imports this module at the end of ``import verl``, in every process (Ray workers
included). It must stay light: it registers the CPU platform, arranges for the ``digen`` v1
trainer mode to be registered, and records that it ran; nothing else (no diffusers, no Ray).
veRL swallows plugin import errors at debug level, so ``python -m verl_digen.doctor`` reads
:data:`LOADED` (and :data:`TRAINER_MODE_ERROR`) to tell the user whether this actually ran.

The trainer mode: veRL's trainer registry (``register_trainer``) lives in
``verl.trainer.ppo.v1``, whose import costs seconds and hundreds of MB (TransferQueue, the
LLM engines) that most processes importing ``verl`` never need. So the mode is registered
the moment that package itself is imported, which ``main_ppo``'s TaskRunner does right before
it looks ``trainer.v1.trainer_mode`` up: an import hook on that one module name, no change to
veRL's code.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import sys
from typing import Any

from verl_digen.platform.cpu import register_cpu_platform

LOADED: bool = False
TRAINER_MODE_ERROR: str | None = None  # why registering the digen trainer mode failed, if it did
_V1 = "verl.trainer.ppo.v1"


def register_trainer_mode() -> None:
    """Register ``trainer.v1.trainer_mode=digen`` in veRL's trainer registry (idempotent)."""
    global TRAINER_MODE_ERROR
    try:
        import verl_digen.trainer.verl_mode  # noqa: F401  (@register_trainer("digen"))
    except Exception as e:  # never break veRL's own trainers; say what went wrong instead
        TRAINER_MODE_ERROR = f"{type(e).__name__}: {e}"
        logging.getLogger(__name__).warning("verl-digen: the digen trainer mode is not registered: %s",
                                            TRAINER_MODE_ERROR)


class _RegisterWhenV1Loads(importlib.abc.MetaPathFinder):
    """Finds ``verl.trainer.ppo.v1`` like the rest of ``sys.meta_path`` would, and registers
    the digen mode right after the package has executed (its registry is then complete)."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != _V1:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)  # one-shot; also keeps the lookup below from recursing
        spec = importlib.util.find_spec(name)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def exec_then_register(module: Any) -> None:
            exec_module(module)
            register_trainer_mode()

        loader.exec_module = exec_then_register
        return spec


def _arrange_trainer_mode() -> None:
    if _V1 in sys.modules:
        register_trainer_mode()
    elif not any(isinstance(f, _RegisterWhenV1Loads) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterWhenV1Loads())


register_cpu_platform()
_arrange_trainer_mode()
LOADED = True
