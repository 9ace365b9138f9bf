"""The cost model against our device measurements and veRL-Omni's published runs
(``python -m verl_digen.sim.calibrate``).

- the kernel efficiencies are the device measurements (``docs/measured/``), the same for every
  system; veRL-Omni's fitted terms are its own and ours are measured;
- every published run is predicted within +-30% by the shipped (calibrated) profiles (one fitted
  step constant for three steps: the LoRA pair comes out 24-28% short, stated in docs/cost_model.md);
- the shipped constants are what the measurements and the fit give for the current model;
- fitted on the two 4-GPU runs alone, the model predicts the 64-GPU run within +-50% (45% slow:
  the out-of-sample error the simulated ratios carry);
- a system profile changes the costs it says it changes.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from verl_digen.sim.calibrate import (
    BAND,
    FITTED_DEVICES,
    JUDGE,
    MFU_CAP,
    Constants,
    CALL_ROWS_REPORT,
    apply,
    calibrate,
    check,
    fit_step,
    measured_device_basis,
    load_runs,
    predict,
    run_costs,
    run_plan,
)
from verl_digen.sim.cost_model import SWAP, load_catalog

STRONG_SCALING_BAND = 0.5  # the 64-GPU run from the 4-GPU ones: 45% slow on the measured basis


@pytest.fixture(scope="module")
def catalog():
    return load_catalog()


@pytest.fixture(scope="module")
def runs():
    return {r.name: r for r in load_runs()}


def test_every_published_run_is_predicted_within_the_band(catalog, runs):
    rows = check(runs.values(), catalog)
    assert {r["stage"] for r in rows} == {"rollout", "reward", "step"}
    for r in rows:
        assert abs(r["error"]) <= BAND, f"{r['run']}: predicted {r['predicted_s']:.1f} s, published {r['published_s']} s"


def test_shipped_constants_are_physical_and_the_same_on_every_hopper_device(catalog):
    c = Constants.of(catalog)
    assert 0 < c.mfu_train <= c.mfu_forward <= MFU_CAP
    assert c.mfu_half_tokens > 0 and c.step_fixed_s >= 0 and c.decode_tail_s >= 0
    for name in FITTED_DEVICES:
        d = catalog.devices[name]
        assert (d.mfu_forward, d.mfu_train, d.mfu_half_tokens) == (c.mfu_forward, c.mfu_train, c.mfu_half_tokens)
        assert "calibrate" in d.sources["mfu_train"] and "measured" in d.sources["mfu_train"]
        assert CALL_ROWS_REPORT in d.sources["mfu_half_tokens"]


def test_kernel_efficiencies_are_shared_and_fitted_terms_stay_veRL_Omnis(catalog):
    """One basis: no system's passes carry a factor of their own, and the per-step cost fitted to
    veRL-Omni's published steps is not charged to ours (ours is measured on our runtime)."""
    ours, omni = catalog.systems["verl-digen"], catalog.systems["verl-omni"]
    assert ours.train_efficiency == omni.train_efficiency == 1.0
    assert omni.step_fixed_s > 10 * ours.step_fixed_s > 0
    assert "step_overhead" in ours.sources["step_fixed_s"] and "calibrate" in omni.sources["step_fixed_s"]
    assert omni.engine_call_s > 0 and ours.engine_call_s == 0  # its engine's per-call cost, fitted
    assert ours.denoise_step_s > 0 and omni.denoise_step_s == 0  # our sampler's, measured


def test_the_shipped_efficiencies_are_the_device_measurements(catalog):
    """calibrated.yaml's efficiencies reproduce the measured call sizes and training passes (a
    change to the FLOP model not followed by ``calibrate --write`` fails here)."""
    dev = measured_device_basis(load_catalog(overrides=False))
    c = Constants.of(catalog)
    assert c.mfu_forward == pytest.approx(dev.mfu_forward, rel=1e-3)
    assert c.mfu_half_tokens == pytest.approx(dev.mfu_half_tokens, rel=1e-2)
    assert c.mfu_train == pytest.approx(dev.mfu_train, rel=1e-3)
    assert catalog.systems["verl-digen"].denoise_step_s == pytest.approx(dev.denoise_step_s, rel=1e-3)
    # the measured curve is flat: a one-row call within 15% of a 24-row call per sample (H200: 1.12x)
    per_sample = {rows: modelled for rows, _, modelled in dev.call_rows}
    assert per_sample[1] / per_sample[24] < 1.15
    for _, measured, modelled in dev.call_rows + dev.train + dev.generate:
        assert abs(modelled / measured - 1) < 0.06


def test_the_fitted_basis_charges_every_system_the_fitted_training_efficiency(catalog, runs):
    """--train fitted refits mfu_train to veRL-Omni's whole steps; it is the device's (every system's),
    and it differs from the measured one, which is why the choice is a basis, not a detail."""
    base = load_catalog(overrides=False)
    cal = calibrate(list(runs.values()), base, train="fitted")
    assert cal.train == "fitted" and cal.constants.mfu_train < 0.8 * Constants.of(catalog).mfu_train
    cat = apply(base, cal.constants)
    assert cat.devices["H800"].mfu_train == cal.constants.mfu_train
    assert cat.systems["verl-digen"].train_efficiency == cat.systems["verl-omni"].train_efficiency == 1.0


def test_shipped_constants_are_the_fit_of_the_current_model(catalog, runs):
    """A change to the model that is not followed by ``calibrate --write`` fails here."""
    for r in runs.values():
        if r.stage == "rollout":  # stage 1 reproduces both generation phases
            assert predict(r, catalog) == pytest.approx(r.published_s, rel=0.01)
    sync, async_ = runs["lora-4xH800"], runs["lora-4xH800-async-reward"]
    gap = predict(sync, catalog) - predict(async_, catalog)  # stage 2 reproduces the reward pair's difference
    assert gap == pytest.approx(sync.published_s - async_.published_s, abs=2.0)
    steps = [r for r in runs.values() if r.stage == "step"]
    c = Constants.of(catalog)

    def rms(cc: Constants) -> float:
        cat = apply(catalog, cc)
        return math.sqrt(sum((predict(r, cat) / r.published_s - 1) ** 2 for r in steps) / len(steps))

    best = rms(c)
    for change in ({"step_fixed_s": c.step_fixed_s + 3}, {"step_fixed_s": max(0.0, c.step_fixed_s - 3)}):
        assert rms(dataclasses.replace(c, **change)) >= best - 1e-3, change


def test_fitted_on_four_gpu_runs_the_model_predicts_sixty_four(catalog, runs):
    """Leave-one-out on the run that tests strong scaling: fit veRL-Omni's per-step overhead on the
    two 4-GPU runs only, predict the 64-GPU one (published 105 s): 45% slow on the measured basis,
    the out-of-sample error docs/benchmarks_sim.md states beside every ratio against veRL-Omni."""
    small = [runs["lora-4xH800"], runs["full-4xH200"]]
    fitted, _ = fit_step(catalog, small, Constants.of(catalog))
    big = runs["full-64xH100"]
    assert abs(predict(big, apply(catalog, fitted)) / big.published_s - 1) <= STRONG_SCALING_BAND


def test_the_judge_and_the_overheads_do_not_shrink_with_more_gpus(catalog, runs):
    """The scaling the uncalibrated model missed: at 64 GPUs most of the step is work that more
    GPUs do not shorten (the judge's decoding tail, the per-step overhead)."""
    r = runs["full-64xH100"]
    costs = run_costs(r, catalog)
    spec, cluster = run_plan(r, costs)
    dev = costs.device(r.device)
    share = costs.workload.images_per_step // r.devices
    fixed = costs.reward.decode_tail_s + costs.system.step_fixed_s
    assert fixed > 0.5 * predict(r, catalog)
    assert costs.reward_seconds(share, dev, residency=SWAP, per_worker=share) > costs.reward.decode_tail_s
    assert catalog.rewards[JUDGE].decode_tail_s > 0


def test_a_system_profile_changes_the_costs_it_names(catalog, runs):
    r = runs["full-4xH200"]
    omni = run_costs(r, catalog)
    spec, cluster = run_plan(r, omni)
    dev, group = omni.device(r.device), omni.train_group(cluster)
    share = omni.workload.images_per_step // r.devices
    plain = omni.with_system(dataclasses.replace(omni.system, recompute_logprob=False))
    # recomputing old log-probs: one forward pass per trained step and log-prob micro-batch
    extra = omni.train_seconds(share, dev, group) - plain.train_seconds(share, dev, group)
    passes = math.ceil(share / omni.system.logprob_micro_batch)
    one = omni.logprob_pass_seconds(omni.system.logprob_micro_batch, dev, group)
    assert extra == pytest.approx(omni.workload.trained_steps * passes * one)
    # parameter offload: the shard crosses the host link once per round trip, each way
    no_param = omni.with_system(dataclasses.replace(omni.system, param_offload=False))
    moved = omni.system.param_offload_roundtrips * omni.param_shard_bytes(group) / (dev.host_link_gbps * 1e9)
    assert omni.switch_seconds("train", dev, group) - no_param.switch_seconds("train", dev, group) == pytest.approx(moved)
    # a swapped judge pays its wake-up and sleep on top of the same scoring
    resident = omni.reward_seconds(share, dev, per_worker=share)
    assert omni.reward_seconds(share, dev, residency=SWAP, per_worker=share) - resident == pytest.approx(omni.reward_swap_seconds(dev))
    # two PPO mini-batches: two optimizer updates per step
    one_mb = omni.with_workload(mini_batches=1)
    assert omni.optimizer_seconds(dev, group) - one_mb.optimizer_seconds(dev, group) == pytest.approx(
        one_mb.optimizer_seconds(dev, group) - omni.system.step_fixed_s)
