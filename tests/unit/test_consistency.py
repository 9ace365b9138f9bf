"""On-policy consistency: with the weights that sampled a batch, the trainer's recomputed
log-probs equal the rollout's behaviour log-probs (ratio 1 within 1e-5)."""

from __future__ import annotations

import pytest
import torch

from verl_digen.config.schema import AlgoConfig, LoraConfigSpec
from verl_digen.models.base import SampleSpec
from verl_digen.models.registry import load_adapter
from verl_digen.workers.sampling import SamplingSettings, sample_groups
from verl_digen.workers.training import PolicyUpdater, TrainSettings, add_lora
from verl_digen.algos.window import SdeWindowConfig


def _settings(sde_type: str = "sde", guidance: float = 1.0, window: SdeWindowConfig | None = None) -> SamplingSettings:
    return SamplingSettings(
        spec=SampleSpec(height=32, width=32, guidance_scale=guidance),
        num_steps=6,
        noise_level=0.7,
        sde_type=sde_type,
        window=window or SdeWindowConfig(mode="fixed", start=1, size=3),
        timestep_fraction=1.0,
    )


PROMPTS = {0: "a red apple", 1: "a blue car"}


def _sample(adapter, settings, *, version=0, groups=(0, 1)):
    return sample_groups(
        adapter, [PROMPTS[g] for g in groups], list(groups), list(groups),
        group_size=2, settings=settings, training_step=0, seed=7, policy_version=version,
    )


@pytest.mark.parametrize(
    "arch,sde_type,guidance",
    [("flux", "sde", 1.0), ("flux", "cps", 1.0), ("flux", "dance_sde", 1.0), ("sd3", "sde", 4.5), ("sd3", "cps", 4.5)],
)
def test_recomputed_log_probs_equal_behaviour_log_probs(arch, sde_type, guidance, tiny_flux, tiny_sd3):
    path = tiny_flux if arch == "flux" else tiny_sd3
    adapter = load_adapter(path)
    add_lora(adapter, LoraConfigSpec(rank=4))
    settings = _settings(sde_type, guidance)
    data = _sample(adapter, settings)
    updater = PolicyUpdater(
        adapter, TrainSettings(algo=AlgoConfig(), sampling=settings, lora_only=True, images_per_step=len(data))
    )
    recomputed = updater.recompute_log_probs(data)
    window = data.batch["sde_mask"][0]
    assert window.sum() == 3
    behaviour = data.batch["log_probs"][:, window]
    ratio = torch.exp(recomputed[:, window] - behaviour)
    assert torch.allclose(ratio, torch.ones_like(ratio), atol=1e-5), (ratio - 1).abs().max()


def test_first_training_step_sees_ratio_one_and_no_clipping(tiny_flux):
    adapter = load_adapter(tiny_flux)
    add_lora(adapter, LoraConfigSpec(rank=4))
    settings = _settings()
    data = _sample(adapter, settings)
    updater = PolicyUpdater(
        adapter, TrainSettings(algo=AlgoConfig(), sampling=settings, lora_only=True, images_per_step=len(data))
    )
    metrics = updater.train_micro_batch(data, torch.tensor([1.0, -1.0, 0.5, -0.5]))
    assert abs(metrics["actor/ratio_mean"] - 1.0) < 1e-5
    assert metrics["actor/clip_frac"] == 0.0
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in updater.params)


def test_a_group_is_the_same_trajectory_whichever_batch_samples_it(tiny_flux):
    adapter = load_adapter(tiny_flux)
    # a window from step 0: the trajectory carries x_0, the noise, as its first latent
    settings = _settings(window=SdeWindowConfig(mode="fixed", start=0, size=3))
    alone = _sample(adapter, settings, groups=(1,))
    together = _sample(adapter, settings, groups=(0, 1))
    rows = [i for i, g in enumerate(together.non_tensor_batch["group_id"]) if g == 1]
    # Different forward batch sizes may round differently; the noise is identical.
    torch.testing.assert_close(together.batch["latents"][rows], alone.batch["latents"], atol=1e-5, rtol=1e-5)
    assert together.batch["latent_steps"][0, 0] == 0
    assert torch.equal(together.batch["latents"][rows, 0], alone.batch["latents"][:, 0])


def test_trajectory_records_the_version_it_was_sampled_with(tiny_flux):
    adapter = load_adapter(tiny_flux)
    data = _sample(adapter, _settings(), version=3)
    assert set(data.non_tensor_batch["policy_version"].tolist()) == {3}


@pytest.mark.parametrize("arch,guidance", [("flux", 1.0), ("sd3", 4.5)])
def test_a_micro_batch_trains_in_passes_of_the_rollouts_calls_with_the_one_pass_gradient(arch, guidance, tiny_flux, tiny_sd3):
    """A micro-batch trains one backward per trained step and transformer call (``forward_rows``
    samples), so activations are bounded by one call; the accumulated gradient and the metrics
    are those of one backward over the whole micro-batch, to float rounding."""
    import dataclasses

    path = tiny_flux if arch == "flux" else tiny_sd3
    grads, metrics, backwards = {}, {}, {}
    for rows in (0, 2):  # 0: one pass of all 4 samples; 2: two passes of the rollout's 2-row calls
        adapter = load_adapter(path)
        add_lora(adapter, LoraConfigSpec(rank=4))
        settings = dataclasses.replace(_settings(guidance=guidance), forward_rows=rows)
        data = _sample(adapter, settings)
        updater = PolicyUpdater(adapter, TrainSettings(algo=AlgoConfig(kl_beta=0.01), sampling=settings,
                                                       lora_only=False, images_per_step=len(data)))
        calls, visits = [], []
        # one hook call per backward through the transformer's output projection
        last = [m for m in adapter.transformer.modules() if isinstance(m, torch.nn.Linear)][-1]
        last.register_full_backward_hook(lambda *a: calls.append(1))
        visit = updater._reference_on_device
        updater._reference_on_device = lambda: (visits.append(1), visit())[1]
        metrics[rows] = updater.train_micro_batch(data, torch.tensor([1.0, -1.0, 0.5, -0.5]))
        grads[rows] = [p.grad.clone() for p in updater.params]
        backwards[rows] = len(calls)
        # the KL reference's forwards of every step and pass in one visit of its weights (issue 24:
        # an offloaded reference is copied in once per micro-batch, not per step and pass)
        assert len(visits) == 1
    assert backwards[0] == 3 and backwards[2] == 6  # 3 trained steps x (1 pass, 2 passes)
    assert metrics[2]["actor/passes"] == 6.0 and metrics[0]["actor/passes"] == 3.0
    for a, b in zip(grads[0], grads[2]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)
    for key in ("actor/loss", "actor/kl_loss", "actor/ratio_mean", "actor/approx_kl"):
        assert metrics[0][key] == pytest.approx(metrics[2][key], rel=1e-4, abs=1e-7), key


def test_a_records_negative_prompt_is_its_cfg_negative_in_rollout_and_validation(tiny_sd3):
    """A prompt record's ``negative_prompt`` (veRL-Omni's per-row column) is the CFG negative of
    its samples, recorded for the trainer; rows without one use ``digen.sampling.negative_prompt``.
    Validation takes the records too; without records, or with none of their own, it is unchanged."""
    import dataclasses

    from verl_digen.workers.validation import sample_deterministic

    adapter = load_adapter(tiny_sd3)
    settings = dataclasses.replace(_settings(guidance=4.5), negative_prompt="low quality")
    records = [{"prompt": PROMPTS[0], "negative_prompt": "blurry, dark"}, {"prompt": PROMPTS[1]}]
    data = sample_groups(adapter, [PROMPTS[0], PROMPTS[1]], [0, 1], [0, 1], group_size=2, settings=settings,
                         training_step=0, seed=7, policy_version=0, metadata=records)
    own = adapter.encode_prompts(["blurry, dark"])
    default = adapter.encode_prompts(["low quality"])
    neg = data.batch["neg"]
    close = dict(atol=1e-5, rtol=1e-5)  # SD3's encoders round by batch size (~1 ulp)
    for key in own:
        for row, expected in ((0, own), (1, own), (2, default), (3, default)):
            torch.testing.assert_close(neg[key][row], expected[key][0].cpu(), **close)
        assert not torch.allclose(neg[key][0], neg[key][2])
    plain = sample_deterministic(adapter, [PROMPTS[0], PROMPTS[1]], settings, seed=3)
    same = sample_deterministic(adapter, [PROMPTS[0], PROMPTS[1]], settings, seed=3,
                                records=[{"prompt": PROMPTS[0]}, {"prompt": PROMPTS[1], "negative_prompt": None}])
    assert torch.equal(plain, same)
    mixed = sample_deterministic(adapter, [PROMPTS[0], PROMPTS[1]], settings, seed=3, records=records)
    assert not torch.equal(mixed[0], plain[0])
    torch.testing.assert_close(mixed[1], plain[1], atol=1e-5, rtol=1e-5)  # the default row: same negative
