"""veRL plugin entry point (``verl.plugins`` group, name ``digen``).

veRL imports this module at the end of ``import verl``, in every process (Ray workers
included). It must stay light: it registers the CPU platform, installs the import hooks of
:mod:`verl_digen.verl_hooks` (the ``digen`` trainer mode is registered when veRL imports its v1
trainers), and records that it ran; nothing else (no diffusers, no Ray).
veRL swallows plugin import errors at debug level, so ``python -m verl_digen.doctor`` reads
:data:`LOADED` to tell the user whether this actually ran.
"""

from verl_digen import verl_hooks
from verl_digen.platform.cpu import register_cpu_platform

LOADED: bool = False

register_cpu_platform()
verl_hooks.install()
LOADED = True
