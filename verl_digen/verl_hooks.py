"""Where verl-digen hooks into veRL at import time, without editing veRL's code.

* ``verl.trainer.ppo.v1`` (veRL's v1 trainers and their registry): the ``digen`` trainer mode
  is registered with veRL's own ``register_trainer``, right after that package has executed
  (a one-shot import hook on its name, :class:`_AfterImport`), so that ``import verl``, which
  runs the plugin in every process, stays light. No patch.
* ``verl.utils.config.validate_config``: **the one runtime patch** (version-guarded: veRL
  0.9.x). ``main_ppo`` validates its config in the driver, before Ray starts, with LLM rules
  that cannot hold for a diffusion run: with veRL's default ``algorithm.adv_estimator=gae`` it
  asks for a critic and builds its model config from veRL's default LLM path (and stops
  there); it requires log-prob micro-batch sizes; with LoRA it reads the mandatory
  ``actor_rollout_ref.rollout.name``. veRL has no hook for a trainer mode to validate its own
  config, so the function is wrapped: when ``trainer.v1.trainer_mode=digen``, the digen mode's
  checks run instead (:func:`verl_digen.trainer.resolve.check_run_config`: veRL's keys mapped onto
  ours, keys that cannot apply refused, files, model and reward checked), so a bad key stops
  the job before Ray with a message naming it. Every other mode gets veRL's own function.
* The command line of ``main_ppo`` in the digen mode (:func:`accept_omni_keys`): veRL-Omni's
  diffusion keys, which veRL's config lacks, become ``++key=value`` before Hydra parses it.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import logging
import sys
from typing import Any, Callable

_log = logging.getLogger(__name__)

V1_TRAINERS = "verl.trainer.ppo.v1"
VERL_CONFIG = "verl.utils.config"
PATCHED_VERL = "0.9."  # the veRL versions the validate_config patch is written against

#: Why a hook failed, by module name (``python -m verl_digen.doctor`` and the tests read it).
HOOK_ERRORS: dict[str, str] = {}


def register_trainer_mode() -> None:
    """Register ``trainer.v1.trainer_mode=digen`` in veRL's trainer registry (idempotent)."""
    import verl_digen.trainer.verl_mode  # noqa: F401  (@register_trainer("digen"))


def patch_validate_config() -> bool:
    """Wrap ``verl.utils.config.validate_config`` (see the module docstring); True when the
    wrapper is in place. Does nothing on a veRL other than :data:`PATCHED_VERL`, or twice."""
    import verl
    import verl.utils
    from verl.utils import config as verl_config

    original = verl_config.validate_config
    if getattr(original, "_digen_wrapped", False):
        return True
    if not str(verl.__version__).startswith(PATCHED_VERL):
        _log.warning("verl-digen: veRL %s is not %sx: validate_config is not wrapped, so main_ppo checks the digen "
                     "mode with its LLM rules", verl.__version__, PATCHED_VERL)
        return False

    @functools.wraps(original)
    def validate_config(config: Any, use_reference_policy: bool, use_critic: bool) -> None:
        from verl_digen.config.verl_keys import MAIN_PPO, TRAINER_MODE

        if config.trainer.v1.get("trainer_mode") != TRAINER_MODE:
            return original(config, use_reference_policy=use_reference_policy, use_critic=use_critic)
        from verl_digen.config.compose import in_hydra_app
        from verl_digen.trainer.resolve import check_resume, check_run_config, one_line_errors

        try:
            # the checkpoint a resume would read too: a different run's is named here, before Ray,
            # not from inside veRL's TaskRunner
            check_resume(check_run_config(config, entry=MAIN_PPO))
        except one_line_errors() as e:
            if not in_hydra_app():  # called by code of its own, not main_ppo's Hydra app
                raise
            # one named line, as verl_digen.main prints it, not Hydra's report of a traceback
            print(f"[verl-digen] error: {e}", file=sys.stderr, flush=True)
            sys.exit(2)
        print("[verl-digen] the digen trainer mode's config checks passed", flush=True)

    validate_config._digen_wrapped = True  # type: ignore[attr-defined]
    verl_config.validate_config = validate_config
    verl.utils.validate_config = validate_config
    return True


MAIN_PPO_MODULE = "verl.trainer.main_ppo"


def accept_omni_keys(argv: list[str], main_module: str | None) -> bool:
    """``python -m verl.trainer.main_ppo trainer.v1.trainer_mode=digen``: rewrite veRL-Omni's
    diffusion keys in ``argv`` (in place) to ``++key=value``, so that Hydra, which parses the
    command line after ``import verl`` has run this plugin, adds them to veRL's config instead of
    refusing them ("Could not override"); the digen mode's checks then map or refuse each
    (:mod:`verl_digen.config.omni_keys`). Any other program or trainer mode: ``argv`` untouched.
    True when it rewrote something."""
    if main_module != MAIN_PPO_MODULE:
        return False
    from verl_digen.config.verl_keys import TRAINER_MODE

    modes = [a.partition("=")[2] for a in argv[1:] if a.partition("=")[0].lstrip("+") == "trainer.v1.trainer_mode"]
    if not modes or modes[-1] != TRAINER_MODE:
        return False
    from verl_digen.config.omni_keys import plain_overrides

    rewritten = argv[:1] + plain_overrides(argv[1:])
    changed = rewritten != argv
    argv[:] = rewritten
    return changed


def _main_module() -> str | None:
    """The module ``python -m`` runs. ``import verl`` (which runs this plugin) happens while runpy
    imports the module's parent packages, before ``__main__`` has its spec, so the command line
    itself (``sys.orig_argv``) is read first."""
    argv = list(getattr(sys, "orig_argv", ()))
    i = 1
    while i < len(argv):
        arg = argv[i]
        if arg == "-m" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("-m") and len(arg) > 2:
            return arg[2:]
        if arg in ("-c", "-") or not arg.startswith("-"):
            break  # python -c ... or python script.py: not a module run
        i += 2 if arg in ("-W", "-X", "--check-hash-based-pycs") else 1  # options that take a value
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return getattr(spec, "name", None)


_HOOKS: dict[str, Callable[[], Any]] = {V1_TRAINERS: register_trainer_mode, VERL_CONFIG: patch_validate_config}


def _run_hook(name: str) -> None:
    try:
        _HOOKS[name]()
    except Exception as e:  # never break veRL itself; say what went wrong instead
        HOOK_ERRORS[name] = f"{type(e).__name__}: {e}"
        _log.warning("verl-digen: hook on %s failed: %s", name, HOOK_ERRORS[name])


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds one module the way the rest of ``sys.meta_path`` would, and runs its hook right
    after the module has executed."""

    def __init__(self, name: str) -> None:
        self.name = name

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != self.name:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)  # one-shot; also keeps the lookup below from recursing
        spec = importlib.util.find_spec(name)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def exec_then_hook(module: Any) -> None:
            exec_module(module)
            _run_hook(name)

        loader.exec_module = exec_then_hook
        return spec


def install() -> None:
    """Arrange every hook: now for a module already imported, else right after its import; and,
    under ``main_ppo`` in the digen mode, veRL-Omni's keys on the command line (:func:`accept_omni_keys`)."""
    try:
        accept_omni_keys(sys.argv, _main_module())
    except Exception as e:  # never break veRL itself
        HOOK_ERRORS["argv"] = f"{type(e).__name__}: {e}"
        _log.warning("verl-digen: veRL-Omni keys on the command line not rewritten: %s", HOOK_ERRORS["argv"])
    for name in _HOOKS:
        if name in sys.modules:
            _run_hook(name)
        elif not any(isinstance(f, _AfterImport) and f.name == name for f in sys.meta_path):
            sys.meta_path.insert(0, _AfterImport(name))
