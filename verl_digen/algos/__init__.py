"""FlowGRPO-family algorithm maths: SDE steps with log-probs, advantages, loss, SDE windows.

Pure functions on tensors; no veRL, Ray or model code here.
"""

from verl_digen.algos.advantages import STD_MODES, GroupAdvantageConfig, group_advantages
from verl_digen.algos.loss import PolicyLossOutput, flow_grpo_loss, gaussian_kl
from verl_digen.algos.sde import SDE_TYPES, SdeStepOutput, ode_step, sde_step_with_logprob
from verl_digen.algos.window import (
    WINDOW_MODES,
    SdeWindowConfig,
    select_sde_window,
    subsample_timesteps,
)

__all__ = [
    "SDE_TYPES",
    "STD_MODES",
    "WINDOW_MODES",
    "GroupAdvantageConfig",
    "PolicyLossOutput",
    "SdeStepOutput",
    "SdeWindowConfig",
    "flow_grpo_loss",
    "gaussian_kl",
    "group_advantages",
    "ode_step",
    "sde_step_with_logprob",
    "select_sde_window",
    "subsample_timesteps",
]
