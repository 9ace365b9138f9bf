"""FlowGRPO-family algorithm maths: SDE steps with log-probs, advantages, loss, SDE windows.

Pure functions on tensors; no veRL, Ray or model code here. The names below are imported on first
use (:mod:`verl_digen.lazy`): the config schema needs only the SDE window's settings, and a
process that reads a config without running the maths does not import torch for it.
"""

from verl_digen.lazy import lazy_exports

_WHERE = {
    "STD_MODES": "advantages",
    "GroupAdvantageConfig": "advantages",
    "group_advantages": "advantages",
    "PolicyLossOutput": "loss",
    "flow_grpo_loss": "loss",
    "gaussian_kl": "loss",
    "SDE_TYPES": "sde",
    "SdeStepOutput": "sde",
    "ode_step": "sde",
    "sde_step_with_logprob": "sde",
    "WINDOW_MODES": "window",
    "SdeWindowConfig": "window",
    "select_sde_window": "window",
    "subsample_timesteps": "window",
}
__all__ = sorted(_WHERE)
__getattr__, __dir__ = lazy_exports(__name__, _WHERE)
