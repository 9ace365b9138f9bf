"""The digit_classifier reward: which digit a prompt asks for, the classifier's quality on real
digits, image formats, errors that name the bad input, and its place in the registry/config."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from verl_digen.config.schema import ConfigError, digen_config_from_dict
from verl_digen.rewards import build_reward, build_reward_from_config, registered_rewards
from verl_digen.rewards.digits import DigitClassifierReward, requested_digit


@pytest.fixture(scope="module")
def reward() -> DigitClassifierReward:
    return build_reward("digit_classifier")


@pytest.fixture(scope="module")
def digits():
    """Two real images of every digit (the first of each class in scikit-learn's data) as
    ``[20, 3, 8, 8]`` in [0, 1], and their labels."""
    from sklearn.datasets import load_digits

    data = load_digits()
    index = [int(np.flatnonzero(data.target == d)[k]) for k in (0, 1) for d in range(10)]
    images = torch.from_numpy(data.images[index] / 16.0).float()[:, None].expand(-1, 3, -1, -1)
    return images.contiguous(), data.target[index].tolist()


@pytest.mark.parametrize(
    ("prompt", "digit"),
    [
        ("a handwritten digit 7", 7),
        ("the number Seven", 7),
        ("a 0 written by hand", 0),
        ("handwritten nine!", 9),
        ("the digit 3, written by hand: three", 3),  # the same digit twice is one digit
    ],
)
def test_requested_digit(prompt, digit):
    assert requested_digit(prompt) == digit


@pytest.mark.parametrize(
    ("prompt", "why"),
    [
        ("a photo of a cat", "names no digit"),
        ("a handwritten digit 12", "names no digit"),  # 12 is not a digit
        ("someone wrote a 3 next to a 4", r"names several digits \[3, 4\]"),
        ("", "names no digit"),
    ],
)
def test_prompt_without_one_digit_is_an_error_naming_it(reward, prompt, why):
    with pytest.raises(ValueError, match=f"reward 'digit_classifier': prompt {prompt!r} {why}"):
        reward(torch.zeros(1, 3, 8, 8), [prompt])


def test_real_digits_score_high_for_their_label_and_low_for_others(reward, digits):
    images, labels = digits
    right = reward(images, [f"a handwritten digit {d}" for d in labels])
    wrong = reward(images, [f"a handwritten digit {(d + 1) % 10}" for d in labels])
    assert right.shape == (20,) and right.dtype == torch.float32
    assert right.mean() > 0.8 and wrong.mean() < 0.05
    assert torch.all(right > wrong)
    assert reward.heldout_accuracy > 0.9  # on the quarter of the data the classifier never saw
    # Probabilities over the ten digits sum to one.
    torch.testing.assert_close(reward.probabilities(images).sum(dim=1), torch.ones(20))


def test_noise_scores_much_lower_than_a_real_digit(reward, digits):
    images, labels = digits
    noise = torch.rand(20, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    prompts = [f"the number {d}" for d in labels]
    assert reward(noise, prompts).mean() < reward(images, prompts).mean() - 0.5


def test_larger_images_are_pooled_to_8x8(reward, digits):
    images, labels = digits
    prompts = [f"a {d} written by hand" for d in labels]
    upscaled = images.repeat_interleave(4, dim=2).repeat_interleave(4, dim=3)  # 32x32, same content
    torch.testing.assert_close(reward(upscaled, prompts), reward(images, prompts))
    with pytest.raises(ValueError, match="must be 8x8 or a multiple of it, got 12x12"):
        reward(torch.zeros(1, 3, 12, 12), ["the number 1"])


def test_colour_is_read_as_grey(reward, digits):
    images, labels = digits
    prompts = [f"handwritten {d}" for d in labels]
    tinted = images * torch.tensor([0.5, 1.0, 1.5]).view(1, 3, 1, 1)  # same grey mean per pixel
    torch.testing.assert_close(reward(tinted, prompts), reward(images, prompts))


def test_video_is_scored_frame_by_frame(reward, digits):
    images, labels = digits
    video = torch.stack([images, images], dim=2)  # [B, 3, 2, 8, 8]
    prompts = [f"the digit {d}" for d in labels]
    torch.testing.assert_close(reward(video, prompts), reward(images, prompts))


def test_registered_and_built_from_config():
    assert "digit_classifier" in registered_rewards()
    built = build_reward_from_config({"name": "digit_classifier", "kwargs": {"c": 0.5}})
    assert isinstance(built, DigitClassifierReward)
    cfg = digen_config_from_dict({"reward": {"name": "digit_classifier"}})
    assert cfg.reward.name == "digit_classifier"


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), "1"])
def test_bad_argument_names_it(bad):
    with pytest.raises(ValueError, match="reward 'digit_classifier': argument 'c' must be a finite number > 0"):
        build_reward("digit_classifier", c=bad)
    with pytest.raises(ValueError, match="accepted arguments: c"):
        build_reward("digit_classifier", C=1.0)


def test_unknown_reward_name_in_config_lists_it():
    with pytest.raises(ConfigError, match="digen.reward.name='digits'; unknown reward; registered: .*digit_classifier"):
        digen_config_from_dict({"reward": {"name": "digits"}})


# ---------------------------------------------------------------------------- digits_check


def _fake_run(tmp_path, digits, *, noisy_last: bool) -> str:
    """A run directory with validation grids at steps 0 and 10 (real digits, then noise or the
    same digits) and the metrics of 10 steps, written as the loop writes them."""
    import json

    from verl_digen.workers.validation import save_grid_png

    images, labels = digits
    prompts = [f"the number {d}" for d in labels]
    last = torch.rand(images.shape, generator=torch.Generator().manual_seed(0)) if noisy_last else images
    (tmp_path / "run" / "val").mkdir(parents=True)
    save_grid_png(images, str(tmp_path / "run" / "val" / "val_step000000.png"), prompts)
    save_grid_png(last, str(tmp_path / "run" / "val" / "val_step000010.png"), prompts)
    with open(tmp_path / "run" / "metrics.jsonl", "w") as f:
        for step in range(1, 11):
            f.write(json.dumps({"step": step, "reward_mean": step / 10}) + "\n")
    return str(tmp_path / "run")


def test_grid_cells_read_back_the_images_and_prompts(tmp_path, digits):
    from verl_digen.rewards.digits_check import grid_cells

    run_dir = _fake_run(tmp_path, digits, noisy_last=False)
    images, prompts = grid_cells(f"{run_dir}/val/val_step000000.png")
    assert prompts == [f"the number {d}" for d in digits[1]]
    torch.testing.assert_close(images, digits[0], atol=1 / 255, rtol=0)  # uint8 PNG


def test_check_images_agrees_on_real_digits_and_flags_noise(digits):
    from verl_digen.rewards.digits_check import check_images

    images, labels = digits
    prompts = [f"a handwritten digit {d}" for d in labels]
    real = check_images(images, prompts)
    assert min(real["reward"], real["knn"], real["svc"]) > 0.8
    assert real["nearest_real"] < 1e-6  # they are in the data
    noise = check_images(torch.rand(images.shape, generator=torch.Generator().manual_seed(1)), prompts)
    assert max(noise["knn"], noise["svc"]) < 0.5 and noise["nearest_real"] > 1.0


def test_digits_check_cli_prints_every_validation_and_the_sheet(tmp_path, digits, capsys):
    from verl_digen.rewards.digits_check import main

    run_dir = _fake_run(tmp_path, digits, noisy_last=True)
    assert main([run_dir, "--png", str(tmp_path / "sheet.png")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["step", "reward", "knn", "svc", "nearest_real", "train_ma10"]
    step0, step10 = lines[1].split(), lines[2].split()
    assert step0[0] == "0" and step0[-1] == "-"  # no training reward before training
    assert step10[0] == "10" and float(step10[-1]) == pytest.approx(0.55)  # mean of 0.1 .. 1.0
    assert float(step10[1]) < float(step0[1]) and float(step10[4]) > float(step0[4])
    assert (tmp_path / "sheet.png").stat().st_size > 0


def test_digits_check_errors_name_the_problem(tmp_path, capsys):
    from PIL import Image

    from verl_digen.rewards.digits_check import grid_cells, main

    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path)])
    assert exit_info.value.code == 2 and "no validation grids in" in capsys.readouterr().err
    Image.new("RGB", (12, 12)).save(tmp_path / "plain.png")
    with pytest.raises(ValueError, match="plain.png' has no 'prompts' metadata"):
        grid_cells(str(tmp_path / "plain.png"))
