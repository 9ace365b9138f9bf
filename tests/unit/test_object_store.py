"""What crosses the Ray object store each step: a trajectory record carries only what its readers
read (the trained steps' latents, the reward's uint8 pixels, the text embeddings only without a
prompt cache), and ``memory/object_store.py`` predicts its bytes exactly. A run's record of
those bytes per step: tests/e2e/test_object_store_e2e.py."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch

from verl_digen.algos.window import SdeWindowConfig
from verl_digen.config.schema import AlgoConfig, LoraConfigSpec
from verl_digen.models.base import SampleSpec
from verl_digen.models.prompt_cache import PromptEmbeddingCache
from verl_digen.models.registry import load_adapter
from verl_digen.memory.object_store import latent_elements, trajectory_bytes, trajectory_payload_bytes
from verl_digen.workers.sampling import SamplingSettings, carried_latent_steps, sample_groups
from verl_digen.workers.training import PolicyUpdater, TrainSettings, add_lora

PROMPTS = ["a red apple", "a blue car"]
# a preset's shape in small: a 2-step SDE window inside the steps, true CFG (a negative prompt too)
SETTINGS = SamplingSettings(spec=SampleSpec(height=32, width=48, guidance_scale=3.0), num_steps=4, noise_level=0.7,
                            sde_type="sde", window=SdeWindowConfig(mode="fixed", start=1, size=2), timestep_fraction=1.0)


def _sample(adapter):
    return sample_groups(adapter, PROMPTS, [0, 1], [0, 1], group_size=2, settings=SETTINGS, training_step=0, seed=5,
                         policy_version=0)


@pytest.fixture(scope="module")
def records(tiny_flux):
    """The tiny FLUX, and the same groups sampled without a prompt cache and with one."""
    adapter = load_adapter(tiny_flux)
    add_lora(adapter, LoraConfigSpec(rank=4))
    carried = _sample(adapter)
    cache = PromptEmbeddingCache(adapter, model_key="tiny-flux", cache_dir=None).install()
    return adapter, cache, carried, _sample(adapter)


def test_a_trajectory_carries_only_its_trained_steps_latents(records):
    _, _, carried, cached = records
    for data in (carried, cached):
        # steps 1 and 2 are trained: their inputs and outputs x_1, x_2, x_3, not the 5 latents of 4 steps
        assert data.batch["latent_steps"].tolist() == [[1, 2, 3]] * 4
        assert data.batch["latents"].shape[1] == 3
        assert data.batch["train_mask"][0].nonzero().flatten().tolist() == [1, 2]
    assert torch.equal(cached.batch["latents"], carried.batch["latents"])  # the cache's rows are the fresh ones


def test_a_cache_not_shared_by_every_worker_sends_its_rows_with_the_trajectory(records):
    """Node-local cache directories on several nodes: each encodes the prompts apart and may round
    a row differently, so the rollout's rows travel (the warm-up clears ``rows_shared`` when it
    finds more than one cache domain) and the trainer computes on them, not on its own."""
    adapter, cache, carried, _ = records
    cache.rows_shared = False
    try:
        apart = _sample(adapter)
    finally:
        cache.rows_shared = True
    assert {"cond", "neg"} <= set(apart.batch.keys()) and "cond_digest" not in apart.non_tensor_batch
    for key in ("cond", "neg"):
        for name, rows in carried.batch[key].items():
            assert torch.equal(apart.batch[key][name], rows), (key, name)


def test_the_trainer_reads_its_embeddings_from_its_prompt_cache_bitwise(records):
    """With a prompt cache no embeddings travel; the trainer's log-probs are those it computes on a
    record that carries them (the negative prompt's too)."""
    adapter, cache, carried, cached = records
    assert "cond" not in cached.batch.keys() and "neg" not in cached.batch.keys()
    assert {"cond", "neg"} <= set(carried.batch.keys())
    updater = PolicyUpdater(adapter, TrainSettings(algo=AlgoConfig(), sampling=SETTINGS, lora_only=True,
                                                   images_per_step=len(cached)))
    a, b = updater.recompute_log_probs(cached), updater.recompute_log_probs(carried)
    assert torch.equal(a, b) and a[:, 1:3].ne(0).all()
    assert cache.stats()["encoded_prompts"] == 3  # the two prompts and the negative one, once
    # a trainer whose cache holds other bits for a prompt refuses, naming the cause and the fix
    wrong = cached.select_idxs([0, 1, 2, 3])
    wrong.non_tensor_batch["cond_digest"] = wrong.non_tensor_batch["cond_digest"].copy()
    wrong.non_tensor_batch["cond_digest"][0] = "0" * 64
    with pytest.raises(RuntimeError, match="other embeddings of 'a red apple'.*digen.prompt_cache.dir"):
        updater.recompute_log_probs(wrong)
    encode = adapter.encode_prompts
    del adapter.encode_prompts  # no cache installed: nothing to read the rows from
    try:
        with pytest.raises(RuntimeError, match="no prompt cache installed"):
            updater.recompute_log_probs(cached)
    finally:
        adapter.encode_prompts = encode


def test_predicted_bytes_are_a_real_trajectorys(records, tiny_flux):
    """``trajectory_bytes`` from the sampling settings and the model's configs equals the record's
    tensors byte for byte, with and without the text embeddings; serialised (as Ray does: pickle),
    the record adds only framing and its prompt strings."""
    _, _, carried, cached = records
    spec = SETTINGS.spec
    for data in (carried, cached):
        text = (data.batch["cond"], data.batch["neg"]) if "cond" in data.batch.keys() else ()
        predicted = trajectory_bytes(
            num_steps=SETTINGS.num_steps, carried=len(carried_latent_steps([1, 2])),
            latent_elements=latent_elements("flux", tiny_flux, "fp32", spec.height, spec.width, spec.num_frames),
            pixel_elements=3 * spec.num_frames * spec.height * spec.width,
            text_bytes=sum(t[0].numel() * t.element_size() for table in text for t in table.values()),
        )
        tensors = sum(t.numel() * t.element_size() for t in data.batch.values(include_nested=True, leaves_only=True))
        columns = sum(c.nbytes for c in data.non_tensor_batch.values() if c.dtype != object)
        assert tensors + columns == len(data) * predicted.total
        assert predicted.latents == 4 * 3 * data.batch["latents"][0, 0].numel()
        measured = trajectory_payload_bytes(data)
        serialised = len(pickle.dumps(data))
        assert len(data) * predicted.total < measured < serialised < measured + 16 * 1024


def test_a_reward_that_reads_latents_adds_the_final_latents_and_the_prediction_follows(records, tiny_flux):
    """veRL-Omni's output_type latent / both: the record carries x_S too (fp32), counted in the
    prediction; without it the record is as before (the test above)."""
    adapter, _, _, cached = records  # the adapter has the prompt cache installed: sampled as `cached` was
    settings = dataclasses.replace(SETTINGS, keep_final_latents=True)
    data = sample_groups(adapter, PROMPTS, [0, 1], [0, 1], group_size=2, settings=settings, training_step=0, seed=5,
                         policy_version=0)
    spec = SETTINGS.spec
    shape = dict(num_steps=SETTINGS.num_steps, carried=len(carried_latent_steps([1, 2])),
                 latent_elements=latent_elements("flux", tiny_flux, "fp32", spec.height, spec.width, spec.num_frames),
                 pixel_elements=3 * spec.num_frames * spec.height * spec.width)
    with_latents, without = trajectory_bytes(**shape, final_latents=True), trajectory_bytes(**shape)
    assert with_latents.total - without.total == 4 * shape["latent_elements"] == data.batch["final_latents"][0].numel() * 4
    assert trajectory_payload_bytes(data) - trajectory_payload_bytes(cached) == len(data) * 4 * shape["latent_elements"]
    assert "cond" not in data.batch.keys()
    tensors = sum(t.numel() * t.element_size() for t in data.batch.values(include_nested=True, leaves_only=True))
    columns = sum(c.nbytes for c in data.non_tensor_batch.values() if c.dtype != object)
    assert tensors + columns == len(data) * trajectory_bytes(**shape, final_latents=True).total


def test_latent_elements_are_the_adapters_latents(tiny_dirs):
    """The latent count from the configs is what ``prepare_latents`` draws (packed FLUX, video Wan)."""
    for arch, spec in (("flux", SampleSpec(height=64, width=48)), ("wan", SampleSpec(height=32, width=32, num_frames=9))):
        adapter = load_adapter(tiny_dirs[arch])
        x = adapter.prepare_latents(1, spec, torch.Generator().manual_seed(0))
        assert x.numel() == latent_elements(arch, tiny_dirs[arch], "fp32", spec.height, spec.width, spec.num_frames), arch


def test_the_shipped_wan_preset_moves_under_3_5_gb_a_step():
    """Wan at 480x832, 33 frames, 16 steps, 64 samples a step, a 2-step window: 3 latents of 3.6 MB
    and 39.5 MB of uint8 pixels a sample (it carried 17 latents and the UMT5 embeddings, ~110 MB)."""
    from omegaconf import OmegaConf

    from verl_digen.config.compose import compose_config
    from verl_digen.config.schema import digen_config_from_dict
    from verl_digen.memory.object_store import describe, step_bytes

    config = compose_config([], config_name="wan_colocated")
    cfg = digen_config_from_dict(OmegaConf.to_container(config.digen, resolve=True))
    b = step_bytes(cfg)
    assert b.exact and not b.text_carried and b.samples == 64
    assert b.sample.latents == 3 * 4 * 16 * 9 * 60 * 104
    assert b.sample.images == 3 * 33 * 480 * 832
    assert b.per_step < 3.5e9
    line = describe(cfg)[0]
    assert line.startswith("object-store bytes per step: 3.2 GB"), line
    # TCSS (one step off): the next step's records are in flight with this step's
    tcss = dataclasses.replace(cfg, async_=dataclasses.replace(cfg.async_, max_staleness=1))
    assert describe(tcss)[0].endswith("TCSS keeps two steps in flight: 6.4 GB"), describe(tcss)
    # the simulator's cost model charges the same bytes for the same workload
    from verl_digen.sim.cost_model import CostModel, load_catalog

    s = cfg.sampling
    model = CostModel.from_catalog(load_catalog(), "wan2.1-14b", devices=["H800"], height=s.height, width=s.width,
                                   frames=s.num_frames, num_steps=s.num_steps, sde_window=s.sde_window.size,
                                   group_size=cfg.batch.group_size, groups_per_step=cfg.batch.groups_per_step)
    assert model.object_store_bytes() == b.per_step
