"""Time to target in ``python -m verl_digen.compare``: when the validation reward or the moving
average of the training reward first reaches ``--target-reward``, in wall seconds and images, read
from a run's metrics and timeline; the CLI's checks; and a small end-to-end compare on ``digits``."""

from __future__ import annotations

import dataclasses
import json

import pytest

from verl_digen.compare import (
    TargetResult,
    first_reaching,
    main,
    moving_average,
    reward_curve,
    step_end_times,
    time_to_target,
)

from runs import QUIET


def _opt(step: int, end: float, worker: str = "trainer0") -> dict:
    return {"kind": "optimizer_step", "step": step, "start": end - 0.1, "end": end, "worker": worker}


def test_step_end_times_take_the_last_rank_of_each_optimizer_step():
    records = [
        {"kind": "generate", "step": 0, "start": 0.0, "end": 5.0},
        _opt(0, 1.0), _opt(0, 1.5, "trainer1"), _opt(1, 2.5), _opt(2, 4.0),
    ]
    assert step_end_times(records) == {1: 1.5, 2: 2.5, 3: 4.0}  # 1-based, as metrics.jsonl


def test_moving_average_needs_a_full_window():
    assert moving_average([1.0, 2.0, 3.0, 4.0], 2) == [None, 1.5, 2.5, 3.5]
    assert moving_average([1.0, 2.0], 1) == [1.0, 2.0]
    assert moving_average([1.0], 3) == [None]
    with pytest.raises(ValueError, match="--target-window must be >= 1, got 0"):
        moving_average([1.0], 0)


def test_first_reaching_skips_missing_values():
    points = [(0, 0.2), (1, None), (2, 0.5), (3, 0.49), (4, 0.7)]
    assert first_reaching(points, 0.5) == 2
    assert first_reaching(points, 0.6) == 4
    assert first_reaching(points, 0.2) == 0
    assert first_reaching(points, 0.8) is None


def test_time_to_target_by_validation_and_by_moving_average():
    metrics = [
        {"step": 1, "reward_mean": 0.1},
        {"step": 2, "reward_mean": 0.3, "val/reward_mean": 0.25},
        {"step": 3, "reward_mean": 0.5},
        {"step": 4, "reward_mean": 0.7, "val/reward_mean": 0.6},
    ]
    ends = {1: 2.0, 2: 4.5, 3: 6.0, 4: 9.0}
    curve = reward_curve(metrics, ends, window=2, val_before=0.2)
    assert curve[0] == [0, 0.0, None, None, 0.2]
    assert [row[3] for row in curve[1:]] == [None, pytest.approx(0.2), pytest.approx(0.4), pytest.approx(0.6)]
    # val 0.2 -> 0.25 -> 0.6 reaches 0.5 at step 4; the moving average (0.2, 0.4, 0.6) at step 4 too.
    assert time_to_target(curve, 0.5, images_per_step=16) == (TargetResult(4, 9.0, 64), TargetResult(4, 9.0, 64))
    # 0.35: the moving average gets there first (step 3), validation only at step 4.
    assert time_to_target(curve, 0.35, 16) == (TargetResult(4, 9.0, 64), TargetResult(3, 6.0, 48))
    # Reached before training: zero seconds, zero images.
    assert time_to_target(curve, 0.1, 16)[0] == TargetResult(0, 0.0, 0)
    assert time_to_target(curve, 0.9, 16) == (TargetResult(None, None, None),) * 2
    with pytest.raises(ValueError, match="no optimizer step for step 4"):
        reward_curve(metrics, {1: 1.0, 2: 2.0, 3: 3.0}, window=2)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--modes", "colocated,+nope"], "--modes: unknown mode(s) +nope; valid: colocated, disaggregated"),
        (["--target-window", "0"], "--target-window must be >= 1, got 0"),
        (["--target-reward", "nan"], "--target-reward must be a finite number, got nan"),
    ],
)
def test_bad_arguments_are_named(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["--out", str(tmp_path / "cmp"), *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_reward_devices_give_the_disaggregated_modes_a_reward_pool_beside_the_colocated_devices():
    """compare --reward-devices K: the disaggregated modes run on the colocated run's devices
    split into rollout and trainer pools, plus K reward workers (their config's pool layout)."""
    from omegaconf import OmegaConf

    from verl_digen.compare import _pool_split, mode_overrides, reward_pool_overrides
    from verl_digen.config.compose import compose_config
    from verl_digen.config.schema import digen_config_from_dict
    from verl_digen.config.verl_keys import VerlTrainerKeys
    from verl_digen.placement.pools import cluster_from_trainer_keys, pool_layout

    split, r, t = _pool_split([], 2)
    extra = split + reward_pool_overrides(3, 2, 1)
    container = OmegaConf.to_container(
        compose_config(["trainer.n_gpus_per_node=2", *mode_overrides("+tcss", r, t), *extra], config_name="digits"),
        resolve=True)
    digen = digen_config_from_dict(container["digen"])
    layout = pool_layout(digen, cluster_from_trainer_keys(VerlTrainerKeys.of(container)))
    assert (layout.spec.rollout_workers, layout.spec.trainer_workers, layout.spec.reward_workers) == (1, 1, 3)
    assert layout.worker_counts == {"rollout": 1, "trainer": 1, "reward": 3}
    assert reward_pool_overrides(0, 2, 1) == []
    with pytest.raises(SystemExit, match="one node"):
        reward_pool_overrides(2, 16, 2)


@pytest.mark.e2e
@pytest.mark.slow
def test_compare_on_digits_reports_time_to_target(shared_ray, toy_digits, tmp_path, capsys):
    out = tmp_path / "cmp"
    argv = ["--out", str(out), "--config-name", "digits", "--modes", "colocated,+tcss",
            "--target-reward", "0.0", "--target-window", "2", *QUIET, "trainer.total_training_steps=4",
            "trainer.test_freq=2", "digen.batch.groups_per_step=2", "digen.batch.group_size=4"]
    assert main(argv) == 0
    rows = json.loads((out / "summary.json").read_text())
    assert [r["mode"] for r in rows] == ["colocated", "+tcss"]
    for r in rows:
        assert r["images_per_step"] == 8 and r["target_reward"] == 0.0
        curve = r["curve"]
        assert [row[0] for row in curve] == [0, 1, 2, 3, 4]  # step 0: validation before training
        walls = [row[1] for row in curve]
        assert walls == sorted(walls) and walls[0] == 0.0 and walls[-1] > 0
        assert [row[4] is not None for row in curve] == [True, False, True, False, True]  # test_freq=2
        assert r["val_reward_first"] == curve[0][4] and r["val_reward_last"] == curve[-1][4]
        # Any reward reaches 0: validation before training, the moving average at its first full window.
        assert r["target_val"] == {"step": 0, "wall_s": 0.0, "images": 0}
        assert r["target_ma"] == {"step": 2, "wall_s": curve[2][1], "images": 16}
        unreachable = time_to_target(curve, 2.0, 8)
        assert unreachable == (TargetResult(None, None, None),) * 2
    assert rows[1]["max_staleness_seen"] == 1  # +tcss trained on one-step-stale samples
    assert (out / "reward_vs_time.png").stat().st_size > 0
    printed = capsys.readouterr().out
    assert "val: s" in printed and "time to target reward 0.0" in printed

    # --resume reads the finished modes back instead of running them (a different target is
    # recomputed from their curves); changed overrides run again.
    import verl_digen.trainer.loop as loop

    def no_run(cfg, *args, **kwargs):
        raise AssertionError("--resume ran a finished mode again")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loop, "run_training", no_run)
        assert main([*argv[:7], "0.3", *argv[8:], "--resume"]) == 0
        again = json.loads((out / "summary.json").read_text())
        assert "reusing +tcss" in capsys.readouterr().out
        assert [r["curve"] for r in again] == [r["curve"] for r in rows]
        for r in again:
            expected = time_to_target(r["curve"], 0.3, 8)
            assert r["target_reward"] == 0.3
            assert (r["target_val"], r["target_ma"]) == tuple(dataclasses.asdict(t) for t in expected)
        with pytest.raises(AssertionError, match="ran a finished mode again"):
            main([*argv, "digen.seed=7", "--resume"])
