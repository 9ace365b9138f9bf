"""Time to target in ``python -m verl_digen.compare``: when the validation reward or the moving
average of the training reward first reaches ``--target-reward``, in wall seconds and images, read
from a run's metrics and timeline; the CLI's checks. A small end-to-end compare on ``digits``:
tests/e2e/test_compare_target_e2e.py."""

from __future__ import annotations

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
