"""A package's public names imported on first use (PEP 562 module ``__getattr__``).

``algos/`` and ``sync/`` re-export their submodules' names, and those submodules import torch.
Importing a package runs its ``__init__`` before any submodule, so without this, reading a
config (``config/schema.py`` imports ``algos.window``) or the memory planner (which imports
``sync.buckets``) would import torch: seconds in every process that only plans or emulates
(the ``digen.emulate`` workers, one per emulated device). The standard library has no helper for
this (``importlib.util.LazyLoader`` defers a whole module, not a package's re-exports).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from typing import Any, Callable


def lazy_exports(package: str, where: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``'s ``__init__``: ``where`` maps each public name
    to the submodule (relative to the package) that defines it. A name, or a submodule of the
    package, is imported on first access and then kept in the package's namespace."""

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is not None:
            value = getattr(importlib.import_module(f"{package}.{module}"), name)
        elif not name.startswith("__") and importlib.util.find_spec(f"{package}.{name}") is not None:
            # a submodule, as an eager __init__ left it on the package (``algos.sde``)
            value = importlib.import_module(f"{package}.{name}")
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(where))

    return __getattr__, __dir__
