"""SDE window selection and timestep subsampling."""

import pytest
import torch

from verl_digen.algos.window import SdeWindowConfig, select_sde_window, subsample_timesteps


def _win(num_steps, training_step=0, seed=0, **cfg):
    cfg = SdeWindowConfig(**cfg)
    return select_sde_window(num_steps, cfg, training_step=training_step, seed=seed)


def test_all_mode_returns_every_step():
    assert _win(5) == [0, 1, 2, 3, 4]
    assert _win(5, training_step=9, mode="all", size=5) == [0, 1, 2, 3, 4]


def test_fixed_mode_returns_start_to_start_plus_size():
    assert _win(10, mode="fixed", start=2, size=3) == [2, 3, 4]
    assert _win(10, training_step=7, seed=3, mode="fixed", start=2, size=3) == [2, 3, 4]


def test_fixed_mode_size_zero_runs_to_the_end():
    assert _win(6, mode="fixed", start=3) == [3, 4, 5]


def test_random_mode_stays_in_range_and_covers_every_position():
    cfg = dict(mode="random", size=2, start=1, range_end=5)
    firsts = set()
    for step in range(200):
        w = _win(10, training_step=step, seed=11, **cfg)
        assert w == [w[0], w[0] + 1]
        firsts.add(w[0])
    assert firsts == {1, 2, 3, 4}  # window within [1, 5]


def test_random_mode_is_deterministic_in_seed_and_step():
    cfg = dict(mode="random", size=3, range_end=19)
    a = [_win(20, training_step=s, seed=4, **cfg) for s in range(20)]
    b = [_win(20, training_step=s, seed=4, **cfg) for s in range(20)]
    c = [_win(20, training_step=s, seed=5, **cfg) for s in range(20)]
    assert a == b
    assert a != c
    assert len({w[0] for w in a}) > 1  # moves between training steps


def test_random_mode_does_not_touch_global_rng():
    torch.manual_seed(0)
    before = torch.get_rng_state().clone()
    _win(10, training_step=3, seed=1, mode="random", size=2)
    assert torch.equal(torch.get_rng_state(), before)


def test_sliding_moves_by_stride_and_wraps():
    # 6 steps, size 2 -> 5 window positions (first index 0..4)
    firsts = [_win(6, training_step=s, mode="sliding", size=2)[0] for s in range(6)]
    assert firsts == [0, 1, 2, 3, 4, 0]
    firsts = [_win(6, training_step=s, mode="sliding", size=2, stride=2)[0] for s in range(6)]
    assert firsts == [0, 2, 4, 1, 3, 0]
    assert _win(6, training_step=2, mode="sliding", size=2, stride=2) == [4, 5]


def test_sliding_respects_start_and_range_end():
    # range [2, 5], size 3 -> positions 2, 3
    cfg = dict(mode="sliding", size=3, start=2, range_end=5)
    wins = [_win(10, training_step=s, **cfg) for s in range(3)]
    assert wins == [[2, 3, 4], [3, 4, 5], [2, 3, 4]]


@pytest.mark.parametrize(
    "cfg, match",
    [
        (dict(mode="window"), "sde_window.mode='window'"),
        (dict(mode="fixed", size=-1), "sde_window.size=-1"),
        (dict(mode="fixed", size=11), "sde_window.size=11"),
        (dict(mode="fixed", start=8, size=3), "sde_window.start=8 .*sde_window.size=3"),
        (dict(mode="fixed", start=10), "sde_window.start=10"),
        (dict(mode="sliding", size=2, stride=0), "sde_window.stride=0"),
        (dict(mode="random", size=0), "sde_window.size=0 must be >= 1"),
        (dict(mode="random", size=2, range_end=10), "sde_window.range_end=10"),
        (dict(mode="sliding", size=4, start=3, range_end=5), "sde_window.size=4 does not fit"),
        (dict(mode="all", size=3), "sde_window.size=3 has no effect"),
    ],
)
def test_validation_errors_name_field_and_value(cfg, match):
    with pytest.raises(ValueError, match=match):
        SdeWindowConfig(**cfg).validate(10)


def test_valid_config_passes_validation():
    SdeWindowConfig(mode="sliding", size=3, start=1, stride=2, range_end=7).validate(10)


def test_subsample_sizes():
    window = list(range(2, 12))
    g = torch.Generator().manual_seed(0)
    assert len(subsample_timesteps(window, 0.5, generator=g)) == 5
    assert len(subsample_timesteps(window, 0.01, generator=g)) == 1  # at least one step
    assert subsample_timesteps(window, 1.0, generator=g) == window
    assert len(subsample_timesteps(list(range(100)), 0.29, generator=g)) == 29
    assert len(subsample_timesteps(window, 0.99, generator=g)) == 9  # floor, as Flow-GRPO


def test_subsample_is_sorted_subset_and_deterministic():
    window = [3, 5, 8, 9, 12, 15, 20]
    a = subsample_timesteps(window, 0.6, generator=torch.Generator().manual_seed(42))
    b = subsample_timesteps(window, 0.6, generator=torch.Generator().manual_seed(42))
    assert a == b
    assert a == sorted(a) and set(a) <= set(window) and len(set(a)) == len(a) == 4
    picks = {
        tuple(subsample_timesteps(window, 0.6, generator=torch.Generator().manual_seed(s)))
        for s in range(10)
    }
    assert len(picks) > 1


@pytest.mark.parametrize("fraction", [0.0, -0.5, 1.5])
def test_subsample_fraction_out_of_range_raises(fraction):
    with pytest.raises(ValueError, match=f"fraction={fraction}"):
        subsample_timesteps([0, 1, 2], fraction, generator=torch.Generator())


def test_subsample_empty_window_raises():
    with pytest.raises(ValueError, match="empty"):
        subsample_timesteps([], 0.5, generator=torch.Generator())
