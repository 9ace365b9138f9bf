"""The ``digen`` v1 trainer mode of ``python -m verl.trainer.main_ppo``.

veRL's entry point composes its ``ppo_trainer`` config, validates it, starts Ray and, in a
``TaskRunnerV1`` actor, looks ``trainer.v1.trainer_mode`` up in its trainer registry
(``register_trainer``), then calls, in order::

    trainer = trainer_cls(config=config); trainer.init()
    manager = <actor_rollout_ref.rollout.agent.agent_loop_manager_class>.create(
        config=..., llm_client=trainer.get_llm_client(), teacher_client=..., reward_loop_worker_handles=...)
    trainer.fit(manager)

:class:`DigenPPOTrainer` is registered under ``digen`` (by ``verl_digen.plugin`` the moment
veRL imports its v1 trainers) and is that trainer: ``init`` maps the config (veRL's keys onto
ours, :mod:`verl_digen.config.verl_keys`) and prepares the run (:class:`DigenTrainer`, the
same controller ``python -m verl_digen.main`` drives), ``fit`` runs it. veRL's LLM parts
(token servers, reward loop workers, teachers) do not exist in this mode, so the three getters
return none of them, and the agent loop manager key defaults to
:class:`DiffusionAgentLoopManager`.
"""

from __future__ import annotations

import sys
from typing import Any

from omegaconf import DictConfig, open_dict
from verl.trainer.ppo.v1.trainer_base import PPOTrainer, register_trainer

from verl_digen.config.schema import ConfigError
from verl_digen.config.verl_keys import AGENT_LOOP_MANAGER, MAIN_PPO, TRAINER_MODE


class DiffusionAgentLoopManager:
    """The agent loop manager veRL's TaskRunner builds for the ``digen`` mode.

    An LLM mode's manager owns generation (token servers, agent loops, TransferQueue). Here
    generation is a task of each step's plan, run by the rollout (or fused) workers the
    trainer builds (:mod:`verl_digen.schedule`), so the manager owns no workers: it is what
    ``fit`` receives, and it refuses the LLM clients an LLM mode would hand it, which would
    mean the config asked for LLM servers this mode never starts.
    """

    def __init__(self, config: DictConfig) -> None:
        self.config = config

    @classmethod
    def create(cls, config: DictConfig, llm_client: Any = None, teacher_client: Any = None,
               reward_loop_worker_handles: Any = None) -> "DiffusionAgentLoopManager":
        if llm_client is not None or teacher_client is not None or reward_loop_worker_handles:
            raise ConfigError("invalid config: the digen trainer mode starts no LLM servers, teachers or reward "
                              "loop workers; remove the keys that ask for them (distillation.*, reward.reward_model.*)")
        return cls(config)


@register_trainer(TRAINER_MODE)
class DigenPPOTrainer(PPOTrainer):
    """FlowGRPO on diffusion models as a veRL v1 trainer (``trainer.v1.trainer_mode=digen``)."""

    def __init__(self, config: DictConfig) -> None:
        # PPOTrainer.__init__ is not called: it builds the LLM trainer's parts (replay buffer over
        # TransferQueue, KL controllers, MoE metrics) from keys that mean nothing here.
        self.config = config
        self.trainer_mode = TRAINER_MODE
        self.result = None
        agent = config.actor_rollout_ref.rollout.agent
        chosen = agent.get("agent_loop_manager_class")
        if chosen not in (None, AGENT_LOOP_MANAGER):
            raise _reported(ConfigError(
                f"invalid config: actor_rollout_ref.rollout.agent.agent_loop_manager_class={chosen!r}; the digen "
                f"trainer mode generates with {AGENT_LOOP_MANAGER} (leave it unset)"))
        with open_dict(agent):  # the plugin's default: the user never sets it
            agent.agent_loop_manager_class = AGENT_LOOP_MANAGER

    def init(self) -> None:
        from verl_digen.trainer.loop import DigenTrainer

        try:
            self.digen = DigenTrainer(self.config, entry=MAIN_PPO)
        except (ConfigError, FileNotFoundError) as e:
            raise _reported(e) from None

    def get_llm_client(self) -> None:
        return None

    def get_teacher_client(self) -> None:
        return None

    def get_reward_handles(self) -> list[Any]:
        return []

    def fit(self, agent_loop_manager: DiffusionAgentLoopManager) -> None:  # type: ignore[override]
        if not isinstance(agent_loop_manager, DiffusionAgentLoopManager):
            raise TypeError(f"the digen trainer mode needs a {AGENT_LOOP_MANAGER}, got {type(agent_loop_manager)!r}")
        from verl_digen.trainer.loop import RunStopped

        try:
            self.result = self.digen.run()
        except RunStopped as e:
            # Already printed, few lines, the full traceback in the run's error.log: what reaches veRL's
            # driver (in Ray's traceback of this actor's task) is that message, not its causes again.
            raise RunStopped(str(e)) from None

    # The step hooks of veRL's LLM loop; the digen loop's steps are planned (verl_digen.schedule).
    def on_step_end(self) -> None:
        return None

    def on_sample_end(self) -> None:
        return None


def _reported(error: BaseException) -> BaseException:
    """Print a config error as one line before Ray wraps it in a remote traceback."""
    print(f"[verl-digen] error: {error}", file=sys.stderr, flush=True)
    return error
