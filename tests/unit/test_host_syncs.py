"""Host syncs in the hot paths: a denoising loop reads its trajectory back once, not once per
step; a trained micro-batch reads its metrics back once, not six times per step and pass; an
optimizer step reads its gradient norm once. Counted with ``tests/helpers/host_syncs.py`` (which follows
the data from the model's parameters on a CPU; ``tests/gpu/test_gpu.py`` counts on a real device)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from host_syncs import HostSyncCounter
from verl_digen.algos.window import SdeWindowConfig
from verl_digen.config.schema import AlgoConfig, LoraConfigSpec
from verl_digen.models.base import SampleSpec
from verl_digen.models.registry import load_adapter
from verl_digen.workers.sampling import GroupRequest, SamplingSettings, begin_groups, denoise, finish_groups, sample_groups
from verl_digen.workers.training import PolicyUpdater, TrainSettings, add_lora


def _settings(num_steps: int = 6, rows: int = 0, guidance: float = 1.0) -> SamplingSettings:
    return SamplingSettings(
        spec=SampleSpec(height=32, width=32, guidance_scale=guidance), num_steps=num_steps, noise_level=0.7,
        sde_type="sde", window=SdeWindowConfig(mode="fixed", start=1, size=3), timestep_fraction=1.0,
        forward_rows=rows,
    )


def _request(version: int = 0) -> GroupRequest:
    return GroupRequest(["a red apple", "a blue car"], [0, 1], [0, 1], group_size=2, training_step=0, seed=7,
                        policy_version=version)


def _roots(adapter) -> list[torch.Tensor]:
    return [*adapter.transformer.parameters(), *adapter.transformer.buffers()]


@pytest.mark.parametrize("arch,guidance", [("flux", 1.0), ("sd3", 4.5)])
def test_a_denoising_loop_reads_its_trajectory_back_once(arch, guidance, tiny_flux, tiny_sd3):
    """Whatever the number of steps, and for each TSP stage: one read-back at its end."""
    adapter = load_adapter(tiny_flux if arch == "flux" else tiny_sd3)
    for steps in (4, 8):
        settings = _settings(steps, guidance=guidance)
        state = begin_groups(adapter, _request(), settings)
        with HostSyncCounter(_roots(adapter)) as whole:
            denoise(adapter, state, settings, steps)
        assert whole.total == 1, (steps, dict(whole.calls))
        staged = begin_groups(adapter, _request(), settings)
        with HostSyncCounter(_roots(adapter)) as first:
            denoise(adapter, staged, settings, steps // 2)
        with HostSyncCounter(_roots(adapter)) as second:
            denoise(adapter, staged, settings, steps)
        assert first.total == second.total == 1, (dict(first.calls), dict(second.calls))
        # The stages record the same trajectory as one call.
        a, b = finish_groups(adapter, state, settings), finish_groups(adapter, staged, settings)
        assert torch.equal(a.batch["latents"], b.batch["latents"])
        assert torch.equal(a.batch["log_probs"], b.batch["log_probs"])
        # the window is steps 1-3: the trajectory carries their inputs and outputs, x_1 .. x_4
        assert a.batch["latents"].device.type == "cpu" and a.batch["latent_steps"][0].tolist() == [1, 2, 3, 4]


def test_validation_sampling_reads_the_latents_back_once(tiny_flux):
    adapter = load_adapter(tiny_flux)
    settings = _settings(6)
    state = begin_groups(adapter, _request(), settings, ode=True)
    with HostSyncCounter(_roots(adapter)) as c:
        denoise(adapter, state, settings, 6)
    assert c.total == 1, dict(c.calls)
    assert len(state.latents) == 1 and state.latents[0].device.type == "cpu"


def _updater(adapter, settings, n: int, *, kl_beta: float = 0.0, lora_only: bool = True) -> PolicyUpdater:
    return PolicyUpdater(adapter, TrainSettings(algo=AlgoConfig(kl_beta=kl_beta), sampling=settings,
                                                lora_only=lora_only, images_per_step=n))


@pytest.mark.parametrize("rows,kl_beta,lora_only", [(0, 0.0, True), (2, 0.0, True), (2, 0.01, False)])
def test_a_trained_micro_batch_and_an_optimizer_step_read_back_once_each(rows, kl_beta, lora_only, tiny_flux):
    """3 trained steps x 1 or 2 passes: one read-back of the micro-batch's metrics, one of the
    optimizer step's gradient norm; the metrics are the per-pass values' weighted means."""
    adapter = load_adapter(tiny_flux)
    add_lora(adapter, LoraConfigSpec(rank=4))
    settings = _settings(6, rows=rows)
    data = sample_groups(adapter, *dataclasses.astuple(_request())[:3], group_size=2, settings=settings,
                         training_step=0, seed=7, policy_version=0)
    updater = _updater(adapter, settings, len(data), kl_beta=kl_beta, lora_only=lora_only)
    roots = _roots(adapter) + list(updater.opt_params)
    with HostSyncCounter(roots) as train:
        metrics = updater.train_micro_batch(data, torch.tensor([1.0, -1.0, 0.5, -0.5]))
    assert train.total == 1, dict(train.calls)
    with HostSyncCounter(roots) as step:
        opt = updater.optimizer_step()
    assert step.total == 1, dict(step.calls)
    assert metrics["actor/passes"] == (6.0 if rows else 3.0) and metrics["actor/trained_steps"] == 3.0
    assert abs(metrics["actor/ratio_mean"] - 1.0) < 1e-5 and metrics["actor/clip_frac"] == 0.0
    assert all(isinstance(v, float) for v in (*metrics.values(), *opt.values()))
    assert opt["actor/grad_norm"] > 0 and opt["actor/skipped_nonfinite"] == 0.0


def test_a_non_finite_gradient_still_skips_the_step_with_one_read_back(tiny_flux):
    adapter = load_adapter(tiny_flux)
    add_lora(adapter, LoraConfigSpec(rank=4))
    settings = _settings(6)
    data = sample_groups(adapter, *dataclasses.astuple(_request())[:3], group_size=2, settings=settings,
                         training_step=0, seed=7, policy_version=0)
    updater = _updater(adapter, settings, len(data))
    updater.train_micro_batch(data, torch.tensor([1.0, -1.0, 0.5, -0.5]))
    before = [p.detach().clone() for p in updater.params]
    updater.params[0].grad.fill_(float("nan"))
    with HostSyncCounter(_roots(adapter)) as step:
        opt = updater.optimizer_step()
    assert step.total == 1, dict(step.calls)
    assert opt["actor/skipped_nonfinite"] == 1.0 and opt["actor/grad_norm"] != opt["actor/grad_norm"]
    assert all(torch.equal(a, p) for a, p in zip(before, updater.params))


def test_the_device_record_is_the_trajectory_the_memory_planner_charges(tiny_flux):
    """The denoising loop's device buffers: x_0 plus one fp32 latent per step and one log-prob per
    SDE step per sample, within the planner's ``samples * ((num_steps + 1) latents + num_steps
    log-probs)`` (equal when every step is an SDE step)."""
    from torch.overrides import TorchFunctionMode

    class Allocs(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.numel = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if getattr(func, "__name__", "") == "new_empty":
                self.numel.append(out.numel())
            return out

    adapter = load_adapter(tiny_flux)
    steps = 4
    settings = dataclasses.replace(_settings(steps), window=SdeWindowConfig(mode="fixed", start=0, size=steps))
    state = begin_groups(adapter, _request(), settings)
    latent = state.newest[0].numel()
    with Allocs() as allocs:
        denoise(adapter, state, settings, steps)
    samples = state.batch
    assert allocs.numel == [samples * steps * latent + samples * steps]
    planner_bytes = samples * (steps + 1) * latent * 4 + samples * steps * 4
    assert 4 * (allocs.numel[0] + samples * latent) == planner_bytes
