"""The FlowGRPO training loop, driven as plans on Ray worker groups.

Read it as the algorithm: for each step, sample groups of images with SDE log-probs,
score them, normalise rewards within each group, train on micro-batches of whole groups
with gradient accumulation, step the optimizer, hand the weights to rollout. *Where* and
*when* each of those runs is the plan's business (colocated, disaggregated, +GAP, +TCSS).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from verl_digen.config.schema import ConfigError, DigenConfig, digen_config_from_dict
from verl_digen.placement.pools import build_worker_groups, cluster_from_trainer_config, pool_layout
from verl_digen.schedule.plan import TaskKind, WorkerId, group_ids
from verl_digen.schedule.strategies import StepCosts, StepPlanner, measure_costs
from verl_digen.schedule.timeline import save_gantt
from verl_digen.trainer.ray_executor import RayPlanExecutor

# Keep the console for the progress bar and the metrics, not per-worker loading bars.
QUIET_ENV = {
    "TOKENIZERS_PARALLELISM": "false",
    "TRANSFORMERS_VERBOSITY": "error",
    "DIFFUSERS_VERBOSITY": "error",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
}
for _k, _v in QUIET_ENV.items():
    os.environ.setdefault(_k, _v)


class RunStopped(RuntimeError):
    """The run stopped cleanly on a failure; the message names it and how to resume."""


class NonFiniteTraining(RuntimeError):
    """Too many optimizer steps had non-finite gradients."""


@dataclass
class RunResult:
    output_dir: str
    metrics: list[dict[str, Any]]
    strategy: str
    devices: int
    wall_s: float
    extra: dict[str, Any] = field(default_factory=dict)


def _total_steps(trainer_cfg: Any) -> int:
    steps = trainer_cfg.get("total_training_steps")
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ConfigError(f"invalid config: trainer.total_training_steps={steps!r}; must be a positive integer")
    return steps


def resolve_model_path(cfg: DigenConfig) -> str:
    from verl_digen.models.registry import ADAPTERS, detect_arch
    from verl_digen.models.tiny import ensure_tiny

    if cfg.model.path is None:
        return ensure_tiny(cfg.model.tiny_arch)
    if not os.path.isdir(cfg.model.path):
        raise FileNotFoundError(f"digen.model.path: model path '{cfg.model.path}' does not exist")
    if cfg.model.arch is not None and cfg.model.arch not in ADAPTERS:
        raise ConfigError(f"invalid config: digen.model.arch={cfg.model.arch!r}; known: {', '.join(sorted(ADAPTERS))}")
    detect_arch(cfg.model.path)  # names a missing model_index.json or an unsupported pipeline
    return os.path.abspath(cfg.model.path)


def resolve_prompts(cfg: DigenConfig, source: str | None = None) -> list[str]:
    from verl_digen.data import builtin_prompts, load_prompts

    key = "digen.data.prompts" if source is None else "digen.validation.prompts"
    source = source or cfg.data.prompts
    try:
        if source.startswith("builtin:"):
            return builtin_prompts(source.split(":", 1)[1])
        return load_prompts(source)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{key}: {e}") from None
    except ValueError as e:
        raise ConfigError(f"invalid config: {key}={source!r}: {e}") from None


def output_dir_for(cfg: DigenConfig, trainer_cfg: Any) -> str:
    if cfg.output_dir:
        path = cfg.output_dir
    else:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path = os.path.join("runs", str(trainer_cfg.project_name), f"{trainer_cfg.experiment_name}-{stamp}")
    os.makedirs(path, exist_ok=True)
    return os.path.abspath(path)


def preflight_reward(cfg: DigenConfig) -> None:
    """Fail before any worker starts when a remote reward (HTTP server, VLM judge) is unreachable."""
    from verl_digen.rewards import build_reward

    specs = [{"name": cfg.reward.name, "kwargs": cfg.reward.kwargs}] + list(cfg.reward.components)
    for spec in specs:
        if spec.get("name") in ("http", "vlm_judge"):
            build_reward(spec["name"], **dict(spec.get("kwargs") or {})).check_reachable()


def _init_ray(devices: int, cfg: DigenConfig, use_gpu: bool) -> bool:
    import ray

    if ray.is_initialized():
        return False
    num_cpus = cfg.ray_num_cpus or max(devices + 2, os.cpu_count() or 1)
    ray.init(
        num_cpus=num_cpus,
        include_dashboard=False,
        ignore_reinit_error=True,
        log_to_driver=True,
        runtime_env={"env_vars": {**QUIET_ENV, "OMP_NUM_THREADS": "1"}},
    )
    return True


def _mean(values: list[float]) -> float:
    return float(sum(values) / len(values)) if values else 0.0


class DigenTrainer:
    """Builds pools and workers, then runs ``trainer.total_training_steps`` planned steps."""

    def __init__(self, config: DictConfig) -> None:
        container = OmegaConf.to_container(config, resolve=True)
        assert isinstance(container, dict)
        self.full_config = container
        self.trainer_cfg = config.trainer
        self.cfg = digen_config_from_dict(container.get("digen"))
        self.total_steps = _total_steps(self.trainer_cfg)
        self.cluster = cluster_from_trainer_config(self.trainer_cfg)
        self.layout = pool_layout(self.cfg, self.cluster)
        self.spec = self.layout.spec
        self.prompts = resolve_prompts(self.cfg)
        self.emulated = self.cfg.emulate.model is not None
        self.test_freq = -1 if self.emulated else int(self.trainer_cfg.get("test_freq", -1) or -1)
        self.val_prompts = resolve_prompts(self.cfg, self.cfg.validation.prompts)[: self.cfg.validation.num_prompts]
        preflight_reward(self.cfg)
        # An emulated cluster has no model, no weights to save and nothing to resume.
        self.model_path = "<emulated>" if self.emulated else resolve_model_path(self.cfg)
        self.output_dir = output_dir_for(self.cfg, self.trainer_cfg)
        self.ckpt_root = str(self.trainer_cfg.default_local_dir)
        self.save_freq = -1 if self.emulated else int(self.trainer_cfg.get("save_freq", -1) or -1)
        self.resume_from = None if self.emulated else self._resume_checkpoint()
        self.start_step = self.resume_from.step if self.resume_from else 0
        if self.start_step >= self.total_steps:
            raise ConfigError(
                f"checkpoint {self.resume_from.path} is at step {self.start_step}, which already reaches "
                f"trainer.total_training_steps={self.total_steps}; raise total_training_steps to continue, "
                "or start fresh with trainer.resume_mode=disable"
            )
        self._last_saved = self.start_step

    def _resume_checkpoint(self):
        from verl_digen.trainer.checkpoint import checkpoint_at, find_latest

        mode = self.trainer_cfg.get("resume_mode", "auto")
        if mode == "disable":
            return None
        if mode == "auto":
            return find_latest(self.ckpt_root)
        if mode == "resume_path":
            path = self.trainer_cfg.get("resume_from_path")
            if not path:
                raise ConfigError("invalid config: trainer.resume_mode=resume_path needs trainer.resume_from_path")
            return checkpoint_at(str(path))
        raise ConfigError(f"invalid config: trainer.resume_mode={mode!r}; valid: auto, disable, resume_path")

    # ------------------------------------------------------------------ run

    def run(self) -> RunResult:
        import ray

        from verl.utils.tracking import Tracking
        from verl_digen.data import PromptSampler

        cfg = self.cfg
        use_gpu = torch.cuda.is_available()
        devices = self.spec.devices
        owns_ray = _init_ray(devices, cfg, use_gpu)
        threads = max(1, (os.cpu_count() or 1) // max(devices, 1)) if not use_gpu else 4
        digen_dict = self.full_config["digen"]
        if self.emulated:
            from verl_digen.sim.emulated import build_emulated_worker_groups, emulation_costs

            em = cfg.emulate
            groups, actors = build_emulated_worker_groups(
                self.layout, emulation_costs(em.model, em.device_type), device=em.device_type,
                time_scale=em.time_scale, group_size=cfg.batch.group_size,
            )
        else:
            groups, actors = build_worker_groups(
                self.layout, config=digen_dict, model_path=self.model_path, use_gpu=use_gpu, num_threads=threads
            )
        try:
            infos = ray.get([a.init_model.remote() for a in actors.values()], timeout=cfg.task_timeout_s)
            with open(os.path.join(self.output_dir, "workers.json"), "w") as f:
                json.dump([{**i, "worker": str(w)} for w, i in zip(actors, infos)], f, indent=2)
            if cfg.prompt_cache.enable and not self.emulated:
                encoders = [a for w, a in actors.items() if w.pool != "reward"]
                stats = ray.get([a.warm_prompt_cache.remote(self.prompts + self.val_prompts) for a in encoders],
                                timeout=cfg.task_timeout_s)
                self.prompt_cache_stats = stats[0]
            sampler = PromptSampler(self.prompts, seed=cfg.seed, shuffle=cfg.data.shuffle)
            self.history: list[dict[str, Any]] = []
            if self.resume_from is not None:
                self._load_checkpoint(actors, sampler)
            if self.spec.placement == "disaggregated":
                self._open_weight_channel(actors, use_gpu)
            tracker = Tracking(
                project_name=self.trainer_cfg.project_name,
                experiment_name=self.trainer_cfg.experiment_name,
                default_backend=list(self.trainer_cfg.logger),
                config=self.full_config,
            )
            try:
                metrics = self._train(actors, sampler, tracker)
            except BaseException as e:
                raise self._stopped(e, actors) from e
            extra = self._finish(actors)
            tracker.finish()
        finally:
            from ray.util.placement_group import remove_placement_group

            for wg in groups.values():
                for a in wg.workers:
                    ray.kill(a, no_restart=True)
                for pg in getattr(wg.resource_pool, "pgs", None) or []:
                    remove_placement_group(pg)
            if owns_ray:
                ray.shutdown()
        print(f"[verl-digen] run output: {self.output_dir}")
        return RunResult(
            output_dir=self.output_dir,
            metrics=metrics,
            strategy=self.spec.name,
            devices=devices,
            wall_s=self._wall_s,
            extra=extra,
        )

    def _finish(self, actors: dict[WorkerId, Any]) -> dict[str, Any]:
        """Check rollout holds the trainer's final weights; optionally save them."""
        import ray

        extra: dict[str, Any] = {}
        source = actors[self.spec.trainers[0]]
        if self.spec.placement == "disaggregated":
            digests = ray.get(
                [source.weights_digest.remote()] + [actors[w].weights_digest.remote() for w in self.spec.generators],
                timeout=120,
            )
            extra["weights_in_sync"] = all(d == digests[0] for d in digests[1:])
            if not extra["weights_in_sync"]:
                raise RuntimeError("after the final sync, rollout weights differ from the trainer's")
        if self.cfg.save_final_weights and not self.emulated:
            from safetensors.torch import save_file

            state = ray.get(source.trainable_state_cpu.remote(), timeout=300)
            path = os.path.join(self.output_dir, "final_weights.safetensors")
            save_file(state, path)
            extra["final_weights"] = path
        return extra

    def _open_weight_channel(self, actors: dict[WorkerId, Any], use_gpu: bool) -> None:
        import ray

        backend = self.cfg.sync.backend
        if backend == "auto":
            backend = "nccl" if use_gpu else "gloo"
        sender = actors[WorkerId("trainer", 0)]
        receivers = [actors[WorkerId("rollout", r)] for r in range(self.spec.rollout_workers)]
        addr, port = ray.get(sender.sync_master_endpoint.remote(), timeout=60)
        world = len(receivers) + 1
        ray.get(
            [sender.sync_open.remote(0, world, addr, port, backend)]
            + [w.sync_open.remote(i + 1, world, addr, port, backend) for i, w in enumerate(receivers)],
            timeout=self.cfg.task_timeout_s,
        )
        digests = ray.get([sender.weights_digest.remote(), receivers[0].weights_digest.remote()], timeout=60)
        if digests[0] != digests[1]:
            raise RuntimeError("rollout and trainer start from different weights (same model dir and LoRA seed expected)")

    def _train(self, actors: dict[WorkerId, Any], sampler: Any, tracker: Any) -> list[dict[str, Any]]:
        from tqdm import tqdm

        cfg = self.cfg
        if self.spec.tsp_stages > 1 and cfg.tsp.balance:
            self.spec = self._balanced_stages(actors)
        first = self.start_step
        planner = StepPlanner(self.spec, start_step=first)
        executor = RayPlanExecutor(planner.plan, actors, std_mode=cfg.algo.std_mode, timeout_s=cfg.task_timeout_s)
        self._executor = executor
        metrics_path = os.path.join(self.output_dir, "metrics.jsonl")
        lookahead = 1 if self.spec.max_staleness else 0
        assigned_until = first - 1
        # The sampler's position before each step's prompts were drawn: what a checkpoint
        # after step s stores (prompts of s+1 may already be drawn by TCSS look-ahead).
        self._sampler_before: dict[int, dict[str, Any]] = {first: sampler.state_dict()}

        def assign_prompts(step: int) -> None:
            nonlocal assigned_until
            while assigned_until < step:
                assigned_until += 1
                self._sampler_before[assigned_until] = sampler.state_dict()
                ids = group_ids(assigned_until, self.spec.groups_per_step)
                for g, (idx, prompt) in zip(ids, sampler.next(len(ids))):
                    executor.prompts[g] = (idx, prompt)
            self._sampler_before.setdefault(assigned_until + 1, sampler.state_dict())

        costs = StepCosts()
        all_metrics: list[dict[str, Any]] = list(self.history)
        nonfinite = sum(int(m.get("actor/skipped_nonfinite", 0)) for m in all_metrics)
        t_run0 = time.time()
        t_prev = t_run0
        self._completed = first
        bar = tqdm(range(first, self.total_steps), desc=f"digen {self.spec.name}", disable=not cfg.progress_bar,
                   initial=first, total=self.total_steps)
        with open(metrics_path, "w") as mf:
            for m in all_metrics:
                mf.write(json.dumps(m) + "\n")
            for s in range(first, self.total_steps):
                assign_prompts(min(s + lookahead, self.total_steps - 1))
                tag_metrics, tag_groups = self._tag_decision(executor, s)
                if self.spec.tsp_stages > 1 and cfg.tsp.balance and s > first:
                    planner.spec = self.spec = self._rebalanced_stages(executor, s - 1)
                planner.plan_step(s, costs, has_next=s + 1 < self.total_steps, tag_groups=tag_groups)
                executor.run_until([f"opt:{s}"])
                t_end = time.time()
                m = self._step_metrics(executor, s, t_prev, t_end)
                m.update(tag_metrics)
                if self.test_freq > 0 and ((s + 1) % self.test_freq == 0 or s + 1 == self.total_steps):
                    m.update(self._validate(actors, s + 1, tracker))
                all_metrics.append(m)
                self._completed = s + 1
                mf.write(json.dumps(m) + "\n")
                mf.flush()
                tracker.log(data={k: v for k, v in m.items() if isinstance(v, (int, float))}, step=m["step"])
                bar.update(1)
                bar.set_postfix(reward=f"{m['reward_mean']:.4f}", img_s=f"{m['images_per_s']:.2f}")
                nonfinite += int(m.get("actor/skipped_nonfinite", 0))
                if nonfinite > cfg.max_nonfinite_steps:
                    raise NonFiniteTraining(
                        f"{nonfinite} optimizer steps skipped for non-finite gradients "
                        f"(digen.max_nonfinite_steps={cfg.max_nonfinite_steps})"
                    )
                if self.save_freq > 0 and ((s + 1) % self.save_freq == 0 or s + 1 == self.total_steps):
                    self._save_checkpoint(actors, s + 1, all_metrics)
                costs = measure_costs(executor.timeline.of_step(s), s, self.spec, costs)
                t_prev = time.time()
            bar.close()
            executor.run_until(None)  # nothing may be left running (e.g. a final sync)
        self._wall_s = time.time() - t_run0
        executor.plan.check(complete_steps=range(first, self.total_steps))
        executor.timeline.write_jsonl(os.path.join(self.output_dir, "timeline.jsonl"), t0=t_run0)
        self._save_gantt(executor, all_metrics, t_run0)
        return all_metrics

    def _validate(self, actors: dict[WorkerId, Any], step: int, tracker: Any) -> dict[str, float]:
        """Validation on the first trainer (it holds the newest weights, and the EMA)."""
        import numpy as np
        import ray
        from PIL import Image

        from verl_digen.trainer.media import log_images_tensorboard, log_images_wandb

        val_dir = os.path.join(self.output_dir, "val")
        ranks = self.spec.trainers if self.spec.fsdp else self.spec.trainers[:1]  # FSDP: lockstep forwards
        out = ray.get(
            [actors[w].validate.remote(self.val_prompts, step, val_dir) for w in ranks], timeout=self.cfg.task_timeout_s
        )[0]
        grid = np.asarray(Image.open(out["grid_path"]).convert("RGB"))
        loggers = list(self.trainer_cfg.logger)
        if "tensorboard" in loggers:
            tb_dir = os.environ.get(
                "TENSORBOARD_DIR", os.path.join("tensorboard_log", str(self.trainer_cfg.project_name),
                                                str(self.trainer_cfg.experiment_name))
            )
            log_images_tensorboard(tb_dir, "val/images", grid, step)
        if "wandb" in loggers:
            log_images_wandb("val/images", grid, step)
        return out["metrics"]

    # ------------------------------------------------------------------ checkpoints

    def _save_checkpoint(self, actors: dict[WorkerId, Any], step: int, metrics: list[dict[str, Any]]) -> str:
        import ray

        from verl_digen.trainer.checkpoint import save_checkpoint

        trainer_actors = [actors[w] for w in self.spec.trainers]
        if self.spec.fsdp:  # sharded optimizer state: every rank saves its own shard
            states = ray.get([a.checkpoint_state.remote() for a in trainer_actors], timeout=self.cfg.task_timeout_s)
            state = states[0]
            state["optimizer_per_rank"] = [st.pop("optimizer") for st in states]
        else:
            state = ray.get(trainer_actors[0].checkpoint_state.remote(), timeout=self.cfg.task_timeout_s)
        if state["version"] != step:
            raise RuntimeError(f"trainer holds version {state['version']} at the end of step {step}")
        ckpt = save_checkpoint(
            self.ckpt_root,
            step,
            weights=state.pop("weights"),
            trainer_state=state,
            controller_state={
                "step": step,
                "sampler": self._sampler_before[step],
                "metrics": metrics[:step],
            },
            meta={
                "strategy": self.spec.name,
                "model_path": self.model_path,
                "lora_only": self.cfg.model.lora.enable,
                "lora": dataclasses.asdict(self.cfg.model.lora),
                "arch": self.cfg.model.arch,
                "output_dir": self.output_dir,
                "max_staleness": self.spec.max_staleness,
            },
            max_to_keep=self.trainer_cfg.get("max_actor_ckpt_to_keep"),
        )
        self._last_saved = step
        return ckpt.path

    def _load_checkpoint(self, actors: dict[WorkerId, Any], sampler: Any) -> None:
        import ray

        ckpt = self.resume_from
        weights, trainer_state, ctrl = ckpt.weights(), ckpt.trainer_state(), ckpt.controller_state()
        refs = []
        for w, a in actors.items():
            if w.pool == "reward":
                continue
            is_trainer = w in self.spec.trainers
            refs.append(a.load_checkpoint_state.remote(weights, trainer_state if is_trainer else None, ckpt.step))
        digests = ray.get(refs, timeout=self.cfg.task_timeout_s)
        if len(set(digests)) != 1:
            raise RuntimeError(f"workers disagree on the weights loaded from {ckpt.path}")
        sampler.load_state_dict(ctrl["sampler"])
        self.history = list(ctrl["metrics"])
        print(f"[verl-digen] resumed from {ckpt.path} (step {ckpt.step}, policy version {ckpt.step})")

    def _stopped(self, error: BaseException, actors: dict[WorkerId, Any]) -> BaseException:
        """Turn a failure into a clean stop: checkpoint what completed, say how to resume."""
        done = getattr(self, "_completed", self.start_step)
        saved = None
        if done > self._last_saved and done > 0:
            try:
                saved = self._save_checkpoint(actors, done, self._metrics_so_far())
            except Exception as e:  # the trainer itself may be the one that died
                saved = f"not written ({e.__class__.__name__}: {e})"
        elif self._last_saved > 0:
            saved = os.path.join(self.ckpt_root, f"global_step_{self._last_saved}")
        how = (
            f"resume with trainer.resume_mode=auto trainer.default_local_dir={self.ckpt_root}"
            if self._last_saved > 0 or (saved and not str(saved).startswith("not"))
            else "no checkpoint exists yet (set trainer.save_freq to write them)"
        )
        kind = "interrupted" if isinstance(error, KeyboardInterrupt) else "stopped"
        message = f"[verl-digen] run {kind} after {done} completed steps: {error}\n" \
                  f"[verl-digen] checkpoint: {saved or 'none'}; {how}"
        print(message, flush=True)
        if isinstance(error, KeyboardInterrupt):
            return error
        return RunStopped(message)

    def _metrics_so_far(self) -> list[dict[str, Any]]:
        path = os.path.join(self.output_dir, "metrics.jsonl")
        if not os.path.exists(path):
            return []
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]

    def _balanced_stages(self, actors: dict[WorkerId, Any]):
        """TSP: stage ranges balanced by the per-step cost measured on a rollout worker."""
        import ray

        from verl_digen.schedule.elastic import balance_stages

        prof = ray.get(actors[WorkerId("rollout", 0)].profile_step_costs.remote(), timeout=self.cfg.task_timeout_s)
        bounds = balance_stages(prof["step_s"], self.spec.tsp_stages, head_s=prof["head_s"], tail_s=prof["tail_s"])
        self.stage_profile = {**prof, "bounds": list(bounds)}
        with open(os.path.join(self.output_dir, "tsp_stages.json"), "w") as f:
            json.dump(self.stage_profile, f, indent=2)
        print(f"[verl-digen] TSP stage ranges {list(bounds)} from measured step costs (tsp_stages.json)")
        return dataclasses.replace(self.spec, stage_bounds=bounds)

    def _rebalanced_stages(self, executor: RayPlanExecutor, step: int):
        """TSP: move stage boundaries using the stage durations measured in ``step``.

        Each stage's measured time (its steps plus what the profile cannot see: receiving the
        in-flight state, packing and shipping the record) is spread over its steps; the
        boundaries move only when that predicts a >10% shorter slowest stage.
        """
        from verl_digen.schedule.elastic import balance_stages

        bounds = self.spec.bounds
        k = self.spec.tsp_stages
        per_stage: list[list[float]] = [[] for _ in range(k)]
        for r in executor.timeline.of_step(step):
            if r.kind == "generate" and ":s" in r.task:
                per_stage[int(r.task.rsplit(":s", 1)[1])].append(r.end - r.start)
        if not all(per_stage):
            return self.spec
        means = [sum(v) / len(v) for v in per_stage]
        step_costs = [means[i] / (bounds[i + 1] - bounds[i]) for i in range(k) for _ in range(bounds[i], bounds[i + 1])]
        new = balance_stages(step_costs, k)

        def slowest(b):
            return max(sum(step_costs[b[i]:b[i + 1]]) for i in range(k))

        if new != tuple(bounds) and slowest(new) < 0.9 * slowest(bounds):
            self.stage_profile.setdefault("rebalanced", []).append({"step": step + 1, "bounds": list(new)})
            return dataclasses.replace(self.spec, stage_bounds=new)
        return self.spec

    def _tag_decision(self, executor: RayPlanExecutor, s: int) -> tuple[dict[str, float], int]:
        """TAG's share for step ``s`` from the rates measured in step ``s - 1``."""
        from verl_digen.schedule.elastic import TagDecision, decide_tag_share, tag_inputs_from_timeline

        if not self.spec.tag:
            return {}, 0
        inputs = tag_inputs_from_timeline(self.spec, executor.timeline, s - 1, self.cfg.tag.switch_cost_s)
        if inputs is None:
            return TagDecision(0, 0.0, 0.0, "no measurements yet").as_metrics(None), 0
        d = decide_tag_share(inputs)
        return d.as_metrics(inputs), d.groups

    def _step_metrics(self, executor: RayPlanExecutor, s: int, t0: float, t1: float) -> dict[str, Any]:
        res = executor.results[s]
        rewards = torch.cat([res.rewards[g] for g in sorted(res.rewards)])
        wall = t1 - t0
        images = self.spec.groups_per_step * self.spec.group_size
        syncs = [r for r in executor.timeline.since(t0) if r.kind == TaskKind.SYNC.value and r.end <= t1]
        m: dict[str, Any] = {
            "step": s + 1,
            "policy_version": s + 1,
            "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std(unbiased=False)),
            "images_per_s": images / wall,
            "images_per_device_s": images / wall / self.spec.devices,
            "step_time_s": wall,
            "bubble_fraction": executor.timeline.bubble_fraction(t0, t1),
            "weight_sync_s": sum(r.end - r.start for r in syncs),
            "max_staleness_seen": int(max((t["staleness_max"] for t in res.train), default=0)),
            "strategy": self.spec.name,
            "devices": self.spec.devices,
        }
        # Where the idle time sits: trainers waiting for the first groups (head), rollout
        # waiting for the trainers to finish, step and sync (drain).
        trainers = [str(w) for w in self.spec.trainers]
        rollout = [str(w) for w in self.spec.generators]
        m["bubble/head_trainer"] = executor.timeline.edge_idle(trainers, t0, t1, head_kind="train")[0]
        m["bubble/drain_rollout"] = executor.timeline.edge_idle(rollout, t0, t1, drain_kind="generate")[1]
        keys = {k for t in res.train for k in t if k.startswith("actor/")}
        for k in sorted(keys):
            m[k] = _mean([t[k] for t in res.train if k in t])
        m.update(res.optimizer)
        m["policy_version"] = s + 1
        return m

    def _save_gantt(self, executor: RayPlanExecutor, metrics: list[dict[str, Any]], t_run0: float) -> None:
        last = max(1, self.cfg.gantt_last_steps)
        opt_end = {r.step: r.end for r in executor.timeline.records if r.kind == TaskKind.OPTIMIZER_STEP.value}
        first = max(0, self.total_steps - last)
        t0 = opt_end.get(first - 1, t_run0)
        t1 = max(opt_end.values())
        save_gantt(
            executor.timeline, os.path.join(self.output_dir, "gantt.png"), t0=t0, t1=t1,
            title=f"{self.spec.name}, {self.spec.devices} devices, steps {first + 1}-{self.total_steps}",
        )


def run_training(config: DictConfig) -> RunResult:
    return DigenTrainer(config).run()
