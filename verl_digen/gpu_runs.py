"""The parts of ``python -m verl_digen.gpu_check`` that rehearse the first disaggregated runs on one GPU.

Each runs in a child process of its own (``gpu_check --child-part NAME``: a CUDA fault or a
stuck Ray does not take the other parts with it) and returns its figures beside the memory
planner's predictions; on a CPU (``--device cpu --size tiny``) the same code runs at tiny size,
which is how CI rehearses them without a GPU:

* ``snapshot_order``: the sender's host snapshot (:class:`~verl_digen.sync.snapshot.HostSnapshot`)
  of a slowly produced state (``torch.cuda._sleep`` before each tensor is written: the host runs far
  ahead of the producer's kernels), 4 MiB buckets, twice (fresh pinned buffers, then reused); the
  captured bytes equal the sources bitwise;
* ``tsp_prompt_cache``: the tiny preset disaggregated with ``digen.tsp.stages=2`` and the prompt
  cache, 2 steps (the real job, ``python -m verl_digen.main``);
* ``reward_pool``: the digits preset with its classifier reward in a reward pool, 2 steps; and the
  same images scored on the CPU and on the device, compared;
* ``disaggregated_one_gpu``: one rollout and one trainer worker sharing the device, GAP + TCSS,
  3 steps and a checkpoint: the run's own weight digests (version 0 and the final one), staleness,
  NaN, and each worker's peak memory beside the planner's. ``--size real``: FLUX.1 at real size
  with random weights, saved first as a diffusers folder (the job loads a model from a path);
* ``full_ft_one_rank`` (in :mod:`verl_digen.gpu_check`): a full fine-tune step of FLUX on one rank.

Several workers on one GPU: Ray gives each worker one of the node's GPU ids and sets its
``CUDA_VISIBLE_DEVICES`` to that id *as the node's own CUDA_VISIBLE_DEVICES lists it*, so a node
started with ``CUDA_VISIBLE_DEVICES=0,0`` and two GPUs hands both workers device 0. The job
joins that Ray instance (started by the child's driver, ended with it) instead of starting its own.
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
import time
from typing import Any, Callable

import torch

from verl_digen.gpu_support import _device, _ended, _PartFailed, _run

GIB = 1 << 30

# The driver of a run whose workers share the devices: Ray started here with DIGEN_CHECK_DEVICES
# devices (GPUs, all one device, or CPU slots), then the job itself, which joins it.
_DRIVER = r"""
import os, sys
import ray
from verl_digen.config.omni_keys import plain_overrides
from verl_digen.trainer.runtime import QUIET_ENV
n, cuda = int(os.environ["DIGEN_CHECK_DEVICES"]), os.environ["DIGEN_CHECK_CUDA"] == "1"
ray.init(num_cpus=n + 2, num_gpus=n if cuda else 0, include_dashboard=False, log_to_driver=True,
         runtime_env={"env_vars": {**QUIET_ENV, "OMP_NUM_THREADS": "1"}})
sys.argv = ["verl_digen.main", *plain_overrides(sys.argv[1:])]
from verl_digen.main import main
main()
"""


def shared_device_run(overrides: list[str], *, devices: int, cuda: bool, timeout: float,
                      config_name: str | None = None) -> dict[str, Any]:
    """``python -m verl_digen.main`` on ``devices`` workers that share one GPU (``cuda``) or on
    CPU slots: return code, output tail, and the run's ``metrics.jsonl`` rows and ``workers.json``.
    ``overrides`` must set ``digen.output_dir``."""
    env = {**os.environ, "DIGEN_CHECK_DEVICES": str(devices), "DIGEN_CHECK_CUDA": "1" if cuda else "0",
           "PYTHONUNBUFFERED": "1"}
    env.pop("RAY_ADDRESS", None)
    if cuda:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(["0"] * devices)
    cmd = [sys.executable, "-c", _DRIVER, *(["--config-name", config_name] if config_name else []),
           f"trainer.n_gpus_per_node={devices}", *overrides]
    t0 = time.perf_counter()
    res = _run(cmd, timeout=timeout, env=env)
    res["seconds"] = time.perf_counter() - t0
    out_dir = next(o.split("=", 1)[1] for o in overrides if o.startswith("digen.output_dir="))
    res["rows"] = _json_lines(os.path.join(out_dir, "metrics.jsonl"))
    workers = os.path.join(out_dir, "workers.json")
    res["workers"] = json.load(open(workers, encoding="utf-8")) if os.path.isfile(workers) else []
    return res


def _json_lines(path: str) -> list[dict[str, Any]]:
    if not os.path.isfile(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _check_run(name: str, res: dict[str, Any], steps: int) -> None:
    if res["rc"] != 0:
        raise RuntimeError(f"{name} run {_ended(res)}:\n{res['tail']}")
    got = [r.get("step") for r in res["rows"]]
    if got != list(range(1, steps + 1)):
        raise AssertionError(f"{name} run logged steps {got}, not 1..{steps}")


def _nonfinite(rows: list[dict[str, Any]]) -> list[str]:
    """``step:key`` of every logged number that is NaN or infinite."""
    return [f"{r.get('step')}:{k}" for r in rows for k, v in r.items()
            if isinstance(v, float) and not math.isfinite(v)]


def _composed(overrides: list[str], config_name: str | None):
    from omegaconf import OmegaConf

    from verl_digen.config.compose import compose_config
    from verl_digen.config.schema import digen_config_from_dict

    cfg = compose_config(overrides, **({"config_name": config_name} if config_name else {}))
    return cfg, digen_config_from_dict(OmegaConf.to_container(cfg.digen, resolve=True))


def memory_beside_plan(overrides: list[str], config_name: str | None, devices: int, rows: list[dict[str, Any]],
                       model_path: str | None = None) -> dict[str, Any]:
    """Each pool's measured peaks (the last step's ``memory/<pool>/*``: device allocated and
    reserved on a GPU, host RSS) beside the planner's peak for the role, and their ratio."""
    from verl_digen.memory.plan import plan_job
    from verl_digen.trainer.resolve import resolve_model_path

    _cfg, dcfg = _composed([f"trainer.n_gpus_per_node={devices}", *overrides], config_name)
    model_path = model_path or resolve_model_path(dcfg)  # the built-in tiny model's folder, as the run's
    plans = {p.role: p for p in plan_job(dcfg, devices_per_node=devices, model_path=model_path)}
    last = rows[-1] if rows else {}
    out: dict[str, Any] = {"planned_total_gib": round(sum(p.peak_gib for p in plans.values()), 3)}
    for role, plan in sorted(plans.items()):
        pool = "rollout" if role in ("rollout", "generate") else role
        # allocated is compared with the peak less the plan's overhead (CUDA context, allocator
        # slack: not allocated tensors), reserved with the whole peak
        without = (plan.peak_bytes - plan.bytes.get("overhead", 0)) / GIB
        row: dict[str, Any] = {"planned_peak_gib": round(plan.peak_gib, 3), "planned_without_overhead_gib": round(without, 3),
                               "planned_phase": plan.phase,
                               "planned": {k: round(v / GIB, 3) for k, v in plan.bytes.items() if v}}
        for key in ("device_max_allocated_gib", "device_max_reserved_gib", "host_peak_gib"):
            value = last.get(f"memory/{pool}/{key}")
            if value is not None:
                row[key] = round(value, 3)
        if "device_max_allocated_gib" in row and without > 0:
            row["allocated_over_plan"] = round(row["device_max_allocated_gib"] / without, 3)
            row["reserved_over_plan"] = round(row["device_max_reserved_gib"] / plan.peak_gib, 3)
            row["allocated_within_15pct"] = 0.85 <= row["allocated_over_plan"] <= 1.15
        out[role] = row
    return out


# ---------------------------------------------------------------------- snapshot_order


def part_snapshot_order(device_name: str, *, tensors: int = 64, numel: int = 1 << 18,
                        bucket_bytes: int = 4 << 20) -> dict[str, Any]:
    """A slowly produced state captured twice into 4 MiB buckets, compared bitwise."""
    from verl_digen.sync.snapshot import HostSnapshot, weights_digest

    device = _device(device_name)
    cuda = device.type == "cuda"
    g = torch.Generator(device=device).manual_seed(0)
    refs = [torch.rand(numel, device=device, generator=g, dtype=torch.float32).to(torch.bfloat16 if i % 2 else torch.float32)
            for i in range(tensors)]
    if cuda:
        torch.cuda.synchronize(device)

    def produce():
        for i, ref in enumerate(refs):
            out = torch.full_like(ref, -1.0)  # what a copy that ran before the write would read
            if cuda:
                torch.cuda._sleep(2_000_000)  # about a millisecond of GPU time before the write
            out.copy_(ref)
            yield f"w{i:03d}", out

    snap = HostSnapshot(bucket_bytes=bucket_bytes)
    rounds = []
    for k in range(2):  # fresh buffers, then the same ones reused
        t0 = time.perf_counter()
        snap.capture(produce())
        enqueued = time.perf_counter() - t0
        host = snap.state()
        seconds = time.perf_counter() - t0
        mismatched = [f"w{i:03d}" for i, ref in enumerate(refs)
                      if not torch.equal(host[f"w{i:03d}"].reshape(-1).view(torch.uint8), ref.cpu().view(torch.uint8))]
        rounds.append({"buckets": len(list(snap.parts())), "bytes": snap.nbytes, "enqueue_seconds": enqueued,
                       "seconds": seconds, "mismatched": mismatched[:8], "mismatched_count": len(mismatched),
                       "allocations": snap.allocations, "ptrs_first": snap.buffer_ptrs()[:1]})
    src_digest = weights_digest({f"w{i:03d}": r for i, r in enumerate(refs)})
    out = {"device": str(device), "tensors": tensors, "bucket_bytes": bucket_bytes, "rounds": rounds,
           "pinned": cuda and all(b.is_pinned() for buffers, _ in snap.parts() for b in buffers),
           "buffers_reused": rounds[0]["allocations"] == rounds[1]["allocations"],
           "digest_equal": weights_digest(snap.state()) == src_digest,
           "bitwise_equal": all(r["mismatched_count"] == 0 for r in rounds)}
    if not (out["bitwise_equal"] and out["digest_equal"] and out["buffers_reused"] and rounds[0]["buckets"] >= 4):
        raise AssertionError(f"snapshot_order: {out}")
    return out


# ---------------------------------------------------------------------- runs on shared devices


def _run_dirs(tmp: str, name: str) -> list[str]:
    return [f"digen.output_dir={tmp}/{name}", f"trainer.default_local_dir={tmp}/{name}_ck",
            "digen.progress_bar=false"]


def part_tsp_prompt_cache(device_name: str, size: str, timeout: float) -> dict[str, Any]:
    """The tiny preset, disaggregated: 2 rollout workers in one time-step pipeline
    (``digen.tsp.stages=2``) and a trainer, with the prompt cache, 2 steps."""
    cuda = device_name.startswith("cuda")
    with tempfile.TemporaryDirectory() as tmp:
        ov = ["digen.placement=disaggregated", "digen.pools.rollout.devices=2", "digen.pools.trainer.devices=1",
              "digen.tsp.stages=2", "digen.prompt_cache.enable=true", f"digen.prompt_cache.dir={tmp}/pc",
              f"digen.model.dtype={'bf16' if cuda else 'fp32'}", "trainer.total_training_steps=2",
              "trainer.save_freq=-1", *_run_dirs(tmp, "tsp")]
        res = shared_device_run(ov, devices=3, cuda=cuda, timeout=timeout)
        _check_run("tsp_prompt_cache", res, 2)
        cache_files = sum(len(f) for _, _, f in os.walk(f"{tmp}/pc"))
        out = {"seconds_run": res["seconds"], "images_per_s": [r.get("images_per_s") for r in res["rows"]],
               "loss": [r.get("actor/loss") for r in res["rows"]], "strategy": res["rows"][0].get("strategy"),
               "prompt_cache_files": cache_files, "nonfinite": _nonfinite(res["rows"]),
               "memory": memory_beside_plan([o for o in ov if not o.startswith("digen.output_dir")], None, 3, res["rows"])}
        if out["nonfinite"] or not cache_files:
            raise AssertionError(f"tsp_prompt_cache: {out}")
        return out


def _reward_scores(device_name: str, samples: int = 16) -> dict[str, Any]:
    """The digits preset's reward on the same images on the CPU and on ``device_name``."""
    from verl_digen.config.schema import RewardConfig
    from verl_digen.rewards.base import build_reward_from_config

    _cfg, dcfg = _composed([], "digits")
    g = torch.Generator().manual_seed(0)
    images = torch.rand(samples, 3, 8, 8, generator=g)
    prompts = [f"the digit {i % 10}" for i in range(samples)]
    spec: RewardConfig = dcfg.reward
    scores = {}
    for dev in ("cpu", device_name):
        fn = build_reward_from_config(spec.as_spec(), device=dev)
        scores[dev] = fn(images.to(dev), prompts, None).float().cpu()
    diff = float((scores["cpu"] - scores[device_name]).abs().max())
    return {"reward": spec.name, "samples": samples, "max_abs_diff_cpu_vs_device": diff,
            "cpu_mean": float(scores["cpu"].mean()), "device_mean": float(scores[device_name].mean())}


def part_reward_pool(device_name: str, size: str, timeout: float) -> dict[str, Any]:
    """The digits preset with its classifier in a reward pool (rollout, trainer, reward), 2 steps,
    and the reward's scores on the CPU and the device compared."""
    cuda = device_name.startswith("cuda")
    out: dict[str, Any] = {"scores": _reward_scores(device_name)}
    with tempfile.TemporaryDirectory() as tmp:
        ov = ["digen.placement=disaggregated", "digen.pools.rollout.devices=1", "digen.pools.trainer.devices=1",
              "digen.pools.reward.devices=1", "digen.batch.groups_per_step=2", "digen.batch.group_size=4",
              "trainer.total_training_steps=2", "trainer.save_freq=-1", "trainer.test_freq=-1",
              "trainer.val_before_train=false", *_run_dirs(tmp, "reward_pool")]
        res = shared_device_run(ov, devices=3, cuda=cuda, timeout=timeout, config_name="digits")
        _check_run("reward_pool", res, 2)
        out.update(seconds_run=res["seconds"], reward_mean=[r.get("reward_mean") for r in res["rows"]],
                   nonfinite=_nonfinite(res["rows"]),
                   reward_workers=[w for w in res["workers"] if w.get("role") == "reward"],
                   memory=memory_beside_plan([o for o in ov if not o.startswith("digen.output_dir")], "digits", 3,
                                             res["rows"]))
    # bf16 on the device against fp32 on the CPU would differ by ~1e-3; both are fp32 here
    if out["nonfinite"] or not out["reward_workers"] or out["scores"]["max_abs_diff_cpu_vs_device"] > 1e-4:
        raise AssertionError(f"reward_pool: {out}")
    return out


def save_random_flux(folder: str, device: torch.device, build_real: Callable[..., Any]) -> dict[str, Any]:
    """Real-size FLUX.1 with random weights (``build_real``:
    :func:`~verl_digen.gpu_check.build_real_flux`), saved as a diffusers folder that
    ``digen.model.path`` loads (bf16 safetensors, ~33 GB)."""
    t0 = time.perf_counter()
    adapter = build_real(device, torch.bfloat16)
    save_flux_folder(adapter, folder)
    del adapter
    if device.type == "cuda":
        torch.cuda.empty_cache()
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(folder) for f in fs)
    return {"seconds": time.perf_counter() - t0, "gib": size / GIB}


def save_flux_folder(adapter: Any, folder: str) -> None:
    """A FLUX adapter's components as a diffusers pipeline folder (what ``load_adapter`` reads)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline

    pipe = FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler.from_config(adapter.scheduler_config),
                        vae=adapter.vae, text_encoder=adapter.text_encoder, tokenizer=adapter.tokenizer,
                        text_encoder_2=adapter.text_encoder_2, tokenizer_2=adapter.tokenizer_2,
                        transformer=adapter.transformer)
    pipe.save_pretrained(folder, safe_serialization=True)


def part_disaggregated_one_gpu(device_name: str, size: str, timeout: float,
                               build_real: Callable[..., Any] | None = None) -> dict[str, Any]:
    """One rollout and one trainer worker on one device: GAP + TCSS, 3 steps, a checkpoint.
    ``build_real``: the real-size model's builder (``--size real``)."""
    out: dict[str, Any] = {"size": size}
    try:
        return _disaggregated(device_name, size, timeout, out, build_real)
    except Exception as e:  # what was measured before the failure goes into the report
        raise _PartFailed(f"{type(e).__name__}: {e}", out) from e


def _disaggregated(device_name: str, size: str, timeout: float, out: dict[str, Any],
                   build_real: Callable[..., Any] | None) -> dict[str, Any]:
    cuda = device_name.startswith("cuda")
    with tempfile.TemporaryDirectory(dir=os.environ.get("DIGEN_CHECK_DISK")) as tmp:
        ov = ["digen.placement=disaggregated", "digen.pools.rollout.devices=1", "digen.pools.trainer.devices=1",
              "digen.gap.enable=true", "digen.async.max_staleness=1", "trainer.total_training_steps=3",
              "trainer.save_freq=3", f"digen.model.dtype={'bf16' if cuda else 'fp32'}"]
        config_name, model_path = None, None
        if size == "real":  # the real job loads a model from a path: the random one, saved first
            model_path = os.path.join(tmp, "flux-random")
            out["saved_model"] = save_random_flux(model_path, _device(device_name), build_real)
            config_name = "flux_disaggregated"
            ov += [f"digen.model.path={model_path}", "digen.batch.groups_per_step=1", "digen.batch.group_size=2",
                   "digen.batch.groups_per_task=1", "digen.batch.train_micro_batch_groups=1",
                   "digen.sampling.height=256", "digen.sampling.width=256", "digen.sampling.num_steps=10",
                   "digen.memory.device_type=H200", "trainer.test_freq=-1", "trainer.val_before_train=false"]
        run_ov = [*ov, *_run_dirs(tmp, "disagg")]
        res = shared_device_run(run_ov, devices=2, cuda=cuda, timeout=timeout, config_name=config_name)
        out["seconds_run"] = res["seconds"]
        _check_run("disaggregated_one_gpu", res, 3)
        rows = res["rows"]
        ck = os.path.join(tmp, "disagg_ck")
        out.update(
            strategy=rows[0].get("strategy"),
            # the run compares the trainer's and rollout's weight digests at version 0 and after
            # the last sync, and stops with an error when they differ: rc 0 means equal at both
            weights_digests_checked=["version 0", f"version {rows[-1].get('policy_version')}"],
            max_staleness_seen=max(r.get("max_staleness_seen", 0) for r in rows),
            policy_versions=[r.get("policy_version") for r in rows],
            weight_sync_s=[r.get("weight_sync_s") for r in rows],
            images_per_s=[r.get("images_per_s") for r in rows],
            loss=[r.get("actor/loss") for r in rows], nonfinite=_nonfinite(rows),
            checkpoints=sorted(d for d in os.listdir(ck) if d.startswith("global_step")) if os.path.isdir(ck) else [],
        )
        out["memory"] = memory_beside_plan(ov, config_name, 2, rows, model_path=model_path)
    if out["nonfinite"] or out["max_staleness_seen"] > 1 or "global_step_3" not in out["checkpoints"]:
        raise AssertionError(f"disaggregated_one_gpu: {out}")
    return out
