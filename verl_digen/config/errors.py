"""The user-configuration error, in a module of its own that imports nothing of the package, so
that the torch-free decisions below the config (``memory/fsdp_layout.py``) can raise it without an
import circle through :mod:`verl_digen.config.schema`, which re-exports it."""


class ConfigError(ValueError):
    """A user configuration problem; the message names the key, the value and what is valid."""
