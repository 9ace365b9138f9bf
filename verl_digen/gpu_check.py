"""``python -m verl_digen.gpu_check``: one command that checks a CUDA machine and writes one JSON report.

Parts (``--parts``, all by default on a CUDA machine), each isolated (a failure is recorded with
its traceback and the next part runs) and the report rewritten after each one, so a run stopped
by a time limit still leaves what it measured:

* ``versions``: Python, torch, CUDA, the device, veRL, diffusers, transformers, peft, ray, and
  ``python -m verl_digen.doctor``;
* ``pytest_gpu``: ``pytest -m gpu`` (the device-only tests) and its summary line;
* ``flux_phases``: FLUX.1 at real size from the shipped configs with random weights (bf16,
  LoRA r32, activation checkpointing, 8 samples of 512 x 512, 16 steps, the ``flux_colocated``
  preset's guidance): seconds and ``torch.cuda.max_memory_allocated`` of every phase (encode,
  generate, decode, reward, recompute, train, optimizer step, sync), next to the memory
  planner's figure for the same phase and the cost model's seconds; max |logp - logp_old|
  on-policy; images/s of our rollout against diffusers' ``FluxPipeline`` on the same weights,
  shape and steps; the text encoders' time on the GPU and on the CPU;
* ``fsdp_dcp``: one rank on NCCL (gloo on CPU): FSDP2-sharded LoRA training step, DCP save,
  a fresh model loaded from it, weights and optimizer state compared bitwise;
* ``tiny_run``: the tiny preset for 2 steps in bf16 with the prompt cache and a checkpoint per
  step, then resumed for a third step (the real job, ``python -m verl_digen.main``).

Named with ``--parts`` only: the rehearsals of the first disaggregated runs on one GPU
(``snapshot_order``, ``tsp_prompt_cache``, ``reward_pool``, ``disaggregated_one_gpu``,
``full_ft_one_rank``; :mod:`verl_digen.gpu_runs`), each in a child process.

``--size tiny`` runs ``flux_phases`` on the tiny FLUX model (and ``--device cpu`` on the CPU):
the same code, which is how CI tests this module without a GPU.

Random weights are built in memory (``from_config`` on the device, in bf16) rather than saved and
loaded: 33 GB of safetensors written and read back would cost minutes of device time and test
only the loader, which the tiny models exercise through the same ``from_pretrained`` path.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Iterator

import torch

from verl_digen.gpu_support import _device, _ended, _PartFailed, _run  # noqa: F401 (gpu_check's names too)

GIB = 1 << 30
PARTS = ("versions", "pytest_gpu", "flux_phases", "fsdp_dcp", "tiny_run")
# Rehearsals of the first disaggregated runs on one GPU (verl_digen/gpu_runs.py), each in a child
# process; named with --parts (not in the default set).
RUN_PARTS = ("snapshot_order", "tsp_prompt_cache", "reward_pool", "disaggregated_one_gpu", "full_ft_one_rank")
PRESET = "flux_colocated"
PROMPT = "a photo of a red cat sitting on a blue chair"


# ---------------------------------------------------------------------- report


class Report:
    """The JSON report, rewritten after every part."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.data: dict[str, Any] = {"started": datetime.datetime.now(datetime.timezone.utc).isoformat(), "parts": {}}
        self.write()

    def write(self) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(self.data, f, indent=1, default=str)
        os.replace(tmp, self.path)

    def run(self, name: str, fn: Callable[[], dict[str, Any]]) -> None:
        t0 = time.perf_counter()
        print(f"[gpu_check] {name} ...", flush=True)
        # replaced when the part ends: a check stopped by a time limit shows which part it cut off
        self.data["parts"][name] = {"ok": False, "error": "started, not finished when the report was last written"}
        self.write()
        try:
            out = {"ok": True, **fn()}
        except Exception as e:  # recorded, and the next part runs
            partial = getattr(e, "partial", {})
            out = {**partial, "ok": False, "error": f"{type(e).__name__}: {e}",
                   "traceback": partial.get("traceback") or traceback.format_exc()}
        out["seconds"] = round(time.perf_counter() - t0, 2)
        self.data["parts"][name] = out
        self.write()
        print(f"[gpu_check] {name}: {'ok' if out['ok'] else 'FAILED: ' + out['error']} ({out['seconds']} s)", flush=True)


# ---------------------------------------------------------------------- versions, pytest


def part_versions() -> dict[str, Any]:
    import importlib.metadata as md

    out: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        out.update(device=props.name, device_gib=round(props.total_memory / GIB, 1),
                   capability=f"{props.major}.{props.minor}", device_count=torch.cuda.device_count())
        try:
            out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception as e:  # reported, not fatal
            out["nccl"] = f"unavailable: {e}"
    for dist_name in ("verl", "verl-digen", "diffusers", "transformers", "peft", "ray", "accelerate", "safetensors"):
        try:
            out[dist_name] = md.version(dist_name)
        except md.PackageNotFoundError:
            out[dist_name] = None
    doctor = _run([sys.executable, "-m", "verl_digen.doctor"], timeout=120)
    out["doctor_rc"], out["doctor"] = doctor["rc"], doctor["tail"]
    if doctor["rc"] != 0:  # the versions stay in the report; the part says the install has a problem
        lines = [ln for ln in doctor["tail"].splitlines() if ln.strip()]
        raise _PartFailed(f"python -m verl_digen.doctor {_ended(doctor)}: {lines[-1] if lines else 'no output'}", out)
    return out


def part_pytest_gpu(timeout: float, log_path: str | None = None, workers: int = 1) -> dict[str, Any]:
    """``pytest -m gpu`` (on ``workers`` pytest-xdist processes when more than one); its whole
    output goes to ``log_path`` when given (the report keeps the tail)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    tests = os.path.join(root, "tests")
    if not os.path.isdir(tests):
        raise FileNotFoundError(f"no tests/ next to the package at {root} (run from a checkout)")
    res = _run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rfEs", "--durations=20", "-p", "no:cacheprovider",
                "-o", "addopts=", "--timeout", str(int(timeout)), *(["-n", str(workers)] if workers > 1 else []), tests],
               timeout=timeout + 30, log_path=log_path)
    lines = [ln for ln in res["tail"].splitlines() if ln.strip()]
    summary = next((ln for ln in reversed(lines) if " passed" in ln or " failed" in ln or " error" in ln), None)
    if res["rc"] not in (0,):
        raise RuntimeError(f"pytest -m gpu {_ended(res)}: {summary}\n{res['tail']}")
    return {"summary": summary, "tail": res["tail"][-1500:]}


# ---------------------------------------------------------------------- phases


class PhaseMeter:
    """Seconds and (on CUDA) peak allocated memory of each phase, measured around it."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.phases: dict[str, dict[str, Any]] = {}

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def phase(self, name: str, **extra: Any) -> Iterator[dict[str, Any]]:
        record: dict[str, Any] = dict(extra)
        self._sync()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            record["allocated_before_gib"] = torch.cuda.memory_allocated(self.device) / GIB
        t0 = time.perf_counter()
        yield record
        self._sync()
        record["seconds"] = time.perf_counter() - t0
        if self.cuda:
            record["max_allocated_gib"] = torch.cuda.max_memory_allocated(self.device) / GIB
            record["max_reserved_gib"] = torch.cuda.max_memory_reserved(self.device) / GIB  # the plan's overhead holds the gap
            record["allocated_after_gib"] = torch.cuda.memory_allocated(self.device) / GIB
            free, total = torch.cuda.mem_get_info(self.device)
            record["device_used_gib"] = (total - free) / GIB
        self.phases[name] = record


def device_type(device: torch.device) -> str:
    """The device table's entry (verl_digen/platform/devices.yaml) for ``device``: the CUDA
    device's name when the table has it (an H200 is predicted as an H200), else H100, the
    device the cost model was measured on (also for the CPU: predictions are for a GPU)."""
    from verl_digen.platform.devices import device_types

    if device.type == "cuda":
        name = torch.cuda.get_device_name(device).upper()
        for kind in sorted(device_types(), key=len, reverse=True):
            if kind.upper() in name:
                return kind
    return "H100"


def _preset_config(size: str, group_size: int, overrides: list[str]):
    """The ``flux_colocated`` preset on one device with one group of ``group_size`` samples per step."""
    from verl_digen.config.compose import compose_config
    from verl_digen.config.schema import digen_config_from_dict
    from omegaconf import OmegaConf

    ov = ["trainer.n_gpus_per_node=1", "digen.batch.groups_per_step=1", f"digen.batch.group_size={group_size}",
          "digen.batch.groups_per_task=1", "digen.batch.train_micro_batch_groups=1", *overrides]
    if size == "tiny":
        ov.append("+smoke=tiny")
    cfg = compose_config(ov, config_name=PRESET)
    return cfg, digen_config_from_dict(OmegaConf.to_container(cfg.digen, resolve=True))


def build_real_flux(device: torch.device, dtype: torch.dtype, seed: int = 0):
    """FLUX.1-dev at real size from the shipped configs, random weights, built on ``device`` in
    ``dtype`` (no fp32 copy first: 12B parameters in fp32 would need 48 GB on the way)."""
    from verl_digen.models.flux import FluxAdapter
    from verl_digen.models.real_configs import instantiate, model_components, scheduler_config
    from verl_digen.models.tiny import build_clip_tokenizer, build_t5_tokenizer

    torch.manual_seed(seed)
    modules: dict[str, torch.nn.Module] = {}
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        for name in model_components("flux"):
            with torch.device(device):
                module = instantiate("flux", name).to(dtype).eval()
            if name != "transformer":
                module.requires_grad_(False)
            modules[name] = module
    finally:
        torch.set_default_dtype(previous)
    # Tokenizers built here (no hub): ids within the real vocabularies, the real lengths (77, 512).
    tokenizer = build_clip_tokenizer(max_length=77)
    tokenizer_2 = build_t5_tokenizer(max_length=512)
    adapter = FluxAdapter(tokenizer=tokenizer, tokenizer_2=tokenizer_2, scheduler_config=scheduler_config("flux"),
                          max_sequence_length=512, **modules)
    adapter.compute_dtype = dtype
    return adapter


def _load_flux(size: str, device: torch.device, dtype: torch.dtype):
    if size == "real":
        return build_real_flux(device, dtype)
    from verl_digen.models.registry import load_adapter
    from verl_digen.models.tiny import ensure_tiny

    return load_adapter(ensure_tiny("flux"), "flux", device=device, dtype=dtype)


def _predictions(dcfg, meter_device: str, group_size: int, num_steps: int, trained_steps: int, forward_rows: int):
    """The memory planner's phases (colocated role, one GPU) and the cost model's seconds for the
    same shape."""
    from verl_digen.memory.plan import GIB as PGIB, plan_job
    from verl_digen.sim.cost_model import CostModel, TrainGroup, load_catalog

    plan = plan_job(dcfg, devices_per_node=1)[0]
    memory = {phase: {"total_gib": sum(b.values()) / PGIB, "without_overhead_gib": (sum(b.values()) - b["overhead"]) / PGIB,
                      **{k + "_gib": v / PGIB for k, v in b.items() if v}}
              for phase, b in plan.phases.items()}
    s = dcfg.sampling
    cm = CostModel.from_catalog(
        load_catalog(), "flux-12b", devices=[meter_device], height=s.height, width=s.width, num_steps=num_steps,
        group_size=group_size, groups_per_step=1, sde_window=s.sde_window.size, lora=dcfg.model.lora.enable,
        lora_rank=dcfg.model.lora.rank, gradient_checkpointing=bool(dcfg.model.checkpointing),
        cfg=s.guidance_scale > 1.0,
    )
    dev = cm.device(meter_device)
    group = TrainGroup(ranks=1, nodes=1, shard=1, shard_nodes=1, sends=False)
    seconds = {
        "encode": cm.encode_seconds(1, dev),
        "generate": dev.generate_overhead_s + num_steps * (cm.denoise_seconds(group_size, dev, forward_rows or None)
                                                           + cm.system.denoise_step_s),
        "decode": cm.decode_seconds(group_size, dev),
        "reward": cm.reward_seconds(group_size, dev),
        "recompute": trained_steps * cm.logprob_pass_seconds(group_size, dev, group),
        "train": trained_steps * cm.train_pass_seconds(group_size, dev, group),
        # the Adam update alone: the system's fixed per-step cost (step_fixed_s, fitted to whole
        # published steps) is charged in optimizer_seconds but is not this call's work
        "optimizer": cm.optimizer_seconds(dev, group) - cm.system.step_fixed_s,
    }
    return {"memory_plan": memory, "memory_plan_peak_phase": plan.phase, "cost_model_seconds": seconds,
            "cost_model_pass_batch": cm.pass_batch(dev, group), "cost_model_device": meter_device,
            "cost_model_step_fixed_s": cm.system.step_fixed_s,
            "cost_model_reward_profile": cm.reward.name if cm.reward is not None else None}


def _rollout(adapter, settings, group_size: int, seed: int, meter: PhaseMeter | None = None):
    """One group of our rollout: generate (SDE with log-probs) and decode, as the workers run it."""
    from verl_digen.workers.sampling import GroupRequest, begin_groups, denoise, finish_groups

    request = GroupRequest([PROMPT], [0], [0], group_size, training_step=0, seed=seed, policy_version=0)
    ctx = meter.phase if meter is not None else (lambda name: contextlib.nullcontext({}))
    with ctx("generate"):
        state = begin_groups(adapter, request, settings)
        denoise(adapter, state, settings, settings.num_steps)
    with ctx("decode"):
        data = finish_groups(adapter, state, settings)
    return data


def _pipeline_images_per_s(adapter, settings, group_size: int, repeats: int) -> dict[str, Any]:
    """diffusers' FluxPipeline on the adapter's own modules (same weights), prompt embeddings
    given (our rollout takes them from the prompt cache), output decoded to pixels."""
    from diffusers import FluxPipeline

    from verl_digen.models.real_configs import build_scheduler

    spec = settings.spec
    pipe = FluxPipeline(scheduler=build_scheduler("flux"), vae=adapter.vae, text_encoder=None, tokenizer=None,
                        text_encoder_2=None, tokenizer_2=None, transformer=adapter.transformer)
    pipe.set_progress_bar_config(disable=True)
    cond = adapter.encode_prompts([PROMPT])
    device = adapter.device

    def once() -> float:
        gen = torch.Generator(device="cpu").manual_seed(0)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        pipe(prompt_embeds=cond["prompt_embeds"], pooled_prompt_embeds=cond["pooled_prompt_embeds"],
             num_images_per_prompt=group_size, height=spec.height, width=spec.width,
             num_inference_steps=settings.num_steps, guidance_scale=spec.distilled_guidance or 3.5,
             output_type="pt", generator=gen)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    once()  # warm-up
    times = [once() for _ in range(repeats)]
    return {"seconds": min(times), "images_per_s": group_size / min(times)}


def _encoder_seconds(adapter, device: torch.device, prompts: int) -> dict[str, Any]:
    """Text-encoder seconds per prompt: ``prompts`` prompts in one call on ``device``, and one
    prompt on the CPU (where the prompt-cache warm-up of a training worker used to run them)."""
    names = ("text_encoder", "text_encoder_2")

    def per_prompt(n: int) -> float:
        batch = [f"{PROMPT} {i}" for i in range(n)]
        adapter.encode_prompts(batch[:1])  # warm-up
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        adapter.encode_prompts(batch)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) / n

    out: dict[str, Any] = {"device_prompts": prompts, "device_seconds_per_prompt": per_prompt(prompts)}
    if device.type == "cuda":
        # encode_prompts runs each encoder where it is: the same call with the encoders on the CPU.
        for n in names:
            getattr(adapter, n).to("cpu")
        try:
            out["cpu_threads"] = torch.get_num_threads()
            out["cpu_seconds_per_prompt"] = per_prompt(1)
        finally:
            for n in names:
                getattr(adapter, n).to(device)
        out["cpu_over_device"] = out["cpu_seconds_per_prompt"] / out["device_seconds_per_prompt"]
    return out


def part_flux_phases(size: str, device_name: str, *, group_size: int, pipeline_repeats: int = 1,
                     encoder_cpu: bool = True, compare_pipeline: bool = True, checkpointing: bool = True,
                     lora: bool = True, out: dict[str, Any] | None = None) -> dict[str, Any]:
    """The phases of one training step of FLUX (see the module's docstring). ``out`` is filled as
    the phases run, so that a failure leaves what was measured before it. ``lora=False``: a full
    fine-tune (every transformer weight trained, the ``full_ft_one_rank`` part)."""
    from verl_digen.rewards import build_reward_from_config
    from verl_digen.sync.state import flatten_state, state_digest, state_nbytes, trainable_state
    from verl_digen.workers.fsdp import enable_gradient_checkpointing
    from verl_digen.workers.training import PolicyUpdater, TrainSettings, add_lora
    from verl_digen.workers.sampling import step_plan
    from verl_digen.workers.worker import sampling_settings

    device = _device(device_name)
    dtype = torch.bfloat16
    cfg, dcfg = _preset_config(size, group_size, ["digen.model.dtype=bf16",
                                                  f"digen.model.gradient_checkpointing={str(checkpointing).lower()}",
                                                  f"digen.model.lora.enable={str(lora).lower()}",
                                                  # a full fine-tune of 12B with fp32 master weights and
                                                  # Adam does not fit one H200 (the plan: 233 GiB); bf16: 94
                                                  *([] if lora else ["digen.model.trainable_dtype=bf16"])])
    settings = sampling_settings(dcfg)
    meter = PhaseMeter(device)
    out = {} if out is None else out
    out["phases"] = meter.phases
    out.update({"size": size, "device": str(device), "dtype": "bf16", "group_size": group_size,
                           "height": settings.spec.height, "width": settings.spec.width,
                           "num_steps": settings.num_steps, "lora_rank": dcfg.model.lora.rank if lora else None,
                           "gradient_checkpointing": bool(dcfg.model.checkpointing),
                           "distilled_guidance": settings.spec.distilled_guidance,
                           "forward_rows": settings.forward_rows})
    with meter.phase("load"):
        adapter = _load_flux(size, device, dtype)
    out["transformer_params"] = sum(p.numel() for p in adapter.transformer.parameters())

    adapter.encode_prompts(["warm-up"])  # the first call pays one-time CUDA/cuBLAS set-up (0.48 s on an H100)
    with meter.phase("encode", prompts=1):
        adapter.encode_prompts([PROMPT])
    out["text_encoders"] = _encoder_seconds(adapter, device, prompts=8) if encoder_cpu else None

    # The run's set-up: the prompt cache warmed and routing adapter.encode_prompts, so that the
    # rollouts below take their embeddings from it, as a run's do (and as FluxPipeline is given them).
    from verl_digen.models.prompt_cache import PromptEmbeddingCache

    cache = PromptEmbeddingCache(adapter, model_key="gpu-check", cache_dir=None)
    cache.warm([PROMPT, settings.negative_prompt])
    cache.install()
    if compare_pipeline:
        # Our rollout against FluxPipeline on the same (base) weights, before LoRA is injected.
        _rollout(adapter, settings, group_size, seed=1)  # warm-up
        t0 = time.perf_counter()
        _rollout(adapter, settings, group_size, seed=2)
        if device.type == "cuda":
            torch.cuda.synchronize()
        ours = time.perf_counter() - t0
        pipe = _pipeline_images_per_s(adapter, settings, group_size, pipeline_repeats)
        out["rollout_vs_pipeline"] = {"ours_seconds": ours, "ours_images_per_s": group_size / ours,
                                      "pipeline_seconds": pipe["seconds"], "pipeline_images_per_s": pipe["images_per_s"],
                                      "ours_over_pipeline": pipe["seconds"] / ours}

    # The rest of the run's set-up: text encoders released, LoRA, checkpointing.
    out["text_encoder_bytes_freed"] = cache.release_encoders()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if lora:
        add_lora(adapter, dcfg.model.lora, dtype=torch.float32)
    out["gradient_checkpointing_on"] = checkpointing and enable_gradient_checkpointing(adapter.transformer)
    # A full fine-tune as the worker sets it up: digen.model.trainable_dtype and the placement's
    # optimizer offload, which the memory plan assumes too (LoRA: fp32 adapters, as before).
    full_dtype = torch.float32 if dcfg.model.trainable_dtype == "fp32" else torch.bfloat16
    updater = PolicyUpdater(adapter, TrainSettings(
        algo=dcfg.algo, sampling=settings, lora_only=lora, images_per_step=group_size,
        trainable_dtype=torch.float32 if lora else full_dtype,
        optimizer_offload=False if lora else dcfg.optimizer_offloaded))
    out["trainable_params"] = sum(p.numel() for p in updater.params)
    steps = len(step_plan(settings, training_step=0, seed=3)[1])
    out["cost_model_device_type"] = device_type(device)
    out.update(_predictions(dcfg, out["cost_model_device_type"], group_size, settings.num_steps, steps,
                            settings.forward_rows))

    data = _rollout(adapter, settings, group_size, seed=3, meter=meter)
    reward_fn = build_reward_from_config(dcfg.reward.as_spec())
    from verl_digen.models.base import pixels_from_uint8

    with meter.phase("reward", reward=dcfg.reward.name):
        rewards = reward_fn(pixels_from_uint8(data.batch["images"]), [PROMPT] * group_size, None)
    out["rewards_finite"] = bool(torch.isfinite(rewards).all())
    # the trained steps: the trajectory carries only their latents (the whole SDE window unless
    # digen.sampling.timestep_fraction subsamples it), so only those are recomputed
    window = [int(j) for j in torch.nonzero(data.batch["train_mask"][0]).flatten()]
    with meter.phase("recompute", steps=len(window)):
        recomputed = updater.recompute_log_probs(data)
    old = data.batch["log_probs"][:, window]
    diff = (recomputed[:, window] - old).abs()
    out["on_policy"] = {"max_abs_logp_diff": float(diff.max()), "window": window,
                        "logp_finite": bool(torch.isfinite(old).all()), "mean_abs_logp": float(old.abs().mean())}

    advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-4) if group_size > 1 else torch.ones(group_size)
    if not torch.isfinite(advantages).all() or float(advantages.abs().max()) == 0.0:
        advantages = torch.linspace(-1.0, 1.0, group_size)  # random weights can give equal rewards
    with meter.phase("train", passes=steps, rows=group_size):
        train_metrics = updater.train_micro_batch(data, advantages)
    out["train_metrics"] = train_metrics
    with meter.phase("optimizer"):
        opt = updater.optimizer_step()
    out["grad_norm"] = opt["actor/grad_norm"]
    with meter.phase("sync", what="trainable_state + flatten into device buckets"):
        state = trainable_state(adapter.transformer, lora_only=lora)
        buffers, _meta = flatten_state(state, device=device)
    out["sync_bytes"] = state_nbytes(state)
    t0 = time.perf_counter()
    state_digest(state)
    out["sync_digest_seconds"] = time.perf_counter() - t0
    del buffers
    out["prompt_cache"] = {k: v for k, v in cache.stats().items() if k in ("hits", "misses", "encoded_prompts")}
    out["comparison"] = _compare(out)
    return out


def part_flux_phases_child(args: argparse.Namespace, device: str, group_size: int) -> dict[str, Any]:
    """:func:`part_flux_phases` in a child process: a CUDA fault (an illegal address poisons the
    context) must not take the other parts with it, and the memory it held is returned."""
    with tempfile.TemporaryDirectory() as tmp:
        out_file = os.path.join(tmp, "child.json")
        cmd = [sys.executable, "-m", "verl_digen.gpu_check", "--child-flux", out_file, "--device", device,
               "--size", args.size, "--group-size", str(group_size)]
        cmd += ["--no-encoder-cpu"] if args.no_encoder_cpu else []
        cmd += ["--no-pipeline"] if args.no_pipeline else []
        cmd += ["--no-checkpointing"] if args.no_checkpointing else []
        res = _run(cmd, timeout=args.flux_timeout)
        result: dict[str, Any] = {}
        if os.path.isfile(out_file):
            with open(out_file, encoding="utf-8") as f:
                result = json.load(f)
        if res["rc"] != 0:
            result["child_rc"], result["child_tail"] = res["rc"], res["tail"]
            error = result.get("error") or f"child {_ended(res)}"
            raise _PartFailed(error, result)
        return result


def _flux_child(out_file: str, args: argparse.Namespace, device: str, group_size: int) -> int:
    out: dict[str, Any] = {}
    rc = 0
    try:
        part_flux_phases(args.size, device, group_size=group_size, encoder_cpu=not args.no_encoder_cpu,
                         compare_pipeline=not args.no_pipeline, checkpointing=not args.no_checkpointing, out=out)
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"
        out["traceback"] = traceback.format_exc()
        rc = 1
    with open(out_file, "w", encoding="utf-8") as f:
        json.dump(out, f, default=str)
    return rc


# The cost model's and the planner's names for the measured phases.
_PLAN_PHASE = {"encode": "load", "generate": "generate", "decode": "decode", "train": "train"}


def _compare(out: dict[str, Any]) -> dict[str, Any]:
    """Measured / predicted for every phase with both figures."""
    rows: dict[str, Any] = {}
    phases = out["phases"]
    for name, rec in phases.items():
        row: dict[str, Any] = {"seconds": rec["seconds"]}
        pred_s = out["cost_model_seconds"].get(name)
        if pred_s:
            row["predicted_seconds"] = pred_s
            row["time_ratio"] = rec["seconds"] / pred_s
            row["time_within_25pct"] = 0.75 <= row["time_ratio"] <= 1.25
        if "max_allocated_gib" in rec:
            row["max_allocated_gib"] = rec["max_allocated_gib"]
            plan_phase = _PLAN_PHASE.get(name)
            if plan_phase in out["memory_plan"]:
                pred = out["memory_plan"][plan_phase]["without_overhead_gib"]
                row["planned_gib"] = pred
                row["memory_ratio"] = rec["max_allocated_gib"] / pred
                row["memory_within_15pct"] = 0.85 <= row["memory_ratio"] <= 1.15
        rows[name] = row
    return rows


# ---------------------------------------------------------------------- FSDP2 + DCP


def part_fsdp_dcp(device_name: str) -> dict[str, Any]:
    """Run in a child process: one rank, FSDP2 + DCP save and load, compared bitwise."""
    with tempfile.TemporaryDirectory() as tmp:
        out_file = os.path.join(tmp, "child.json")
        res = _run([sys.executable, "-m", "verl_digen.gpu_check", "--child-fsdp-dcp", out_file, "--device", device_name],
                   timeout=300)
        if res["rc"] != 0 or not os.path.isfile(out_file):
            raise RuntimeError(f"fsdp_dcp child {_ended(res)}:\n{res['tail']}")
        with open(out_file, encoding="utf-8") as f:
            return json.load(f)


def _fsdp_dcp_child(out_file: str, device_name: str) -> None:
    import torch.distributed as dist

    from verl_digen.config.schema import AlgoConfig, LoraConfigSpec, digen_config_from_dict
    from verl_digen.models.registry import load_adapter
    from verl_digen.models.tiny import ensure_tiny
    from verl_digen.sync.transport import find_free_port
    from verl_digen.workers.fsdp import is_fsdp, shard_for_training
    from verl_digen.workers.sampling import sample_groups
    from verl_digen.workers.sharded_state import load_rank_state, save_rank_state
    from verl_digen.workers.training import PolicyUpdater, TrainSettings, add_lora
    from verl_digen.workers.worker import sampling_settings

    device = _device(device_name)
    cuda = device.type == "cuda"
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(find_free_port("127.0.0.1")))
    kwargs: dict[str, Any] = {"device_id": device} if cuda else {}
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1, **kwargs)
    try:
        path = ensure_tiny("flux")
        dtype = torch.bfloat16 if cuda else torch.float32
        settings = sampling_settings(digen_config_from_dict({"sampling": {"num_steps": 4}}))

        def model():
            adapter = load_adapter(path, "flux", device=device, dtype=dtype)
            add_lora(adapter, LoraConfigSpec(rank=4))
            shard_for_training(adapter.transformer)
            updater = PolicyUpdater(adapter, TrainSettings(AlgoConfig(), settings, lora_only=True, images_per_step=2))
            return adapter, updater

        adapter, updater = model()
        data = sample_groups(adapter, ["a cat"], [0], [0], group_size=2, settings=settings, training_step=0, seed=1,
                             policy_version=0)
        updater.train_micro_batch(data, torch.tensor([1.0, -1.0]))
        updater.optimizer_step(dist.group.WORLD)
        with tempfile.TemporaryDirectory() as ck:
            t0 = time.perf_counter()
            save_rank_state(ck, module=adapter.transformer, optimizer=updater.optimizer, ema=None, lora_only=True,
                            version=1, rank=0, group=dist.group.WORLD)
            saved_s = time.perf_counter() - t0
            fresh, fresh_updater = model()
            t0 = time.perf_counter()
            load_rank_state(ck, module=fresh.transformer, optimizer=fresh_updater.optimizer, ema=None,
                            lora_only=True, rank=0, group=dist.group.WORLD)
            loaded_s = time.perf_counter() - t0

        def local(t):
            return t.to_local() if hasattr(t, "to_local") else t

        a = {n: local(p).detach() for n, p in adapter.transformer.named_parameters() if "lora_" in n}
        b = {n: local(p).detach() for n, p in fresh.transformer.named_parameters() if "lora_" in n}
        weights_equal = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        sa, sb = updater.optimizer.state, fresh_updater.optimizer.state
        pa, pb = updater.opt_params, fresh_updater.opt_params
        opt_equal = all(
            torch.equal(local(sa[x]["exp_avg"]), local(sb[y]["exp_avg"]))
            and torch.equal(local(sa[x]["exp_avg_sq"]), local(sb[y]["exp_avg_sq"]))
            for x, y in zip(pa, pb)
        )
        result = {"backend": dist.get_backend(), "world_size": dist.get_world_size(), "sharded": is_fsdp(adapter.transformer),
                  "lora_tensors": len(a), "weights_equal": weights_equal, "optimizer_equal": opt_equal,
                  "save_seconds": saved_s, "load_seconds": loaded_s}
        if not (weights_equal and opt_equal):
            raise AssertionError(f"DCP round trip changed the state: {result}")
    finally:
        dist.destroy_process_group()
    with open(out_file, "w", encoding="utf-8") as f:
        json.dump(result, f)


# ---------------------------------------------------------------------- tiny job with resume


def part_tiny_run(timeout: float, dtype: str = "bf16") -> dict[str, Any]:
    """The real job on one device: 2 steps with a checkpoint per step, then resumed to step 3."""
    with tempfile.TemporaryDirectory() as tmp:
        common = ["trainer.n_gpus_per_node=1", "trainer.save_freq=1", f"digen.model.dtype={dtype}",
                  "digen.prompt_cache.enable=true", "digen.progress_bar=false",
                  f"trainer.default_local_dir={tmp}/ck", f"digen.prompt_cache.dir={tmp}/pc"]
        results: dict[str, Any] = {}
        rows_of: dict[str, list[dict[str, Any]]] = {}
        for name, steps in (("first", 2), ("resumed", 3)):
            out_dir = os.path.join(tmp, name)
            res = _run([sys.executable, "-m", "verl_digen.main", *common, f"trainer.total_training_steps={steps}",
                        f"digen.output_dir={out_dir}"], timeout=timeout / 2)
            if res["rc"] != 0:
                limit = " (each of the two runs gets half of --tiny-run-timeout)" if res["rc"] is None else ""
                raise RuntimeError(f"{name} run {_ended(res)}{limit}:\n{res['tail']}")
            with open(os.path.join(out_dir, "metrics.jsonl"), encoding="utf-8") as f:
                rows_of[name] = [json.loads(line) for line in f if line.strip()]
            results[name] = {"steps": [r.get("step") for r in rows_of[name]],
                             "images_per_s": [r.get("images_per_s") for r in rows_of[name]],
                             "loss": [r.get("actor/loss") for r in rows_of[name]]}
        # The resumed run restores steps 1-2 from the checkpoint (their logged rows come back as
        # they were, wall-clock figures included: retrained steps could not match) and trains step 3.
        first, resumed = rows_of["first"], rows_of["resumed"]
        if [r.get("step") for r in resumed] != [1, 2, 3] or resumed[:2] != first:
            raise AssertionError(f"the resumed run did not continue the first one: first {results['first']}, "
                                 f"resumed {results['resumed']}")
        results["resumed_from_step"] = 2
        return results


# ---------------------------------------------------------------------- the run parts, in children


def _run_part(name: str, args: argparse.Namespace, device: str) -> dict[str, Any]:
    """One of :data:`RUN_PARTS`, in this process (the child's side)."""
    from verl_digen import gpu_runs

    if name == "snapshot_order":
        # 64 tensors of 1 MiB (48 MiB, 13 buckets); tiny (the CPU rehearsal): 32 of them
        return gpu_runs.part_snapshot_order(device, tensors=64 if args.size == "real" else 32)
    if name == "full_ft_one_rank":
        out: dict[str, Any] = {}
        part_flux_phases(args.size, device, group_size=args.group_size or 2, encoder_cpu=False,
                         compare_pipeline=False, checkpointing=not args.no_checkpointing, lora=False, out=out)
        # the train and optimizer-step peaks beside the plan's train and step phases (the CPU
        # measures no device memory: the plan's figures alone)
        for phase, plan_phase in (("train", "train"), ("optimizer", "step")):
            measured = out["phases"][phase].get("max_allocated_gib")
            planned = out["memory_plan"].get(plan_phase, {}).get("without_overhead_gib", 0.0)
            ratio = measured / planned if measured is not None and planned > 0 else None
            out[f"{phase}_vs_plan"] = {"max_allocated_gib": measured, "planned_gib": planned, "memory_ratio": ratio,
                                       "memory_within_15pct": None if ratio is None else 0.85 <= ratio <= 1.15}
        return out
    if name == "disaggregated_one_gpu":
        return gpu_runs.part_disaggregated_one_gpu(device, args.size, args.run_timeout, build_real=build_real_flux)
    part = {"tsp_prompt_cache": gpu_runs.part_tsp_prompt_cache, "reward_pool": gpu_runs.part_reward_pool}[name]
    return part(device, args.size, args.run_timeout)


def _part_child(out_file: str, name: str, args: argparse.Namespace, device: str) -> int:
    out: dict[str, Any] = {}
    rc = 0
    try:
        out = _run_part(name, args, device)
    except Exception as e:
        out = {**getattr(e, "partial", {}), "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        rc = 1
    with open(out_file, "w", encoding="utf-8") as f:
        json.dump(out, f, default=str)
    return rc


def part_in_child(name: str, args: argparse.Namespace, device: str) -> dict[str, Any]:
    """A run part in a child process of its own, given ``--run-timeout`` plus a minute (plus five
    for saving the real-size model)."""
    with tempfile.TemporaryDirectory() as tmp:
        out_file = os.path.join(tmp, "child.json")
        cmd = [sys.executable, "-m", "verl_digen.gpu_check", "--child-part", name, "--child-out", out_file,
               "--device", device, "--size", args.size, "--run-timeout", str(args.run_timeout)]
        cmd += ["--group-size", str(args.group_size)] if args.group_size else []
        cmd += ["--no-checkpointing"] if args.no_checkpointing else []
        # a minute more than the run; the real-size disaggregated part first saves ~33 GB of random FLUX
        extra = 300 if name == "disaggregated_one_gpu" and args.size == "real" else 60
        res = _run(cmd, timeout=args.run_timeout + extra)
        result: dict[str, Any] = {}
        if os.path.isfile(out_file):
            with open(out_file, encoding="utf-8") as f:
                result = json.load(f)
        if res["rc"] != 0:
            result["child_rc"], result["child_tail"] = res["rc"], res["tail"]
            raise _PartFailed(result.get("error") or f"child {_ended(res)}", result)
        return result


# ---------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m verl_digen.gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="gpu_check.json", help="the JSON report (rewritten after every part)")
    p.add_argument("--parts", default=",".join(PARTS),
                   help=f"comma-separated subset of {','.join(PARTS)} (the default), {','.join(RUN_PARTS)}")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--size", choices=("real", "tiny"), default="real", help="flux_phases: real-size FLUX or the tiny one")
    p.add_argument("--group-size", type=int, default=None, help="flux_phases samples (default 8; tiny: 2)")
    p.add_argument("--no-encoder-cpu", action="store_true", help="flux_phases: skip timing the text encoders on the CPU")
    p.add_argument("--pytest-timeout", type=float, default=240.0)
    p.add_argument("--pytest-log", default=None, help="pytest_gpu: write pytest's whole output here")
    p.add_argument("--pytest-workers", type=int, default=1, help="pytest_gpu: pytest-xdist processes (-n)")
    p.add_argument("--tiny-run-timeout", type=float, default=240.0)
    p.add_argument("--no-pipeline", action="store_true", help="flux_phases: skip the FluxPipeline comparison")
    p.add_argument("--no-checkpointing", action="store_true", help="flux_phases: train without activation checkpointing")
    p.add_argument("--flux-timeout", type=float, default=420.0)
    p.add_argument("--run-timeout", type=float, default=300.0,
                   help=f"each of {', '.join(RUN_PARTS)}: its run's limit (the child gets a minute more)")
    p.add_argument("--child-part", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-fsdp-dcp", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-flux", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    group = args.group_size or (8 if args.size == "real" else 2)
    if args.child_fsdp_dcp:
        _fsdp_dcp_child(args.child_fsdp_dcp, device)
        return 0
    if args.child_flux:
        return _flux_child(args.child_flux, args, device, group)
    if args.child_part:
        return _part_child(args.child_out, args.child_part, args, device)
    parts = [x for x in args.parts.split(",") if x]
    unknown = set(parts) - set(PARTS) - set(RUN_PARTS)
    if unknown:
        p.error(f"unknown parts {sorted(unknown)}; valid: {', '.join(PARTS + RUN_PARTS)}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda but torch sees no CUDA device")
    report = Report(args.out)
    report.data.update(device=device, size=args.size, command=" ".join([sys.executable, "-m", "verl_digen.gpu_check", *(argv or sys.argv[1:])]))
    runners = {
        "versions": part_versions,
        "pytest_gpu": lambda: part_pytest_gpu(args.pytest_timeout, args.pytest_log, args.pytest_workers),
        "flux_phases": lambda: part_flux_phases_child(args, device, group),
        "fsdp_dcp": lambda: part_fsdp_dcp(device),
        "tiny_run": lambda: part_tiny_run(args.tiny_run_timeout, "bf16" if device.startswith("cuda") else "fp32"),
        **{name: (lambda name=name: part_in_child(name, args, device)) for name in RUN_PARTS},
    }
    for name in parts:
        report.run(name, runners[name])
    failed = [n for n in parts if not report.data["parts"][n]["ok"]]
    report.data["failed"] = failed
    report.data["finished"] = datetime.datetime.now(datetime.timezone.utc).isoformat()
    report.write()
    print(f"[gpu_check] report: {args.out}; failed parts: {', '.join(failed) or 'none'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
