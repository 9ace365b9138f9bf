"""Model adapters on the tiny models.

Every architecture (FLUX, SD3, Qwen-Image, Wan2.1, HunyuanVideo): save/load round trip, seeded
builds, bf16 loading, shapes, schedules, CFG, gradients, decoding, a deterministic Euler loop,
registry errors and the tiny-model CLI. FLUX and SD3 specifics: tokenizers, resolution shift,
distilled guidance, parity with the diffusers pipelines, the tiny-model cache. The other
architectures' specifics are in test_models_video.py."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from verl_digen.models import ADAPTERS, SampleSpec, detect_arch, load_adapter
from verl_digen.models.tiny import TINY_ARCHS, TINY_VERSION, build_tiny, ensure_tiny

from runs import PIXEL_SHAPE, PROMPTS, SPECS, euler_sample

pytestmark = pytest.mark.usefixtures("one_thread")

ARCHS = ["flux", "sd3"]  # this file's architecture-specific tests
VIDEO_ARCHS = ["wan", "hunyuan_video"]
# B=2 at SPECS (32x32 pixels: 16x16 latents; videos 5 frames).
LATENT_SHAPE = {
    "flux": (2, 64, 16),  # packed 2x2 patches of 4-channel 16x16 latents
    "sd3": (2, 4, 16, 16),
    "qwen_image": (2, 64, 16),  # packed like FLUX
    "wan": (2, 4, 3, 16, 16),  # temporal factor 2: 5 frames -> 3 latent frames
    "hunyuan_video": (2, 4, 2, 16, 16),  # temporal factor 4: 5 frames -> 2 latent frames
}
PIPELINE_CLASS = {
    "flux": "FluxPipeline",
    "sd3": "StableDiffusion3Pipeline",
    "qwen_image": "QwenImagePipeline",
    "wan": "WanPipeline",
    "hunyuan_video": "HunyuanVideoPipeline",
}


# ---------------------------------------------------------------------- build / load (every arch)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_tiny_dir_layout_and_detection(arch, tiny_dirs):
    with open(os.path.join(tiny_dirs[arch], "model_index.json")) as f:
        assert json.load(f)["_class_name"] == PIPELINE_CLASS[arch]
    assert detect_arch(tiny_dirs[arch]) == arch
    assert isinstance(ADAPTERS[arch], type) and ADAPTERS[arch].arch == arch


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_roundtrip_weights_equal_saved(arch, tiny_dirs, adapters):
    saved = load_file(os.path.join(tiny_dirs[arch], "transformer", "diffusion_pytorch_model.safetensors"))
    loaded = adapters[arch].transformer.state_dict()
    assert set(saved) <= set(loaded)
    for name, tensor in saved.items():
        assert torch.equal(loaded[name], tensor), name
    n_params = sum(p.numel() for p in adapters[arch].transformer.parameters())
    assert 1_000 <= n_params <= 300_000


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_second_load_predicts_identical_velocity(arch, tiny_dirs, adapters):
    spec = SPECS[arch]
    again = load_adapter(tiny_dirs[arch], arch)
    latents = adapters[arch].prepare_latents(2, spec, torch.Generator().manual_seed(1))
    sigma = torch.tensor([0.9, 0.4])
    with torch.no_grad():
        v1 = adapters[arch].predict_velocity(latents, sigma, adapters[arch].encode_prompts(PROMPTS), spec)
        v2 = again.predict_velocity(latents, sigma, again.encode_prompts(PROMPTS), spec)
    assert torch.equal(v1, v2)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_bf16_load_returns_fp32(arch, tiny_dirs):
    spec = SPECS[arch]
    adapter = load_adapter(tiny_dirs[arch], dtype=torch.bfloat16)
    assert adapter.transformer.dtype == torch.bfloat16
    latents = adapter.prepare_latents(2, spec, torch.Generator().manual_seed(0))
    with torch.no_grad():
        velocity = adapter.predict_velocity(latents, torch.tensor([0.6, 0.3]), adapter.encode_prompts(PROMPTS), spec)
        pixels = adapter.decode(latents, spec)
    assert velocity.dtype == pixels.dtype == torch.float32
    assert torch.isfinite(velocity).all()


@pytest.mark.parametrize("arch", ["flux", "wan"])
def test_build_is_seeded(arch, tmp_path, tiny_dirs):
    same = build_tiny(arch, str(tmp_path / "same"), seed=0)
    other = build_tiny(arch, str(tmp_path / "other"), seed=1)
    weights = "transformer/diffusion_pytorch_model.safetensors"
    ref = load_file(os.path.join(tiny_dirs[arch], weights))
    same_w, other_w = load_file(os.path.join(same, weights)), load_file(os.path.join(other, weights))
    assert all(torch.equal(ref[k], same_w[k]) for k in ref)
    assert not all(torch.equal(ref[k], other_w[k]) for k in ref)


@pytest.mark.parametrize("arch", ARCHS)
def test_tokenizers_reload_and_separate_prompts(arch, adapters):
    adapter = adapters[arch]
    # The saved tokenizers know common prompt words, so short prompts fit the 16-token window.
    assert adapter.tokenizer.tokenize("a photo of a cat") == ["a</w>", "photo</w>", "of</w>", "a</w>", "cat</w>"]
    t5 = adapter.tokenizer_2 if arch == "flux" else adapter.tokenizer_3
    assert len(t5.tokenize("a red cube on a table")) == 6
    cond = adapter.encode_prompts(["a red cube", "a blue cube", "ünïcode ✓ prompt"])
    for tensor in cond.values():
        assert torch.isfinite(tensor).all()
        assert not torch.equal(tensor[0], tensor[1])


# ---------------------------------------------------------------------- shapes and schedule


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_shapes(arch, adapters):
    adapter, spec = adapters[arch], SPECS[arch]
    cond = adapter.encode_prompts(PROMPTS)
    for tensor in cond.values():
        assert tensor.shape[0] == 2  # batch-first
    latents = adapter.prepare_latents(2, spec, torch.Generator().manual_seed(0))
    assert latents.shape == LATENT_SHAPE[arch] and latents.dtype == torch.float32
    with torch.no_grad():
        velocity = adapter.predict_velocity(latents, torch.tensor([1.0, 0.5]), cond, spec)
        pixels = adapter.decode(latents, spec)
    assert velocity.shape == latents.shape and velocity.dtype == torch.float32
    assert pixels.shape == PIXEL_SHAPE[arch] and pixels.dtype == torch.float32
    # A non-square size (and, for Wan, another frame count) goes through as well.
    frames = 3 if arch == "wan" else 1
    other = SampleSpec(height=16, width=48, num_frames=frames)
    latents = adapter.prepare_latents(1, other, torch.Generator().manual_seed(0))
    with torch.no_grad():
        velocity = adapter.predict_velocity(latents, torch.tensor([0.5]), adapter.encode_prompts(["x"]), other)
        expected = (1, 3, frames, 16, 48) if arch in VIDEO_ARCHS else (1, 3, 16, 48)
        assert adapter.decode(velocity, other).shape == expected


@pytest.mark.parametrize("arch", ARCHS)
def test_bad_image_size_is_rejected(arch, adapters):
    with pytest.raises(ValueError, match="divisible"):
        adapters[arch].prepare_latents(1, SampleSpec(height=30, width=32), torch.Generator())


@pytest.mark.parametrize("arch", TINY_ARCHS)
@pytest.mark.parametrize("num_steps", [1, 4, 10])
def test_sigmas(arch, num_steps, adapters):
    sigmas = adapters[arch].sigmas(num_steps, SPECS[arch])
    assert sigmas.shape == (num_steps + 1,) and sigmas.dtype == torch.float32
    assert torch.all(sigmas[1:] < sigmas[:-1])
    # 1, or 1 - 1e-6 for Wan2.1's UniPC multistep scheduler (diffusers keeps its log(alpha) finite)
    assert sigmas[0].item() == pytest.approx(1.0, abs=2e-6)
    assert sigmas[-1].item() == 0.0


def test_flux_sigmas_use_resolution_shift(adapters):
    # More image tokens -> larger mu -> more time spent at high noise.
    small = adapters["flux"].sigmas(4, SampleSpec(32, 32))
    large = adapters["flux"].sigmas(4, SampleSpec(256, 256))
    assert torch.all(large[1:-1] > small[1:-1])


# ---------------------------------------------------------------------- guidance, grads, pixels


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_cfg_runs_and_differs(arch, adapters):
    adapter, spec = adapters[arch], SPECS[arch]
    cond, negative = adapter.encode_prompts(PROMPTS), adapter.encode_prompts([""])
    latents = adapter.prepare_latents(2, spec, torch.Generator().manual_seed(0))
    sigma = torch.tensor([0.8, 0.8])
    cfg_spec = dataclasses.replace(spec, guidance_scale=4.0)
    with torch.no_grad():
        plain = adapter.predict_velocity(latents, sigma, cond, spec)
        cfg = adapter.predict_velocity(latents, sigma, cond, cfg_spec, negative)
        # Scale 1 means no CFG even with a negative prompt.
        scale_one = adapter.predict_velocity(latents, sigma, cond, spec, negative)
    assert cfg.shape == plain.shape
    assert not torch.allclose(cfg, plain, atol=1e-4)
    assert torch.equal(scale_one, plain)


def test_flux_distilled_guidance_changes_velocity(adapters):
    adapter = adapters["flux"]
    cond = adapter.encode_prompts(PROMPTS)
    latents = adapter.prepare_latents(2, SPECS["flux"], torch.Generator().manual_seed(0))
    sigma = torch.tensor([0.5, 0.5])
    with torch.no_grad():
        low = adapter.predict_velocity(latents, sigma, cond, SampleSpec(32, 32, distilled_guidance=1.0))
        high = adapter.predict_velocity(latents, sigma, cond, SampleSpec(32, 32, distilled_guidance=5.0))
    assert not torch.allclose(low, high, atol=1e-5)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_velocity_is_differentiable(arch, adapters):
    adapter, spec = adapters[arch], SPECS[arch]
    latents = adapter.prepare_latents(1, spec, torch.Generator().manual_seed(0))
    velocity = adapter.predict_velocity(latents, torch.tensor([0.7]), adapter.encode_prompts(PROMPTS[:1]), spec)
    velocity.square().mean().backward()
    grads = [p.grad for p in adapter.transformer.parameters() if p.grad is not None]
    assert grads and any(g.abs().sum() > 0 for g in grads)
    adapter.transformer.zero_grad(set_to_none=True)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_decode_in_unit_range(arch, adapters):
    spec = SPECS[arch]
    latents = 3.0 * adapters[arch].prepare_latents(2, spec, torch.Generator().manual_seed(0))
    with torch.no_grad():
        pixels = adapters[arch].decode(latents, spec)
    assert pixels.min() >= 0.0 and pixels.max() <= 1.0
    assert pixels.std() > 1e-3  # the random decoder does not collapse to a constant
    if arch in VIDEO_ARCHS:  # frames differ from one another
        assert not torch.allclose(pixels[:, :, 0], pixels[:, :, -1], atol=1e-3)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_euler_loop_is_deterministic(arch, adapters):
    spec = SPECS[arch]
    first = euler_sample(adapters[arch], PROMPTS, spec, num_steps=3, seed=7)
    second = euler_sample(adapters[arch], PROMPTS, spec, num_steps=3, seed=7)
    other_seed = euler_sample(adapters[arch], PROMPTS, spec, num_steps=3, seed=8)
    assert torch.equal(first, second)
    assert not torch.equal(first, other_seed)


@pytest.mark.parametrize("arch", ARCHS)
def test_matches_diffusers_pipeline(arch, tiny_dirs, adapters):
    """Our Euler loop reproduces the diffusers pipeline's images from the same generator seed."""
    from diffusers import FluxPipeline, StableDiffusion3Pipeline

    adapter = adapters[arch]
    common = dict(height=32, width=32, num_inference_steps=4, output_type="pt", max_sequence_length=16)
    if arch == "flux":
        pipe = FluxPipeline.from_pretrained(tiny_dirs[arch])
        # Distilled guidance 3.5 plus true CFG against the empty prompt.
        kwargs = dict(guidance_scale=3.5, true_cfg_scale=2.0, negative_prompt="")
        spec = SampleSpec(32, 32, guidance_scale=2.0, distilled_guidance=3.5)
    else:
        pipe = StableDiffusion3Pipeline.from_pretrained(tiny_dirs[arch])
        kwargs = dict(guidance_scale=2.0)  # CFG against the empty prompt, the pipeline's default
        spec = SampleSpec(32, 32, guidance_scale=2.0)
    pipe.set_progress_bar_config(disable=True)
    expected = pipe(PROMPTS, generator=torch.Generator().manual_seed(3), **common, **kwargs).images
    ours = euler_sample(adapter, PROMPTS, spec, num_steps=4, seed=3, negative_prompt="")
    assert ours.shape == expected.shape
    torch.testing.assert_close(ours, expected.float(), atol=1e-5, rtol=0)


# ---------------------------------------------------------------------- registry errors


def test_missing_path_raises(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_adapter(str(tmp_path / "nope"))


def test_missing_model_index_raises(tmp_path):
    with pytest.raises(FileNotFoundError, match="model_index.json"):
        load_adapter(str(tmp_path), "flux")


def test_unknown_arch_raises(tiny_dirs):
    with pytest.raises(ValueError, match=r"unknown model arch 'unet'.*flux, sd3, qwen_image, wan, hunyuan_video"):
        load_adapter(tiny_dirs["flux"], "unet")


def test_unsupported_pipeline_raises(tmp_path):
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionPipeline"}))
    with pytest.raises(ValueError, match="unsupported pipeline class 'StableDiffusionPipeline'"):
        load_adapter(str(tmp_path))


@pytest.mark.parametrize(("saved", "requested"), [("sd3", "flux"), ("wan", "hunyuan_video")])
def test_arch_mismatch_raises(saved, requested, tiny_dirs):
    with pytest.raises(ValueError, match="does not match"):
        load_adapter(tiny_dirs[saved], requested)


# ---------------------------------------------------------------------- cache and CLI


def test_ensure_tiny_builds_once(tmp_path, monkeypatch):
    import verl_digen.models.tiny as tiny

    monkeypatch.setenv("VERL_DIGEN_CACHE", str(tmp_path))
    path = ensure_tiny("sd3")
    assert path == str(tmp_path / "tiny" / f"sd3-{TINY_VERSION}")
    assert os.path.isfile(os.path.join(path, "model_index.json"))
    assert [p for p in os.listdir(tmp_path / "tiny")] == [f"sd3-{TINY_VERSION}"]  # no temp dirs left behind

    def no_rebuild(*args, **kwargs):
        raise AssertionError("ensure_tiny rebuilt a cached model")

    monkeypatch.setattr(tiny, "build_tiny", no_rebuild)
    assert ensure_tiny("sd3") == path
    with pytest.raises(ValueError, match="unknown tiny arch"):
        ensure_tiny("unet")


def test_cli_writes_loadable_dir(tmp_path, run_as_main):
    out = tmp_path / "cli_flux"
    status, stdout, stderr = run_as_main("verl_digen.models.tiny", "--arch", "flux", "--out", str(out))
    assert status == 0, stderr
    assert stdout.strip().splitlines()[-1] == str(out)
    assert load_adapter(str(out)).arch == "flux"


def test_cli_main_writes_a_loadable_qwen_image_dir(tmp_path, capsys):
    """The same command's main() for a second family."""
    from verl_digen.models.tiny import main

    out = tmp_path / "cli_qwen_image"
    main(["--arch", "qwen_image", "--out", str(out)])
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(out)
    assert load_adapter(str(out)).arch == "qwen_image"


def test_import_is_light():
    code = "import sys, verl_digen.models; assert 'diffusers' not in sys.modules, 'diffusers imported'"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr


def test_the_worker_encodes_prompts_to_the_configured_text_length(tiny_dirs, monkeypatch):
    """``digen.model.max_sequence_length`` (veRL-Omni's ``rollout.pipeline.max_sequence_length``)
    reaches the adapter a worker loads: prompts are encoded to that many T5 tokens."""
    from verl_digen.config import digen_config_from_dict
    from verl_digen.workers.worker import ROLE_CAPABILITIES, DiffusionWorker

    for key, value in {"WORLD_SIZE": "1", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(key, value)
    lengths = {}
    for length in (None, 24):
        cfg = digen_config_from_dict({"placement": "disaggregated", "model": {"arch": "flux", "max_sequence_length": length}})
        worker = DiffusionWorker("rollout", cfg, tiny_dirs["flux"])
        worker._load_policy(ROLE_CAPABILITIES["rollout"])
        embeds = worker.adapter.encode_prompts(["a photo of a cat"])
        lengths[length] = (worker.adapter.max_sequence_length, embeds["prompt_embeds"].shape[1])
    assert lengths[24] == (24, 24)
    assert lengths[None][0] == lengths[None][1] != 24  # the tiny tokenizer's default


@pytest.mark.parametrize("arch", ["flux", "sd3", "qwen_image", "wan", "hunyuan_video"])
def test_prompt_token_counts_read_the_prompt_as_the_text_encoder_does(arch, tiny_dirs):
    """veRL's data.max_prompt_length counts these: the length tokenizer's tokens, with the chat
    template of the families whose pipelines apply one (Qwen-Image, HunyuanVideo)."""
    from transformers import AutoTokenizer

    from verl_digen.models.registry import ADAPTERS

    cls = ADAPTERS[arch]
    short, long = "a cat", "a red cube on a table beside a green sphere"
    counts = cls.prompt_token_counts(tiny_dirs[arch], [short, long])
    plain = AutoTokenizer.from_pretrained(tiny_dirs[arch], subfolder=cls.length_tokenizer)(short)["input_ids"]
    assert counts[0] < counts[1]
    if arch in ("qwen_image", "hunyuan_video"):
        assert counts[0] > len(plain) + 5  # the template's tokens count
    else:
        assert counts[0] == len(plain)


def test_under_fsdp2_host_offload_the_adapter_computes_on_the_workers_device(monkeypatch, tiny_dirs):
    """digen.fsdp.param_offload keeps the shards on the host and FSDP2 computes each unit on the
    GPU (its root moves the inputs there), so sampling's and training's own tensors (latents,
    noise, sigmas, the SDE maths) must go to the worker's device, not to the parameters' (an H100
    run failed on cuda:0 vs cpu in the SDE step). The device is a stand-in here: ``compute_device``
    answers ``meta`` (any device other than the parameters'), and the process group and the
    sharding are left out (the two-rank gloo offload test in test_fsdp_e2e.py runs them); what is
    checked is where the worker tells the adapter to compute."""
    import verl_digen.workers.worker as worker_mod
    from verl_digen.config import digen_config_from_dict
    from verl_digen.workers.worker import ROLE_CAPABILITIES, DiffusionWorker

    for key, value in {"WORLD_SIZE": "1", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(key, value)
    devices = {}
    for offload in (False, True):
        cfg = digen_config_from_dict({"placement": "colocated", "model": {"arch": "flux"},
                                      "fsdp": {"enable": True, "param_offload": offload}})
        worker = DiffusionWorker("fused", cfg, tiny_dirs["flux"])
        worker._load_policy(ROLE_CAPABILITIES["fused"])
        with monkeypatch.context() as m:
            m.setattr(worker, "_join_trainer_group", lambda: None)
            m.setattr(worker, "_shard_for_training", lambda: None)
            m.setattr(worker_mod, "compute_device", lambda: torch.device("meta"))
            worker._prepare_training()
        params = {p.device.type for p in worker.adapter.transformer.parameters()}
        devices[offload] = (worker.adapter.device.type, params)
    assert devices[False] == ("cpu", {"cpu"})  # without the offload: where the parameters are
    assert devices[True] == ("meta", {"cpu"})  # with it: the worker's device, shards on the host


def test_rank_0_waits_for_a_rendezvous_port_in_use_and_names_one_held_too_long(monkeypatch):
    """veRL picks MASTER_PORT when it creates rank 0 and the ranks bind it only at init_model: on
    a busy machine the port can be taken meanwhile (a CI run failed with EADDRINUSE). Rank 0 waits
    for a port held for a moment and joins; a port held throughout is an error naming it. A real
    gloo process group of one in this process (destroyed again: the default group can be made
    anew after that; a fresh interpreter cost seconds of the fast lane), a real socket holding the
    port."""
    import socket
    import threading
    import time

    import torch.distributed as dist

    from verl_digen.workers.worker import init_process_group_retrying

    assert not dist.is_initialized()
    held, timers = [], []

    def hold(seconds):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        held.append(sock)
        if seconds is not None:
            timers.append(threading.Timer(seconds, sock.close))
            timers[-1].start()
        return sock.getsockname()[1]

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    try:
        monkeypatch.setenv("MASTER_PORT", str(hold(1.5)))  # in use when rank 0 first tries, free a moment later
        t0 = time.monotonic()
        init_process_group_retrying(attempts=20, wait_s=0.25, backend="gloo", rank=0, world_size=1)
        try:
            joined = (dist.get_world_size(), round(time.monotonic() - t0, 1) >= 1.0)
        finally:
            dist.destroy_process_group()
        assert joined == (1, True), joined
        port = hold(None)  # held throughout
        monkeypatch.setenv("MASTER_PORT", str(port))
        with pytest.raises(RuntimeError) as refused:
            init_process_group_retrying(attempts=3, wait_s=0.1, backend="gloo", rank=0, world_size=1)
        assert not dist.is_initialized()
    finally:
        for timer in timers:
            timer.join()
        for sock in held:
            sock.close()
    message = str(refused.value)
    assert message.startswith(f"the trainer ranks' rendezvous port MASTER_PORT={port} ") and "stayed in use" in message, message


def test_the_trainer_rendezvous_listens_on_a_port_the_os_assigned_and_the_other_ranks_meet_there(monkeypatch):
    """Rank 0's store binds a port the OS assigns (so nothing can take it between choosing and
    binding, as with veRL's MASTER_PORT); a rank given that port reaches it over real TCP; a rank
    given none falls back to MASTER_PORT (None)."""
    from verl_digen.workers.worker import rendezvous_store

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    master = rendezvous_store(rank=0, world_size=2, port=None, timeout_s=30)
    assert master.port > 0
    other = rendezvous_store(rank=1, world_size=2, port=master.port, timeout_s=30)
    other.set("from_rank_1", "hello")
    assert master.get("from_rank_1") == b"hello"
    assert rendezvous_store(rank=1, world_size=2, port=None, timeout_s=30) is None
