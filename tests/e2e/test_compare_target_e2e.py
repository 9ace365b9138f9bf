"""A small end-to-end ``python -m verl_digen.compare`` on ``digits``: two modes run, each reports its
time to the target reward (by validation and by the moving average) and ``--resume`` reads the
finished modes back. Time to target from a run's records: tests/unit/test_compare_target.py."""

from __future__ import annotations

import dataclasses
import json

import pytest

from verl_digen.compare import TargetResult, main, time_to_target

from runs import QUIET


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
