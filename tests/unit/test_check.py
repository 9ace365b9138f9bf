"""``python -m verl_digen.check``: every config-time check of a run, without Ray or weights.

Every shipped preset passes at its real device counts (planned with its family's shipped real
configs, which the output says: the walk of every preset, minutes, is in
tests/e2e/test_check_e2e.py); a micro-batch that cannot be dealt over the FSDP ranks, or a job
that does not fit its GPUs, exits 2 naming the key; the command writes nothing and starts no Ray."""

from __future__ import annotations

import os

import pytest

from verl_digen.check import main as check_main


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    status = check_main(list(argv))
    out = capsys.readouterr()
    return status, out.out, out.err


def test_the_wan_colocated_split_that_crashed_on_8_gpus_exits_2_naming_the_key(capsys):
    status, out, err = _run(capsys, "--config-name", "wan_colocated", "digen.batch.train_micro_batch_groups=1")
    assert status == 2 and out == ""
    assert "4 rows do not split evenly over 8 FSDP ranks" in err and "digen.batch.train_micro_batch_groups" in err
    assert "the run would NOT start" in err


def test_tag_on_fsdp_trainers_at_real_size_would_start_and_says_how_its_share_is_cut(capsys):
    # HunyuanVideo full fine-tune, 6 FSDP trainer ranks: calls of 2 videos, 4 per group -> 2 slices
    # of 2 per group (gcd(6, 4 / 2)), 3 groups give each rank one slice
    status, out, _ = _run(capsys, "--config-name", "hunyuan_video_full_disaggregated", "digen.tag.enable=true",
                          "digen.tag.groups=6")
    assert status == 0, out
    assert ("TAG: the trainers' share (6 group(s) every step) in multiples of 3 group(s), each group in 2 sample "
            "slice(s), as many on each of the 6 FSDP ranks") in out
    assert "memory: trainer peaks" in out  # the trainers' generate phase planned too
    status, _, err = _run(capsys, "--config-name", "hunyuan_video_full_disaggregated", "digen.tag.enable=true",
                          "digen.tag.groups=4")
    assert status == 2 and "digen.tag.groups=4; must be a multiple of 3" in err


def test_a_job_that_does_not_fit_exits_2_naming_the_memory_key(capsys):
    status, _, err = _run(capsys, "--config-name", "qwen_image_full_disaggregated", "digen.memory.device_gib=48")
    assert status == 2
    assert "does not fit in GPU memory" in err and "digen.memory.device_gib" in err and "trainer" in err


def test_bad_keys_and_pools_exit_2_naming_them(capsys):
    status, _, err = _run(capsys, "--config-name", "sd3_disaggregated", "digen.pools.trainer.devices=7")
    assert status == 2 and "digen.pools" in err
    status, _, err = _run(capsys, "--config-name", "sd3_disaggregated", "digen.model.arch=nope")
    assert status == 2 and "digen.model.arch" in err
    status, _, err = _run(capsys, "--config-name", "no_such_preset")
    assert status == 2 and "no_such_preset" in err


def test_veRL_Omnis_diffusion_keys_are_taken_without_a_plus_as_the_run_takes_them(capsys):
    """As verl_digen.main and main_ppo take them: the preset's own size written as veRL-Omni's keys is
    the preset's plan; another size is the one-value rule's refusal naming both keys."""
    status, out, err = _run(capsys, "--config-name", "flux_colocated", "actor_rollout_ref.rollout.pipeline.height=512",
                            "actor_rollout_ref.rollout.pipeline.width=512")
    assert status == 0, err
    assert out == _run(capsys, "--config-name", "flux_colocated")[1]
    status, _, err = _run(capsys, "--config-name", "flux_colocated", "actor_rollout_ref.rollout.pipeline.height=768")
    assert status == 2 and "pipeline.height=768 and digen.sampling.height=512 are the same setting" in err


def test_a_model_path_not_on_this_machine_is_said_and_planned_with_the_shipped_configs(capsys, tmp_path):
    missing = tmp_path / "FLUX.1-dev"
    status, out, _ = _run(capsys, "--config-name", "flux_disaggregated", f"digen.model.path={missing}")
    assert status == 0
    assert f"digen.model.path '{missing}' is not a directory on this machine" in out
    assert "shipped configs of flux" in out


def test_cli_exit_status(tmp_path, monkeypatch, run_as_main):
    monkeypatch.chdir(tmp_path)
    status, _, err = run_as_main("verl_digen.check", "--config-name", "wan_colocated",
                                 "digen.batch.train_micro_batch_groups=1")
    assert status == 2, err
    assert "digen.batch.train_micro_batch_groups" in err
    status, out, err = run_as_main("verl_digen.check", "--config-name", "digits")
    assert status == 0, err
    assert "placement: colocated" in out and "check: OK" in out and os.listdir(tmp_path) == []


@pytest.mark.parametrize("placement", ["colocated", "disaggregated"])
def test_call_rows_are_checked_at_config_time_for_every_placement(placement):
    """The split that crashed wan_colocated's workers is refused before any worker starts, for
    both placements, and the memory planner refuses it too (it no longer rounds a share up)."""
    from omegaconf import OmegaConf

    from verl_digen.config.compose import compose_config
    from verl_digen.config.schema import ConfigError, digen_config_from_dict
    from verl_digen.memory import plan_job
    from verl_digen.trainer.resolve import check_run_config

    # 1 group of 4 rows over 8 (colocated: every GPU) or 6 (the trainer pool) FSDP ranks
    pools = [] if placement == "colocated" else ["digen.pools.rollout.devices=2", "digen.pools.trainer.devices=6"]
    overrides = [f"digen.placement={placement}", "digen.fsdp.enable=true", "digen.batch.train_micro_batch_groups=1",
                 "digen.batch.group_size=4", *pools]
    config = compose_config(overrides, config_name="wan_colocated")
    with pytest.raises(ConfigError, match="digen.batch.train_micro_batch_groups"):
        check_run_config(config, without_weights=True)
    if placement == "colocated":  # the typed config alone cannot know the cluster; the planner can
        digen = digen_config_from_dict(OmegaConf.to_container(config.digen, resolve=True))
        with pytest.raises(ConfigError, match="do not split evenly over 8 FSDP ranks"):
            plan_job(digen, devices_per_node=8)
