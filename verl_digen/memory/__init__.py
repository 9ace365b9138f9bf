"""Per-GPU memory planning at real size, on the meta device (no weights, no GPU).

* :mod:`verl_digen.memory.trace`: what one forward of a real-size denoiser keeps (saved for
  backward, and live in a no-grad forward), measured on the meta device;
* :mod:`verl_digen.memory.plan`: every role's peak per GPU (weights, gradients, optimizer,
  activations, encoders/VAE, sync buffers), and the check the job runs before any worker starts;
* ``python -m verl_digen.memory``: the table for one preset or all of them.

docs/memory.md explains the derivation and how far off it can be.
"""

from verl_digen.memory.plan import (
    MemoryPlanError,
    RolePlan,
    check_job_memory,
    decide_checkpointing,
    decide_encoder_offload,
    decide_optimizer_offload,
    plan_job,
)

__all__ = ["MemoryPlanError", "RolePlan", "check_job_memory", "decide_checkpointing", "decide_encoder_offload",
           "plan_job"]
