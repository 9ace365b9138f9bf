"""``python -m verl_digen.profile``: measure this machine and write a cost-model profile.

Default mode: time the real task code of the tiny model (or any ``digen.model.path``) on this
machine, in-process, one thread per worker as the training loop gives each worker:

- ``sample_groups`` for 1 and 2 groups at ``S`` and ``S/2`` denoising steps: the slope in
  steps is one forward (fitted as ``overhead + per-image x images``), the intercept is the
  per-call and per-image work outside the denoiser loop (prompt encoding, latents, decoding);
- the reward function on 1 and 2 groups of images;
- ``PolicyUpdater.train_micro_batch`` on 1 and 2 groups (per trained step: one pass);
- ``PolicyUpdater.optimizer_step``;
- a weight sync of the LoRA state between two processes over gloo (``WeightChannel``).

The fit is written as a profile in the format of ``verl_digen/sim/profiles/*.yaml``: a model
(the architecture's sizes read from the loaded transformer), a device whose effective FLOP rate
reproduces the measured forward, and a system with the measured fixed costs. ``--check`` then
runs the real training loop (colocated on 2 devices and disaggregated 1+1 by default) and
compares each run's steady-state step time with the simulator's prediction from the profile::

    python -m verl_digen.profile --out /tmp/tiny_cpu.yaml --check

``--block`` instead measures one DiT block at a real model's width and sequence length (e.g. on
a GPU: ``--block --hidden 3072 --tokens 4608``) and writes a device profile with the measured
forward and training efficiency, to replace the ``mfu_*`` estimates of a shipped device profile.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import math
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from typing import Any, Callable

SOURCE = "measured by python -m verl_digen.profile"


def _median_time(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _line(x0: float, y0: float, x1: float, y1: float) -> tuple[float, float]:
    """(intercept, slope) through two points; the intercept is clamped at 0."""
    slope = (y1 - y0) / (x1 - x0)
    slope = max(slope, 1e-12)
    return max(y0 - slope * x0, 0.0), slope


# ---------------------------------------------------------------------------- weight sync


def _sync_endpoint(rank: int, port: int, shapes: list[tuple[int, ...]], repeats: int, out: Any) -> None:
    import torch

    from verl_digen.sync.transport import WeightChannel

    torch.set_num_threads(1)
    channel = WeightChannel("gloo", rank, 2, "127.0.0.1", port, timeout_s=120)
    state = {f"w{i}": torch.zeros(s) for i, s in enumerate(shapes)}
    times = []
    for v in range(repeats + 1):
        t0 = time.perf_counter()
        if rank == 0:
            channel.send(state, v)
        else:
            channel.recv()
        times.append(time.perf_counter() - t0)
    channel.close()
    if rank == 0:
        out.put(statistics.median(times[1:]))


def measure_sync(shapes: list[tuple[int, ...]], repeats: int = 5) -> float:
    """Median seconds of one gloo weight sync of tensors of ``shapes`` between two processes."""
    from verl_digen.sync.transport import find_free_port

    ctx = mp.get_context("spawn")
    port = find_free_port("127.0.0.1")
    out = ctx.Queue()
    procs = [ctx.Process(target=_sync_endpoint, args=(r, port, shapes, repeats, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        result = out.get(timeout=300)
    finally:
        for p in procs:
            p.join(timeout=60)
    return float(result)


# ---------------------------------------------------------------------------- runtime


class _Echo:
    def echo(self, request: dict) -> dict:
        return {"ok": True, "n": len(request)}


def measure_task_overhead(repeats: int = 30) -> float:
    """Median round trip of an empty actor call through Ray (what every task pays on top)."""
    import ray

    owns = not ray.is_initialized()
    if owns:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        actor = ray.remote(num_cpus=0)(_Echo).remote()
        ray.get(actor.echo.remote({}))
        times = []
        for i in range(repeats):
            t0 = time.perf_counter()
            ray.get(actor.echo.remote({"group_ids": [i], "step": 0}))
            times.append(time.perf_counter() - t0)
        ray.kill(actor)
    finally:
        if owns:
            ray.shutdown()
    return statistics.median(times)


# ---------------------------------------------------------------------------- tiny model


def _model_shape(adapter: Any, spec: Any) -> dict[str, Any]:
    """Sizes the cost model's FLOP formula needs, read from the loaded denoiser."""
    import torch

    tr = adapter.transformer
    cfg = tr.config
    layers = int(getattr(cfg, "num_layers", 0) or 0) + int(getattr(cfg, "num_single_layers", 0) or 0)
    if layers == 0:
        layers = sum(len(getattr(tr, n)) for n in ("transformer_blocks", "single_transformer_blocks", "blocks") if hasattr(tr, n))
    heads = int(getattr(cfg, "num_attention_heads", 1))
    head_dim = int(getattr(cfg, "attention_head_dim", getattr(cfg, "inner_dim", 1)))
    params = sum(p.numel() for n, p in tr.named_parameters() if "lora_" not in n)
    lora_params = sum(p.numel() for n, p in tr.named_parameters() if "lora_" in n)
    gen = torch.Generator().manual_seed(0)
    latents = adapter.prepare_latents(1, spec, gen)
    cond = adapter.encode_prompts(["a photo of a cat"])
    text = max((v.shape[1] for v in cond.values() if v.dim() == 3), default=0)
    if latents.dim() == 3:  # packed tokens [B, N, C] (FLUX)
        image_tokens = latents.shape[1]
    else:  # [B, C, h, w] with patch_size
        p = int(getattr(cfg, "patch_size", 2))
        image_tokens = (latents.shape[-2] // p) * (latents.shape[-1] // p)
    vae = int(getattr(adapter, "vae_scale_factor", 8))
    patch = max(1, round(math.sqrt(spec.height * spec.width / vae**2 / image_tokens)))
    return {
        "params": float(params),
        "lora_params": float(lora_params),
        "layers": layers,
        "hidden": heads * head_dim,
        "vae_spatial": vae,
        "patch": patch,
        "text_tokens": int(text),
        "image_tokens": int(image_tokens),
    }


def _load(overrides: list[str], threads: int) -> tuple[Any, Any, Any]:
    """(digen config, adapter with LoRA, sampling settings) of the configured model."""
    import torch
    from omegaconf import OmegaConf

    from verl_digen.config.compose import compose_config
    from verl_digen.config.schema import digen_config_from_dict
    from verl_digen.models.base import resolve_dtype
    from verl_digen.models.registry import load_adapter
    from verl_digen.trainer.resolve import resolve_model_path
    from verl_digen.workers.training import add_lora
    from verl_digen.workers.worker import compute_device, sampling_settings

    torch.set_num_threads(threads)
    config = compose_config(overrides)
    cfg = digen_config_from_dict(OmegaConf.to_container(config, resolve=True)["digen"])
    device = compute_device()
    # The workers' precision: weights in the run's dtype, LoRA in the trainable dtype.
    adapter = load_adapter(resolve_model_path(cfg), cfg.model.arch, device=device,
                           dtype=resolve_dtype(cfg.model.dtype, device), max_sequence_length=cfg.model.max_sequence_length)
    if cfg.model.lora.enable:
        add_lora(adapter, cfg.model.lora, dtype=resolve_dtype(cfg.model.trainable_dtype, device))
    return cfg, adapter, sampling_settings(cfg)


def _task_timings(overrides: list[str], threads: int, repeats: int, barrier: Any = None) -> dict[str, Any]:
    """Median seconds of each task's code: generate (1, 2 groups x S, S/2 steps), reward and
    train (1, 2 groups), optimizer step. ``barrier``: start together with sibling processes."""
    import torch

    from verl_digen.algos.window import SdeWindowConfig
    from verl_digen.models.base import pixels_from_uint8
    from verl_digen.rewards import build_reward_from_config
    from verl_digen.workers.sampling import sample_groups
    from verl_digen.workers.training import PolicyUpdater, TrainSettings

    cfg, adapter, settings = _load(overrides, threads)
    G, S = cfg.batch.group_size, settings.num_steps
    S2 = max(1, S // 2)
    half = dataclasses.replace(settings, num_steps=S2)
    try:
        SdeWindowConfig(**dataclasses.asdict(settings.window)).validate(S2)
    except (ValueError, TypeError):
        half = dataclasses.replace(half, window=SdeWindowConfig(mode="all"))

    def gen(n: int, st: Any) -> Any:
        return sample_groups(
            adapter, [f"a photo of a cat {i}" for i in range(n)], list(range(n)), list(range(n)), group_size=G,
            settings=st, training_step=0, seed=cfg.seed, policy_version=0,
        )

    reward_fn = build_reward_from_config(
        {"name": cfg.reward.name, "kwargs": cfg.reward.kwargs, "components": cfg.reward.components}
        if cfg.reward.name == "weighted" else {"name": cfg.reward.name, "kwargs": cfg.reward.kwargs}
    )
    trainer = PolicyUpdater(
        adapter,
        TrainSettings(algo=cfg.algo, sampling=settings, lora_only=cfg.model.lora.enable, images_per_step=cfg.batch.images_per_optimizer_step),
    )
    data = {n: gen(n, settings) for n in (1, 2)}
    if barrier is not None:
        barrier.wait()
    out = {f"gen_{n}_{s}": _median_time(lambda: gen(n, st), repeats) for n in (1, 2) for s, st in ((S, settings), (S2, half))}
    for n in (1, 2):
        prompts = [str(p) for p in data[n].non_tensor_batch["prompt"]]
        out[f"reward_{n}"] = _median_time(lambda: reward_fn(pixels_from_uint8(data[n].batch["images"]), prompts), repeats)
        out[f"train_{n}"] = _median_time(lambda: trainer.train_micro_batch(data[n], torch.randn(n * G)), repeats)
    out["optimizer"] = _median_time(lambda: trainer.optimizer_step(None), repeats)
    out["trained_steps"] = int(data[1].batch["train_mask"][0].sum())
    out["S"], out["S2"], out["G"] = S, S2, G
    return out


def _task_timings_child(args: tuple, barrier: Any, queue: Any) -> None:
    queue.put(_task_timings(*args, barrier=barrier))


def measure_tiny(
    overrides: list[str], *, threads: int, repeats: int, concurrency: int = 1, links: bool = True
) -> dict[str, Any]:
    """Time the task code of the configured model on this machine; returns the raw fit.

    ``concurrency`` processes measure at once (the devices of a CPU run share the machine's
    cores and memory bandwidth); their timings are averaged."""
    from verl_digen.sync.state import trainable_state

    if concurrency <= 1:
        runs = [_task_timings(overrides, threads, repeats)]
    else:
        ctx = mp.get_context("spawn")
        barrier, queue = ctx.Barrier(concurrency), ctx.Queue()
        procs = [ctx.Process(target=_task_timings_child, args=((overrides, threads, repeats), barrier, queue))
                 for _ in range(concurrency)]
        for p in procs:
            p.start()
        runs = [queue.get(timeout=900) for _ in procs]
        for p in procs:
            p.join(timeout=60)
    t = {k: statistics.mean(r[k] for r in runs) for k in runs[0]}
    G, S, S2, k = runs[0]["G"], runs[0]["S"], runs[0]["S2"], runs[0]["trained_steps"]
    per_step = {n: (t[f"gen_{n}_{S}"] - t[f"gen_{n}_{S2}"]) / (S - S2) if S > S2 else t[f"gen_{n}_{S}"] / S for n in (1, 2)}
    outside = {n: t[f"gen_{n}_{S}"] - S * per_step[n] for n in (1, 2)}
    fwd0, fwd1 = _line(G, per_step[1], 2 * G, per_step[2])  # per forward: overhead, per image
    gen0, gen1 = _line(G, outside[1], 2 * G, outside[2])  # per call, per image outside the loop
    rew0, rew1 = _line(G, t["reward_1"], 2 * G, t["reward_2"])
    pass0, pass1 = _line(G, t["train_1"] / k, 2 * G, t["train_2"] / k)

    cfg, adapter, settings = _load(overrides, threads)
    sync_small = sync_big = task_overhead = math.nan
    bw = math.nan
    if links:  # weight sync between two processes and the Ray round trip
        state = trainable_state(adapter.transformer, lora_only=cfg.model.lora.enable)
        sync_small = measure_sync([tuple(v.shape) for v in state.values()], repeats)
        sync_big = measure_sync([(16, 1024, 1024)], repeats)  # 64 MB of fp32
        nbytes_small = sum(v.numel() * v.element_size() for v in state.values())
        bw = max((16 * 1024 * 1024 * 4 - nbytes_small) / max(sync_big - sync_small, 1e-9), 1e6)
        task_overhead = measure_task_overhead()

    return {
        "cfg": cfg,
        "shape": _model_shape(adapter, settings.spec),
        "settings": settings,
        "timings": {
            "tasks_s": {k2: v for k2, v in t.items() if k2 not in ("trained_steps", "S", "S2", "G")},
            "sync_s": {"lora_state": sync_small, "64MB": sync_big},
            "ray_round_trip_s": task_overhead,
            "concurrency": concurrency,
        },
        "fit": {
            "forward_overhead_s": fwd0,
            "forward_s_per_image": fwd1,
            "generate_overhead_s": gen0,
            "generate_s_per_image": gen1,
            "reward_overhead_s": rew0,
            "reward_s_per_image": rew1,
            "train_pass_overhead_s": pass0,
            "train_pass_s_per_image": pass1,
            "trained_steps": k,
            "optimizer_s": t["optimizer"],
            "sync_fixed_s": sync_small,
            "sync_gbps": bw / 1e9,
            "task_overhead_s": task_overhead,
        },
        "threads": threads,
        "concurrency": concurrency,
    }


def host_contention(isolated: dict[str, Any], contended: dict[str, Any]) -> float:
    """Extra fraction of a task's time when the other device of the machine is busy: the mean
    slow-down of the generate and train timings measured by two processes at once."""
    a, b = isolated["timings"]["tasks_s"], contended["timings"]["tasks_s"]
    keys = [k for k in a if k.startswith(("gen_", "train_"))]
    return max(0.0, statistics.mean(b[k] / a[k] for k in keys) - 1.0)


def profile_document(raw: dict[str, Any], name: str, device: str, contended: dict[str, Any] | None = None) -> dict[str, Any]:
    """The YAML document (models / devices / systems) of a :func:`measure_tiny` result
    (``contended``: the same measured by two processes at once, for ``host_contention``)."""
    from verl_digen.sim.cost_model import ModelProfile, Workload

    cfg, shape, fit, settings = raw["cfg"], raw["shape"], raw["fit"], raw["settings"]
    s = cfg.sampling
    window = settings.window.size if settings.window.mode != "all" else 0
    workload = {
        "height": s.height, "width": s.width, "frames": s.num_frames, "num_steps": s.num_steps,
        "cfg": bool(settings.uses_cfg), "group_size": cfg.batch.group_size, "groups_per_step": cfg.batch.groups_per_step,
        "sde_window": window, "timestep_fraction": s.timestep_fraction, "lora": cfg.model.lora.enable,
        "lora_rank": cfg.model.lora.rank, "kl": cfg.algo.kl_beta > 0, "train_device_batch": 1 << 20,
    }
    model = {
        "params": shape["params"], "layers": shape["layers"], "hidden": shape["hidden"],
        "vae_spatial": shape["vae_spatial"], "patch": shape["patch"], "text_tokens": shape["text_tokens"],
        "joint_text": True, "lora_params": shape["lora_params"], "gradient_checkpointing": False,
        "defaults": workload,
    }
    probe = ModelProfile(name=name, **{k: v for k, v in model.items() if k != "defaults"})
    from verl_digen.sim.cost_model import CostModel, SystemProfile

    tmp = CostModel(model=probe, workload=Workload(**workload), devices={}, system=SystemProfile())
    cfg_factor = 2 if settings.uses_cfg else 1
    flops = cfg_factor * tmp.forward_flops()  # per image, both branches
    rate = flops / fit["forward_s_per_image"]  # effective FLOP/s of this device on this model
    peak_tflops = rate / 1e12
    train_factor = tmp.train_flops_factor
    mfu_train = train_factor * flops / (rate * fit["train_pass_s_per_image"])
    pixels = s.height * s.width * s.num_frames
    model["decode_flops_per_pixel"] = fit["generate_s_per_image"] * rate / pixels
    model["reward_flops_per_image"] = fit["reward_s_per_image"] * rate
    when = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    host = (f"{platform.node()} ({platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
            f"torch threads={raw['threads']}, {raw['concurrency']} concurrent worker process(es))")
    src = f"{SOURCE} on {host}, {when}"
    model["sources"] = {
        "params": f"{src}: the loaded transformer's parameters (LoRA factors counted in lora_params)",
        "layers": f"{src}: transformer config (blocks attending over the sequence)",
        "hidden": f"{src}: transformer config heads x head_dim",
        "text_tokens": f"{src}: the conditioning's sequence length",
        "decode_flops_per_pixel": (
            f"{src}: per-image generate work outside the denoiser loop (prompt encoding, latents, VAE decode), "
            f"{fit['generate_s_per_image'] * 1e3:.3f} ms/image, expressed at this device's effective rate"
        ),
        "reward_flops_per_image": f"{src}: reward {fit['reward_s_per_image'] * 1e3:.3f} ms/image at the effective rate",
        "defaults": f"{src}: the digen config the measurement ran with",
    }
    dev = {
        "peak_tflops": peak_tflops, "mfu_forward": 1.0, "mfu_train": mfu_train,
        "hbm_gb": round(_memory_gb(), 1), "hbm_tbps": 10.0,
        "intra_node_gbps": fit["sync_gbps"], "inter_node_gbps": fit["sync_gbps"], "host_link_gbps": 1000.0,
        "devices_per_node": os.cpu_count() or 1, "decode_mfu": 1.0,
        "forward_overhead_s": fit["forward_overhead_s"], "train_pass_overhead_s": fit["train_pass_overhead_s"],
        "generate_overhead_s": fit["generate_overhead_s"], "reward_overhead_s": fit["reward_overhead_s"],
        "system": device,
        "host_contention": host_contention(raw, contended) if contended else 0.0,
        "sources": {
            "host_contention": (
                f"{src}: generate and train timed by two processes at once vs alone (mean slow-down - 1)"
                if contended else "not measured (--no-contention)"
            ),
            "peak_tflops": f"{src}: effective FLOP/s that reproduces the measured forward ({fit['forward_s_per_image'] * 1e3:.3f} ms per image-step; mfu_forward is 1 by construction)",
            "mfu_train": f"{src}: {fit['train_pass_s_per_image'] * 1e3:.3f} ms per image and trained step (forward+backward) relative to the forward rate",
            "forward_overhead_s": f"{src}: intercept of the per-step time against images per call",
            "train_pass_overhead_s": f"{src}: intercept of the per-trained-step time against images per micro-batch",
            "generate_overhead_s": f"{src}: intercept of the time outside the denoiser loop per generate call",
            "reward_overhead_s": f"{src}: intercept of the reward time per call",
            "intra_node_gbps": f"{src}: gloo weight-sync bandwidth between two processes (64 MB transfer)",
            "inter_node_gbps": "as intra_node_gbps (one machine)",
            "hbm_gb": "physical memory of this machine",
        },
    }
    system = {
        "nccl_efficiency": 1.0, "comm_overlap": 0.0, "switch_fixed_s": 0.0,
        "optimizer_fixed_s": fit["optimizer_s"], "sync_fixed_s": fit["sync_fixed_s"],
        "grad_bytes_per_param": 4.0, "optimizer_bytes_per_param": 12.0, "memory_headroom": 0.9,
        "activation_bytes": 34.0, "collective_step_latency_s": 0.0, "hsdp_shard": 1,
        "task_overhead_s": fit["task_overhead_s"],
        "sources": {
            "task_overhead_s": f"{src}: median round trip of an empty Ray actor call",
            "hsdp_shard": "1: the runtime keeps a full replica per trainer and all-reduces gradients at the optimizer step (PolicyUpdater.optimizer_step), no FSDP",
            "switch_fixed_s": "0: a fused worker of this runtime keeps one copy of the weights (no offload between generate and train)",
            "optimizer_fixed_s": f"{src}: PolicyUpdater.optimizer_step",
            "sync_fixed_s": f"{src}: one gloo WeightChannel send of the LoRA state between two processes",
            "comm_overlap": "0: no per-pass collectives to overlap",
        },
    }
    generic = {
        "vae_spatial": f"{src}: the adapter's VAE scale factor",
        "patch": f"{src}: image tokens per latent pixel of the loaded denoiser",
        "joint_text": "the tiny FLUX/SD3 denoisers attend over text and image tokens jointly",
        "lora_params": f"{src}: LoRA parameters injected with digen.model.lora",
        "gradient_checkpointing": "the runtime trains without activation checkpointing",
        "mfu_forward": "1 by construction: peak_tflops is the measured effective rate",
        "hbm_tbps": "placeholder: the optimizer step is measured directly (system.optimizer_fixed_s)",
        "host_link_gbps": "placeholder: nothing is offloaded on this runtime",
        "devices_per_node": "CPU cores of this machine",
        "decode_mfu": "1 by construction (decode_flops_per_pixel is expressed at the effective rate)",
        "system": "the measured system profile of the same name",
        "nccl_efficiency": "1: the measured gloo bandwidth is used as is",
        "grad_bytes_per_param": "the runtime all-reduces fp32 gradients",
        "optimizer_bytes_per_param": "AdamW state in fp32",
        "memory_headroom": "as the GPU profiles (no effect at this size)",
        "activation_bytes": "as the GPU profiles (no effect at this size)",
        "collective_step_latency_s": "0: no per-pass collectives",
    }
    for entry in (model, dev, system):
        for key in entry:
            if key != "sources" and key not in entry["sources"]:
                entry["sources"][key] = generic.get(key, src)
    return {"models": {name: model}, "devices": {device: dev}, "systems": {device: system},
            "measurements": raw["timings"]}


def _memory_gb() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    except (ValueError, OSError, AttributeError):
        return 16.0


def write_profile(doc: dict[str, Any], path: str) -> None:
    import yaml

    def plain(x: Any) -> Any:
        if isinstance(x, dict):
            return {str(k): plain(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [plain(v) for v in x]
        if hasattr(x, "item"):
            return x.item()
        return x

    header = (
        "# Cost-model profile written by `python -m verl_digen.profile` (see its --help).\n"
        "# Effective rates reproduce the measured task times of this model on this machine; every\n"
        "# value's provenance is in `sources`. `measurements` keeps the raw medians (seconds).\n"
    )
    with open(path, "w") as f:
        f.write(header)
        yaml.safe_dump(plain(doc), f, sort_keys=False, width=110)


# ---------------------------------------------------------------------------- --check


def check_against_real_runs(
    profiles: dict[str, str] | str, name: str, device: str, overrides: list[str], steps: int
) -> list[dict[str, Any]]:
    """Run the real loop colocated (2 devices) and disaggregated (1+1, without and with GAP);
    compare the steady-state step time (steps 2..N) with two simulations of the same strategy:

    - ``simulated``: the cost model with each measured profile (``profiles``: label -> file;
      e.g. measured alone and with two processes at once, which bracket a shared CPU machine);
    - ``replayed``: fixed per-kind task times taken from the run's own timeline, which isolates
      the schedule (plan + executor semantics) from the profile's accuracy.
    """
    if isinstance(profiles, str):
        profiles = {"simulated": profiles}
    from verl_digen.config.compose import compose_config
    from verl_digen.schedule.timeline import Timeline
    from verl_digen.sim.cost_model import CostModel, TableCostModel, load_catalog
    from verl_digen.workers.emulated import cluster_for_layout
    from verl_digen.sim.simulator import simulate
    from verl_digen.trainer.loop import DigenTrainer

    costs = {label: CostModel.from_catalog(load_catalog([path]), name, devices=[device]) for label, path in profiles.items()}
    rows = []
    for label, placement in (
        ("colocated, 2 devices", ["digen.placement=colocated", "trainer.n_gpus_per_node=2"]),
        ("disaggregated 1+1", ["digen.placement=disaggregated", "trainer.n_gpus_per_node=2"]),
        ("disaggregated 1+1, GAP", ["digen.placement=disaggregated", "trainer.n_gpus_per_node=2", "digen.gap.enable=true"]),
    ):
        cfg = compose_config(
            ["digen.progress_bar=false", f"trainer.total_training_steps={steps}", "digen.output_dir=/tmp/digen_profile_check",
             *overrides, *placement]
        )
        trainer = DigenTrainer(cfg)
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
        result = trainer.run()
        cluster = cluster_for_layout(trainer.job.layout, device)
        predicted = {
            label: simulate(trainer.spec, c, cluster, steps=steps, warmup=1, mirror_loop=True) for label, c in costs.items()
        }
        timeline = Timeline.read_jsonl(os.path.join(result.output_dir, "timeline.jsonl"))
        per_kind: dict[str, list[float]] = {}
        for r in timeline.records:
            if r.step >= 1:
                per_kind.setdefault(r.kind, []).append(r.end - r.start)
        table = TableCostModel(seconds={k: statistics.mean(v) for k, v in per_kind.items()})
        replay = simulate(trainer.spec, table, cluster, steps=steps, warmup=1, mirror_loop=True)
        real = statistics.mean(m["step_time_s"] for m in result.metrics[1:])
        rep = statistics.mean(m["step_time_s"] for m in replay.step_metrics[1:])
        row = {
            "run": label, "real_step_s": real, "replayed_step_s": rep, "replay_error": real / rep - 1,
            "real_bubble": statistics.mean(m["bubble_fraction"] for m in result.metrics[1:]),
            "task_ms_real": {k: 1000 * statistics.mean(v) for k, v in per_kind.items()},
            "load_average": load,
        }
        for plabel, sim in predicted.items():
            pred = statistics.mean(m["step_time_s"] for m in sim.step_metrics[1:])
            row[f"{plabel}_step_s"] = pred
            row[f"{plabel}_error"] = real / pred - 1
            row[f"{plabel}_bubble"] = statistics.mean(m["bubble_fraction"] for m in sim.step_metrics[1:])
        rows.append(row)
    return rows


def format_check(rows: list[dict[str, Any]]) -> str:
    labels = [k[: -len("_step_s")] for k in rows[0] if k.endswith("_step_s") and k not in ("real_step_s", "replayed_step_s")]
    head = f"{'run':<24} {'real s':>7} " + " ".join(f"{lab + ' s':>14} {'err':>7}" for lab in labels)
    head += f" {'replayed s':>10} {'err':>7} {'load':>5}"
    lines = [head]
    for r in rows:
        line = f"{r['run']:<24} {r['real_step_s']:>7.3f} "
        line += " ".join(f"{r[lab + '_step_s']:>14.3f} {100 * r[lab + '_error']:>+6.1f}%" for lab in labels)
        line += f" {r['replayed_step_s']:>10.3f} {100 * r['replay_error']:>+6.1f}% {r['load_average']:>5.1f}"
        lines.append(line)
    lines.append(
        "err = real / predicted - 1. simulated: the measured profile; no_contention: the same with the two CPU devices\n"
        "treated as independent (host_contention = 0). replayed: the run's own mean task times (schedule only).\n"
        "load: 1-min load average when the run started (the machine is shared with other jobs)."
    )
    return "\n".join(lines)


# ---------------------------------------------------------------------------- --block


def measure_block(hidden: int, tokens: int, heads: int, batch: int, repeats: int, dtype_name: str) -> dict[str, Any]:
    """Forward and forward+backward time of one pre-norm transformer block (attention + 4x MLP)."""
    import torch
    import torch.nn.functional as F

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, dtype_name) if device == "cuda" else torch.float32

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm1 = torch.nn.LayerNorm(hidden)
            self.qkv = torch.nn.Linear(hidden, 3 * hidden)
            self.out = torch.nn.Linear(hidden, hidden)
            self.norm2 = torch.nn.LayerNorm(hidden)
            self.mlp1 = torch.nn.Linear(hidden, 4 * hidden)
            self.mlp2 = torch.nn.Linear(4 * hidden, hidden)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, n, _ = x.shape
            q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, heads, hidden // heads).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, hidden)
            x = x + self.out(a)
            return x + self.mlp2(F.gelu(self.mlp1(self.norm2(x))))

    block = Block().to(device=device, dtype=dtype)
    x = torch.randn(batch, tokens, hidden, device=device, dtype=dtype, requires_grad=True)
    params = sum(p.numel() for p in block.parameters())
    flops = batch * (2.0 * params * tokens + 4.0 * tokens * tokens * hidden)

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    def fwd() -> None:
        with torch.no_grad():
            block(x)
        sync()

    def fwd_bwd() -> None:
        block(x).sum().backward()
        sync()

    t_f = _median_time(fwd, repeats)
    t_fb = _median_time(fwd_bwd, repeats)
    name = torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu"
    return {"device": name, "flops": flops, "forward_s": t_f, "train_s": t_fb,
            "forward_tflops": flops / t_f / 1e12, "train_tflops": 3 * flops / t_fb / 1e12}


# ---------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m verl_digen.profile", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="profile YAML to write")
    p.add_argument("--name", default=None, help="model profile name (default: tiny-<arch>)")
    p.add_argument("--device-name", default=None, help="device profile name (default: cpu-<host> / the GPU)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (the loop gives each worker cores/devices)")
    p.add_argument("--no-contention", action="store_true",
                   help="skip the second measurement with two processes at once (host_contention = 0)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--check", action="store_true", help="also run the real loop and compare with the simulator")
    p.add_argument("--check-steps", type=int, default=6)
    p.add_argument("--block", action="store_true", help="measure one DiT block instead (device efficiency)")
    p.add_argument("--hidden", type=int, default=3072)
    p.add_argument("--tokens", type=int, default=4608)
    p.add_argument("--heads", type=int, default=24)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--peak-tflops", type=float, default=None, help="--block: the device's dense peak, to express MFU")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("overrides", nargs="*", help="hydra overrides of the digen config (after --)")
    args = p.parse_args(argv)

    if args.block:
        r = measure_block(args.hidden, args.tokens, args.heads, args.batch, args.repeats, args.dtype)
        peak = args.peak_tflops or r["train_tflops"]
        name = args.device_name or r["device"].replace(" ", "-")
        doc = {"devices": {name: {
            "peak_tflops": peak, "mfu_forward": r["forward_tflops"] / peak, "mfu_train": r["train_tflops"] / peak,
            "hbm_gb": 80, "hbm_tbps": 3.35, "intra_node_gbps": 450, "inter_node_gbps": 50, "host_link_gbps": 50,
            "sources": {
                "mfu_forward": f"{SOURCE} --block: one DiT block, hidden {args.hidden}, {args.tokens} tokens, batch {args.batch}, {args.dtype}: {r['forward_tflops']:.1f} TFLOP/s",
                "mfu_train": f"{SOURCE} --block: forward+backward {r['train_tflops']:.1f} TFLOP/s",
                "peak_tflops": "--peak-tflops (spec sheet)" if args.peak_tflops else "not given: the measured training rate",
                "hbm_gb": "placeholder: edit from the spec sheet", "hbm_tbps": "placeholder", "intra_node_gbps": "placeholder",
                "inter_node_gbps": "placeholder", "host_link_gbps": "placeholder",
            }}}, "measurements": r}
        write_profile(doc, args.out)
        print(f"{r['device']}: forward {r['forward_tflops']:.2f} TFLOP/s, forward+backward {r['train_tflops']:.2f} TFLOP/s -> {args.out}")
        return 0

    raw = measure_tiny(args.overrides, threads=args.threads, repeats=args.repeats, concurrency=1)
    contended = None
    if not args.no_contention:
        contended = measure_tiny(args.overrides, threads=args.threads, repeats=args.repeats, concurrency=2, links=False)
    cfg = raw["cfg"]
    name = args.name or f"tiny-{cfg.model.tiny_arch if cfg.model.path is None else 'model'}"
    device = args.device_name or f"cpu-{platform.node() or 'local'}"
    doc = profile_document(raw, name, device, contended)
    write_profile(doc, args.out)
    print(f"wrote {args.out}: model {name!r}, device {device!r}")
    for k, v in raw["fit"].items():
        print(f"  {k:<24} {v:.6g}")
    print(f"  {'host_contention':<24} {doc['devices'][device]['host_contention']:.6g}")
    if args.check:
        paths = {"simulated": args.out}
        if contended is not None:  # the same profile with devices treated as independent
            isolated = os.path.splitext(args.out)[0] + ".isolated.yaml"
            write_profile(profile_document(raw, name, device), isolated)
            paths = {"simulated": args.out, "no_contention": isolated}
        rows = check_against_real_runs(paths, name, device, args.overrides, args.check_steps)
        print(format_check(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
