"""Prompt-embedding cache (verl_digen/models/prompt_cache.py) on the tiny models.

- the cache returns what a fresh ``encode_prompts`` returns, bit for bit, from memory and from
  disk in a fresh cache object (every architecture);
- a prompt's cached row is the row of the fresh encode that first produced it; a fresh encode of
  another batch composition equals it bitwise where the encoder is batch-invariant (FLUX, Wan,
  HunyuanVideo here) and within a few ulp where it is not (SD3, Qwen-Image);
- hit/miss/encode counters, model-key isolation, corrupted or foreign disk entries recomputed;
- ``release_text_encoders`` frees the encoders (bytes counted) and ``encode_prompts`` then raises;
  releasing needs every needed prompt warm, and a later miss names the prompt;
- the first training step (sampling + FlowGRPO micro-batch + optimizer step) with the cache gives
  the same LoRA weights as without (in process here; through a real run's workers:
  tests/e2e/test_prompt_cache_e2e.py)."""

from __future__ import annotations

import os

import pytest
import torch

from verl_digen.algos.window import SdeWindowConfig
from verl_digen.config.schema import AlgoConfig, LoraConfigSpec
from verl_digen.models.base import SampleSpec
from verl_digen.models.prompt_cache import PromptEmbeddingCache, model_cache_key, prompt_digest
from verl_digen.models.registry import load_adapter
from verl_digen.models.tiny import TINY_ARCHS
from verl_digen.workers.sampling import SamplingSettings, conditioning_from, sample_groups
from verl_digen.workers.training import PolicyUpdater, TrainSettings, add_lora

# Mixed lengths (Qwen-Image pads a batch to its longest prompt), an empty prompt and non-ASCII.
PROMPTS = [
    "a photo of a cat",
    "two blue birds sitting on a small boat under the dark sky",
    "",
    "a red cube on a table",
    "\u00fcn\u00efcode \u2713 prompt",
]
# Another composition of the same prompts: reordered, repeated, a smaller batch (3, not 5) whose
# longest prompt is shorter (Qwen-Image pads to it).
MIXED = [PROMPTS[3], PROMPTS[0], PROMPTS[3]]
MIXED_ROWS = [3, 0, 3]
# Whether a fresh encode gives a prompt the same row in any batch (measured on CPU, fp32, tiny
# models). Not SD3: its CLIP text projections run a GEMV for one prompt and GEMM kernels chosen by
# batch size otherwise (rows differ by ~1 ulp between some batch sizes); not Qwen-Image: it pads
# each batch to its longest prompt, so the attention lengths (and rounding) differ.
BATCH_INVARIANT = {"flux": True, "sd3": False, "qwen_image": False, "wan": True, "hunyuan_video": True}


def assert_bitwise(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        assert got[k].device == want[k].device, k
        assert torch.equal(got[k], want[k]), f"{k}: max |diff| {(got[k].double() - want[k].double()).abs().max()}"


def rows_of(cond: dict, idx: list[int]) -> dict:
    return {k: v[idx] for k, v in cond.items()}


# ---------------------------------------------------------------------- exactness


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_cache_returns_the_fresh_encode_bitwise(arch, adapters, tiny_dirs, tmp_path):
    adapter = adapters[arch]
    key = model_cache_key(tiny_dirs[arch], adapter)
    fresh = adapter.encode_prompts(PROMPTS)

    cache = PromptEmbeddingCache(adapter, model_key=key, cache_dir=str(tmp_path))
    assert_bitwise(cache.encode(PROMPTS), fresh)  # cold: the misses in one call
    assert_bitwise(cache.encode(PROMPTS), fresh)  # from memory
    s = cache.stats()
    assert (s["misses"], s["encode_calls"], s["memory_hits"], s["disk_hits"]) == (5, 1, 5, 0)

    # A fresh cache object on the same directory (what a new process sees): served from disk.
    again = PromptEmbeddingCache(adapter, model_key=key, cache_dir=str(tmp_path))
    assert_bitwise(again.encode(PROMPTS), fresh)
    s = again.stats()
    assert (s["disk_hits"], s["misses"], s["encode_calls"]) == (5, 0, 0)
    disk_only = PromptEmbeddingCache(adapter, model_key=key, cache_dir=str(tmp_path), max_memory_items=0)
    assert_bitwise(disk_only.encode(PROMPTS), fresh)
    assert disk_only.stats()["disk_hits"] == 5

    # Another batch composition: always the rows the fresh encode gave these prompts; and equal
    # to a fresh encode of that composition bitwise exactly when the encoder is batch-invariant.
    got = again.encode(MIXED)
    assert_bitwise(got, rows_of(fresh, MIXED_ROWS))
    reference = adapter.encode_prompts(MIXED)
    if BATCH_INVARIANT[arch]:
        assert_bitwise(got, reference)
    for k in reference:  # batch-variant encoders: as close as two fresh encodes are
        torch.testing.assert_close(got[k], reference[k], atol=1e-6, rtol=1e-6)


def test_repeated_prompts_are_encoded_once_and_memory_is_bounded(adapters, tiny_dirs, tmp_path):
    adapter = adapters["flux"]
    fresh = adapter.encode_prompts(PROMPTS)
    cache = PromptEmbeddingCache(adapter, model_key="k", cache_dir=str(tmp_path), max_memory_items=2)
    calls = []
    inner = cache._encode_fn
    cache._encode_fn = lambda prompts: calls.append(list(prompts)) or inner(prompts)

    negative = cache.encode([PROMPTS[2]] * 4)  # CFG's [negative] * n: one prompt encoded
    assert calls == [[PROMPTS[2]]]
    assert_bitwise(negative, rows_of(fresh, [2, 2, 2, 2]))
    assert cache.warm(PROMPTS) == 4 and calls[-1] == [p for p in PROMPTS if p != PROMPTS[2]]
    assert cache.warm(PROMPTS) == 0 and len(calls) == 2
    s = cache.stats()
    assert s["memory_items"] == 2 and s["disk_writes"] == 5 and s["encoded_prompts"] == 5
    # Evicted from memory (LRU of 2), read back from disk; nothing re-encoded.
    assert_bitwise(cache.encode(PROMPTS), fresh)
    assert len(calls) == 2 and cache.stats()["disk_hits"] >= 3
    assert cache.stats()["encode_seconds"] > 0

    memory_only = PromptEmbeddingCache(adapter, model_key="k", cache_dir=None)
    assert_bitwise(memory_only.encode(PROMPTS), fresh)
    assert_bitwise(memory_only.encode(PROMPTS[:2]), rows_of(fresh, [0, 1]))
    assert memory_only.stats()["memory_hits"] == 2 and memory_only.stats()["disk_writes"] == 0
    with pytest.raises(ValueError, match="at least one prompt"):
        memory_only.encode([])


def test_disk_layout_and_model_key_isolation(adapters, tiny_dirs, tmp_path):
    flux, sd3 = adapters["flux"], adapters["sd3"]
    key_flux = model_cache_key(tiny_dirs["flux"], flux)
    assert key_flux == model_cache_key(tiny_dirs["flux"], flux)  # stable
    assert key_flux != model_cache_key(tiny_dirs["sd3"], sd3)
    assert key_flux != model_cache_key(tiny_dirs["flux"])  # the adapter's settings count
    shorter = load_adapter(tiny_dirs["flux"])
    shorter.max_sequence_length = 8  # a different T5 length gives different embeddings
    assert model_cache_key(tiny_dirs["flux"], shorter) != key_flux

    cache = PromptEmbeddingCache(flux, model_key=key_flux, cache_dir=str(tmp_path))
    cache.encode(PROMPTS[:2])
    digest = prompt_digest(PROMPTS[0])
    assert os.path.isfile(tmp_path / key_flux / digest[:2] / f"{digest}.safetensors")
    assert not [f for _, _, files in os.walk(tmp_path) for f in files if f.startswith(".tmp-")]

    # Another model key in the same directory shares nothing, even for the same prompts.
    other = PromptEmbeddingCache(sd3, model_key="sd3-other", cache_dir=str(tmp_path))
    assert_bitwise(other.encode(PROMPTS[:2]), sd3.encode_prompts(PROMPTS[:2]))
    assert other.stats()["disk_hits"] == 0 and other.stats()["misses"] == 2
    # A flux entry copied under the sd3 key is refused (its metadata names flux's key).
    src = tmp_path / key_flux / digest[:2] / f"{digest}.safetensors"
    dst = tmp_path / "sd3-other" / digest[:2] / f"{digest}.safetensors"
    dst.write_bytes(src.read_bytes())
    fresh_other = PromptEmbeddingCache(sd3, model_key="sd3-other", cache_dir=str(tmp_path))
    with pytest.warns(RuntimeWarning, match="model_key"):
        assert_bitwise(fresh_other.encode(PROMPTS[:1]), sd3.encode_prompts(PROMPTS[:1]))
    assert fresh_other.stats()["disk_rejects"] == 1

    # A changed tokenizer file changes the key.
    import shutil

    copy = tmp_path / "flux-copy"
    shutil.copytree(tiny_dirs["flux"], copy)
    same = model_cache_key(str(copy))
    with open(copy / "tokenizer_2" / "tokenizer_config.json", "a") as f:
        f.write("\n")
    assert model_cache_key(str(copy)) != same
    with pytest.raises(ValueError, match="model_key"):
        PromptEmbeddingCache(flux, model_key="../escape", cache_dir=str(tmp_path))


def test_corrupted_or_foreign_disk_entries_are_recomputed(adapters, tmp_path):
    adapter = adapters["flux"]
    fresh = adapter.encode_prompts(PROMPTS)
    PromptEmbeddingCache(adapter, model_key="k", cache_dir=str(tmp_path)).encode(PROMPTS)

    def path(prompt):
        d = prompt_digest(prompt)
        return tmp_path / "k" / d[:2] / f"{d}.safetensors"

    data = path(PROMPTS[0]).read_bytes()
    path(PROMPTS[0]).write_bytes(data[:-3] + bytes(b ^ 0xFF for b in data[-3:]))  # flipped tensor bytes
    path(PROMPTS[1]).write_bytes(path(PROMPTS[1]).read_bytes()[:50])  # truncated
    path(PROMPTS[2]).write_bytes(b"not a safetensors file")
    path(PROMPTS[3]).write_bytes(path(PROMPTS[4]).read_bytes())  # another prompt's entry (a "collision")

    cache = PromptEmbeddingCache(adapter, model_key="k", cache_dir=str(tmp_path))
    with pytest.warns(RuntimeWarning, match="recomputing"):
        got = cache.encode(PROMPTS)
    assert_bitwise(got, fresh)
    s = cache.stats()
    assert (s["disk_rejects"], s["misses"], s["disk_hits"], s["encode_calls"]) == (4, 4, 1, 1)
    # The bad files were rewritten: a new cache reads all five back.
    again = PromptEmbeddingCache(adapter, model_key="k", cache_dir=str(tmp_path))
    assert_bitwise(again.encode(PROMPTS), fresh)
    assert again.stats()["disk_hits"] == 5 and again.stats()["disk_rejects"] == 0


# ---------------------------------------------------------------------- releasing the encoders


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_release_text_encoders_frees_their_bytes(arch, tiny_dirs):
    adapter = load_adapter(tiny_dirs[arch])
    modules = [v for k, v in vars(adapter).items() if k.startswith("text_encoder") and v is not None]
    expected = sum(t.numel() * t.element_size() for m in modules for t in (*m.parameters(), *m.buffers()))
    assert expected > 0
    assert adapter.release_text_encoders() == expected
    for name in ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2", "text_encoder_3", "tokenizer_3"):
        assert getattr(adapter, name, None) is None
    with pytest.raises(RuntimeError, match="text encoders were released; use the prompt cache"):
        adapter.encode_prompts(["a cat"])
    assert adapter.release_text_encoders() == 0  # nothing left to free


def test_release_needs_warm_prompts_and_a_later_miss_names_the_prompt(tiny_dirs, tmp_path):
    adapter = load_adapter(tiny_dirs["sd3"])
    fresh = adapter.encode_prompts(PROMPTS[:3])
    cache = PromptEmbeddingCache(adapter, model_key="k", cache_dir=str(tmp_path))
    with pytest.raises(RuntimeError, match="warm"):
        cache.release_encoders()
    cache.warm(PROMPTS[:3])
    with pytest.raises(RuntimeError, match="not cached, e.g. 'a red cube on a table'"):
        cache.release_encoders(needed=PROMPTS[:4])
    assert not adapter.text_encoders_released
    tiny = PromptEmbeddingCache(adapter, model_key="k", cache_dir=None, max_memory_items=2)
    tiny.warm(PROMPTS[:3])
    with pytest.raises(RuntimeError, match="do not fit"):
        tiny.release_encoders()

    assert cache.release_encoders() > 0
    assert cache.stats()["released"] and cache.stats()["bytes_freed"] > 0
    assert_bitwise(cache.encode(PROMPTS[:3]), fresh)
    with pytest.raises(RuntimeError, match=r"prompt 'a red cube on a table' \(and 1 more\) is not cached"):
        cache.encode([PROMPTS[0], PROMPTS[3], PROMPTS[4]])
    # A new cache on the same directory serves the warm prompts without any encoder.
    again = PromptEmbeddingCache(adapter, model_key="k", cache_dir=str(tmp_path))
    assert_bitwise(again.encode(PROMPTS[:3]), fresh)
    with pytest.raises(RuntimeError, match="'a red cube on a table'"):
        again.encode([PROMPTS[3]])


# ---------------------------------------------------------------------- the first training step


TRAIN_PROMPTS = ["a red apple", "a blue car", "a cute dog", "a green tree", "a white horse", "a small boat"]
NEGATIVE = "blurry"


def _first_step(adapter, settings):
    """Sample 2 groups of 2, train one micro-batch, take the optimizer step; the updated LoRA."""
    groups = [1, 4]
    data = sample_groups(
        adapter, [TRAIN_PROMPTS[g] for g in groups], groups, groups,
        group_size=2, settings=settings, training_step=0, seed=7, policy_version=0,
    )
    updater = PolicyUpdater(
        adapter, TrainSettings(algo=AlgoConfig(lr=3e-4), sampling=settings, lora_only=True, images_per_step=len(data))
    )
    updater.train_micro_batch(data, torch.tensor([1.0, -1.0, 0.5, -0.5]))
    updater.optimizer_step()
    lora = {n: p.detach().clone() for n, p in adapter.transformer.named_parameters() if "lora_" in n}
    return data, lora


@pytest.mark.parametrize("arch", ["flux", "sd3"])
def test_first_step_update_is_the_same_with_the_cache(arch, tiny_dirs, tmp_path):
    settings = SamplingSettings(
        spec=SampleSpec(height=32, width=32, guidance_scale=4.5),  # true CFG: the negative prompt too
        num_steps=4,
        noise_level=0.7,
        sde_type="sde",
        window=SdeWindowConfig(mode="fixed", start=1, size=2),
        timestep_fraction=1.0,
        negative_prompt=NEGATIVE,
    )
    plain = load_adapter(tiny_dirs[arch])
    add_lora(plain, LoraConfigSpec(rank=4))
    initial = {n: p.detach().clone() for n, p in plain.transformer.named_parameters() if "lora_" in n}
    data_plain, lora_plain = _first_step(plain, settings)

    cached = load_adapter(tiny_dirs[arch])
    add_lora(cached, LoraConfigSpec(rank=4))
    cache = PromptEmbeddingCache(
        cached, model_key=model_cache_key(tiny_dirs[arch], cached), cache_dir=str(tmp_path)
    )
    cache.warm(TRAIN_PROMPTS + [NEGATIVE])  # the whole prompt set in one call, before training
    assert cache.release_encoders() > 0
    # install() shadows cached.encode_prompts with cache.encode on this instance: the rollout
    # worker plugs the cache in exactly so (begin_groups calls adapter.encode_prompts), so the
    # sampling and training code below is the unchanged production path. The cache keeps the
    # adapter's own encoder, which is released here: any encode would raise.
    cache.install()
    data_cached, lora_cached = _first_step(cached, settings)
    s = cache.stats()
    # 2 prompts + the negative, served to the rollout and again to the trainer (the record carries
    # no embeddings: the trainer reads them from its cache, here the same one)
    assert s["encode_calls"] == 1 and s["misses"] == 7 and s["hits"] == 6

    leaves = sorted(data_cached.batch.keys(include_nested=True, leaves_only=True), key=str)
    # with a cache no embeddings travel: the trainer reads them from its own cache by prompt
    text = sorted(k for k in data_plain.batch.keys(include_nested=True, leaves_only=True) if k[0] in ("cond", "neg"))
    assert sorted(data_plain.batch.keys(include_nested=True, leaves_only=True), key=str) == sorted(leaves + text, key=str)
    cond, neg = conditioning_from(data_cached, cached)
    served = {("cond", k): v for k, v in cond.items()} | {("neg", k): v for k, v in neg.items()}
    assert sorted(served) == text
    assert any(not torch.equal(lora_plain[n], initial[n]) for n in initial)  # the step did update
    if BATCH_INVARIANT[arch]:
        # FLUX: the cached embeddings (warmed in a batch of 7) are the fresh ones bit for bit, so
        # the whole step is: trajectories, log-probs and the updated LoRA weights.
        for k in leaves:
            assert torch.equal(data_cached.batch[k], data_plain.batch[k]), k
        for k in text:
            assert torch.equal(served[k], data_plain.batch[k]), k
        for n in lora_plain:
            assert torch.equal(lora_cached[n], lora_plain[n]), n
    else:
        # SD3: a fresh encode of the 2 step prompts differs from their rows in the warm batch of
        # 7 by ~1 ulp (batch-size-dependent CLIP projection kernels), with or without the cache;
        # the update agrees to that rounding.
        for k in (("cond", "prompt_embeds"), ("cond", "pooled_prompt_embeds"), ("neg", "pooled_prompt_embeds")):
            torch.testing.assert_close(served[k], data_plain.batch[k], atol=1e-6, rtol=1e-6)
        # Adam's first update is ~lr x sign(gradient), so that rounding reaches the weights
        # (1.5e-6 on the AMD EPYC CI machine); it stays under 1% of the update itself.
        update = max(float((lora_plain[n] - initial[n]).abs().max()) for n in lora_plain)
        apart = max(float((lora_cached[n] - lora_plain[n]).abs().max()) for n in lora_plain)
        assert apart < 1e-2 * update, (apart, update)
