"""verl-digen: disaggregated RL post-training of diffusion generators on veRL."""

__version__ = "0.1.0"
VERL_VERSION_PINNED = "0.9.1"
