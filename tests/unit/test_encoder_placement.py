"""Where the text encoders run and live (issue 24, items 1 and 6).

- the prompt-cache warm-up encodes on the worker's device (offloaded encoders onloaded once),
  in bounded batches, each prompt once per shared cache directory (workers split the set),
  and every worker's host memory of embedding rows is bounded in bytes (backed by the disk);
- a request the cache serves moves no encoder; a nested ``onloaded`` block neither moves them
  again nor sends them back early;
- generating workers keep their text encoders resident unless ``digen.model.offload_text_encoders``
  (decided by the memory plan before Ray starts) says otherwise, and the memory plan charges what
  the workers then keep.

On CPU there is no second device, so the tests stand the meta device in for the worker's GPU:
the adapter's ``device`` is its transformer's (here on ``meta``), and ``onloaded`` moves the
offloaded modules to ``adapter.device`` by the same call that moves them to ``cuda`` on a GPU
worker. The recording encoder reports the device its own parameter is on when it runs. The
warm-up on a real GPU: tests/gpu/test_encoder_placement_gpu.py."""

from __future__ import annotations

import os

import pytest
import torch

from verl_digen.config.schema import ConfigError, DigenConfig, PromptCacheConfig
from verl_digen.models.base import DiffusionAdapter, onloaded
from verl_digen.models.prompt_cache import PromptEmbeddingCache
from verl_digen.trainer.warmup import cache_domains
from verl_digen.workers import prompt_warmup
from verl_digen.workers.prompt_warmup import finish, share_of, visible_nodes, warm_share, write_probe

PROMPTS = [f"prompt number {i}" for i in range(23)]
ROW = 16  # floats per prompt row


class _Encoder(torch.nn.Module):
    """A text encoder whose parameter really moves: to ``meta`` (the stand-in GPU) and back to an
    empty CPU tensor (meta holds no values to copy back; the output does not use them)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(ROW))
        self.moves: list[str] = []
        self.calls: list[tuple[str, int]] = []  # (device of the weight, rows) per call

    def to(self, device):  # type: ignore[override]
        device = torch.device(device)
        self.moves.append(device.type)
        return super().to(device) if device.type == "meta" else self.to_empty(device=device)

    def forward(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        self.calls.append((self.weight.device.type, len(prompts)))
        return {"prompt_embeds": torch.stack([torch.full((ROW,), float(len(p))) for p in prompts])}


class _Adapter:
    """The parts of a :class:`DiffusionAdapter` the cache and ``onloaded`` use; its transformer
    is on the meta device, which stands for the worker's GPU."""

    text_encoder_names = ("text_encoder",)
    text_encoders_released = False
    offloaded: tuple[str, ...] = ()
    offload_to_cpu = DiffusionAdapter.offload_to_cpu
    release_text_encoders = DiffusionAdapter.release_text_encoders
    compute_device = DiffusionAdapter.compute_device
    device = DiffusionAdapter.device

    def __init__(self, offload: bool = True) -> None:
        self.transformer = torch.nn.Linear(2, 2, device="meta")
        self.text_encoder = _Encoder()
        if offload:
            self.offload_to_cpu(("text_encoder",))
            self.text_encoder.moves.clear()

    def encode_prompts(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        return self.text_encoder(prompts)


def _cache(adapter, tmp_path, **kw) -> PromptEmbeddingCache:
    return PromptEmbeddingCache(adapter, model_key="k", cache_dir=str(tmp_path), **kw)


def test_a_digest_vouches_for_the_row_served_after_another_worker_replaced_it(tmp_path):
    """Two workers of one directory: this one digested a prompt's row, forgot the row (LRU), and
    another worker wrote its own encode of the prompt meanwhile. digest() must describe the row
    encode() now serves (the file's), not the one it served before: a trajectory carries it."""
    mine, other = _cache(_Adapter(offload=False), tmp_path, max_memory_items=1), _cache(_Adapter(offload=False), tmp_path)
    before = mine.digest(PROMPTS[0])
    different = {"prompt_embeds": torch.full((1, ROW), -1.0)}  # another encode of the same prompt
    other._store(PROMPTS[0], different)
    mine.encode([PROMPTS[1]])  # evicts this worker's row of PROMPTS[0]
    mine.encode([PROMPTS[0]])  # served from the file: the other worker's row (on the adapter's device)
    assert mine.digest(PROMPTS[0]) == other.digest(PROMPTS[0]) != before


# ---------------------------------------------------------------------- item 1: the warm-up


def test_warm_up_encodes_on_the_workers_device_in_bounded_batches(tmp_path):
    """Today's warm-up ran offloaded encoders where they were parked (the CPU) in one batch of
    every prompt: here every encoder call must see its weight on the adapter's device, hold at
    most encode_batch_size prompts, and the encoders must be moved there once and back after."""
    adapter = _Adapter()
    cache = _cache(adapter, tmp_path)
    out = warm_share(cache, PROMPTS, 0, 1, batch_size=5)
    enc = adapter.text_encoder
    assert out == {"share": len(PROMPTS), "encoded": len(PROMPTS)}
    assert [d for d, _ in enc.calls] == ["meta"] * 5  # ceil(23 / 5) calls, all on the device
    assert [n for _, n in enc.calls] == [5, 5, 5, 5, 3]
    assert enc.moves == ["meta", "cpu"]  # onloaded once for the whole warm-up
    assert enc.weight.device.type == "cpu"


def test_workers_encode_disjoint_shares_and_the_others_read_them(tmp_path):
    """Two workers sharing a cache directory: each prompt is encoded once in the run, not once
    per worker; finishing reads the other's rows (no encoder call) and releases the encoders."""
    a, b = _Adapter(), _Adapter()
    ca, cb = _cache(a, tmp_path), _cache(b, tmp_path)
    assert warm_share(ca, PROMPTS, 0, 2, batch_size=4)["encoded"] == 12
    assert warm_share(cb, PROMPTS, 1, 2, batch_size=4)["encoded"] == 11
    ea, eb = a.text_encoder, b.text_encoder
    calls_before = (len(ea.calls), len(eb.calls))
    for cache in (ca, cb):
        stats = finish(cache, PROMPTS, batch_size=4, release=True)
        assert stats["encoded_here"] == 0 and stats["released"]
    assert (len(ea.calls), len(eb.calls)) == calls_before
    assert sum(n for _, n in ea.calls + eb.calls) == len(PROMPTS)
    assert a.text_encoder is None and b.text_encoder is None  # released
    got = b.encode_prompts(PROMPTS[:3])["prompt_embeds"]  # served from the cache, a's share included
    assert got.shape == (3, ROW)


def test_share_of_splits_the_distinct_prompts():
    prompts = PROMPTS + PROMPTS[:4]  # repeats are one prompt
    shares = [share_of(prompts, i, 3) for i in range(3)]
    assert sorted(p for s in shares for p in s) == sorted(PROMPTS)
    assert max(map(len, shares)) - min(map(len, shares)) <= 1
    with pytest.raises(ValueError):
        share_of(prompts, 3, 3)


class _Method:
    """An actor method whose ``remote`` calls it at once (the warm-up's ray.get is the identity
    here): what a test of the driver's calls needs, without starting Ray for them."""

    def __init__(self, fn):
        self.remote = fn


class _WarmupWorker:
    def __init__(self, node: str, root: str) -> None:
        self.node, self.root, self.finished = node, root, None
        self.prompt_cache_probe = _Method(lambda token: write_probe(self.root, token, self.node))
        self.prompt_cache_peers = _Method(lambda token: visible_nodes(self.root, token))
        self.warm_prompt_cache = _Method(lambda prompts, i, n: {"encoded": len(share_of(prompts, i, n))})
        self.finish_prompt_cache = _Method(self._finish)

    def _finish(self, prompts, token, rows_shared=True):
        self.finished = rows_shared
        return {"encoded_here": 0, "memory_bytes": 0, "bytes_freed": 0, "released": True}


@pytest.mark.parametrize("shared", [True, False], ids=["one directory", "one per node"])
def test_the_warm_up_tells_every_worker_whether_its_cache_rows_are_the_runs(tmp_path, monkeypatch, shared):
    """One cache domain: the trainer reads the rollout's rows from its own cache. Several (a
    node-local directory on each node): each encodes the prompts apart, so every worker is told
    its rows are not shared and its trajectories carry their embeddings."""
    import ray

    from verl_digen.trainer.warmup import warm_prompt_caches

    monkeypatch.setattr(ray, "get", lambda refs, timeout=None: refs)
    roots = {"A": str(tmp_path / "a"), "B": str(tmp_path / ("a" if shared else "b"))}
    workers = {f"{n}{i}": _WarmupWorker(n, roots[n]) for n in "AB" for i in range(2)}
    record = warm_prompt_caches(workers, PROMPTS, timeout_s=5)
    assert record["domains"] == (1 if shared else 2) and record["embeddings_travel"] is not shared
    assert {w.finished for w in workers.values()} == {shared}


def test_cache_domains_follow_which_nodes_share_the_directory(tmp_path):
    """Nodes A and B mount one directory, node C has its own: A and B split the prompts, C
    encodes them all (each prompt once per directory), whatever node a worker is on."""
    shared, local = str(tmp_path / "shared"), str(tmp_path / "local")
    workers = {"a0": ("A", shared), "a1": ("A", shared), "b0": ("B", shared), "c0": ("C", local)}
    for node, root in workers.values():
        write_probe(root, "tok", node)
    seen = {w: tuple(visible_nodes(root, "tok")) for w, (_, root) in workers.items()}
    assert seen["a0"] == ("A", "B") and seen["c0"] == ("C",)
    assert cache_domains(seen) == [["a0", "a1", "b0"], ["c0"]]
    assert cache_domains({"x": (), "y": ()}) == [["x"], ["y"]]  # unwritable: each alone
    prompt_warmup.remove_probe(local, "tok", "C")
    assert not os.path.exists(os.path.join(local, prompt_warmup.PROBES, "tok"))


def test_host_memory_of_rows_is_bounded_in_bytes_and_backed_by_disk(tmp_path):
    """Every worker used to keep every embedding in host RAM; the byte bound keeps a few rows and
    the released cache still serves every prompt (from disk)."""
    row_bytes = ROW * 4
    adapter = _Adapter()
    cache = _cache(adapter, tmp_path, max_memory_bytes=3 * row_bytes)
    finish(cache, PROMPTS, batch_size=8, release=True)
    assert cache.stats()["memory_bytes"] <= 3 * row_bytes and cache.stats()["memory_items"] == 3
    out = adapter.encode_prompts(PROMPTS)["prompt_embeds"]
    assert out.shape == (len(PROMPTS), ROW)
    assert cache.stats()["memory_bytes"] <= 3 * row_bytes and cache.stats()["disk_hits"] >= len(PROMPTS) - 3


def test_open_cache_bounds_memory_by_the_config(tmp_path, tiny_dirs):
    from verl_digen.models.registry import load_adapter

    pc = PromptCacheConfig(enable=True, dir=str(tmp_path), max_host_mb=1.5)
    cache = prompt_warmup.open_cache(load_adapter(tiny_dirs["flux"]), tiny_dirs["flux"], pc)
    assert cache.max_memory_bytes == int(1.5 * 2**20) and cache.cache_dir == str(tmp_path)


@pytest.mark.parametrize("key, value", [("encode_batch_size", 0), ("encode_batch_size", 2.5), ("max_host_mb", -1)])
def test_bad_prompt_cache_knobs_name_the_key(key, value):
    cfg = DigenConfig()
    setattr(cfg.prompt_cache, key, value)
    with pytest.raises(ConfigError, match=f"digen.prompt_cache.{key}"):
        cfg.validate()


# ---------------------------------------------------------------------- item 6: no needless moves


def test_a_request_served_by_the_cache_moves_no_encoder(tmp_path):
    """With the cache installed (release_encoders=false), a step whose prompts are all cached
    must not move the encoders host <-> device; a miss moves them once, there and back."""
    from verl_digen.workers.sampling import _encoders_on_device

    adapter = _Adapter()
    cache = _cache(adapter, tmp_path)
    cache.warm(PROMPTS[:4])
    cache.install()
    adapter.text_encoder.moves.clear()
    with _encoders_on_device(adapter):  # begin_groups' block
        adapter.encode_prompts(PROMPTS[:4])
    assert adapter.text_encoder.moves == []
    with _encoders_on_device(adapter):
        adapter.encode_prompts(["a new prompt"])
    assert adapter.text_encoder.moves == ["meta", "cpu"]


def test_nested_onloaded_blocks_move_the_encoders_once():
    adapter = _Adapter()
    enc = adapter.text_encoder
    with onloaded(adapter, ("text_encoder",)):
        with onloaded(adapter, ("text_encoder",)):
            assert enc.weight.device.type == "meta"
        assert enc.weight.device.type == "meta"  # the inner block did not send it back
    assert enc.moves == ["meta", "cpu"]


def test_generating_roles_offload_their_encoders_only_when_decided(tmp_path):
    """Fused workers used to park the encoders on CPU whatever the memory allowed, so every
    generate call moved them both ways; now a generating role offloads them exactly when
    digen.model.offload_text_encoders is true, trainers always."""
    from verl_digen.workers.worker import ROLE_CAPABILITIES, offloaded_parts

    cfg = DigenConfig()
    for value, expect in (("false", ()), ("auto", ()), ("true", ("text_encoders",))):
        cfg.model.offload_text_encoders = value
        assert offloaded_parts(ROLE_CAPABILITIES["fused"], cfg) == expect
        assert offloaded_parts(ROLE_CAPABILITIES["rollout"], cfg) == expect
        assert offloaded_parts(ROLE_CAPABILITIES["trainer"], cfg) == ("text_encoders", "vae")
    cfg.model.offload_text_encoders = "sometimes"
    with pytest.raises(ConfigError, match="digen.model.offload_text_encoders"):
        cfg.validate()


# ---------------------------------------------------------------------- the memory plan


def _plan(*overrides: str, name: str = "flux_colocated"):
    from omegaconf import OmegaConf

    from verl_digen.config.compose import compose_config
    from verl_digen.config.schema import digen_config_from_dict
    from verl_digen.memory import plan_job

    configs = os.path.join(os.path.dirname(__file__), "..", "..", "configs")
    composed = compose_config(list(overrides), config_name=name, config_dir=configs)
    digen = digen_config_from_dict(OmegaConf.to_container(composed.digen, resolve=True))
    devices = composed.trainer.n_gpus_per_node
    return digen, devices, {p.role: p for p in plan_job(digen, devices_per_node=devices, nnodes=1)}


def _encoder_bytes(digen, devices) -> int:
    from verl_digen.memory.plan import _encoder_and_vae_bytes, job_shape

    return _encoder_and_vae_bytes(job_shape(digen, devices_per_node=devices, nnodes=1))[0]


@pytest.mark.parametrize("name, role", [("flux_colocated", "colocated"), ("qwen_image_disaggregated", "rollout")])
def test_the_plan_charges_the_encoders_where_the_generating_workers_keep_them(name, role):
    """Resident encoders are charged in every phase; offloaded ones only in an ``encode`` phase
    (the generate call's encode), and the workers offload exactly when the plan says so."""
    from verl_digen.workers.worker import ROLE_CAPABILITIES, offloaded_parts

    no_cache = "digen.prompt_cache.enable=false"
    resident_cfg, devices, resident = _plan(no_cache, "digen.model.offload_text_encoders=false", name=name)
    offloaded_cfg, _, offloaded = _plan(no_cache, "digen.model.offload_text_encoders=true", name=name)
    encoders = _encoder_bytes(resident_cfg, devices)
    assert encoders > 5 * 2**30
    res, off = resident[role].phases, offloaded[role].phases
    assert res["generate"]["encoders_vae"] - off["generate"]["encoders_vae"] == encoders
    assert "encode" not in res and off["encode"]["encoders_vae"] == off["generate"]["encoders_vae"] + encoders
    worker_role = "fused" if role == "colocated" else "rollout"
    assert "text_encoders" not in offloaded_parts(ROLE_CAPABILITIES[worker_role], resident_cfg)
    assert "text_encoders" in offloaded_parts(ROLE_CAPABILITIES[worker_role], offloaded_cfg)


def test_auto_keeps_the_encoders_resident_exactly_when_they_fit():
    from verl_digen.memory import decide_encoder_offload

    # checkpointing pinned: with auto, a smaller device could turn it on and move the peaks
    no_cache = ("digen.prompt_cache.enable=false", "digen.model.gradient_checkpointing=true")
    _, _, resident = _plan(*no_cache, "digen.model.offload_text_encoders=false")
    _, _, offloaded = _plan(*no_cache, "digen.model.offload_text_encoders=true")
    low, high = offloaded["colocated"].peak_gib, resident["colocated"].peak_gib
    assert low < high
    for gib, expect in ((high + 1, False), ((low + high) / 2, True)):
        digen, devices, _ = _plan(*no_cache, f"digen.memory.device_gib={gib}")
        assert digen.model.offload_text_encoders == "auto"
        assert decide_encoder_offload(digen, devices_per_node=devices) is expect
    digen, devices, _ = _plan("digen.prompt_cache.enable=true", f"digen.memory.device_gib={(low + high) / 2}")
    assert decide_encoder_offload(digen, devices_per_node=devices) is False  # released after the warm-up


def test_the_warm_up_phase_charges_the_batch_the_workers_encode():
    """The worker encodes digen.prompt_cache.encode_batch_size prompts per call (warm_share gets
    it from the config); the plan's warm phase activations scale with exactly that batch."""
    from verl_digen.memory.plan import _encoder_activation_bytes, job_shape

    small_cfg, devices, small = _plan("digen.prompt_cache.encode_batch_size=8")
    _, _, large = _plan("digen.prompt_cache.encode_batch_size=64")
    w8, w64 = small["colocated"].phases["warm"], large["colocated"].phases["warm"]
    assert w64["activations"] == 8 * w8["activations"] > 0
    job = job_shape(small_cfg, devices_per_node=devices, nnodes=1)
    assert w8["activations"] == _encoder_activation_bytes(job, 8)
    assert w8["encoders_vae"] >= _encoder_bytes(small_cfg, devices) and w8["optimizer"] == 0
    _, _, off = _plan("digen.prompt_cache.enable=false")
    assert "warm" not in off["colocated"].phases
