"""verl-digen: disaggregated RL post-training of diffusion generators on veRL."""

__version__ = "0.1.0"
VERL_VERSION_PINNED = "0.9.1"  # the veRL everything is tested with (scripts/constraints.txt)
VERL_VERSIONS_SUPPORTED = ">=0.9.0.dev0,<0.10"  # what pyproject.toml accepts (patches/README.md)
