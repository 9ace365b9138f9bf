"""Memory hygiene of the workers: images cross processes as uint8, the VAE decodes in chunks,
text encoders and the VAE can live on CPU between uses (training GPUs)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from runs import PROMPTS, SPECS

pytestmark = pytest.mark.usefixtures("one_thread")


def _settings(arch: str, **overrides):
    from verl_digen.algos.window import SdeWindowConfig
    from verl_digen.workers.sampling import SamplingSettings

    return SamplingSettings(spec=SPECS[arch], num_steps=2, noise_level=0.7, sde_type="sde",
                            window=SdeWindowConfig(mode="fixed", start=0, size=1), timestep_fraction=1.0, **overrides)


def _state(adapter, settings):
    from verl_digen.workers.sampling import GroupRequest, begin_groups, denoise

    state = begin_groups(adapter, GroupRequest(PROMPTS, [0, 1], [0, 1], group_size=2, training_step=0, seed=5,
                                               policy_version=0), settings)
    return denoise(adapter, state, settings, settings.num_steps)


@pytest.mark.parametrize("arch", ["flux", "wan"])
def test_trajectories_carry_uint8_pixels_that_rewards_see_within_quantisation(arch, adapters):
    from verl_digen.models.base import pixels_from_uint8
    from verl_digen.rewards import build_reward_from_config
    from verl_digen.workers.sampling import decode_groups, finish_groups

    settings = _settings(arch)
    state = _state(adapters[arch], settings)
    exact = decode_groups(adapters[arch], state, settings)  # fp32 in [0, 1]
    data = finish_groups(adapters[arch], state, settings)
    images = data.batch["images"]
    assert images.dtype == torch.uint8 and images.shape == exact.shape
    seen = pixels_from_uint8(images)
    assert float((seen - exact).abs().max()) <= 0.5 / 255 + 1e-6
    reward = build_reward_from_config({"name": "brightness"})
    torch.testing.assert_close(reward(seen, ["p"] * 4, None), reward(exact, ["p"] * 4, None), atol=0.5 / 255, rtol=0)


@pytest.mark.parametrize("arch", ["sd3", "hunyuan_video"])
def test_vae_decodes_in_chunks_of_vae_decode_chunk_samples(arch, adapters):
    from verl_digen.workers.sampling import decode_groups

    adapter = adapters[arch]
    whole = _settings(arch)
    state = _state(adapter, whole)
    batches = []
    original = adapter.vae.decode

    def counting_decode(z, *args, **kwargs):
        batches.append(z.shape[0])
        return original(z, *args, **kwargs)

    adapter.vae.decode = counting_decode  # instance attribute: counts the calls, runs the real decode
    try:
        at_once = decode_groups(adapter, state, whole)
        assert batches == [4]
        batches.clear()
        chunked = decode_groups(adapter, state, dataclasses.replace(whole, vae_decode_chunk=3))
        assert batches == [3, 1]
    finally:
        del adapter.vae.decode
    torch.testing.assert_close(chunked, at_once, atol=1e-5, rtol=0)


class _RecordingModule(torch.nn.Module):
    """Records where it is moved: the machine has no GPU, so moving to one is observed, not done."""

    def __init__(self) -> None:
        super().__init__()
        self.moves: list[str] = []
        self.weight = torch.nn.Parameter(torch.zeros(3))

    def to(self, *args, **kwargs):  # type: ignore[override]
        self.moves.append(str(args[0]) if args else str(kwargs.get("device")))
        return self


def test_offloaded_encoders_visit_the_device_only_while_encoding(monkeypatch):
    from verl_digen.models import base
    from verl_digen.models.flux import FluxAdapter

    adapter = object.__new__(FluxAdapter)  # only the offload bookkeeping is exercised
    encoder, vae = _RecordingModule(), _RecordingModule()
    adapter.text_encoder, adapter.vae = encoder, vae
    assert adapter.offload_to_cpu(("text_encoder",)) == 0  # already on CPU: nothing moved
    assert adapter.offloaded == ("text_encoder",) and encoder.moves == ["cpu"]
    monkeypatch.setattr(FluxAdapter, "device", property(lambda self: torch.device("cuda", 0)))
    with base.onloaded(adapter, ("text_encoder", "vae")):
        assert encoder.moves == ["cpu", "cuda:0"]
    assert encoder.moves == ["cpu", "cuda:0", "cpu"]
    assert vae.moves == []  # not offloaded: left where it is
    with pytest.raises(RuntimeError), base.onloaded(adapter, ("text_encoder",)):
        raise RuntimeError("encoding failed")
    assert encoder.moves[-1] == "cpu"  # back on CPU even after an error


def test_offloaded_ema_keeps_cpu_shadows_that_average_like_the_device_ones():
    from verl_digen.workers.ema import EMA

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4, 3).to(torch.bfloat16)), torch.nn.Parameter(torch.randn(5))]
    named = [(f"p{i}", p) for i, p in enumerate(params)]
    on_device, offloaded = EMA(named, decay=0.9), EMA(named, decay=0.9, offload=True)
    assert offloaded.offloaded and all(offloaded.shadow(n).device.type == "cpu" for n, _ in named)
    for _ in range(3):
        with torch.no_grad():
            for p in params:
                p.add_(torch.randn_like(p))
        on_device.update()
        offloaded.update()
    for n, _ in named:
        assert torch.equal(offloaded.shadow(n), on_device.shadow(n))
