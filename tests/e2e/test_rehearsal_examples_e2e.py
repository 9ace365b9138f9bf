"""Dress rehearsal of every ``examples/flowgrpo`` script, as test_rehearsal.py's of every preset
(its docstring says what a rehearsal changes and what a resume must equal): the script's command
line as bash hands it to ``main_ppo``, the rehearsal's changes made in the script's own keys, two
runs through the digen loop on main_ppo's key mapping. A file of its own so that pytest-xdist's
two workers share the rehearsal (``--dist loadfile`` gives a file to one worker). The fast test
that both files rehearse everything shipped: tests/unit/test_rehearsal_examples.py."""

from __future__ import annotations

import math
import os

import pytest

from test_examples import EXAMPLES, _make_workspace, script_argv
from test_omni_keys import _verl_config
from test_rehearsal import REPO, TINY_FRAMES, assert_resumed_as_planned


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+")


def with_values(overrides: list[str], values: dict[str, object]) -> list[str]:
    """``overrides`` (a script's, as Hydra reads them) with each key of ``values`` set to its value:
    in place where the script sets it (its ``+`` kept), else added (``+digen.*``: main_ppo's
    config has no digen group). None removes the key."""
    out, done = [], set()
    for o in overrides:
        key = _key(o)
        if key in values:
            done.add(key)
            if values[key] is not None:
                out.append(f"{o[: len(o) - len(o.lstrip('+'))]}{key}={values[key]}")
        else:
            out.append(o)
    out += [f"{'+' if k.startswith('digen.') else ''}{k}={v}" for k, v in values.items()
            if k not in done and v is not None]
    return out


def example_rehearsal_values(checked) -> dict[str, object]:
    """:func:`rehearsal_overrides` in the script's own keys (veRL's and veRL-Omni's where it
    writes them), from ``checked``: what ``main_ppo``'s checks made of the script's command line."""
    cfg = checked.cfg
    steps = cfg.sampling.num_steps
    tiny_steps = math.ceil(steps / 2)
    values: dict[str, object] = {
        "actor_rollout_ref.rollout.pipeline.height": 32, "actor_rollout_ref.rollout.pipeline.width": 32,
        "actor_rollout_ref.rollout.pipeline.num_inference_steps": tiny_steps, "trainer.nnodes": 1,
    }
    if cfg.sampling.num_frames > 1:
        values["digen.sampling.num_frames"] = TINY_FRAMES
    window = cfg.sampling.sde_window
    if window.mode != "all":
        range_end = math.ceil((window.range_end if window.range_end is not None else steps) * tiny_steps / steps)
        values["actor_rollout_ref.rollout.algo.sde_window_range"] = f"[{window.start},{range_end + 1}]"  # end exclusive
        values["actor_rollout_ref.rollout.algo.sde_window_size"] = min(window.size, range_end - window.start + 1)
    if cfg.placement == "disaggregated":
        values |= {"trainer.n_gpus_per_node": 4, "digen.pools.rollout.devices": 2, "digen.pools.trainer.devices": 2,
                   "digen.pools.rollout.nodes": None, "digen.pools.trainer.nodes": None}
    else:
        values["trainer.n_gpus_per_node"] = 2
    batch = cfg.batch
    unit = math.lcm(batch.train_micro_batch_groups, batch.groups_per_task, batch.mini_batches_per_step)
    groups = unit * math.ceil(2 / unit)
    values["data.train_batch_size"] = groups
    values["actor_rollout_ref.actor.ppo_mini_batch_size"] = groups // batch.mini_batches_per_step
    return values


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory) -> str:
    """A tiny random CLIP (model, tokenizer, preprocessor) standing in for PickScore and its
    processor, as test_preference.py's: the scripts name hub ids this machine cannot fetch."""
    from verl_digen.rewards import build_tiny_clip

    return build_tiny_clip(tmp_path_factory.mktemp("tiny_clip"), seed=3)


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.usefixtures("loopback_no_proxy")
@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: os.path.relpath(p, os.path.join(REPO, "examples")))
def test_example_runs_two_steps_as_shipped_and_resumes(script, shared_ray, tiny_dirs, tiny_clip, tmp_path, monkeypatch):
    """The script's command line, read as test_examples.py reads it (bash runs it with a recording
    ``python3``) with the tiny model of its family, PickScore's tiny stand-in and a local reward
    server for its OCR / GenEval servers; then :func:`example_rehearsal_values` in its own keys,
    and the same two runs as a preset's through the digen loop on main_ppo's key mapping."""
    from verl_digen.config.omni_keys import plain_overrides
    from verl_digen.config.verl_keys import MAIN_PPO
    from verl_digen.rewards.serve import RewardServer
    from verl_digen.trainer.loop import run_training
    from verl_digen.trainer.resolve import check_run_config

    monkeypatch.setenv("WANDB_MODE", "offline")  # the shipped check: a user has a W&B key, this machine none
    family = {"sd35": "sd3"}.get(os.path.basename(os.path.dirname(script)), os.path.basename(os.path.dirname(script)))
    workspace = _make_workspace(tmp_path / "workspace")
    with RewardServer("brightness", port=0) as server:  # stands in for the OCR and GenEval scorer servers
        env = {"WORKSPACE": str(workspace), "OCR_REWARD_SERVER_URL": server.url, "GENEVAL_SERVER_URL": server.url,
               "REWARD_CLIENT": str(workspace / "http_scorer_client.py")}
        # what main_ppo makes of the script as shipped (the real model's sizes), then its command
        # line with the tiny models in place of the hub's
        checked = check_run_config(_verl_config(plain_overrides(script_argv(script, env, tmp_path)[2:])),
                                   entry=MAIN_PPO, without_weights=True)
        shipped = plain_overrides(script_argv(script, {**env, "MODEL_PATH": tiny_dirs[family], "PICKSCORE_PATH": tiny_clip,
                                                       "CLIP_PROCESSOR_PATH": tiny_clip}, tmp_path)[2:])
        tiny = with_values(shipped, example_rehearsal_values(checked) | {
            "trainer.total_training_steps": 2, "trainer.save_freq": 1,
            "trainer.logger": "[console]",  # the scripts' W&B needs a user's key
            "digen.progress_bar": "false", "digen.save_final_weights": "true",
            "digen.prompt_cache.dir": tmp_path / "prompt_embeds"})

        cfg = check_run_config(_verl_config(tiny), entry=MAIN_PPO).cfg  # (the reward server's preflight: inside)
        assert cfg.placement == checked.cfg.placement and cfg.batch.group_size == checked.cfg.batch.group_size

        def run(name: str, *more: str):
            return run_training(_verl_config([*tiny, f"+digen.output_dir={tmp_path / name}",
                                              f"trainer.default_local_dir={tmp_path / name / 'ck'}", *more]),
                                entry=MAIN_PPO)

        straight = run("straight")
        assert [m["step"] for m in straight.metrics] == [1, 2]
        disaggregated = "weights_in_sync" in straight.extra
        first = tmp_path / "straight" / "ck" / "global_step_1"
        resumed = run("resumed", "trainer.resume_mode=resume_path", f"trainer.resume_from_path={first}",
                      *(["+digen.tsp.stages=2"] if disaggregated else []))
    assert_resumed_as_planned(straight, resumed, num_steps=cfg.sampling.num_steps, groups=cfg.batch.groups_per_step)
