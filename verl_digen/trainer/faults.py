"""What a run does when a worker dies during training: name it (:func:`dead_workers`), and where
``digen.fault.restarts`` allows, replace every worker and continue from the newest intact
checkpoint in the same job (:func:`restart`); any other failure stops the run
(:meth:`verl_digen.trainer.loop.DigenTrainer._stopped`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from verl_digen.schedule.plan import WorkerId
from verl_digen.trainer import runtime
from verl_digen.trainer.ray_executor import WorkerDied

__all__ = ["dead_workers", "restart"]


def dead_workers(error: BaseException, actors: dict[WorkerId, Any]) -> str | None:
    """The worker(s) whose death ``error`` reports (the executor's :class:`WorkerDied`, or Ray's
    ``ActorDiedError`` from a call outside the plan, e.g. a checkpoint save), named as a stop
    names them; None for any other failure (a task that raised, an interrupt), which stops the run."""
    import ray

    seen: set[int] = set()
    err: BaseException | None = error
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, WorkerDied):
            return ", ".join(f"{w} (pool {w.pool!r})" for w in err.workers)
        if isinstance(err, ray.exceptions.ActorDiedError):
            actor_id = getattr(err, "actor_id", None)
            named = [f"{w} (pool {w.pool!r})" for w, a in actors.items() if actor_id and a._actor_id.hex() == actor_id]
            return ", ".join(named) or f"actor {actor_id}"
        err = err.__cause__ or err.__context__
    return None


def restart(trainer: Any, error: BaseException, dead: str, use_gpu: bool) -> tuple[dict[WorkerId, Any], Any]:
    """``digen.fault.restarts``: a worker of ``trainer`` (a running
    :class:`~verl_digen.trainer.loop.DigenTrainer`) died during training. Release every worker group,
    start new ones, load the newest intact checkpoint (what ``trainer.resume_mode=auto`` would
    resume; none: step 0) and hand back the new workers and prompt sampler. What ran after
    that checkpoint runs again from its state (the groups TCSS generated ahead included), so
    the run continues exactly as a resume in a new job would."""
    from verl_digen.data import PromptSampler
    from verl_digen.trainer.checkpoint import find_latest_intact

    job, cfg = trainer.job, trainer.job.cfg
    trainer._restarts += 1
    runtime.write_error_log(job.output_dir, error)  # the dead worker's traceback, as a stop keeps it
    runtime.release(trainer._groups, owns_ray=False)
    trainer._groups = {}
    ckpt = None if job.emulated else find_latest_intact(trainer.checkpoints.root)
    trainer.job = job = dataclasses.replace(job, resume_from=ckpt)
    trainer._completed = job.start_step
    actors = trainer._start_workers(use_gpu)
    sampler = PromptSampler(job.prompts, seed=cfg.seed, shuffle=cfg.data.shuffle)
    if ckpt is not None:
        trainer.history = trainer.checkpoints.load(ckpt, actors, sampler)
    else:
        trainer.history, trainer.checkpoints.last_saved = [], 0
    if trainer.spec.placement == "disaggregated":
        runtime.open_weight_channel(trainer.spec, actors, cfg, use_gpu, trainer.deadlines)
    print(f"[verl-digen] worker {dead} died; restart {trainer._restarts} of {cfg.fault.restarts} "
          f"(digen.fault.restarts): new workers, resumed from step {job.start_step} "
          f"({ckpt.path if ckpt is not None else 'no checkpoint: from the start'})", flush=True)
    return actors, sampler
