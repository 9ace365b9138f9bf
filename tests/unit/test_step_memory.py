"""Each step's memory peaks per pool (``memory/<pool>/*`` in the step's metrics).

- :func:`verl_digen.memory.measure.interval_peaks`: the host's peak, and on CUDA the device's
  reserved and allocated peaks since the previous call (reset after each; on a GPU:
  tests/gpu/test_step_memory_gpu.py);
- the executor's aggregation: per pool, the max over the step's reports (the results of reward,
  train and optimizer tasks, and the generating workers' peaks the reward passes on); a pool that
  reported nothing has no keys;
- the messages carry the peaks through pickling (Ray);
- the real worker, in process: TSP stages pass their peaks on in the in-flight state, the last
  stage's output (each chunk) carries the max, and the reward returns it as ``generator_memory``.

The e2e check that a disaggregated run's steps carry ``memory/rollout/*`` and
``memory/trainer/*`` is in ``tests/e2e/test_loop.py`` (``test_rollout_weights_equal_trainer_weights_after_sync``),
on a run that test makes anyway; a GPU run's device keys in ``tests/gpu/test_gpu.py``."""

from __future__ import annotations

import dataclasses
import pickle

import torch

from verl_digen.memory.measure import interval_peaks, max_peaks
from verl_digen.schedule.plan import Plan, Task, TaskId, TaskKind, WorkerId
from verl_digen.trainer.ray_executor import RayPlanExecutor
from verl_digen.workers.messages import OptimizerResult, RewardResult, TrainResult


def test_interval_peaks_off_cuda_report_the_host_peak_only():
    first = interval_peaks(torch.device("cpu"))
    assert set(first) == {"host_peak_gib"} and first["host_peak_gib"] > 0
    again = interval_peaks(torch.device("cpu"))
    assert again["host_peak_gib"] >= first["host_peak_gib"]  # a high-water mark: never lower


def test_max_peaks_keeps_each_keys_largest_figure():
    assert max_peaks() == {}
    assert max_peaks({"a": 1.0, "b": 5.0}, {}, {"a": 3.0, "c": 2.0}) == {"a": 3.0, "b": 5.0, "c": 2.0}


def test_the_results_carry_their_peaks_through_pickling():
    peaks = {"host_peak_gib": 1.5, "device_max_reserved_gib": 3.0, "device_max_allocated_gib": 2.0}
    results = [
        TrainResult(metrics={}, staleness_max=0.0, staleness_min=0.0, memory=peaks),
        OptimizerResult(metrics={}, policy_version=1, memory=peaks),
        RewardResult(group_id=torch.tensor([0]), rewards=torch.tensor([1.0]), policy_version=torch.tensor([0]),
                     memory=peaks, generator_memory=peaks),
    ]
    for r in results:
        back = pickle.loads(pickle.dumps(r))
        assert back.memory == peaks
    assert pickle.loads(pickle.dumps(results[2])).generator_memory == peaks
    # unset (emulated workers): empty
    assert TrainResult(metrics={}, staleness_max=0.0, staleness_min=0.0).memory == {}
    assert OptimizerResult(metrics={}, policy_version=1).memory == {}


# ---------------------------------------------------------------------------- the real worker, in process


def test_tsp_stages_pass_their_peaks_on_and_the_reward_returns_the_max(monkeypatch, tiny_flux):
    """Two TSP stages (no Ray): the first's peaks travel in the in-flight state, the last's output
    carries the max of both in its meta_info (its chunks too: split keeps meta_info), and the
    scoring worker returns them as ``generator_memory`` next to its own ``memory``."""
    from verl_digen.config.schema import digen_config_from_dict
    from verl_digen.models.registry import load_adapter
    from verl_digen.rewards import build_reward
    from verl_digen.workers.messages import GenerateRequest
    from verl_digen.workers.sampling import GroupsInFlight
    from verl_digen.workers.worker import DiffusionWorker, sampling_settings

    for key, value in {"WORLD_SIZE": "1", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(key, value)
    cfg = digen_config_from_dict({"sampling": {"num_steps": 2}, "batch": {"group_size": 2}})
    worker = DiffusionWorker("rollout", cfg, tiny_flux)
    worker.adapter, worker.settings = load_adapter(tiny_flux), sampling_settings(cfg)
    worker.reward_fn = build_reward("brightness")
    request = GenerateRequest(group_ids=(0,), prompts=("a cat",), prompt_indices=(0,), metadata=({},), step=0,
                              version=0, denoise=(0, 1))
    state = worker.generate(request)
    assert isinstance(state, GroupsInFlight) and state.memory["host_peak_gib"] > 0
    state.memory = {"host_peak_gib": 1e6, "device_max_reserved_gib": 7.0}  # as if the first stage's worker held more
    last = dataclasses.replace(request, denoise=(1, 2), chunk_rows=1)
    chunks = worker.generate(last, state)
    assert len(chunks) == 2
    for chunk in chunks:
        assert chunk.meta_info["memory"] == {"host_peak_gib": 1e6, "device_max_reserved_gib": 7.0}
    reward = worker.compute_reward(*chunks)
    assert reward.generator_memory == {"host_peak_gib": 1e6, "device_max_reserved_gib": 7.0}
    assert set(reward.memory) == {"host_peak_gib"} and 0 < reward.memory["host_peak_gib"] < 1e6


# ---------------------------------------------------------------------------- the executor


ROLLOUT, TRAINER0, TRAINER1, REWARD = (WorkerId("rollout", 0), WorkerId("trainer", 0), WorkerId("trainer", 1),
                                       WorkerId("reward", 0))


def _executor(tasks: list[Task]) -> RayPlanExecutor:
    """An executor of ``tasks`` that runs nothing: the test hands it results as if they finished."""
    ex = RayPlanExecutor(Plan([ROLLOUT, TRAINER0, TRAINER1, REWARD], tasks), {}, std_mode="group", timeout_s=60)
    for t in tasks:
        ex.bound[t.id] = t.workers
    return ex


def _peaks(host: float, reserved: float | None = None, allocated: float | None = None) -> dict[str, float]:
    out = {"host_peak_gib": host}
    if reserved is not None:
        out |= {"device_max_reserved_gib": reserved, "device_max_allocated_gib": allocated}
    return out


def _reward(group: int, memory: dict, generator_memory: dict) -> RewardResult:
    return RewardResult(group_id=torch.tensor([group, group]), rewards=torch.tensor([0.25, 0.75]),
                        policy_version=torch.tensor([0, 0]), memory=memory, generator_memory=generator_memory)


def _step(reward_pool: WorkerId, *, reports: bool = True):
    """One step of two groups: generate on rollout, reward on ``reward_pool``, a micro-batch
    trained by both trainers (a gang), the optimizer step; the results handed to the executor."""
    gens = [Task(TaskId.generate((g,)), TaskKind.GENERATE, (ROLLOUT,), step=0, groups=(g,)) for g in (0, 1)]
    rewards = [Task(TaskId.reward((g,)), TaskKind.REWARD, (reward_pool,), step=0, groups=(g,)) for g in (0, 1)]
    train = Task(TaskId.train(0, 0), TaskKind.TRAIN, (TRAINER0, TRAINER1), step=0, groups=(0, 1))
    opt = Task(TaskId.optimizer_step(0), TaskKind.OPTIMIZER_STEP, (TRAINER0, TRAINER1), step=0, version=1)
    ex = _executor([*gens, *rewards, train, opt])
    for t in gens:
        ex.gen_of_group[t.groups[0]] = [t.id]
    m = (lambda *a: _peaks(*a)) if reports else (lambda *a: {})
    ex._on_finish(rewards[0], [_reward(0, m(1.0, 4.0, 3.0), m(2.0, 10.0, 8.0))], 0.0, 1.0)
    ex._on_finish(rewards[1], [_reward(1, m(1.5, 3.0, 2.5), m(2.5, 9.0, 8.5))], 0.0, 1.0)
    ex._on_finish(train, [TrainResult({}, 0.0, 0.0, memory=m(3.0, 20.0, 15.0)),
                          TrainResult({}, 0.0, 0.0, memory=m(3.5, 19.0, 16.0))], 0.0, 1.0)
    ex._on_finish(opt, [OptimizerResult({}, 1, memory=m(3.2, 21.0, 14.0)),
                        OptimizerResult({}, 1, memory=m(3.1, 18.0, 17.0))], 0.0, 1.0)
    return ex.step_metrics(0)


def test_each_pool_reports_the_max_over_its_steps_results():
    m = _step(REWARD)
    memory = {k: v for k, v in m.items() if k.startswith("memory/")}
    assert memory == {
        # the generating worker's peaks, passed on by the rewards
        "memory/rollout/host_peak_gib": 2.5, "memory/rollout/device_max_reserved_gib": 10.0,
        "memory/rollout/device_max_allocated_gib": 8.5,
        "memory/reward/host_peak_gib": 1.5, "memory/reward/device_max_reserved_gib": 4.0,
        "memory/reward/device_max_allocated_gib": 3.0,
        # every rank's train and optimizer results, not rank 0's only; each key its own max
        "memory/trainer/host_peak_gib": 3.5, "memory/trainer/device_max_reserved_gib": 21.0,
        "memory/trainer/device_max_allocated_gib": 17.0,
    }
    assert m["reward_mean"] == 0.5  # the rest of the step's metrics as before


def test_the_rollout_workers_own_scoring_counts_in_the_rollout_pool():
    """No reward pool: the rollout worker scores what it generated; both reports are rollout's."""
    m = _step(ROLLOUT)
    assert m["memory/rollout/device_max_reserved_gib"] == 10.0 and m["memory/rollout/host_peak_gib"] == 2.5
    assert not any(k.startswith("memory/reward/") for k in m)


def test_a_pool_that_reported_nothing_has_no_keys():
    """Emulated workers measure nothing: no memory/ key at all."""
    assert not any(k.startswith("memory/") for k in _step(REWARD, reports=False))


def test_a_pool_without_a_device_reports_the_host_only():
    ex = _executor([Task(TaskId.reward((0,)), TaskKind.REWARD, (REWARD,), step=0, groups=(0,))])
    ex._on_finish(ex.plan.tasks[0], [_reward(0, _peaks(1.25), {})], 0.0, 1.0)
    m = ex.step_metrics(0)
    assert m["memory/reward/host_peak_gib"] == 1.25
    assert not any(k.startswith("memory/reward/device") or k.startswith("memory/rollout/") for k in m)
