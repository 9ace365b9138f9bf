"""SDE step maths: hand-computed values per sde_type, scoring, RNG, errors, gradients."""

import math

import pytest
import torch

from verl_digen.algos.sde import SDE_TYPES, ode_step, sde_step_with_logprob

# B=2 samples of 3 latent elements, sigma -> sigma_next
SIGMA = [0.8, 0.5]
SIGMA_NEXT = [0.6, 0.3]
SAMPLE = [[0.5, -1.0, 2.0], [1.5, 0.25, -0.75]]
VELOCITY = [[1.0, 0.5, -2.0], [-0.5, 1.25, 0.3]]
PREV = [[0.3, -1.1, 2.4], [1.7, 0.1, -0.8]]
ETA = 0.7


def _tensors():
    return (
        torch.tensor(VELOCITY),
        torch.tensor(SAMPLE),
        torch.tensor(SIGMA),
        torch.tensor(SIGMA_NEXT),
    )


def _gauss_logpdf(x, mean, std):
    return -((x - mean) ** 2) / (2 * std**2) - math.log(std) - math.log(math.sqrt(2 * math.pi))


def _hand(sde_type, eta=ETA, sigma=SIGMA, sigma_next=SIGMA_NEXT):
    """Per-sample (means, std, log_prob) computed with scalar `math`, element by element."""
    out = []
    for b in range(2):
        s, sn = sigma[b], sigma_next[b]
        dt = sn - s
        means, terms = [], []
        for x, v, y in zip(SAMPLE[b], VELOCITY[b], PREV[b]):
            if sde_type == "sde":
                s_safe = sn if s == 1 else s
                sd = math.sqrt(s / (1 - s_safe)) * eta
                m = x * (1 + sd * sd / (2 * s) * dt) + v * (1 + sd * sd * (1 - s) / (2 * s)) * dt
                std = sd * math.sqrt(-dt)
                terms.append(_gauss_logpdf(y, m, std))
            elif sde_type == "cps":
                std = sn * math.sin(eta * math.pi / 2)
                x0 = x - s * v
                eps = x + v * (1 - s)
                m = x0 * (1 - sn) + eps * math.sqrt(sn * sn - std * std)
                terms.append(-((y - m) ** 2))
            else:
                x0 = x - s * v
                score = -(x - (1 - s) * x0) / (s * s)
                m = x + dt * v - 0.5 * eta * eta * score * dt
                std = eta * math.sqrt(s - sn)
                terms.append(_gauss_logpdf(y, m, std))
            means.append(m)
        out.append((means, std, sum(terms) / len(terms)))
    return out


@pytest.mark.parametrize("sde_type", SDE_TYPES)
def test_hand_computed_mean_std_logprob(sde_type):
    v, x, s, sn = _tensors()
    out = sde_step_with_logprob(
        v, x, s, sn, noise_level=ETA, sde_type=sde_type, prev_sample=torch.tensor(PREV)
    )
    assert out.std.shape == (2, 1)
    assert out.log_prob.shape == (2,)
    for b, (means, std, lp) in enumerate(_hand(sde_type)):
        for j in range(3):
            assert out.mean[b, j].item() == pytest.approx(means[j], abs=1e-6)
        assert out.std[b, 0].item() == pytest.approx(std, abs=1e-6)
        assert out.log_prob[b].item() == pytest.approx(lp, abs=1e-6, rel=1e-6)


@pytest.mark.parametrize("sde_type", SDE_TYPES)
def test_sampled_prev_sample_is_mean_plus_std_times_generator_noise(sde_type):
    v, x, s, sn = _tensors()
    out = sde_step_with_logprob(
        v, x, s, sn, noise_level=ETA, sde_type=sde_type, generator=torch.Generator().manual_seed(3)
    )
    noise = torch.randn((2, 3), generator=torch.Generator().manual_seed(3), dtype=torch.float32)
    for b, (means, std, _) in enumerate(_hand(sde_type)):
        for j in range(3):
            expected = means[j] + std * noise[b, j].item()
            assert out.prev_sample[b, j].item() == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("sde_type", SDE_TYPES)
def test_scoring_the_sampled_prev_sample_reproduces_its_log_prob(sde_type):
    v, x, s, sn = _tensors()
    g = torch.Generator().manual_seed(0)
    sampled = sde_step_with_logprob(v, x, s, sn, noise_level=ETA, sde_type=sde_type, generator=g)
    scored = sde_step_with_logprob(
        v, x, s, sn, noise_level=ETA, sde_type=sde_type, prev_sample=sampled.prev_sample
    )
    torch.testing.assert_close(scored.log_prob, sampled.log_prob, atol=1e-6, rtol=0)
    torch.testing.assert_close(scored.prev_sample, sampled.prev_sample, atol=0, rtol=0)


def test_sigma_one_on_first_step_is_finite_for_sde():
    v, x, _, _ = _tensors()
    s = torch.tensor([1.0, 1.0])
    sn = torch.tensor([0.9, 0.75])
    out = sde_step_with_logprob(
        v, x, s, sn, noise_level=ETA, sde_type="sde", generator=torch.Generator().manual_seed(0)
    )
    for t in (out.prev_sample, out.mean, out.std, out.log_prob):
        assert torch.isfinite(t).all()
    # the substituted sigma is sigma_next: std_dev_t = sqrt(1 / (1 - 0.9)) * eta
    expected_std = math.sqrt(1 / (1 - 0.9)) * ETA * math.sqrt(0.1)
    assert out.std[0, 0].item() == pytest.approx(expected_std, rel=1e-6)


def test_same_generator_seed_gives_identical_samples():
    v, x, s, sn = _tensors()
    def run(seed):
        g = torch.Generator().manual_seed(seed)
        return sde_step_with_logprob(v, x, s, sn, noise_level=ETA, generator=g)

    a, b, c = run(7), run(7), run(8)
    assert torch.equal(a.prev_sample, b.prev_sample)
    assert torch.equal(a.log_prob, b.log_prob)
    assert not torch.equal(a.prev_sample, c.prev_sample)


def test_scoring_leaves_generator_state_unchanged():
    v, x, s, sn = _tensors()
    g = torch.Generator().manual_seed(5)
    before = g.get_state().clone()
    sde_step_with_logprob(v, x, s, sn, noise_level=ETA, prev_sample=torch.tensor(PREV), generator=g)
    assert torch.equal(g.get_state(), before)


def test_unknown_sde_type_error_names_the_value():
    v, x, s, sn = _tensors()
    with pytest.raises(ValueError, match="'ode_plus'.*sde.*cps.*dance_sde"):
        sde_step_with_logprob(v, x, s, sn, noise_level=ETA, sde_type="ode_plus")


def test_sigma_shape_mismatch_raises():
    v, x, s, _ = _tensors()
    with pytest.raises(ValueError, match="sigma_next must have shape"):
        sde_step_with_logprob(v, x, s, torch.tensor([0.5, 0.4, 0.3]), noise_level=ETA)
    with pytest.raises(ValueError, match="sigma must have shape"):
        sde_step_with_logprob(v, x, s.reshape(2, 1), s, noise_level=ETA)


def test_prev_sample_shape_mismatch_raises():
    v, x, s, sn = _tensors()
    with pytest.raises(ValueError, match="prev_sample shape"):
        sde_step_with_logprob(v, x, s, sn, noise_level=ETA, prev_sample=torch.zeros(2, 4))


@pytest.mark.parametrize("sde_type", SDE_TYPES)
def test_gradients_flow_from_log_prob_to_velocity(sde_type):
    v, x, s, sn = _tensors()
    v = v.clone().requires_grad_(True)
    out = sde_step_with_logprob(
        v, x, s, sn, noise_level=ETA, sde_type=sde_type, prev_sample=torch.tensor(PREV)
    )
    out.log_prob.sum().backward()
    assert v.grad is not None
    assert torch.isfinite(v.grad).all() and v.grad.abs().sum() > 0


def test_low_precision_inputs_are_computed_in_fp32():
    v, x, s, sn = _tensors()
    g = torch.Generator().manual_seed(0)
    out = sde_step_with_logprob(v.bfloat16(), x.bfloat16(), s, sn, noise_level=ETA, generator=g)
    for t in (out.prev_sample, out.mean, out.std, out.log_prob):
        assert t.dtype == torch.float32


def test_ode_step_is_euler():
    v, x, s, sn = _tensors()
    out = ode_step(v.half(), x, s, sn)
    assert out.dtype == torch.float32
    for b in range(2):
        for j in range(3):
            expected = SAMPLE[b][j] + (SIGMA_NEXT[b] - SIGMA[b]) * VELOCITY[b][j]
            assert out[b, j].item() == pytest.approx(expected, abs=1e-3)
