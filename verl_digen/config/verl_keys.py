"""veRL's keys, mapped onto ours: one source of truth per setting.

A run's config is veRL's ``ppo_trainer`` config plus our ``digen`` group, whichever entry
point composed it (``python -m verl.trainer.main_ppo trainer.v1.trainer_mode=digen`` or
``python -m verl_digen.main``). Every veRL key that means something for diffusion RL is
listed in :data:`MAPPED` with the ``digen.*`` field it sets; :func:`resolve_run_config` applies
them. A veRL key left at veRL's default sets nothing (the ``digen`` default stands). A key set
both ways to different values is a :class:`ConfigError` naming both. Any other veRL key set
to a value other than veRL's default cannot apply and is a :class:`ConfigError` naming it:
nothing is silently ignored. ``docs/verl_keys.md`` is the table of this module.

veRL's defaults are read from ``_generated_ppo_trainer.yaml``, the fully composed default
config veRL ships next to ``ppo_trainer.yaml`` (its CI keeps the two equal; a test here checks
it too). Values that are interpolations there (``${...}``) follow other keys and are not
compared themselves.
"""

from __future__ import annotations

import copy
import functools
import math
import os
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Mapping

from verl_digen.config.omni_keys import OMNI_HANDLED, OMNI_MAPPED, is_omni_key, omni_settings, tree_get
from verl_digen.config.omni_keys import PIPE as OMNI_PIPE, VAL_PIPE as OMNI_VAL_PIPE
from verl_digen.config.schema import DEVICES, ConfigError, hydra_defaults, prompt_sources

# The two ways in: veRL's own entry point running our trainer mode, or our short form.
MAIN_PPO = "main_ppo"
DIGEN_MAIN = "verl_digen.main"

TRAINER_MODE = "digen"
# The agent loop manager veRL's TaskRunner builds for this mode (see verl_digen.trainer.verl_mode).
AGENT_LOOP_MANAGER = "verl_digen.trainer.verl_mode.DiffusionAgentLoopManager"
_MANAGER_KEY = "actor_rollout_ref.rollout.agent.agent_loop_manager_class"

class _Unset:
    """A key the config does not have (shown as ``unset`` in messages)."""

    def __repr__(self) -> str:
        return "unset"


_UNSET = _Unset()

#: ``trainer.resume_mode``: resume the newest intact checkpoint, start fresh, or resume ``resume_from_path``.
RESUME_MODES = ("auto", "disable", "resume_path")


@dataclass(frozen=True)
class Mapped:
    """One row of the table: the veRL key, the ``digen.*`` key it sets, and how."""

    verl_key: str
    digen_key: str
    meaning: str
    convert: Callable[[Any, Mapping[str, Any]], Any] | None = None  # (value, whole config) -> digen value


def _optimizer(value: Any, _: Mapping[str, Any]) -> str:
    """veRL spells optimizers by class (``AdamW``); digen's schema validates the lowercase name."""
    return str(value).lower()


def _model_dtype(value: Any, _: Mapping[str, Any]) -> str:
    """veRL's FSDP ``model_dtype`` (``bfloat16`` / ``bf16``, ``float32`` / ``fp32``) -> digen.model.dtype."""
    names = {"bfloat16": "bf16", "bf16": "bf16", "float32": "fp32", "fp32": "fp32"}
    name = str(value).lower()
    if name not in names:
        raise ConfigError(f"invalid config: actor_rollout_ref.actor.fsdp_config.model_dtype={value!r}; valid: "
                          "bfloat16 (bf16), float32 (fp32)")
    return names[name]


def _val_samples(value: Any, _: Mapping[str, Any]) -> int:
    """veRL's ``data.val_max_samples`` (-1: all) -> how many validation prompts are sampled."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"invalid config: data.val_max_samples={value!r}; a positive number of validation prompts "
                          "(or leave veRL's -1: digen.validation.num_prompts decides)")
    return value


def _target_modules(value: Any, _: Mapping[str, Any]) -> list[str]:
    if isinstance(value, str):
        return [value]
    return list(value)


def _prompt_files(key: str) -> Callable[[Any, Mapping[str, Any]], Any]:
    """veRL's data files: one path or a list of paths (read in order and concatenated)."""

    def convert(value: Any, _: Mapping[str, Any]) -> Any:
        files = [os.path.expanduser(f) for f in prompt_sources(value, key)]
        return files[0] if len(files) == 1 else files

    return convert


def _strategy(value: Any, _: Mapping[str, Any]) -> bool:
    """veRL's ``fsdp2`` (its default ``fsdp`` reads as unset) -> shard the trainers with FSDP2."""
    if value != "fsdp2":
        raise ConfigError(f"invalid config: actor_rollout_ref.actor.strategy={value!r}; valid: fsdp2 (FSDP2 over "
                          "the training ranks, digen.fsdp.enable=true), or leave veRL's default fsdp (unsharded)")
    return True


def _val_generations(value: Any, _: Mapping[str, Any]) -> int:
    """veRL's ``trainer.log_val_generations`` (its default 0 reads as unset) -> validation images logged."""
    if not _is_positive_int(value):
        raise ConfigError(f"invalid config: trainer.log_val_generations={value!r}; a positive number of validation "
                          "images to log (or leave veRL's 0: digen.validation.log_images decides)")
    return value


def _rollout_data_dir(value: Any, _: Mapping[str, Any]) -> str:
    """veRL's ``trainer.rollout_data_dir`` (its default null reads as unset) -> where every training
    step's samples are dumped; a name Hydra read as a number is the text the user wrote."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)) or not str(value).strip():
        raise ConfigError(f"invalid config: trainer.rollout_data_dir={value!r}; a directory to dump every training "
                          "step's samples into (or null: no dump)")
    return os.path.expanduser(str(value))


def _std_mode(value: Any, _: Mapping[str, Any]) -> str:
    return "group" if value else "none"


MAPPED: tuple[Mapped, ...] = (
    Mapped("actor_rollout_ref.model.path", "digen.model.path", "diffusers model directory",
           lambda v, _: os.path.expanduser(str(v))),
    Mapped("actor_rollout_ref.model.lora_rank", "digen.model.lora.rank", "LoRA rank (> 0 turns LoRA on)"),
    Mapped("actor_rollout_ref.model.lora_alpha", "digen.model.lora.alpha", "LoRA alpha"),
    Mapped("actor_rollout_ref.model.target_modules", "digen.model.lora.target_modules",
           "LoRA target modules (diffusers module names)", _target_modules),
    Mapped("actor_rollout_ref.actor.optim.lr", "digen.algo.lr", "learning rate"),
    Mapped("actor_rollout_ref.actor.optim.weight_decay", "digen.algo.weight_decay", "weight decay"),
    Mapped("actor_rollout_ref.actor.optim.betas", "digen.algo.betas", "Adam betas", lambda v, _: [float(b) for b in v]),
    Mapped("actor_rollout_ref.actor.optim.clip_grad", "digen.algo.max_grad_norm", "gradient-norm clip"),
    Mapped("actor_rollout_ref.actor.grad_clip", "digen.algo.max_grad_norm", "gradient-norm clip"),
    Mapped("actor_rollout_ref.actor.optim.optimizer", "digen.algo.optimizer", "AdamW or SGD", _optimizer),
    Mapped("actor_rollout_ref.actor.clip_ratio", "digen.algo.clip_range", "PPO clip range (Flow-GRPO: about 1e-4)"),
    Mapped("actor_rollout_ref.actor.use_kl_loss", "digen.algo.kl_beta",
           "KL to the frozen reference on (with kl_loss_coef as beta)", lambda v, c: _kl_beta(c)),
    Mapped("actor_rollout_ref.actor.kl_loss_coef", "digen.algo.kl_beta", "KL beta (needs use_kl_loss=true)",
           lambda v, c: _kl_beta(c)),
    Mapped("actor_rollout_ref.rollout.n", "digen.batch.group_size", "images per prompt (GRPO group)"),
    Mapped("data.train_batch_size", "digen.batch.groups_per_step", "prompts per step"),
    Mapped("data.train_files", "digen.data.prompts", "training prompts (.parquet in veRL's format, .jsonl, .txt)",
           _prompt_files("data.train_files")),
    Mapped("data.val_files", "digen.validation.prompts", "validation prompts", _prompt_files("data.val_files")),
    Mapped("data.shuffle", "digen.data.shuffle", "shuffle the prompts every epoch"),
    Mapped("actor_rollout_ref.actor.fsdp_config.param_offload", "digen.fsdp.param_offload",
           "FSDP2's host offload: parameters, gradients and the optimizer step on the host"),
    Mapped("actor_rollout_ref.actor.fsdp_config.param_offload", "digen.fsdp.enable",
           "param_offload is FSDP's: it shards the training ranks with FSDP2 too"),
    Mapped("actor_rollout_ref.actor.fsdp_config.optimizer_offload", "digen.model.optimizer_offload",
           "the optimizer state on the host between optimizer steps (veRL's default false reads as unset: auto)",
           lambda v, _: "true" if v else "false"),
    Mapped("data.max_prompt_length", "digen.data.max_prompt_tokens",
           "longest prompt in tokens of the model's text tokenizer, chat template included (veRL's default 512 "
           "reads as unset)"),
    Mapped("data.filter_overlong_prompts", "digen.data.filter_overlong_prompts",
           "drop over-long prompts when the data is read (how many is printed) instead of refusing the run"),
    Mapped("actor_rollout_ref.model.custom_chat_template", "digen.data.chat_template",
           "a Jinja template over a chat prompt's messages that makes the image prompt"),
    Mapped("data.val_max_samples", "digen.validation.num_prompts", "validation prompts sampled", _val_samples),
    Mapped("actor_rollout_ref.actor.fsdp_config.model_dtype", "digen.model.dtype",
           "the weights' compute dtype, rollout and training alike (bfloat16 / float32)", _model_dtype),
    Mapped("data.seed", "digen.seed", "seed"),
    Mapped("algorithm.norm_adv_by_std_in_grpo", "digen.algo.std_mode", "true: divide by a std (veRL: the group's; "
           "veRL-Omni: algorithm.global_std's), false: none", _std_mode),
    Mapped("ray_kwargs.ray_init.num_cpus", "digen.ray_num_cpus", "Ray CPUs (verl_digen.main starts Ray; "
           "main_ppo hands it to ray.init itself)"),
    Mapped("actor_rollout_ref.actor.strategy", "digen.fsdp.enable", "fsdp2: FSDP2 over the training ranks",
           _strategy),
    Mapped("trainer.log_val_generations", "digen.validation.log_images", "validation images sent to the loggers",
           _val_generations),
    Mapped("trainer.rollout_data_dir", "digen.rollout_data_dir", "every training sample dumped: <dir>/<step>/ "
           "images, <dir>/<step>.jsonl rows", _rollout_data_dir),
    # veRL-Omni's diffusion keys (verl_digen.config.omni_keys)
    *(Mapped(*row) for row in OMNI_MAPPED),
)

# veRL keys whose value we check or read but that set no digen.* field (see _derived_settings,
# and VerlTrainerKeys for trainer.*).
READ_DIRECTLY: dict[str, str] = {
    "actor_rollout_ref.actor.ppo_mini_batch_size":
        "prompts per PPO mini-batch (optimizer step): must divide data.train_batch_size -> "
        "digen.batch.mini_batches_per_step = train_batch_size / ppo_mini_batch_size",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu":
        "samples per trainer micro-batch: a multiple of rollout.n -> digen.batch.train_micro_batch_groups; "
        "a divisor of rollout.n -> digen.batch.train_micro_batch_rows (passes within a group)",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu":
        "samples per rollout generate call (log-probs are recorded while sampling): a multiple of rollout.n "
        "-> digen.batch.groups_per_task",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu":
        "reference log-probs are computed inside each trainer micro-batch: must equal ppo_micro_batch_size_per_gpu",
    "algorithm.adv_estimator": "grpo, or veRL-Omni's flow_grpo / dance_grpo (its advantages: the batch's std by "
                               "default, algorithm.global_std); veRL's default gae reads as unset (a veRL-Omni "
                               "recipe's estimator is then its model.algorithm's), gae written on the command "
                               "line is refused (it needs a critic)",
    "reward.custom_reward_function.path": "a Python file -> digen.reward.name=custom",
    "reward.custom_reward_function.name": "the function in it (default compute_score)",
    "reward.reward_manager.name": "naive (per sample, default), batch (the batched form) or "
                                  "MultiVisualRewardManager (veRL-Omni's weighted sum of reward.reward_functions)",
    "custom_reward_function.path": "veRL's legacy spelling of reward.custom_reward_function.path",
    "custom_reward_function.name": "veRL's legacy spelling of reward.custom_reward_function.name",
    "trainer.total_training_steps": "steps (null: len(train prompts) // train_batch_size * total_epochs)",
    "trainer.total_epochs": "epochs when total_training_steps is null",
    "trainer.project_name": "tracking project / run directory",
    "trainer.experiment_name": "tracking experiment / run directory",
    "trainer.logger": "veRL's Tracking backends",
    "trainer.n_gpus_per_node": "devices per node (CPU slots on a CPU machine)",
    "trainer.nnodes": "nodes",
    "trainer.device": "cuda (GPUs when present) or cpu (CPU slots even on a GPU machine)",
    "trainer.val_before_train": "validate the weights training starts from (the initial ones, or on a resume "
                                "the checkpoint's, at its step)",
    "trainer.test_freq": "validate every N steps",
    "trainer.save_freq": "checkpoint every N steps",
    "trainer.resume_mode": "auto | disable | resume_path",
    "trainer.resume_from_path": "checkpoint to resume with resume_mode=resume_path",
    "trainer.default_local_dir": "checkpoint root",
    "trainer.max_actor_ckpt_to_keep": "checkpoints kept",
    "trainer.v1.trainer_mode": "digen (veRL's entry point); sync (its default) is accepted by verl_digen.main",
    "ray_kwargs.ray_init.address": "the Ray cluster to join (null: RAY_ADDRESS, else a cluster `ray start` "
                                   "started on this machine, else a local one); main_ppo hands it to ray.init itself",
    _MANAGER_KEY: f"defaulted by the plugin to {AGENT_LOOP_MANAGER}",
}

#: Settings that only tune an engine a digen run does not use (veRL's vLLM / SGLang / vLLM-Omni
#: rollout engines, veRL's agent loop and reward-loop workers, FSDP1's wrap policy, veRL's
#: profilers): they change how fast or in how much memory another engine runs, never what is
#: learned. Set, they are accepted, and one notice line names them (:meth:`RunConfig.notice`).
#: A key ending in '.' covers everything under it. What each one tunes is its value here
#: (docs/verl_keys.md prints this table).
ENGINE_TUNING: dict[str, str] = {
    "actor_rollout_ref.rollout.name": "the rollout engine (vllm, vllm_omni, sglang): a digen run generates with "
                                      "diffusers inside its own workers",
    "actor_rollout_ref.rollout.mode": "the engine's sync or server mode",
    "actor_rollout_ref.rollout.load_format": "how the engine loads weights",
    "actor_rollout_ref.rollout.agent.": "veRL's agent-loop workers (the digen mode's generating workers are its pools)",
    "actor_rollout_ref.rollout.gpu_memory_utilization": "the engine's KV-cache share of GPU memory",
    "actor_rollout_ref.rollout.enforce_eager": "the engine's CUDA graphs",
    "actor_rollout_ref.rollout.free_cache_engine": "the engine's cache between steps",
    "actor_rollout_ref.rollout.tensor_model_parallel_size": "the engine's tensor parallelism (a diffusers rollout "
                                                            "runs one worker per device)",
    "actor_rollout_ref.rollout.data_parallel_size": "the engine's data parallelism (digen.pools sizes the rollout)",
    "actor_rollout_ref.rollout.expert_parallel_size": "the engine's expert parallelism",
    "actor_rollout_ref.rollout.pipeline_model_parallel_size": "the engine's pipeline parallelism",
    "actor_rollout_ref.rollout.max_num_seqs": "the engine's batch limit",
    "actor_rollout_ref.rollout.max_model_len": "the engine's context limit",
    "actor_rollout_ref.rollout.max_num_batched_tokens": "the engine's token budget",
    "actor_rollout_ref.rollout.enable_chunked_prefill": "the engine's prefill",
    "actor_rollout_ref.rollout.enable_prefix_caching": "the engine's prefix cache",
    "actor_rollout_ref.rollout.disable_log_stats": "the engine's logging",
    "actor_rollout_ref.rollout.engine_kwargs.": "the engine's own arguments",
    "actor_rollout_ref.rollout.cudagraph_capture_sizes": "the engine's CUDA graphs",
    "actor_rollout_ref.rollout.scheduling_policy": "the engine's request scheduling",
    "actor_rollout_ref.rollout.multi_stage_wake_up": "how the engine wakes from sleep",
    "actor_rollout_ref.rollout.skip_tokenizer_init": "the engine's tokenizer",
    "actor_rollout_ref.rollout.calculate_log_probs": "log-probs returned by the engine (a digen rollout always "
                                                     "records its SDE steps' log-probs)",
    "actor_rollout_ref.model.use_remove_padding": "veRL's padding-free LLM kernels",
    "actor_rollout_ref.model.use_fused_kernels": "veRL's fused LLM kernels",
    "actor_rollout_ref.model.fused_kernel_options.": "veRL's fused LLM kernels",
    "actor_rollout_ref.model.use_liger": "Liger's LLM kernels",
    "actor_rollout_ref.model.use_shm": "how veRL copies a model into shared memory",
    "actor_rollout_ref.actor.fsdp_config.use_orig_params": "FSDP1's parameter views",
    "actor_rollout_ref.rollout.checkpoint_engine.": "veRL's weight transfer to the engine (digen.sync moves weights)",
    "actor_rollout_ref.model.attn_backend": "the attention kernels of veRL-Omni's trainer (a digen run uses torch "
                                            "SDPA in rollout and training alike: the same attention)",
    "actor_rollout_ref.rollout.rollout_attn_backend": "the attention kernels of vLLM-Omni's rollout (a digen run "
                                                      "uses torch SDPA)",
    "actor_rollout_ref.actor.fsdp_config.wrap_policy.": "FSDP1's wrap policy (FSDP2 here wraps each transformer "
                                                        "block)",
    "actor_rollout_ref.actor.fsdp_config.reshard_after_forward": "FSDP's resharding between forward and backward "
                                                                 "(memory against speed)",
    "actor_rollout_ref.actor.fsdp_config.forward_prefetch": "FSDP's prefetch of the next all-gather",
    "reward.num_workers": "veRL's reward-loop workers (a digen run scores in its reward pool or its workers)",
    "global_profiler.": "veRL's profiler (a digen run writes its own timeline.jsonl)",
    "actor_rollout_ref.actor.profiler.": "veRL's per-role profiler",
    "actor_rollout_ref.rollout.profiler.": "veRL's per-role profiler",
    "actor_rollout_ref.ref.profiler.": "veRL's per-role profiler",
}


def engine_tuning(key: str) -> str | None:
    """The :data:`ENGINE_TUNING` entry that covers ``key`` (None: it tunes nothing of another engine)."""
    if key in ENGINE_TUNING:
        return key
    return next((p for p in ENGINE_TUNING if p.endswith(".") and key.startswith(p)), None)


#: veRL defaults that read as unset when left alone but cannot apply when the user writes them
#: (on the command line): the value, and why.
REFUSED_WHEN_WRITTEN: dict[str, tuple[Any, str]] = {
    "algorithm.adv_estimator": ("gae", "GAE needs a critic (a value model) that FlowGRPO does not train; set grpo "
                                       "(or flow_grpo, veRL-Omni's name for the same group advantages)"),
}


def override_keys(overrides: Any) -> frozenset[str]:
    """The keys a list of Hydra overrides writes (``a.b=1``, ``+a.b=1``, ``++a.b=1``; ``~a.b``
    deletes, so writes nothing)."""
    keys = set()
    for item in overrides or ():
        text = str(item)
        if text.startswith("~"):
            continue
        key, sep, _ = text.lstrip("+").partition("=")
        if sep:
            keys.add(key.strip())
    return frozenset(keys)


# Subtrees veRL's own entry point consumes before our trainer starts: they mean what veRL
# says under main_ppo, and nothing under verl_digen.main (which starts Ray itself).
_MAIN_PPO_ONLY = ("ray_kwargs", "transfer_queue")

_HINTS = {
    "actor_rollout_ref.model.lora.rank": "use actor_rollout_ref.model.lora_rank",
    "actor_rollout_ref.actor.clip_ratio_low": "verl-digen clips symmetrically: use actor_rollout_ref.actor.clip_ratio",
    "actor_rollout_ref.actor.clip_ratio_high": "verl-digen clips symmetrically: use actor_rollout_ref.actor.clip_ratio",
    "data.prompt_key": "verl-digen reads the prompt from the 'prompt' column (chat messages or a string)",
    "critic.enable": "FlowGRPO has no critic (advantages are GRPO's)",
}


@functools.lru_cache(maxsize=1)
def _verl_defaults_cached() -> dict[str, Any]:
    import verl
    from omegaconf import OmegaConf

    path = os.path.join(os.path.dirname(verl.__file__), "trainer", "config", "_generated_ppo_trainer.yaml")
    if not os.path.isfile(path):
        raise RuntimeError(f"veRL's composed default config {path} is missing; verl-digen is pinned to veRL 0.9.x")
    data = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    assert isinstance(data, dict)
    return data


def verl_defaults() -> dict[str, Any]:
    """veRL's composed ``ppo_trainer`` defaults, unresolved (a fresh copy)."""
    return copy.deepcopy(_verl_defaults_cached())


def _get(tree: Mapping[str, Any], key: str, default: Any = _UNSET) -> Any:
    return tree_get(tree, key, default)


def _set(tree: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    for part in parts[:-1]:
        tree = tree.setdefault(part, {})
    tree[parts[-1]] = value


def _is_set(config: Mapping[str, Any], key: str) -> bool:
    """The key holds a value other than veRL's default."""
    return _differs(_get(config, key), _get(_verl_defaults_cached(), key))


def _differs(value: Any, default: Any) -> bool:
    if default is _UNSET:
        return value is not _UNSET
    if isinstance(default, str) and "${" in default:
        return False  # an interpolation in veRL's defaults: it follows the key it names
    return value != default


def _kl_beta(config: Mapping[str, Any]) -> float:
    if not _get(config, "actor_rollout_ref.actor.use_kl_loss", False):
        if not _get(config, "actor_rollout_ref.actor.kl_loss_coef", 0.0):
            return 0.0  # no KL either way (Flow-GRPO recipes write kl_loss_coef=0.0 with use_kl_loss=False)
        raise ConfigError(
            "invalid config: actor_rollout_ref.actor.kl_loss_coef="
            f"{_get(config, 'actor_rollout_ref.actor.kl_loss_coef')!r} has no effect without "
            "actor_rollout_ref.actor.use_kl_loss=true"
        )
    return float(_get(config, "actor_rollout_ref.actor.kl_loss_coef"))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_positive_int(value: Any) -> bool:
    return _is_int(value) and value >= 1


def _is_optional(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda value: value is None or check(value)


def _key(default: Any, check: Callable[[Any], bool], rule: str, key: str | None = None) -> Any:
    """A field of :class:`VerlTrainerKeys`: its default (written here only), the check of its
    value and the rule a bad value breaks; ``key``: its path under ``trainer.`` when not its name."""
    return field(default=default, metadata={"check": check, "rule": rule, "key": key})


def _is_str(value: Any) -> bool:
    return isinstance(value, str)


def _backends(logger: Any) -> Any:
    """``trainer.logger`` as a tuple: veRL takes one name, a list, or null (no backend); any
    other value is left for the check to name."""
    if isinstance(logger, str):
        return (logger,)
    if logger is None or isinstance(logger, (list, tuple)):
        return tuple(logger or ())
    return logger


@dataclass(frozen=True)
class VerlTrainerKeys:
    """veRL's ``trainer.*`` keys this project reads, typed, built once when the run is checked
    (:func:`resolve_run_config`); a bad value is a :class:`ConfigError` naming its key.

    Each default is written once, here: veRL's own (``_generated_ppo_trainer.yaml``; a test
    checks they agree). Composed configs always hold every key, so a default matters only for a
    mapping that lacks one. The field ``name`` is the key ``trainer.<name>`` unless it says otherwise.
    """

    total_training_steps: int | None = _key(None, _is_optional(_is_positive_int), "must be a positive integer")
    # Only read when total_training_steps is null: checked then (steps_for), not before.
    total_epochs: Any = _key(30, lambda value: True, "")
    project_name: str = _key("verl_examples", _is_str, "must be a name")
    experiment_name: str = _key("gsm8k", _is_str, "must be a name")
    logger: tuple[str, ...] = _key(("console", "wandb"), lambda v: isinstance(v, tuple) and all(map(_is_str, v)),
                                   "must be a backend name or a list of them")
    n_gpus_per_node: int = _key(8, _is_positive_int, "must be a positive integer")
    nnodes: int = _key(1, _is_positive_int, "must be a positive integer")
    device: str = _key("cuda", lambda value: value in DEVICES, f"valid: {', '.join(DEVICES)}")
    val_before_train: bool = _key(True, lambda value: isinstance(value, bool), "must be true or false")
    test_freq: int = _key(-1, _is_int, "must be an integer (<= 0 or null: never)")  # null reads as -1
    save_freq: int = _key(-1, _is_int, "must be an integer (<= 0 or null: never)")  # null reads as -1
    resume_mode: str = _key("auto", lambda value: value in RESUME_MODES, f"valid: {', '.join(RESUME_MODES)}")
    resume_from_path: str | None = _key(None, _is_optional(_is_str), "must be a checkpoint directory")
    # None: veRL's interpolation, checkpoints/<project_name>/<experiment_name> (see checkpoint_root)
    default_local_dir: str | None = _key(None, _is_optional(_is_str), "must be a directory")
    max_actor_ckpt_to_keep: int | None = _key(None, _is_optional(_is_int), "must be an integer or null")
    use_v1: bool = _key(True, bool, "the digen trainer mode is a v1 trainer")
    trainer_mode: str = _key("sync", _is_str, "must be a trainer mode's name", key="v1.trainer_mode")

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not f.metadata["check"](value):
                raise ConfigError(f"invalid config: {self.key(f.name)}={value!r}; {f.metadata['rule']}")
        if self.resume_mode == "resume_path" and not self.resume_from_path:
            raise ConfigError("invalid config: trainer.resume_mode=resume_path needs trainer.resume_from_path")

    @classmethod
    def key(cls, name: str) -> str:
        """The full veRL key of field ``name`` (``trainer.v1.trainer_mode`` for ``trainer_mode``)."""
        meta = next(f.metadata for f in fields(cls) if f.name == name)
        return f"trainer.{meta['key'] or name}"

    @classmethod
    def of(cls, config: Mapping[str, Any]) -> "VerlTrainerKeys":
        """The keys of ``config`` (the whole run config, resolved, as plain data), read as veRL
        writes them: ``logger`` may be one name, a ``*_freq`` of null means never, and names and
        paths Hydra read as numbers are the text the user wrote. A missing key takes its default
        (``logger: null`` means no backend)."""
        found = {f.name: _get(config, cls.key(f.name)) for f in fields(cls)}
        values = {name: value for name, value in found.items() if value is not _UNSET}
        if "logger" in values:
            values["logger"] = _backends(values["logger"])
        for name in ("test_freq", "save_freq"):
            if name in values and values[name] is None:
                values[name] = -1
        for name in ("project_name", "experiment_name", "default_local_dir"):
            if isinstance(values.get(name), (int, float)) and not isinstance(values[name], bool):
                values[name] = str(values[name])
        return cls(**values)

    @property
    def checkpoint_root(self) -> str:
        """``trainer.default_local_dir``, or veRL's default from the project and experiment names."""
        if self.default_local_dir is not None:
            return self.default_local_dir
        return os.path.join("checkpoints", self.project_name, self.experiment_name)

    def steps_for(self, num_prompts: int, groups_per_step: int) -> int:
        """``trainer.total_training_steps``, or, when it is null, veRL's rule: the steps of
        ``trainer.total_epochs`` epochs of whole batches (``num_prompts // train_batch_size`` each)."""
        if self.total_training_steps is not None:
            return self.total_training_steps
        epochs = self.total_epochs
        if not _is_positive_int(epochs):
            raise ConfigError(f"invalid config: trainer.total_epochs={epochs!r}; must be a positive integer "
                              "(or set trainer.total_training_steps)")
        steps = num_prompts // groups_per_step * epochs
        if steps < 1:
            raise ConfigError(f"invalid config: trainer.total_training_steps=None: {num_prompts} training prompts "
                              f"make no whole batch of data.train_batch_size={groups_per_step}")
        return steps


@dataclass
class RunConfig:
    """What a run reads: the ``digen`` mapping with veRL's keys applied, and, for every
    ``digen.*`` key a veRL key set, that veRL key (errors name the key the user wrote); and
    veRL's ``trainer.*`` keys, typed."""

    digen: dict[str, Any]
    origins: dict[str, str]
    trainer: VerlTrainerKeys
    # the ENGINE_TUNING keys the config sets (key -> value): accepted, named by notice()
    engine_keys: dict[str, Any] = field(default_factory=dict)
    # one line per value used other than as written (a veRL-Omni Wan num_frames rounded as diffusers does)
    notes: list[str] = field(default_factory=list)

    def notice(self) -> str | None:
        """One line naming the settings that tune another engine and change nothing here, then one
        line per value used other than as written (None: neither)."""
        lines = list(self.notes)
        if self.engine_keys:
            keys = ", ".join(f"{k}={v!r}" for k, v in self.engine_keys.items())
            lines.insert(0, f"[verl-digen] notice: accepted without effect, these settings tune engines a digen run "
                            f"does not use (docs/verl_keys.md, engine settings): {keys}")
        return "\n".join(lines) or None

    def rename(self, message: str) -> str:
        """A message about ``digen.*`` keys, naming the veRL keys the user set instead."""
        for digen_key in sorted(self.origins, key=len, reverse=True):
            message = message.replace(f"{digen_key}=", f"{self.origins[digen_key]}=").replace(
                f"{digen_key}:", f"{self.origins[digen_key]}:")
        return message


def resolve_run_config(config: Mapping[str, Any], entry: str = DIGEN_MAIN,
                       written: Any = ()) -> RunConfig:
    """Apply veRL's keys in ``config`` (a resolved plain mapping of the whole run config) to its
    ``digen`` group; refuse veRL keys that cannot apply. ``entry``: :data:`MAIN_PPO` or
    :data:`DIGEN_MAIN`; ``written``: the keys the command line wrote (:func:`override_keys`),
    for the defaults that cannot apply when written (:data:`REFUSED_WHEN_WRITTEN`)."""
    digen = copy.deepcopy(dict(config.get("digen") or {}))
    ours = hydra_defaults()
    origins: dict[str, str] = {}

    def put(digen_key: str, value: Any, verl_key: str) -> None:
        mine = _get({"digen": digen}, digen_key)
        default = _get({"digen": ours}, digen_key)
        if digen_key in origins and origins[digen_key] != verl_key:
            previous = _get({"digen": digen}, digen_key)
            if previous != value:
                raise ConfigError(f"invalid config: {origins[digen_key]} and {verl_key} set {digen_key} to "
                                  f"{previous!r} and {value!r}; set one of them")
        elif mine is not _UNSET and _differs(mine, default) and mine != value:
            raise ConfigError(f"invalid config: {verl_key}={_get(config, verl_key)!r} and {digen_key}={mine!r} "
                              f"are the same setting; set only {verl_key}")
        _set(digen, digen_key[len("digen."):], value)
        origins[digen_key] = verl_key

    for row in MAPPED:
        if row.verl_key.startswith("ray_kwargs.") and entry == MAIN_PPO:
            continue  # veRL's own ray.init consumed it
        if not _is_set(config, row.verl_key):
            continue
        value = _get(config, row.verl_key)
        put(row.digen_key, row.convert(value, config) if row.convert else value, row.verl_key)
    if _is_set(config, "actor_rollout_ref.model.lora_rank"):
        rank = _get(config, "actor_rollout_ref.model.lora_rank")
        if not isinstance(rank, int) or rank < 1:
            raise ConfigError(f"invalid config: actor_rollout_ref.model.lora_rank={rank!r}; must be >= 1 "
                              "(full fine-tuning: digen.model.lora.enable=false)")
        put("digen.model.lora.enable", True, "actor_rollout_ref.model.lora_rank")
    elif entry == MAIN_PPO:
        # veRL's lora_rank=0 (its default) is full fine-tuning: a veRL job that names no LoRA rank
        # (veRL-Omni's full-weight recipes) trains every weight, as it does under veRL.
        lora_keys = [k for k in ("actor_rollout_ref.model.lora_alpha", "actor_rollout_ref.model.target_modules")
                     if _is_set(config, k)]
        if lora_keys:
            raise ConfigError(f"invalid config: {lora_keys[0]} is set but actor_rollout_ref.model.lora_rank is not: "
                              "without a rank veRL trains every weight (no LoRA); set lora_rank (> 0) for LoRA")
        put("digen.model.lora.enable", False, "actor_rollout_ref.model.lora_rank")

    notes: list[str] = []
    omni_settings(config, digen, put, written, notes.append)
    _derived_settings(config, digen, ours, put)
    trainer = VerlTrainerKeys.of(config)
    _check_rollout_and_algorithm(config, trainer, entry)
    for key, (value, why) in REFUSED_WHEN_WRITTEN.items():
        if key in written and _get(config, key) == value:
            raise ConfigError(f"invalid config: {key}={value!r} cannot apply: {why}")
    engine_keys = _check_inapplicable(config, entry)
    return RunConfig(digen=digen, origins=origins, trainer=trainer, engine_keys=engine_keys, notes=notes)


def _derived_settings(config: Mapping[str, Any], digen: dict[str, Any], ours: dict[str, Any],
                      put: Callable[[str, Any, str], None]) -> None:
    """Batch sizes in veRL's units (prompts, samples) -> our groups; the custom reward."""
    group_size = _get({"digen": digen}, "digen.batch.group_size")
    if group_size is _UNSET:  # rollout.n unset: the preset's (or the schema's) group size
        group_size = _get({"digen": ours}, "digen.batch.group_size", _UNSET)
        if group_size is _UNSET:
            from verl_digen.config.schema import BatchConfig

            group_size = BatchConfig().group_size
    _mini_batches(config, digen, ours, put)

    def groups(key: str) -> int | None:
        samples = _get(config, key)
        if samples is None or samples is _UNSET:
            return None
        if not isinstance(samples, int) or samples < 1 or samples % group_size:
            raise ConfigError(f"invalid config: {key}={samples!r}; must be a positive multiple of "
                              f"actor_rollout_ref.rollout.n={group_size} (whole groups)")
        return samples // group_size

    micro_key = "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"
    samples = _get(config, micro_key)
    if isinstance(samples, int) and 1 <= samples < group_size and group_size % samples == 0:
        # a micro-batch inside a group: whole-group tasks trained in passes of that many rows per
        # rank (gradient accumulation; the advantages are the whole groups')
        put("digen.batch.train_micro_batch_groups", 1, micro_key)
        put("digen.batch.train_micro_batch_rows", samples, micro_key)
    elif samples is not None and samples is not _UNSET and (
            not isinstance(samples, int) or samples < 1 or samples % group_size):
        raise ConfigError(f"invalid config: {micro_key}={samples!r}; must divide actor_rollout_ref.rollout.n="
                          f"{group_size} (rows per training pass) or be a multiple of it (whole groups)")
    elif (micro := groups(micro_key)) is not None:
        put("digen.batch.train_micro_batch_groups", micro, micro_key)
    rollout_key = "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu"
    per_task = groups(rollout_key)
    if per_task is not None:
        put("digen.batch.groups_per_task", per_task, rollout_key)
    ref_key = "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu"
    # Without use_kl_loss there is no reference model (in veRL either): the key sizes nothing.
    ref = _get(config, ref_key) if _get(config, "actor_rollout_ref.actor.use_kl_loss", False) else None
    if ref is _UNSET or ref is None:
        ref = None
    elif samples is None or samples is _UNSET:  # the micro-batch is digen's: its samples, whole groups
        ref = groups(ref_key)
        samples = _get({"digen": digen}, "digen.batch.train_micro_batch_groups")
    if ref is not None and ref != samples:
        raise ConfigError(
            f"invalid config: {ref_key}={_get(config, ref_key)!r}; must equal {micro_key}="
            f"{_get(config, micro_key)!r} (reference log-probs are computed inside each trainer micro-batch)")

    spec = _reward_spec(config)
    if spec is not None:
        mine = {k: digen.get("reward", {}).get(k, v) for k, v in ours["reward"].items()}
        device = mine.pop("device")  # where the reward runs, not which reward: kept with veRL's keys
        defaults = {k: v for k, v in ours["reward"].items() if k != "device"}
        extra = dict(mine["kwargs"] or {})
        functions = [c["kwargs"] for c in spec["components"]] if spec["name"] == "weighted" else [spec["kwargs"]]
        if mine["name"] in (defaults["name"], spec["name"]) and not mine["components"] and \
                set(extra) <= {"fps", "video_layout"}:
            for kwargs in functions:  # +digen.reward.kwargs.fps / video_layout: custom-reward settings veRL has no key for
                kwargs.update(extra)
        elif mine != defaults and (mine["name"] != "custom" or mine["kwargs"] != spec.get("kwargs")):
            chooser = "reward.reward_functions" if spec["name"] == "weighted" else "reward.custom_reward_function.path"
            raise ConfigError(f"invalid config: {chooser} and digen.reward.* both choose the reward; set one of them")
        digen["reward"] = {**ours["reward"], "kwargs": {}, "components": [], **spec, "device": device}


def _reward_file(path: Any) -> str:
    """A reward file's path as workers load it: a file absolute against the directory the job was
    started from (workers may run elsewhere); ``pkg://module`` as it is (veRL's load_module)."""
    path = str(path)
    if path.startswith("file://"):
        return "file://" + os.path.abspath(os.path.expanduser(path[len("file://"):]))
    if path.startswith("pkg://"):
        return path
    return os.path.abspath(os.path.expanduser(path))


def _reward_spec(config: Mapping[str, Any]) -> dict[str, Any] | None:
    """The ``digen.reward`` that veRL's reward keys choose (None: they choose none): one custom
    function, or veRL-Omni's multi-reward manager's weighted sum of several."""
    path, name, manager = _custom_reward(config)
    spec = _multi_reward_spec(config) if manager == MULTI_REWARD_MANAGER else \
        None if path is None else _custom_function_spec(config, path, name, manager)
    _output_type(config, spec)
    return spec


def _output_type(config: Mapping[str, Any], spec: dict[str, Any] | None) -> None:
    """veRL-Omni's ``pipeline.output_type`` -> each custom function's ``output_type`` (what its
    ``solution_image`` is: pixels, or the final latents, or pixels with the latents in
    ``extra_info["latents_clean"]``); the rollout carries the latents only then."""
    from verl_digen.rewards.custom import LATENT_OUTPUT_TYPES, PIXEL_OUTPUT_TYPES

    written = {}
    for key, setting in ((f"{OMNI_PIPE}.output_type", "output_type"),
                         (f"{OMNI_VAL_PIPE}.output_type", "validation_output_type")):
        value = _get(config, key, None)
        if value is None:
            continue
        if value not in PIXEL_OUTPUT_TYPES + LATENT_OUTPUT_TYPES:
            raise ConfigError(f"invalid config: {key}={value!r}; valid: {', '.join(PIXEL_OUTPUT_TYPES)} (pixels), "
                              "latent (the reward function gets the final latents), both (pixels, and the latents "
                              "in extra_info['latents_clean'])")
        if spec is None and value in LATENT_OUTPUT_TYPES:
            raise ConfigError(f"invalid config: {key}={value!r} hands latents to a reward function, and no "
                              "reward.custom_reward_function.path / reward.reward_functions is set (the built-in "
                              f"rewards score pixels): set a reward function, or {key}=image")
        written[setting] = str(value)
    if spec is None:
        return
    for kwargs in [c["kwargs"] for c in spec["components"]] if spec["name"] == "weighted" else [spec["kwargs"]]:
        kwargs.update(written)


def _custom_function_spec(config: Mapping[str, Any], path: Any, name: Any, manager: Any) -> dict[str, Any]:
    spec = {"name": "custom", "kwargs": {"path": _reward_file(path), "function": str(name),
                                         "batched": manager == "batch"}}
    kwargs = _get(config, "reward.custom_reward_function.reward_kwargs", None) or \
        _get(config, "custom_reward_function.reward_kwargs", None)
    if kwargs:
        spec["kwargs"]["reward_kwargs"] = dict(kwargs)
    return spec


def _multi_reward_spec(config: Mapping[str, Any]) -> dict[str, Any]:
    """veRL-Omni's ``MultiVisualRewardManager``: ``reward.reward_functions.<key>.{path, name, weight,
    required, <setting>...}`` -> a weighted sum (``digen.reward.name=weighted``) of custom functions,
    each labelled by its key, its other entries passed to it by keyword (``server_url``)."""
    key = "reward.reward_functions"
    functions = _get(config, key, None)
    if not isinstance(functions, Mapping) or not functions:
        raise ConfigError(f"invalid config: reward.reward_manager.name={MULTI_REWARD_MANAGER} needs {key}.<name>."
                          "{path,name,weight} (one entry per reward function)")
    components, total = [], 0.0
    for label, entry in functions.items():
        where = f"{key}.{label}"
        if not isinstance(entry, Mapping) or not entry.get("path") or not entry.get("name"):
            raise ConfigError(f"invalid config: {where} needs path and name (the reward file and its function)")
        weight = entry.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
            raise ConfigError(f"invalid config: {where}.weight={weight!r}; must be a number")
        required = entry.get("required", False)
        if isinstance(required, str) and required.lower() in ("true", "false"):
            required = required.lower() == "true"
        if not isinstance(required, bool):
            raise ConfigError(f"invalid config: {where}.required={required!r}; must be true or false")
        settings = {k: v for k, v in entry.items() if k not in ("path", "name", "weight", "required")}
        components.append({"name": "custom", "label": str(label), "weight": float(weight), "kwargs": {
            "path": _reward_file(entry["path"]), "function": str(entry["name"]), "reward_kwargs": settings,
            "required": required, "where": where}})
        total += float(weight)
    if total <= 0:
        raise ConfigError(f"invalid config: the weights of {key} sum to {total:g}; they must sum to more than 0")
    return {"name": "weighted", "components": components}


def _mini_batches(config: Mapping[str, Any], digen: dict[str, Any], ours: dict[str, Any],
                  put: Callable[[str, Any, str], None]) -> None:
    """``ppo_mini_batch_size`` (prompts per optimizer step) -> ``digen.batch.mini_batches_per_step``:
    several optimizer steps per rollout batch, as in veRL, veRL-Omni and Flow-GRPO."""
    mini = "actor_rollout_ref.actor.ppo_mini_batch_size"
    if not _is_set(config, mini):
        return
    groups_per_step = _get({"digen": digen}, "digen.batch.groups_per_step")
    if groups_per_step is _UNSET:
        from verl_digen.config.schema import BatchConfig

        groups_per_step = _get({"digen": ours}, "digen.batch.groups_per_step", BatchConfig().groups_per_step)
    value = _get(config, mini)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or groups_per_step % value:
        raise ConfigError(f"invalid config: {mini}={value!r}; must be a positive divisor of "
                          f"data.train_batch_size={groups_per_step} (prompts per optimizer step)")
    put("digen.batch.mini_batches_per_step", groups_per_step // value, mini)


# veRL's layer-by-layer gather of FSDP weights for the rollout: what verl-digen's sync always does.
LAYERED_SUMMON = "actor_rollout_ref.rollout.layered_summon"

# veRL-Omni's multi-reward manager: its name, the module veRL-Omni loads it from, and the
# placeholder its recipes put in reward.custom_reward_function (never called, there either).
MULTI_REWARD_MANAGER = "MultiVisualRewardManager"
OMNI_MANAGER_MODULE = "pkg://verl_omni.reward_loop.reward_manager"
OMNI_MULTI_PLACEHOLDER = ("pkg://verl_omni.reward_loop.reward_manager.multi", "_multi_reward_placeholder")


def _custom_reward(config: Mapping[str, Any]) -> tuple[Any, Any, Any]:
    """``(path, function name, reward manager)`` of veRL's custom reward keys (path None: unset)."""
    picks = []
    for prefix in ("reward.custom_reward_function", "custom_reward_function"):
        if _get(config, f"{prefix}.path", None):
            picks.append((prefix, _get(config, f"{prefix}.path"), _get(config, f"{prefix}.name")))
        elif _is_set(config, f"{prefix}.name"):
            raise ConfigError(f"invalid config: {prefix}.name={_get(config, f'{prefix}.name')!r} without {prefix}.path")
    if len(picks) == 2 and picks[0][1:] != picks[1][1:]:
        raise ConfigError("invalid config: reward.custom_reward_function and custom_reward_function (legacy) "
                          "name different reward functions; set one of them")
    manager = _get(config, "reward.reward_manager.name", "naive")
    if manager not in ("naive", "batch", MULTI_REWARD_MANAGER):
        raise ConfigError(f"invalid config: reward.reward_manager.name={manager!r}; valid here: naive (per sample), "
                          f"batch (the batched compute_score), {MULTI_REWARD_MANAGER} (veRL-Omni's weighted sum of "
                          "reward.reward_functions)")
    module = _get(config, "reward.reward_manager.module.path", None)
    if module is not None and (manager != MULTI_REWARD_MANAGER or module != OMNI_MANAGER_MODULE):
        raise ConfigError(f"invalid config: reward.reward_manager.module.path={module!r} cannot apply: verl-digen "
                          f"runs its own reward managers; only veRL-Omni's {OMNI_MANAGER_MODULE} with "
                          f"reward.reward_manager.name={MULTI_REWARD_MANAGER} is understood (its weighted sum)")
    if (manager == MULTI_REWARD_MANAGER) != (_get(config, "reward.reward_functions", None) is not None):
        raise ConfigError("invalid config: reward.reward_functions and reward.reward_manager.name="
                          f"{MULTI_REWARD_MANAGER} go together (veRL-Omni's multi-reward manager); set both or neither")
    if manager == MULTI_REWARD_MANAGER:
        # veRL-Omni's recipes point custom_reward_function at a placeholder the manager never calls
        if picks and (picks[0][1], picks[0][2]) != OMNI_MULTI_PLACEHOLDER:
            raise ConfigError(f"invalid config: {picks[0][0]}.path={picks[0][1]!r} with reward.reward_manager.name="
                              f"{MULTI_REWARD_MANAGER}: the rewards are reward.reward_functions; leave "
                              f"{picks[0][0]} unset or at veRL-Omni's placeholder {OMNI_MULTI_PLACEHOLDER[0]}:"
                              f"{OMNI_MULTI_PLACEHOLDER[1]}")
        return None, None, manager
    if not picks:
        if manager != "naive":
            raise ConfigError("invalid config: reward.reward_manager.name=batch needs reward.custom_reward_function.path")
        return None, None, None
    return picks[0][1], picks[0][2], manager


def _check_rollout_and_algorithm(config: Mapping[str, Any], trainer: VerlTrainerKeys, entry: str) -> None:
    summon = _get(config, LAYERED_SUMMON, False)
    if not isinstance(summon, bool):
        raise ConfigError(f"invalid config: {LAYERED_SUMMON}={summon!r}; must be true or false (both run the same: "
                          "the weight sync always gathers sharded weights bucket by bucket)")
    adv = _get(config, "algorithm.adv_estimator", "gae")
    if adv not in ("gae", "grpo", "flow_grpo", "dance_grpo"):
        raise ConfigError(f"invalid config: algorithm.adv_estimator={adv!r}; verl-digen trains with GRPO's "
                          "group advantages (grpo, or veRL-Omni's flow_grpo / dance_grpo)")
    valid = (TRAINER_MODE,) if entry == MAIN_PPO else (TRAINER_MODE, "sync")
    if trainer.trainer_mode not in valid:
        raise ConfigError(f"invalid config: trainer.v1.trainer_mode={trainer.trainer_mode!r}; valid: {', '.join(valid)}")
    manager = _get(config, _MANAGER_KEY, None)
    if manager not in (None, AGENT_LOOP_MANAGER):
        raise ConfigError(f"invalid config: {_MANAGER_KEY}={manager!r}; the digen trainer mode generates with "
                          f"{AGENT_LOOP_MANAGER} (leave it unset)")


#: The classes of a veRL key's value in the digen mode (:func:`key_class`).
HONOURED = "honoured"  # it sets or checks a digen setting (MAPPED, READ_DIRECTLY, veRL-Omni's), or veRL uses it
AT_DEFAULT = "veRL's default"  # veRL's own value: it sets nothing
ENGINE = "engine setting"  # it tunes another engine only: accepted, named by the notice
REFUSED = "refused"  # it would change what is learned and cannot apply: the run stops naming it


@functools.lru_cache(maxsize=1)
def _handled() -> frozenset[str]:
    """The keys (and subtrees) resolve_run_config reads or checks itself."""
    return frozenset({row.verl_key for row in MAPPED} | set(READ_DIRECTLY) | {
        "trainer.use_v1", "algorithm.adv_estimator", "reward.custom_reward_function.reward_kwargs",
        "reward.reward_functions", "reward.reward_manager.module.path", LAYERED_SUMMON,
        "custom_reward_function.reward_kwargs"} | OMNI_HANDLED)


def _skip_roots(entry: str) -> set[str]:
    """Top-level groups left to others: ours, veRL's engine group, and under main_ppo what its driver consumes."""
    return {"digen", "model_engine"} | (set(_MAIN_PPO_ONLY) if entry == MAIN_PPO else set())


def _leaf_class(key: str, value: Any, default: Any) -> str:
    if not _differs(value, default):
        return AT_DEFAULT
    return ENGINE if engine_tuning(key) is not None else REFUSED


def key_class(key: str, value: Any, entry: str = DIGEN_MAIN) -> str:
    """Which class the leaf ``key`` set to ``value`` falls in (:data:`HONOURED`, :data:`AT_DEFAULT`,
    :data:`ENGINE` or :data:`REFUSED`): the rule :func:`resolve_run_config` applies to every key
    of a run's config. A honoured key's value may still be refused by its own check."""
    parts = key.split(".")
    if parts[0] in _skip_roots(entry) or any(".".join(parts[:i]) in _handled() for i in range(1, len(parts) + 1)):
        return HONOURED
    return _leaf_class(key, value, _get(_verl_defaults_cached(), key))


def verl_key_classes(entry: str = MAIN_PPO) -> dict[str, str]:
    """Every leaf key of veRL's composed defaults -> what a value other than veRL's default does in
    the digen mode (:func:`key_class`; :data:`AT_DEFAULT` where veRL's default is an interpolation:
    the key follows the one it names). tests/data/verl_key_classes.tsv holds this table as
    reviewed: a new veRL key, or a key that changes class, fails a test until it is reviewed."""

    class _Other:  # a value no default equals
        pass

    out: dict[str, str] = {}

    def walk(node: Any, key: str) -> None:
        if isinstance(node, Mapping) and node:
            for k, v in node.items():
                walk(v, f"{key}.{k}" if key else str(k))
        else:
            out[key] = key_class(key, _Other(), entry)

    walk(_verl_defaults_cached(), "")
    return out


def _check_inapplicable(config: Mapping[str, Any], entry: str) -> dict[str, Any]:
    """Every other veRL key is at veRL's default or only tunes another engine (returned, key ->
    value: :data:`ENGINE_TUNING`), or the run stops naming it."""
    handled = _handled()
    skip_roots = _skip_roots(entry)
    defaults = _verl_defaults_cached()
    bad: list[str] = []
    engine: dict[str, Any] = {}

    def walk(node: Any, key: str) -> None:
        if key in handled:
            return
        default = _get(defaults, key)
        if isinstance(node, Mapping) and (default is _UNSET or isinstance(default, Mapping)):
            for k, v in node.items():
                walk(v, f"{key}.{k}" if key else str(k))
            return
        kind = _leaf_class(key, node, default)
        if kind == ENGINE:
            engine[key] = node
        elif kind == REFUSED:
            bad.append(key)

    for root, value in config.items():
        if root not in skip_roots:
            walk(value, str(root))
    if bad:
        key = bad[0]
        default = _get(defaults, key)
        hint = _HINTS.get(key) or (
            "a veRL-Omni diffusion key verl-digen has no setting for" if is_omni_key(key) else
            "it is not a veRL key" if default is _UNSET else
            f"it has no meaning for diffusion RL in verl-digen; leave it at veRL's default {default!r}")
        # every one named, so that one run lists them all
        more = f" (and {len(bad) - 1} more: {', '.join(f'{k}={_get(config, k)!r}' for k in bad[1:])})" \
            if len(bad) > 1 else ""
        raise ConfigError(f"invalid config: {key}={_get(config, key)!r} cannot apply: {hint}; "
                          f"see docs/verl_keys.md{more}")
    return engine
