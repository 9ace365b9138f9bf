"""``python -m verl_digen.doctor``: is the plugin loaded, which versions, which devices.

veRL loads plugins at the end of ``import verl`` and logs failures at debug level only, so
a broken install is silent. This command imports veRL *first* and then checks whether our
entry point ran, and says what to do when it did not.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import os
import sys
import traceback


def report() -> tuple[bool, list[str]]:
    lines: list[str] = []
    ok = True
    import verl  # noqa: F401  (runs the verl.plugins entry points)

    loaded = "verl_digen.plugin" in sys.modules and getattr(sys.modules["verl_digen.plugin"], "LOADED", False)
    eps = [ep for ep in md.entry_points(group="verl.plugins") if ep.value.startswith("verl_digen")]
    policy = os.getenv("VERL_USE_EXTERNAL_PLUGINS", "auto")
    if loaded:
        lines.append("plugin: loaded by veRL (entry point verl.plugins:digen)")
    else:
        ok = False
        why = "no 'verl.plugins' entry point for verl_digen is installed (pip install -e . ?)" if not eps else (
            f"VERL_USE_EXTERNAL_PLUGINS={policy!r} excludes it" if policy.lower() not in ("auto",) and "digen" not in policy
            else "its import failed; run: python -c 'import verl_digen.plugin' to see the error"
        )
        lines.append(f"plugin: NOT loaded by veRL: {why}")

    if loaded:  # the digen trainer mode of main_ppo, and the one runtime patch (verl_digen/verl_hooks.py)
        try:
            from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY  # importing v1 registers the mode
        except ImportError as e:  # a dependency of veRL's trainer is missing: say which, and go on
            ok = False
            lines.append(f"main_ppo trainer.v1: its import failed: {import_failure(e)}")
        else:
            from verl.utils.config import validate_config

            from verl_digen import verl_hooks

            registered = "digen" in TRAINER_REGISTRY
            wrapped = getattr(validate_config, "_digen_wrapped", False)
            ok &= registered and wrapped
            lines.append("main_ppo trainer.v1.trainer_mode=digen: " + ("registered" if registered else "NOT registered"))
            lines.append("main_ppo validate_config: " + ("digen checks in the digen mode" if wrapped else "NOT wrapped"))
            for module, error in verl_hooks.HOOK_ERRORS.items():
                lines.append(f"  hook on {module} failed: {error}")

    import ray
    import torch

    import verl_digen

    def version(name: str) -> str:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return "not installed"

    lines.append(f"verl-digen {verl_digen.__version__}")
    from packaging.specifiers import SpecifierSet

    pinned, supported = verl_digen.VERL_VERSION_PINNED, SpecifierSet(verl_digen.VERL_VERSIONS_SUPPORTED)
    verl_v = version("verl")
    in_range = verl_v != "not installed" and supported.contains(verl_v, prereleases=True)
    note = "" if verl_v == pinned else "  (untested: run scripts/verl_contract.sh)" if in_range else "  <-- UNSUPPORTED"
    lines.append(f"verl {verl_v} (tested {pinned}, supported {supported})" + note)
    ok &= in_range
    for pkg in ("torch", "ray", "diffusers", "transformers", "peft", "hydra-core"):
        lines.append(f"{pkg} {version(pkg)}")

    from verl.plugin.platform import PlatformRegistry
    from verl.utils.device import get_device_name

    lines.append(f"veRL platforms registered: {', '.join(PlatformRegistry.registered_names())}")
    lines.append(f"veRL device: {get_device_name()}")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            lines.append(f"  cuda:{i} {torch.cuda.get_device_name(i)}")
    lines.append(f"CPU cores: {os.cpu_count()}  (ray {ray.__version__})")
    return ok, lines


def import_failure(error: ImportError) -> str:
    """``error`` and the file whose import statement raised it, relative to its ``sys.path``
    entry (``fastapi/telemetry/_api.py``: the package that needs what is missing)."""
    frames = traceback.extract_tb(error.__traceback__)
    text = f"{type(error).__name__}: {error}"
    machinery = os.path.dirname(importlib.__file__) + os.sep  # the import system's own frames
    outside = [f.filename for f in frames if not f.filename.startswith(("<", machinery))]
    if not outside:
        return text
    where = os.path.abspath(outside[-1])
    roots = sorted((os.path.abspath(p) for p in sys.path if p), key=len, reverse=True)
    root = next((r for r in roots if where.startswith(r + os.sep)), None)
    return f"{text} (imported by {os.path.relpath(where, root) if root else where})"


def main() -> int:
    ok, lines = report()
    for line in lines:
        print(line)
    print("doctor: OK" if ok else "doctor: PROBLEMS FOUND")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
