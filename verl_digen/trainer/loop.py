"""The FlowGRPO training loop, driven as plans on Ray worker groups.

Read it as the algorithm. Each step:

1. **generate**: sample groups of images per prompt with SDE log-probs;
2. **reward**: score every image;
3. **advantage**: normalise rewards within each group (GRPO);
4. **train**: recompute log-probs on micro-batches of whole groups, clipped surrogate (+KL),
   accumulate gradients;
5. **optimizer step**: policy version ``s + 1``;
6. **sync**: hand the new weights to rollout (disaggregated).

The phases are the methods of :class:`~verl_digen.trainer.ray_executor.RayPlanExecutor`;
*where* and *when* each runs is the plan's business (colocated, disaggregated, +GAP, +TSP,
+TAG, +TCSS), decided per step by :class:`~verl_digen.schedule.driver.StepDriver` (the same
driver the simulator runs in virtual time). This module adds what a run needs around it:
Ray, prompts, validation, checkpoints, logging and a clean stop.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig

from verl_digen.algos.advantages import run_std_correction
from verl_digen.config.verl_keys import DIGEN_MAIN, MAIN_PPO
from verl_digen.schedule.driver import StepDriver
from verl_digen.schedule.elastic import balanced_spec
from verl_digen.schedule.plan import TaskKind, WorkerId, group_ids
from verl_digen.schedule.timeline import save_gantt
from verl_digen.sim.deadlines import Deadlines, run_costs, run_deadlines
from verl_digen.trainer import faults, resolve, runtime
from verl_digen.trainer.checkpoint import RunCheckpoints, locked_run_directories
from verl_digen.trainer.ray_executor import RayPlanExecutor, gang_chunk_rows
from verl_digen.workers.rollout_dump import write_step_rows


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


class DigenTrainer:
    """Builds pools and workers, then runs ``trainer.total_training_steps`` planned steps.

    ``worker_groups``: the factory ``layout -> (groups, actors)`` of the workers to drive;
    default: the emulated cluster when ``digen.emulate.model`` is set, else real
    ``DiffusionWorker`` groups.
    """

    def __init__(self, config: DictConfig, worker_groups: runtime.WorkerGroupFactory | None = None,
                 entry: str = DIGEN_MAIN) -> None:
        # Everything the config decides, checked, with the run's directories and resume point:
        # read from here, never copied (resolve.PreparedRun).
        self.job = job = resolve.prepare_run(config, entry)
        if job.cfg.model.path is None and not job.emulated and entry == MAIN_PPO:
            print(f"[verl-digen] actor_rollout_ref.model.path is at veRL's default: training the tiny "
                  f"random {job.cfg.model.tiny_arch} model ({job.model_path})", flush=True)
        self.worker_groups = worker_groups
        self.spec = job.layout.spec  # the strategy run now (TSP re-balancing replaces it)
        cfg = job.cfg
        meta = {"model_path": job.model_path, "lora_only": cfg.model.lora.enable,
                "lora": dataclasses.asdict(cfg.model.lora), "arch": cfg.model.arch, "output_dir": job.output_dir,
                "identity": job.identity}
        self.checkpoints = RunCheckpoints(job.checkpoint_root, self.spec, meta=meta, timeout_s=cfg.task_timeout_s,
                                          max_to_keep=job.trainer.max_actor_ckpt_to_keep)
        self.history: list[dict[str, Any]] = []
        self.val_before_train: dict[str, float] | None = None
        self._completed = job.start_step
        self._restarts = 0  # workers restarted after a death (digen.fault.restarts)
        # An emulated run's (cost model, device type, time scale): what its workers sleep by and its
        # deadlines are planned with; from digen.emulate (_emulation), or the caller's own
        # (python -m verl_digen.emulate, which builds its workers itself).
        self.emulation: tuple[Any, str, float] | None = None
        self.deadlines = Deadlines.floor(cfg.task_timeout_s)  # the plan's, once Ray says where the run is

    def _default_worker_groups(self, use_gpu: bool) -> runtime.WorkerGroupFactory:
        job = self.job
        if job.emulated:
            from verl_digen.workers.emulated import emulated_worker_groups

            costs, device, time_scale = self._emulation()
            return emulated_worker_groups(costs, device=device, time_scale=time_scale, group_size=job.cfg.batch.group_size)
        return runtime.real_worker_groups(job.cfg, job.model_path, use_gpu=use_gpu,
                                          devices=self.spec.devices, cluster=job.cluster)

    def _emulation(self) -> tuple[Any, str, float] | None:
        """What an emulated run's workers sleep by: ``digen.emulate.model`` on its device type with
        the config's own workload (sizes, steps, batch), planned as the run's calls and sharding,
        at its time scale; None for a real run."""
        if self.emulation is None and self.job.emulated:
            em = self.job.cfg.emulate
            self.emulation = (run_costs(self.job.cfg, self.spec, model=em.model, device=em.device_type),
                              em.device_type, em.time_scale)
        return self.emulation

    def _plan_deadlines(self, use_gpu: bool) -> Deadlines:
        """Each blocking call's deadline from the plan (:func:`verl_digen.sim.deadlines.run_deadlines`)."""
        return run_deadlines(self.job.cfg, self.job.layout, self.spec, self._emulation(), use_gpu=use_gpu)

    # ------------------------------------------------------------------ run

    def run(self) -> RunResult:
        import ray

        job = self.job
        runtime.quiet_logs()
        owns_ray, self._groups = False, {}
        # emulated runs write no checkpoints
        with locked_run_directories(job.output_dir, None if job.emulated else self.checkpoints.root):
            try:
                owns_ray = runtime.init_ray(max(self.spec.devices, job.cluster.devices), job.cfg,
                                            address=job.ray_address, num_cpus=job.ray_num_cpus)
                use_gpu = runtime.device_kind(job.trainer.device, ray.cluster_resources().get("GPU", 0)) == "cuda"
                with runtime.stop_signals():
                    try:
                        metrics, extra = self._run_on_ray(use_gpu)
                    except KeyboardInterrupt as e:  # SIGINT/SIGTERM: exit 128 + signal (main.py)
                        raise runtime.as_interrupt(e) from None
                    except (ray.exceptions.RayError, OSError) as e:  # outside the steps: start, load, final sync
                        raise self._failed(e) from e
            finally:
                runtime.release(self._groups, owns_ray)
        print(f"[verl-digen] run output: {job.output_dir}")
        return RunResult(output_dir=job.output_dir, metrics=metrics, strategy=self.spec.name,
                         devices=self.spec.devices, wall_s=self._wall_s, extra=extra)

    def _run_on_ray(self, use_gpu: bool) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        import ray
        from verl.utils.tracking import Tracking

        from verl_digen.data import PromptSampler

        job, cfg = self.job, self.job.cfg
        self.deadlines = deadlines = self._plan_deadlines(use_gpu)
        self.checkpoints.timeout_s = deadlines.checkpoint_s
        actors = self._start_workers(use_gpu)
        sampler = PromptSampler(job.prompts, seed=cfg.seed, shuffle=cfg.data.shuffle)
        if job.resume_from is not None:
            self.history = self.checkpoints.load(job.resume_from, actors, sampler)
        if self.spec.placement == "disaggregated":
            runtime.open_weight_channel(self.spec, actors, cfg, use_gpu, deadlines)
        tracker = Tracking(project_name=job.trainer.project_name, config=job.container,
                           experiment_name=job.trainer.experiment_name, default_backend=list(job.trainer.logger))
        while True:
            try:
                metrics = self._train(actors, sampler, tracker)
                break
            except BaseException as e:
                dead = faults.dead_workers(e, actors)
                if dead is None or self._restarts >= cfg.fault.restarts:
                    raise self._stopped(e, actors) from e
                actors, sampler = faults.restart(self, e, dead, use_gpu)
        job = self.job  # a restart resumed it from its checkpoint
        extra = runtime.finish_weights(self.spec, actors, cfg, job.output_dir,
                                       save=cfg.save_final_weights and not job.emulated, deadlines=deadlines)
        if self.val_before_train is not None:
            extra["val_before_train"] = self.val_before_train
        if cfg.fault.restarts > 0:
            extra["fault/restarts"] = self._restarts
        runtime.finish_tracking(tracker)
        return metrics, extra

    def _start_workers(self, use_gpu: bool) -> dict[WorkerId, Any]:
        """The run's worker groups started and their models loaded (``workers.json`` names each
        worker's process), the prompt caches warmed."""
        job, cfg = self.job, self.job.cfg
        self._groups, actors = (self.worker_groups or self._default_worker_groups(use_gpu))(job.layout)
        infos = runtime.init_models(actors, self.deadlines)
        with open(os.path.join(job.output_dir, "workers.json"), "w") as f:
            json.dump([{**i, "worker": str(w)} for w, i in zip(actors, infos)], f, indent=2)
        if cfg.prompt_cache.enable and not job.emulated:  # each prompt encoded once per cache directory
            from verl_digen.trainer.warmup import warm_prompt_caches

            self.prompt_cache_stats = warm_prompt_caches(
                {w: a for w, a in actors.items() if w.pool != "reward"},
                job.prompts + job.val_prompts + job.negative_prompts, self.deadlines.load_s)
        return actors

    def _train(self, actors: dict[WorkerId, Any], sampler: Any, tracker: Any) -> list[dict[str, Any]]:
        from tqdm import tqdm

        job, cfg = self.job, self.job.cfg
        first, last = job.start_step, job.total_steps
        if self.spec.tsp_stages > 1 and cfg.tsp.balance:
            self.spec = self._balanced_stages(actors)
        driver = StepDriver(
            self.spec,
            lambda plan: RayPlanExecutor(plan, actors, std_mode=cfg.algo.std_mode, timeout_s=self.deadlines.task_s,
                                         std_correction=run_std_correction(cfg),
                                         chunk_rows=gang_chunk_rows(self.spec), sharded_trainers=self.spec.fsdp),
            start_step=first, total_steps=last, tag_switch_s=cfg.tag.switch_cost_s,
            tsp_rebalance=self.spec.tsp_stages > 1 and cfg.tsp.balance, gat_micro_batches=cfg.gat.fixed,
            tag_groups=cfg.tag.fixed,
        )
        executor: RayPlanExecutor = driver.executor  # type: ignore[assignment]
        lookahead = 1 if self.spec.max_staleness else 0
        prompts_until = first - 1

        def assign_prompts(step: int) -> None:
            """Draw the prompts of every step up to ``step`` (TCSS plans one step ahead)."""
            nonlocal prompts_until
            while prompts_until < step:
                prompts_until += 1
                self.checkpoints.note_sampler(prompts_until, sampler.state_dict())
                ids = group_ids(prompts_until, self.spec.groups_per_step)
                for g, (idx, prompt) in zip(ids, sampler.next(len(ids))):
                    executor.prompts[g] = (idx, prompt)
                    executor.metadata[g] = job.prompt_records[idx]
            self.checkpoints.note_sampler(prompts_until + 1, sampler.state_dict())

        self.checkpoints.note_sampler(first, sampler.state_dict())
        if not job.emulated and job.trainer.val_before_train:
            # veRL's key, with veRL's meaning (whatever trainer.test_freq says): validate the weights
            # training starts from, the initial ones or a resumed checkpoint's, logged at the step
            # they are the weights of (grid val_step<first>.png; not a step's metrics).
            self.val_before_train = self._validate(actors, first)
            tracker.log(data=self.val_before_train, step=first)
            with open(os.path.join(job.output_dir, "val_before_train.json"), "w") as f:
                json.dump(self.val_before_train, f, indent=2)
        all_metrics = list(self.history)
        nonfinite = sum(int(m.get("actor/skipped_nonfinite", 0)) for m in all_metrics)
        t_run0 = time.time()
        bar = tqdm(range(first, last), desc=f"digen {self.spec.name}", disable=not cfg.progress_bar,
                   initial=first, total=last)
        with open(os.path.join(job.output_dir, "metrics.jsonl"), "w") as mf:
            for m in all_metrics:
                mf.write(json.dumps(m) + "\n")
            for s in range(first, last):
                assign_prompts(min(s + lookahead, last - 1))
                # generate -> reward -> advantage -> train -> optimizer step -> sync, as planned
                m = driver.run_step(s)
                if cfg.rollout_data_dir is not None:  # every group of step s is scored: its rows are in
                    write_step_rows(cfg.rollout_data_dir, m["step"], executor.results[s].rollout_rows)
                if job.test_freq > 0 and ((s + 1) % job.test_freq == 0 or s + 1 == last):
                    m.update(self._validate(actors, s + 1))
                if cfg.fault.restarts > 0:
                    m["fault/restarts"] = self._restarts
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
                if job.save_freq > 0 and ((s + 1) % job.save_freq == 0 or s + 1 == last):
                    self.checkpoints.save(actors, s + 1, all_metrics)
            bar.close()
            driver.finish()  # nothing may be left running (e.g. a final sync); the plan checks out
        self._wall_s = time.time() - t_run0
        self.spec = driver.spec
        if driver.stage_changes:
            self._write_stage_profile(rebalanced=driver.stage_changes)
        executor.timeline.write_jsonl(os.path.join(job.output_dir, "timeline.jsonl"), t0=t_run0)
        self._save_gantt(driver, t_run0)
        return all_metrics

    def _validate(self, actors: dict[WorkerId, Any], step: int) -> dict[str, float]:
        """Validation on the first trainer (it holds the newest weights, and the EMA); every
        trainer under FSDP (lockstep forwards)."""
        from verl_digen.trainer.media import validate

        ranks = self.spec.trainers if self.spec.fsdp else self.spec.trainers[:1]
        return validate(actors, ranks, self.job, step)

    def _stopped(self, error: BaseException, actors: dict[WorkerId, Any]) -> BaseException:
        """Turn a failure into a clean stop: checkpoint what completed, say how to resume, in a few
        lines (:func:`runtime.stop_message`; the full tracebacks go to the run's ``error.log``)."""
        if isinstance(error, KeyboardInterrupt):
            error = runtime.as_interrupt(error)
        message = runtime.stop_message(error, self.job.output_dir, self.checkpoints,
                                       lambda e: self.checkpoints.on_stop(e, self._completed, actors,
                                                                          self._metrics_so_far()))
        return error if isinstance(error, KeyboardInterrupt) else RunStopped(message)

    def _failed(self, error: BaseException) -> RunStopped:
        """A failure outside the training steps (workers starting or loading, the final sync): the
        short message and the log, as :meth:`_stopped`, without a checkpoint (the steps wrote theirs)."""
        return RunStopped(runtime.stop_message(
            error, self.job.output_dir, None,
            lambda e: f"[verl-digen] run failed after {self._completed} completed steps: {e}"))

    def _metrics_so_far(self) -> list[dict[str, Any]]:
        path = os.path.join(self.job.output_dir, "metrics.jsonl")
        if not os.path.exists(path):
            return []
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]

    def _balanced_stages(self, actors: dict[WorkerId, Any]):
        """TSP: stage ranges balanced by the per-step cost measured on a rollout worker, sampling
        the first training prompt (the prompt cache's warm-up encoded it before the encoders left)."""
        import ray

        prof = ray.get(actors[WorkerId("rollout", 0)].profile_step_costs.remote(self.job.prompts[0]),
                       timeout=self.deadlines.profile_s)
        spec = balanced_spec(self.spec, prof)
        self._stage_profile = {**prof, "bounds": list(spec.bounds)}
        self._write_stage_profile()
        print(f"[verl-digen] TSP stage ranges {list(spec.bounds)} from measured step costs (tsp_stages.json)")
        return spec

    def _write_stage_profile(self, **extra: Any) -> None:
        with open(os.path.join(self.job.output_dir, "tsp_stages.json"), "w") as f:
            json.dump({**self._stage_profile, **extra}, f, indent=2)

    def _save_gantt(self, driver: StepDriver, t_run0: float) -> None:
        last, total = max(1, self.job.cfg.gantt_last_steps), self.job.total_steps
        first = max(0, total - last)
        t0 = driver.step_end.get(first - 1, t_run0)
        t1 = max(r.end for r in driver.timeline.records if r.kind == TaskKind.OPTIMIZER_STEP.value)
        save_gantt(driver.timeline, os.path.join(self.job.output_dir, "gantt.png"), t0=t0, t1=t1,
                   title=f"{self.spec.name}, {self.spec.devices} devices, steps {first + 1}-{total}")


def run_training(config: DictConfig, worker_groups: runtime.WorkerGroupFactory | None = None,
                 entry: str = DIGEN_MAIN) -> RunResult:
    return DigenTrainer(config, worker_groups, entry).run()
