"""Group advantages and the FlowGRPO clipped-surrogate loss."""

import math

import pytest
import torch

from verl_digen.algos.advantages import GroupAdvantageConfig, group_advantages
from verl_digen.algos.loss import flow_grpo_loss, gaussian_kl

# ---------------------------------------------------------------- advantages


def _pop_std(xs):
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))


def test_group_advantages_hand_example_per_group():
    rewards = torch.tensor([1.0, 2.0, 3.0, 10.0, 14.0])
    groups = torch.tensor([7, 7, 7, 3, 3])  # non-contiguous labels
    adv = group_advantages(rewards, groups)
    s_a, s_b = _pop_std([1, 2, 3]), _pop_std([10, 14])  # sqrt(2/3), 2
    expected = [-1 / (s_a + 1e-4), 0.0, 1 / (s_a + 1e-4), -2 / (s_b + 1e-4), 2 / (s_b + 1e-4)]
    assert adv.tolist() == pytest.approx(expected, abs=1e-6)
    assert adv.dtype == torch.float32


def test_group_advantages_global_std_uses_whole_batch_population_std():
    rewards = torch.tensor([1.0, 2.0, 3.0, 10.0, 14.0])
    groups = torch.tensor([0, 0, 0, 1, 1])
    adv = group_advantages(rewards, groups, std_mode="global")
    s = _pop_std([1, 2, 3, 10, 14])
    expected = [-1 / (s + 1e-4), 0.0, 1 / (s + 1e-4), -2 / (s + 1e-4), 2 / (s + 1e-4)]
    assert adv.tolist() == pytest.approx(expected, abs=1e-6)


def test_group_advantages_none_only_centres():
    rewards, groups = torch.tensor([1.0, 3.0, 5.0, 9.0]), torch.tensor([0, 0, 1, 1])
    adv = group_advantages(rewards, groups, std_mode="none")
    assert adv.tolist() == pytest.approx([-1.0, 1.0, -2.0, 2.0])


def test_group_advantages_clip():
    rewards = torch.tensor([0.0, 0.0, 0.0, 1.0])  # group std sqrt(3)/4 -> A = 3/sqrt(3) = 1.73
    adv = group_advantages(rewards, torch.zeros(4, dtype=torch.long), clip=1.0)
    assert adv.max().item() == pytest.approx(1.0)
    assert adv[:3].tolist() == pytest.approx([-0.25 / (math.sqrt(3) / 4 + 1e-4)] * 3, abs=1e-6)


def test_group_advantages_constant_group_gives_zero():
    adv = group_advantages(torch.tensor([2.0, 2.0, 1.0, 3.0]), torch.tensor([0, 0, 1, 1]))
    assert adv[:2].tolist() == [0.0, 0.0]


def test_group_advantages_singleton_group_raises():
    with pytest.raises(ValueError, match="group size must be >= 2.*\\[5\\]"):
        group_advantages(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0, 0, 5]))


def test_group_advantages_bad_std_mode_raises():
    with pytest.raises(ValueError, match="std_mode='batch'"):
        group_advantages(torch.tensor([1.0, 2.0]), torch.tensor([0, 0]), std_mode="batch")


def test_group_advantages_float_group_ids_raise():
    with pytest.raises(ValueError, match="integer"):
        group_advantages(torch.tensor([1.0, 2.0]), torch.tensor([0.0, 0.0]))


def test_group_advantages_non_finite_reward_raises():
    with pytest.raises(ValueError, match="finite.*\\[1\\]"):
        group_advantages(torch.tensor([1.0, float("nan")]), torch.tensor([0, 0]))


def test_group_advantage_config_call_matches_function():
    r, g = torch.tensor([1.0, 2.0, 4.0, 0.0]), torch.tensor([1, 1, 2, 2])
    cfg = GroupAdvantageConfig(std_mode="global", clip=0.5)
    assert torch.equal(cfg(r, g), group_advantages(r, g, std_mode="global", clip=0.5))


# ---------------------------------------------------------------- loss


def test_ratio_one_gives_minus_mean_advantage_and_no_clipping():
    lp = torch.tensor([-1.0, -2.0, -3.0], requires_grad=True)
    adv = torch.tensor([0.5, -1.0, 2.0])
    out = flow_grpo_loss(lp, lp.detach().clone(), adv, clip_range=1e-4)
    assert out.loss.item() == pytest.approx(-(0.5 - 1.0 + 2.0) / 3)
    assert out.clip_frac.item() == 0.0
    assert out.approx_kl.item() == 0.0
    assert out.ratio_mean.item() == pytest.approx(1.0)
    assert out.kl_loss.item() == 0.0
    out.loss.backward()
    # d/dlp of -A*exp(lp-old)/B at ratio 1 is -A/B
    assert lp.grad.tolist() == pytest.approx([-0.5 / 3, 1.0 / 3, -2.0 / 3])


def test_advantages_are_clamped_to_adv_clip_max():
    lp = torch.zeros(2)
    out = flow_grpo_loss(lp, lp, torch.tensor([10.0, -1.0]), clip_range=0.1, adv_clip_max=5.0)
    assert out.loss.item() == pytest.approx(-(5.0 - 1.0) / 2)


def test_positive_advantage_above_clip_range_has_zero_gradient():
    old = torch.zeros(2)
    lp = torch.tensor([math.log(1.5), math.log(1.5)], requires_grad=True)  # ratio 1.5 > 1.2
    out = flow_grpo_loss(lp, old, torch.tensor([1.0, -1.0]), clip_range=0.2)
    out.loss.backward()
    assert lp.grad[0].item() == 0.0  # A>0, ratio above 1+eps: clipped, no gradient
    assert lp.grad[1].item() == pytest.approx(1.5 / 2)  # A<0: unclipped branch keeps gradient
    assert out.clip_frac.item() == 1.0
    # loss: max(-1.5, -1.2) = -1.2 for A=1; max(1.5, 1.2) = 1.5 for A=-1
    assert out.policy_loss.item() == pytest.approx((-1.2 + 1.5) / 2)


def test_negative_advantage_below_clip_range_has_zero_gradient():
    old = torch.zeros(2)
    lp = torch.tensor([math.log(0.5), math.log(0.5)], requires_grad=True)  # ratio 0.5 < 0.8
    out = flow_grpo_loss(lp, old, torch.tensor([-1.0, 1.0]), clip_range=0.2)
    out.loss.backward()
    assert lp.grad[0].item() == 0.0  # A<0, ratio below 1-eps: clipped, no gradient
    assert lp.grad[1].item() == pytest.approx(-0.5 / 2)  # A>0: unclipped branch
    assert out.approx_kl.item() == pytest.approx(0.5 * math.log(0.5) ** 2)


def test_kl_hand_computed():
    mean = torch.tensor([[1.0, 2.0], [0.0, 0.0]], requires_grad=True)
    ref = torch.tensor([[0.0, 0.0], [1.0, 3.0]])
    std = torch.tensor([[2.0], [0.5]])
    # sample 0: (1 + 4) / 2 / (2 * 4) = 0.3125 ; sample 1: (1 + 9) / 2 / (2 * 0.25) = 10
    assert gaussian_kl(mean, ref, std).tolist() == pytest.approx([0.3125, 10.0])
    assert gaussian_kl(mean, ref, std.flatten()).tolist() == pytest.approx([0.3125, 10.0])
    lp = torch.zeros(2)
    out = flow_grpo_loss(
        lp, lp, torch.zeros(2), clip_range=0.1, kl_beta=0.04, mean=mean, ref_mean=ref, std=std
    )
    assert out.kl_loss.item() == pytest.approx((0.3125 + 10.0) / 2)
    assert out.loss.item() == pytest.approx(0.04 * (0.3125 + 10.0) / 2)
    out.loss.backward()
    assert mean.grad.abs().sum() > 0


@pytest.mark.parametrize("missing", ["mean", "ref_mean", "std"])
def test_kl_beta_without_kl_inputs_raises(missing):
    kw = {"mean": torch.zeros(2, 3), "ref_mean": torch.zeros(2, 3), "std": torch.ones(2)}
    kw.pop(missing)
    lp = torch.zeros(2)
    with pytest.raises(ValueError, match=f"missing \\['{missing}'\\]"):
        flow_grpo_loss(lp, lp, torch.zeros(2), clip_range=0.1, kl_beta=0.1, **kw)


def test_metrics_are_detached_and_loss_is_differentiable():
    lp = torch.tensor([-1.0, -1.2], requires_grad=True)
    out = flow_grpo_loss(lp, torch.tensor([-1.1, -1.0]), torch.tensor([1.0, -0.5]), clip_range=0.05)
    assert out.loss.requires_grad
    for m in (out.policy_loss, out.kl_loss, out.clip_frac, out.approx_kl, out.ratio_mean):
        assert not m.requires_grad and m.ndim == 0


def test_loss_shape_mismatch_raises():
    with pytest.raises(ValueError, match="advantages must have shape"):
        flow_grpo_loss(torch.zeros(3), torch.zeros(3), torch.zeros(2), clip_range=0.1)
    with pytest.raises(ValueError, match="clip_range"):
        flow_grpo_loss(torch.zeros(3), torch.zeros(3), torch.zeros(3), clip_range=0.0)
