"""veRL-Omni's diffusion keys in the digen mode: accepted, and each mapped onto its ``digen.*`` setting.

veRL-Omni's run scripts (``python -m verl_omni.trainer.main_diffusion ...``) write diffusion keys
that veRL's ``ppo_trainer`` config does not have (``actor_rollout_ref.rollout.pipeline.height``,
``actor_rollout_ref.rollout.algo.noise_level``, ``actor_rollout_ref.actor.diffusion_loss.clip_ratio``,
...), without Hydra's ``+``. Under ``python -m verl.trainer.main_ppo trainer.v1.trainer_mode=digen``
Hydra would refuse them ("Could not override"), so :func:`plain_overrides` turns exactly these
keys into ``++key=value`` (add or override) before Hydra parses the command line
(:func:`verl_digen.verl_hooks.accept_omni_keys`, in the digen mode only). Then
:mod:`verl_digen.config.verl_keys` applies :data:`OMNI_MAPPED` like its own table (one value per
setting: the same setting given as a veRL-Omni key, a veRL key or a ``digen.*`` key with
different values is an error naming both), and :func:`omni_settings` checks the keys that set
nothing or depend on the model family. Values verl-digen cannot honour are refused with what to
use instead; nothing is silently dropped. ``docs/verl_keys.md`` lists every key.

The semantics follow veRL-Omni's config dataclasses (``DiffusionRolloutAlgoConfig``,
``DiffusionPipelineConfig``, ``DiffusionLossConfig``): ``noise_level`` and ``sde_type``
(``sde`` | ``cps`` | ``dance_sde``) are the same SDE as ``digen.sampling``'s; a window of
``sde_window_size`` steps starts uniformly in ``[r0, r1 - size]`` for ``sde_window_range=[r0, r1]``
(end exclusive), which is ``digen.sampling.sde_window`` ``mode=random, start=r0, range_end=r1-1``
(inclusive); validation (``val_kwargs``) is deterministic (``noise_level=0``).
"""

from __future__ import annotations

import os
from typing import Any, Callable, Mapping

from verl_digen.config.schema import ConfigError

ARR = "actor_rollout_ref"
LOSS = f"{ARR}.actor.diffusion_loss"
PIPE = f"{ARR}.rollout.pipeline"
ALGO = f"{ARR}.rollout.algo"
VAL_PIPE = f"{ARR}.rollout.val_kwargs.pipeline"
VAL_ALGO = f"{ARR}.rollout.val_kwargs.algo"

#: veRL-Omni's algorithm names for what verl-digen trains: FlowGRPO, and DanceGRPO (veRL-Omni's
#: ``dance_grpo``: the same loss and advantage function, its own sampling, see :func:`_algorithm`).
FLOW_GRPO = "flow_grpo"
DANCE_GRPO = "dance_grpo"
ALGORITHMS = (FLOW_GRPO, DANCE_GRPO)
#: veRL-Omni's dance_grpo pipeline's time shift (its Wan2.2 adapters' ``shift``, 5.0).
DANCE_TIME_SHIFT = 5.0

# veRL-Omni's advantage keys (its DiffusionAlgoConfig; the first is veRL-Omni's only, not veRL's).
GLOBAL_STD = "algorithm.global_std"
NORM_ADV = "algorithm.norm_adv_by_std_in_grpo"
ADV_ESTIMATOR = "algorithm.adv_estimator"

# Keys (and key prefixes, ending in '.') Hydra must accept without '+' in the digen mode; and
# trainer.rollout_data_dir, which veRL's config holds (null) and veRL-Omni's scripts write with
# '+': rewritten to '++' like the rest, which takes either spelling.
_EXACT = (f"{ARR}.model.algorithm", GLOBAL_STD, f"{ARR}.model.extra_tokenizers", f"{ARR}.model.attn_backend",
          f"{ARR}.rollout.rollout_attn_backend", f"{ARR}.rollout.max_prompt_embed_length", "trainer.rollout_data_dir")
_PREFIXES = (f"{LOSS}.", f"{PIPE}.", f"{ALGO}.", f"{VAL_PIPE}.", f"{VAL_ALGO}.")
OMNI_ROOTS = (*_EXACT, *(p[:-1] for p in _PREFIXES))


def is_omni_key(key: str) -> bool:
    """``key`` is one of veRL-Omni's diffusion keys (or under one of its diffusion groups)."""
    return key in _EXACT or key.startswith(_PREFIXES) or key in OMNI_ROOTS


def plain_overrides(argv: list[str]) -> list[str]:
    """``argv`` with each veRL-Omni diffusion override (``key=value`` or ``+key=value``) written
    ``++key=value``, so Hydra adds the key veRL's config lacks; every other argument unchanged."""
    out = []
    for arg in argv:
        key, sep, value = arg.partition("=")
        bare = key.lstrip("+")
        if sep and not key.startswith(("~", "++")) and is_omni_key(bare):
            arg = f"++{bare}={value}"
        out.append(arg)
    return out


def _sde_type(value: Any, _: Mapping[str, Any]) -> str:
    from verl_digen.algos.sde import SDE_TYPES

    if value not in SDE_TYPES:
        raise ConfigError(f"invalid config: {ALGO}.sde_type={value!r}; valid: {', '.join(SDE_TYPES)}")
    return str(value)


# (veRL-Omni key, digen key, meaning, convert or None): rows of verl_keys.MAPPED.
OMNI_MAPPED: tuple[tuple[str, str, str, Callable[[Any, Mapping[str, Any]], Any] | None], ...] = (
    (f"{LOSS}.clip_ratio", "digen.algo.clip_range", "PPO clip range (veRL-Omni's spelling)", None),
    (f"{LOSS}.adv_clip_max", "digen.algo.adv_clip_max", "advantage clip", None),
    (f"{PIPE}.height", "digen.sampling.height", "image height (pixels)", None),
    (f"{PIPE}.width", "digen.sampling.width", "image width (pixels)", None),
    (f"{PIPE}.num_inference_steps", "digen.sampling.num_steps", "denoising steps of a rollout", None),
    (f"{PIPE}.true_cfg_scale", "digen.sampling.guidance_scale", "true CFG scale (> 1: with the negative prompt)",
     None),
    (f"{ALGO}.noise_level", "digen.sampling.noise_level", "the SDE's noise scale (same formula per sde_type)",
     None),
    (f"{ALGO}.sde_type", "digen.sampling.sde_type", "sde | cps | dance_sde", _sde_type),
    (f"{VAL_PIPE}.num_inference_steps", "digen.validation.num_steps", "denoising steps of a validation sample",
     None),
    (f"{PIPE}.max_sequence_length", "digen.model.max_sequence_length",
     "text tokens per prompt (the pipeline's max_sequence_length; the family's default when unset)", None),
)

# Keys that set no digen.* field: the one value (or rule) they may hold, and what to use instead.
OMNI_CHECKED: dict[str, str] = {
    f"{ARR}.model.algorithm": "flow_grpo, or dance_grpo: DanceGRPO's sampling (digen.sampling.time_shift=5.0, "
                              "same_initial_noise=true)",
    f"{LOSS}.loss_mode": "flow_grpo or dance_grpo (veRL-Omni's same clipped loss)",
    GLOBAL_STD: "veRL-Omni's recipes (flow_grpo): true (veRL-Omni's default, written or not) divides by the "
                "batch's std, false by the group's (digen.algo.std_mode global / group, std_estimator=verl_omni); "
                "dance_grpo: only true (veRL-Omni's dance_grpo ignores it)",
    f"{LOSS}.ref_kl_coef": "0.0; the KL to the reference is actor_rollout_ref.actor.use_kl_loss=true with "
                           "kl_loss_coef (digen.algo.kl_beta)",
    f"{LOSS}.*": "other diffusion_loss fields belong to veRL-Omni's other algorithms (MixGRPO, DPO, NFT): refused",
    f"{PIPE}.guidance_scale": "the pipeline's guidance_scale: CFG (digen.sampling.guidance_scale) for SD3 and Wan, "
                              "the distilled guidance embedding (digen.sampling.distilled_guidance) for FLUX and "
                              "HunyuanVideo; Qwen-Image: null or 1.0 (its CFG is true_cfg_scale)",
    f"{ARR}.rollout.max_prompt_embed_length": "the text tokens the transformer sees (SD3 77 + max_sequence_length, "
                                              "the others max_sequence_length): must equal the family's at the run's "
                                              "max_sequence_length",
    f"{ALGO}.sde_window_size": "with sde_window_range: digen.sampling.sde_window (mode=random, size); unset in a "
                               "veRL-Omni recipe: veRL-Omni's window, steps 0..N-2 (mode=fixed, start=0, size=N-1)",
    f"{PIPE}.num_frames": "digen.sampling.num_frames (Wan: a count not t*k+1 rounded as diffusers' WanPipeline "
                          "does, n // t * t + 1, with a notice; the image families: 1)",
    f"{PIPE}.output_type": "what a reward function's solution_image is: image (pt, np, pil: pixels, veRL-Omni's "
                           "default), latent (the final latents), both (pixels, the latents in "
                           "extra_info['latents_clean']); latent / both need a reward function "
                           "(reward.custom_reward_function / reward.reward_functions)",
    f"{ALGO}.sde_window_range": "[r0, r1]: digen.sampling.sde_window start=r0, range_end=r1-1",
    f"{ALGO}.sde_contiguous": "true (windows are contiguous)",
    f"{VAL_ALGO}.noise_level": "0.0 (validation samples are deterministic)",
    f"{VAL_ALGO}.*": "sde_type / sde_window_*: no effect at noise 0; must equal the training value",
    f"{VAL_PIPE}.*": "height, width, guidance_scale, true_cfg_scale, max_sequence_length: validation samples at "
                     "the training values (must equal them)",
    f"{ARR}.model.extra_tokenizers": "{name: {path: <tokenizer subfolder>, max_length}}: the tokenizers the "
                                     "diffusers pipeline loads, at the lengths verl-digen uses (checked)",
}


# Every veRL-Omni key verl_keys' walk over unknown keys leaves to this module (whole groups
# where :func:`omni_settings` checks each of their fields).
# The attention backends are not here: they tune kernels only (verl_keys.ENGINE_TUNING).
OMNI_HANDLED = frozenset({
    *(row[0] for row in OMNI_MAPPED), *(k for k in _EXACT if not k.endswith("attn_backend")), LOSS, VAL_PIPE,
    VAL_ALGO,
    f"{PIPE}.guidance_scale",
    *(f"{ALGO}.{n}" for n in ("sde_window_size", "sde_window_range", "sde_contiguous")),
    f"{PIPE}.num_frames",
    f"{PIPE}.output_type",
})

#: veRL-Omni's defaults (its ``DiffusionRolloutAlgoConfig``, ``DiffusionPipelineConfig`` and
#: generated trainer config) for the keys a veRL-Omni recipe may leave unwritten where
#: verl-digen's own defaults differ: (key, ``digen.*`` setting, veRL-Omni's default). A recipe
#: that writes none of them learns what it learned under veRL-Omni; a ``digen.*`` key written
#: (or a preset's value) wins; a veRL job keeps verl-digen's defaults.
OMNI_DEFAULTS: tuple[tuple[str, str, Any], ...] = (
    (f"{ALGO}.noise_level", "sampling.noise_level", 1.0),  # every sde_type, flow_grpo and dance_grpo alike
    (f"{PIPE}.num_inference_steps", "sampling.num_steps", 10),
    (f"{ARR}.actor.optim.lr", "algo.lr", 1e-6),  # veRL's default too, which reads as unset in a veRL job
    (f"{ARR}.actor.optim.weight_decay", "algo.weight_decay", 0.01),  # likewise
)


def tree_get(tree: Mapping[str, Any], key: str, default: Any = None) -> Any:
    """``tree``'s value at the dotted ``key``, or ``default`` where the path ends."""
    node: Any = tree
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return default
        node = node[part]
    return node


def _fail(key: str, value: Any, rule: str) -> None:
    raise ConfigError(f"invalid config: {key}={value!r} cannot apply: {rule}")


def model_family(config: Mapping[str, Any], digen: Mapping[str, Any]) -> str | None:
    """The model family the run trains: ``digen.model.arch``, else the model directory's
    (``model_index.json``), else the tiny model's; None when the directory cannot be read (its
    own check names it later)."""
    model = digen.get("model") or {}
    if model.get("arch"):
        return str(model["arch"])
    path = model.get("path")
    if path is None:
        return str(model.get("tiny_arch") or "flux")
    if not os.path.isfile(os.path.join(str(path), "model_index.json")):
        return None
    from verl_digen.models.registry import detect_arch

    try:
        return detect_arch(str(path))
    except ValueError:
        return None


def omni_settings(config: Mapping[str, Any], digen: dict[str, Any],
                  put: Callable[[str, Any, str], None], written: Any = (),
                  note: Callable[[str], None] | None = None) -> None:
    """Check veRL-Omni's keys that set nothing by themselves or depend on the model family, and
    put what they mean (``put(digen_key, value, verl_key)``, the one-value rule); ``written``:
    the keys the command line wrote (a ``digen.*`` key written wins over a veRL-Omni default);
    ``note(line)``: a value used other than as written (one notice line each)."""
    _check_algorithm(config)
    _algorithm(config, digen, put, written)
    _advantages(config, digen, put, written)
    _omni_defaults(config, digen, put, written)
    _sde_window(config, digen, put, written)
    _check_validation(config)
    family = model_family(config, digen)
    _guidance(config, family, put)
    _num_frames(config, digen, family, put, note)
    _text_lengths(config, digen, family)


def _check_algorithm(config: Mapping[str, Any]) -> None:
    for key in (f"{ARR}.model.algorithm", f"{LOSS}.loss_mode"):
        value = tree_get(config, key)
        if value is not None and value not in ALGORITHMS:
            _fail(key, value, "verl-digen trains FlowGRPO (flow_grpo) and DanceGRPO (dance_grpo); veRL-Omni's "
                              "other algorithms are not here")
    loss = tree_get(config, LOSS) or {}
    for name, value in loss.items():
        if name in ("clip_ratio", "adv_clip_max", "loss_mode"):
            continue
        if name == "ref_kl_coef":
            if value:
                _fail(f"{LOSS}.ref_kl_coef", value, OMNI_CHECKED[f"{LOSS}.ref_kl_coef"])
            continue
        _fail(f"{LOSS}.{name}", value, "it belongs to veRL-Omni's other algorithms (MixGRPO, DPO, NFT); "
                                       "verl-digen's FlowGRPO loss has clip_ratio, adv_clip_max and the KL "
                                       "(actor_rollout_ref.actor.use_kl_loss / kl_loss_coef)")


def _algorithm(config: Mapping[str, Any], digen: Mapping[str, Any], put: Callable[[str, Any, str], None],
               written: Any) -> None:
    """``model.algorithm=dance_grpo``: what veRL-Omni's dance_grpo pipeline adapters (Wan2.2's, the
    ones it registers under that name) do differently from flow_grpo's: the sigmas are DanceGRPO's
    time-shifted grid with shift 5.0 (:func:`verl_digen.algos.sde.time_shift_sigmas`) and every
    sample of a group starts from the same initial noise (``init_same_noise``). The SDE
    (``rollout.algo.sde_type``, ``dance_sde`` in its recipe), the SDE window, the loss and the
    advantage clip are the keys' as for flow_grpo; the advantages: :func:`_advantages`."""
    key = f"{ARR}.model.algorithm"
    if tree_get(config, key) != DANCE_GRPO:
        return
    for name, value in (("sampling.time_shift", DANCE_TIME_SHIFT), ("sampling.same_initial_noise", True)):
        mine = tree_get(digen, name)
        if f"digen.{name}" in written and mine != value:  # written at the schema's default: put cannot tell
            raise ConfigError(f"invalid config: {key}={DANCE_GRPO!r} and digen.{name}={mine!r} are the same setting; "
                              f"set only {key}")
        put(f"digen.{name}", value, key)


def is_omni_recipe(config: Mapping[str, Any]) -> bool:
    """The config is a veRL-Omni recipe: it holds one of veRL-Omni's diffusion keys or names one of
    its algorithms as ``algorithm.adv_estimator``. Not by the keys veRL has too (rollout_data_dir)
    or that only pick kernels (the attention backends: engine settings change nothing learned)."""
    roots = [r for r in OMNI_ROOTS if r != "trainer.rollout_data_dir" and not r.endswith("attn_backend")]
    return any(tree_get(config, r) is not None for r in roots) or tree_get(config, ADV_ESTIMATOR) in ALGORITHMS


def advantage_estimator(config: Mapping[str, Any]) -> str | None:
    """The advantage estimator veRL-Omni would run: ``algorithm.adv_estimator`` when written (veRL's
    default gae reads as unset), else veRL-Omni's default ``${actor_rollout_ref.model.algorithm}``
    or flow_grpo, for a veRL-Omni recipe; None: a veRL job (veRL's GRPO)."""
    written = tree_get(config, ADV_ESTIMATOR)
    if written not in (None, "gae"):
        return str(written)
    if not is_omni_recipe(config):
        return None
    return str(tree_get(config, f"{ARR}.model.algorithm") or FLOW_GRPO)


def _explicit(digen: Mapping[str, Any], key: str, written: Any) -> bool:
    """``digen.<key>`` was written, or holds a value other than the schema's default."""
    from verl_digen.config.schema import hydra_defaults

    value = tree_get(digen, key)  # None: the run's digen group lacks it (main_ppo composes none)
    return f"digen.{key}" in written or (value is not None and value != tree_get(hydra_defaults(), key))


def _advantages(config: Mapping[str, Any], digen: Mapping[str, Any], put: Callable[[str, Any, str], None],
                written: Any) -> None:
    """veRL-Omni's advantages (``compute_flow_grpo_outcome_advantage``, registered for flow_grpo and
    dance_grpo): ``(r - mean_group) / (std + 1e-4)``, the std the batch's (``algorithm.global_std``,
    true by default) or the group's, or no division (``norm_adv_by_std_in_grpo=false``); each std
    is ``torch.std`` of the rewards repeated once per recorded SDE step (``std_estimator=verl_omni``).
    Its ``compute_advantage`` hands the two keys to flow_grpo only: dance_grpo always divides by
    the batch's std, so there a value other than true is refused rather than ignored."""
    estimator = advantage_estimator(config)
    glob = tree_get(config, GLOBAL_STD)
    if estimator not in ALGORITHMS:
        if glob is not None:
            _fail(GLOBAL_STD, glob, f"it is veRL-Omni's (algorithm.adv_estimator flow_grpo or dance_grpo); with "
                                    f"{ADV_ESTIMATOR}={estimator} use digen.algo.std_mode=global")
        return
    norm = tree_get(config, NORM_ADV, True)
    for key, value in ((NORM_ADV, norm), (GLOBAL_STD, glob)):
        if not isinstance(value, (bool, type(None))):
            _fail(key, value, "must be true or false")
    if estimator == DANCE_GRPO:
        for key, value in ((NORM_ADV, norm), (GLOBAL_STD, glob)):
            if value is False:
                _fail(key, value, "veRL-Omni's dance_grpo ignores it and always divides by the batch's std (its "
                                  "compute_advantage passes it to flow_grpo only); leave it unset, or use flow_grpo")
    elif not norm and glob is True:
        _fail(GLOBAL_STD, glob, f"{NORM_ADV}=false divides by no std at all; set one of them")
    if not _explicit(digen, "algo.std_estimator", written):
        put("digen.algo.std_estimator", "verl_omni", ADV_ESTIMATOR)
    if not norm or (glob is None and _explicit(digen, "algo.std_mode", written)):
        return  # no std (NORM_ADV's row set none), or digen.algo.std_mode written wins over veRL-Omni's default
    mode = "group" if glob is False else "global"
    if mode == "global" and tree_get(digen, "gap.enable"):
        _fail(GLOBAL_STD, True if glob is None else glob,
              "true (veRL-Omni's default when unset) divides by the whole batch's std, and GAP (digen.gap.enable) "
              "trains groups before the batch is complete; set algorithm.global_std=false (the group's std) or "
              "digen.gap.enable=false")
    put("digen.algo.std_mode", mode, GLOBAL_STD)


def _window_range(key: str, value: Any) -> tuple[int, int]:
    if isinstance(value, str):
        import ast

        try:
            value = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            _fail(key, value, "give [first_step, end_step] (end exclusive)")
    if (not isinstance(value, (list, tuple)) or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in value) or value[0] < 0):
        _fail(key, value, "give [first_step, end_step] (two integers, end exclusive)")
    return int(value[0]), int(value[1])


def _omni_defaults(config: Mapping[str, Any], digen: Mapping[str, Any], put: Callable[[str, Any, str], None],
                   written: Any) -> None:
    """A veRL-Omni recipe's unwritten keys at veRL-Omni's defaults (:data:`OMNI_DEFAULTS`)."""
    if not is_omni_recipe(config):
        return
    for key, name, value in OMNI_DEFAULTS:
        # unwritten: absent (veRL-Omni's keys), or at veRL's default (veRL's keys: the same value)
        if tree_get(config, key) in (None, value) and not _explicit(digen, name, written):
            put(f"digen.{name}", value, key)


def _num_steps(digen: Mapping[str, Any]) -> int:
    from verl_digen.config.schema import hydra_defaults

    steps = tree_get(digen, "sampling.num_steps")
    return int(steps if steps is not None else tree_get(hydra_defaults(), "sampling.num_steps"))


def _window_written(digen: Mapping[str, Any], written: Any) -> bool:
    """A ``digen.sampling.sde_window`` field was written (or a preset set one)."""
    from verl_digen.config.schema import hydra_defaults

    if any(str(k).startswith("digen.sampling.sde_window") for k in written):
        return True
    mine = tree_get(digen, "sampling.sde_window")
    return isinstance(mine, Mapping) and any(
        v != tree_get(hydra_defaults(), f"sampling.sde_window.{k}") for k, v in mine.items())


def _sde_window(config: Mapping[str, Any], digen: Mapping[str, Any], put: Callable[[str, Any, str], None],
                written: Any = ()) -> None:
    size_key, range_key = f"{ALGO}.sde_window_size", f"{ALGO}.sde_window_range"
    size, window = tree_get(config, size_key), tree_get(config, range_key)
    if tree_get(config, f"{ALGO}.sde_contiguous", True) is not True:
        _fail(f"{ALGO}.sde_contiguous", tree_get(config, f"{ALGO}.sde_contiguous"), "SDE windows are contiguous here")
    if size is None:
        if window is not None:
            _fail(range_key, window, f"it needs {size_key} (without one veRL-Omni's window is steps 0..N-2)")
        if is_omni_recipe(config) and not _window_written(digen, written):
            # veRL-Omni without a window size (every pipeline adapter, whatever the sde_type):
            # sde_window = (0, N - 1), steps 0..N-2 stochastic and trained, the last one an ODE step
            steps = _num_steps(digen)
            if steps < 2:
                _fail(f"{PIPE}.num_inference_steps", steps, "veRL-Omni's window without sde_window_size is steps "
                                                           "0..N-2, none at 1 step; use >= 2 steps")
            put("digen.sampling.sde_window.mode", "fixed", size_key)
            put("digen.sampling.sde_window.start", 0, size_key)
            put("digen.sampling.sde_window.size", steps - 1, size_key)
        return
    if window is None:
        _fail(size_key, size, f"give {range_key} too ([first_step, end_step], end exclusive)")
    first, end = _window_range(range_key, window)
    if not isinstance(size, int) or isinstance(size, bool) or not 1 <= size <= end - first:
        _fail(size_key, size, f"must be an integer in [1, {end - first}] (the steps of {range_key}={window!r})")
    put("digen.sampling.sde_window.mode", "random", size_key)
    put("digen.sampling.sde_window.size", size, size_key)
    put("digen.sampling.sde_window.start", first, range_key)
    put("digen.sampling.sde_window.range_end", end - 1, range_key)


def _check_validation(config: Mapping[str, Any]) -> None:
    noise = tree_get(config, f"{VAL_ALGO}.noise_level")
    if noise is not None and noise != 0:
        _fail(f"{VAL_ALGO}.noise_level", noise, "validation samples are deterministic here (ODE, noise 0); "
                                                "set 0.0 or leave it unset")
    for name, value in (tree_get(config, VAL_ALGO) or {}).items():
        train = tree_get(config, f"{ALGO}.{name}")
        if name != "noise_level" and value != train:
            _fail(f"{VAL_ALGO}.{name}", value, f"at noise 0 it has no effect; it must equal {ALGO}.{name}={train!r}")
    for name, value in (tree_get(config, VAL_PIPE) or {}).items():
        if name in ("num_inference_steps", "output_type"):  # output_type: verl_keys' _output_type
            continue
        train = tree_get(config, f"{PIPE}.{name}")
        if value != train:
            _fail(f"{VAL_PIPE}.{name}", value, f"validation samples with the training pipeline settings; it must "
                                               f"equal {PIPE}.{name}={train!r} (only num_inference_steps may differ)")


def _wan_temporal_factor(digen: Mapping[str, Any]) -> int:
    """The Wan VAE's ``scale_factor_temporal``: the model directory's ``vae/config.json``, the tiny
    Wan's, else 4 (WanPipeline's when it has no VAE)."""
    import json

    path = tree_get(digen, "model.path")
    if path is None:
        from verl_digen.models.families.wan import TINY_SCALE_FACTOR_TEMPORAL

        return TINY_SCALE_FACTOR_TEMPORAL
    try:
        with open(os.path.join(str(path), "vae", "config.json")) as f:
            return int(json.load(f).get("scale_factor_temporal", 4))
    except (OSError, ValueError):
        return 4


def _num_frames(config: Mapping[str, Any], digen: Mapping[str, Any], family: str | None,
                put: Callable[[str, Any, str], None], note: Callable[[str], None] | None) -> None:
    """``pipeline.num_frames``: the video's frames (veRL-Omni's default 1). For Wan a count that is
    not ``t * k + 1`` (``t``: the VAE's temporal factor) is rounded as diffusers' WanPipeline rounds
    it, ``n // t * t + 1``, with one notice line (WanPipeline logs a warning); HunyuanVideo's
    adapter checks its own; the image families draw one frame."""
    key = f"{PIPE}.num_frames"
    value = tree_get(config, key)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        _fail(key, value, "must be an integer >= 1")
    if family not in ("wan", "hunyuan_video"):
        if family is None and value != 1:
            _fail(key, value, "its rule depends on the model family, which cannot be read from "
                              "actor_rollout_ref.model.path; set digen.model.arch")
        if value != 1:
            _fail(key, value, f"{family} draws images: 1 frame (or leave it unset)")
        return
    used = value
    if family == "wan":
        t = _wan_temporal_factor(digen)
        if value % t != 1:  # diffusers' test and rounding, as in WanPipeline.__call__
            used = max(value // t * t + 1, 1)
            if note is not None:
                note(f"[verl-digen] notice: {key}={value} is not {t}k+1 (the Wan VAE's temporal factor {t}); "
                     f"rounded as diffusers' WanPipeline rounds it, used num_frames={used}")
    put("digen.sampling.num_frames", used, key)


# guidance_scale: which digen setting it is, per family (diffusers' meaning of the argument).
_GUIDANCE = {"sd3": "digen.sampling.guidance_scale", "wan": "digen.sampling.guidance_scale",
             "flux": "digen.sampling.distilled_guidance", "hunyuan_video": "digen.sampling.distilled_guidance"}


def _guidance(config: Mapping[str, Any], family: str | None, put: Callable[[str, Any, str], None]) -> None:
    key = f"{PIPE}.guidance_scale"
    value = tree_get(config, key)
    if value is None:
        return
    if family == "qwen_image":
        if value != 1.0:
            _fail(key, value, f"Qwen-Image is not guidance-distilled; its CFG is {PIPE}.true_cfg_scale")
        return
    if family not in _GUIDANCE:
        _fail(key, value, "its meaning depends on the model family, which cannot be read from "
                          "actor_rollout_ref.model.path; set digen.model.arch")
    put(_GUIDANCE[family], float(value), key)


def family_text_length(family: str, max_sequence_length: int | None = None) -> int:
    """The text tokens per prompt the family's pipeline keeps (``max_sequence_length``, None: its default)."""
    import importlib

    if max_sequence_length is not None:
        return int(max_sequence_length)
    return int(importlib.import_module(f"verl_digen.models.{family}").DEFAULT_MAX_SEQUENCE_LENGTH)


# The tokenizers each family's adapter loads (subfolder -> max length; None: the pipeline's text length).
_TOKENIZERS = {"sd3": {"tokenizer": 77, "tokenizer_2": 77, "tokenizer_3": None},
               "flux": {"tokenizer": 77, "tokenizer_2": None}}


def _text_lengths(config: Mapping[str, Any], digen: Mapping[str, Any], family: str | None) -> None:
    """``max_prompt_embed_length`` and ``extra_tokenizers`` checked against the family's text
    tokens at the run's ``max_sequence_length`` (mapped to ``digen.model.max_sequence_length``
    with the one-value rule; a value above the pipeline's limit is refused by the schema)."""
    keys = (f"{ARR}.rollout.max_prompt_embed_length", f"{ARR}.model.extra_tokenizers")
    given = {k: tree_get(config, k) for k in keys if tree_get(config, k) is not None}
    if not given:
        return
    if family is None:
        key = next(iter(given))
        _fail(key, given[key], "it is checked against the model family, which cannot be read from "
                               "actor_rollout_ref.model.path; set digen.model.arch")
    from verl_digen.models.families import FAMILY_SPECS

    chosen = tree_get(config, f"{PIPE}.max_sequence_length", tree_get(digen, "model.max_sequence_length"))
    length = family_text_length(family, chosen)
    embed = FAMILY_SPECS[family].text_tokens(length)
    if keys[0] in given and given[keys[0]] != embed:
        _fail(keys[0], given[keys[0]], f"the {family} transformer sees {embed} text tokens per prompt here (at "
                                       f"max_sequence_length={length}); set that or leave it unset")
    if keys[1] in given:
        _check_tokenizers(keys[1], given[keys[1]], family, length)


def _check_tokenizers(key: str, value: Any, family: str, length: int) -> None:
    known = _TOKENIZERS.get(family)
    if not isinstance(value, Mapping) or known is None:
        _fail(key, value, f"the {family} pipeline loads its own tokenizer(s) from the model directory; "
                          "leave it unset" if known is None else "give {name: {path, max_length}}")
    for name, entry in value.items():
        path = entry.get("path") if isinstance(entry, Mapping) else None
        if path not in known:
            _fail(f"{key}.{name}.path", path, f"the {family} pipeline's tokenizers are {', '.join(known)}")
        want = known[path] if known[path] is not None else length
        if entry.get("max_length") != want:
            _fail(f"{key}.{name}.max_length", entry.get("max_length"),
                  f"verl-digen reads {path} with {want} tokens (the {family} pipeline's)")
