"""The messages between the controller and its workers (``workers/messages.py``).

- both worker classes (real and emulated) provide :class:`WorkerTasks` with its parameters, so
  the controller's calls cannot drift from either;
- every message survives pickling (Ray) and is frozen; a field a receiver does not know is
  refused when the message is built, not dropped on the way;
- a generate request reaches the sampler whole (:meth:`GroupRequest.for_generate`);
- the worker's role table decides what ``init_model`` builds.
"""

from __future__ import annotations

import dataclasses
import inspect
import pickle

import pytest
import torch

from verl_digen.schedule.plan import WorkerId
from verl_digen.sim.cost_model import Cluster, PoolPlacement, TableCostModel
from verl_digen.workers.emulated import EmulatedTrajectories, EmulatedWorker, TensorData
from verl_digen.workers.messages import (
    MESSAGES,
    GenerateRequest,
    Gradients,
    OptimizerResult,
    RewardResult,
    SyncResult,
    TrainRequest,
    TrainResult,
    WorkerTasks,
)


def _examples() -> dict[type, dict]:
    """Constructor keywords of one instance of every message."""
    return {
        GenerateRequest: dict(group_ids=(3, 4), prompts=("a cat", "a dog"), prompt_indices=(0, 1),
                              metadata=({"answer": 3}, {}), step=2, version=1, denoise=(0, 4), samples=(1, 3)),
        TrainRequest: dict(groups=(3,), advantages=torch.tensor([0.5, -0.5]), train_part=(0, 2), row_part=(1, 2)),
        RewardResult: dict(group_id=torch.tensor([3, 3]), rewards=torch.tensor([0.25, 0.75]),
                           policy_version=torch.tensor([1, 1])),
        TrainResult: dict(metrics={"actor/loss": 0.125}, staleness_max=1.0, staleness_min=0.0),
        Gradients: dict(tensors={"blocks.0.attn.to_q.lora_A.default.weight": torch.ones(2, 3)}, version=2,
                        groups=(3,)),
        OptimizerResult: dict(metrics={"actor/grad_norm": 2.0}, policy_version=3),
        SyncResult: dict(version=3, nbytes=1024, seconds=0.5, num_tensors=4),
    }


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def test_every_message_has_an_example():
    assert set(_examples()) == set(MESSAGES)


@pytest.mark.parametrize("cls", MESSAGES, ids=lambda c: c.__name__)
def test_a_message_survives_pickling(cls):
    kwargs = _examples()[cls]
    back = pickle.loads(pickle.dumps(cls(**kwargs)))
    assert type(back) is cls
    for name, value in kwargs.items():
        assert _same(getattr(back, name), value), name


@pytest.mark.parametrize("cls", MESSAGES, ids=lambda c: c.__name__)
def test_a_message_is_frozen(cls):
    msg = cls(**_examples()[cls])
    name = dataclasses.fields(cls)[0].name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(msg, name, None)


@pytest.mark.parametrize("cls", MESSAGES, ids=lambda c: c.__name__)
def test_a_field_the_receiver_does_not_know_is_refused(cls):
    with pytest.raises(TypeError, match="unexpected keyword argument 'sample_range'"):
        cls(**_examples()[cls], sample_range=(0, 2))


@pytest.mark.parametrize("cls", MESSAGES, ids=lambda c: c.__name__)
def test_a_missing_field_is_refused(cls):
    required = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING]
    kwargs = {k: v for k, v in _examples()[cls].items() if k != required[0]}
    with pytest.raises(TypeError, match=required[0]):
        cls(**kwargs)


def test_an_emulated_reward_becomes_tensors_on_the_driver():
    sent = RewardResult(group_id=TensorData([3, 3], "int64"), rewards=TensorData([0.25, 0.75], "float32"),
                        policy_version=TensorData([1, 1], "int64"))
    got = pickle.loads(pickle.dumps(sent))
    rewards, version = got.of_group(3)
    assert rewards.dtype == torch.float32 and rewards.tolist() == [0.25, 0.75] and version == 1


# ---------------------------------------------------------------------------- the task methods


def _task_methods() -> list[str]:
    return sorted(n for n, v in vars(WorkerTasks).items() if inspect.isfunction(v) and not n.startswith("_"))


def _parameters(fn) -> list[tuple[str, inspect._ParameterKind, object]]:
    """A method's parameters after ``self``: name, kind and default (annotations may differ:
    each worker names its own trajectory type)."""
    params = list(inspect.signature(fn).parameters.values())[1:]
    # ray.remote(cls) adds a keyword-only ``_ray_trace_ctx`` to the class's own methods, in place:
    # after any test of this process made an actor class of the worker, its methods carry it.
    return [(p.name, p.kind, p.default) for p in params if p.name != "_ray_trace_ctx"]


def protocol_mismatches(cls: type) -> list[str]:
    """What ``cls`` lacks or declares differently from :class:`WorkerTasks`."""
    problems = []
    for name in _task_methods():
        method = getattr(cls, name, None)
        if method is None:
            problems.append(f"{cls.__name__}.{name} is missing")
        elif _parameters(method) != _parameters(getattr(WorkerTasks, name)):
            problems.append(f"{cls.__name__}.{name}{_parameters(method)} != {_parameters(getattr(WorkerTasks, name))}")
    return problems


def test_the_protocol_names_the_controllers_calls():
    assert _task_methods() == sorted([
        "open_rendezvous", "init_model", "generate", "compute_reward", "train_micro_batch", "optimizer_step", "sync_join", "sync_recv",
        "profile_step_costs", "refresh_full_state", "weights_digest", "get_policy_version", "ping",
    ])


def test_the_real_worker_provides_the_task_methods():
    from verl_digen.workers.worker import DiffusionWorker

    assert protocol_mismatches(DiffusionWorker) == []


def test_the_emulated_worker_provides_the_task_methods():
    assert protocol_mismatches(EmulatedWorker) == []


def test_a_worker_with_a_renamed_parameter_or_a_missing_method_is_caught():
    class Drifted(EmulatedWorker):
        def train_micro_batch(self, req, *trajectories):  # renamed: a keyword call would break
            return super().train_micro_batch(req, *trajectories)

        sync_recv = None

    problems = protocol_mismatches(Drifted)
    assert any("train_micro_batch" in p for p in problems)
    assert any("sync_recv is missing" in p for p in problems)


# ---------------------------------------------------------------------------- the emulated worker, in process


def _emulated(pool: str = "fused") -> EmulatedWorker:
    worker = WorkerId(pool, 0)
    costs = TableCostModel(seconds={}, group_size=2)
    return EmulatedWorker(worker, costs, Cluster({pool: PoolPlacement(size=1, nodes=1, device="cpu")}), group_size=2, time_scale=0.0)


def test_the_emulated_worker_answers_each_request_with_its_result():
    w = _emulated()
    assert isinstance(w, WorkerTasks)
    gen = GenerateRequest(group_ids=(3,), prompts=("a cat",), prompt_indices=(0,), metadata=({},), step=0, version=0)
    traj = w.generate(gen)
    assert traj == EmulatedTrajectories((3,), 2, 0, None)
    reward = pickle.loads(pickle.dumps(w.compute_reward(traj)))
    assert isinstance(reward, RewardResult) and reward.of_group(3)[0].shape == (2,)
    trained = w.train_micro_batch(TrainRequest(groups=(3,), advantages=torch.zeros(2)), traj)
    assert isinstance(trained, TrainResult) and trained.staleness_max == 0.0
    stepped = w.optimizer_step()
    assert stepped == OptimizerResult(metrics=stepped.metrics, policy_version=1)
    assert w.sync_join(5.0) is None  # nothing in flight: the receivers carry the transfer


def test_a_generate_request_of_another_weights_version_is_refused():
    gen = GenerateRequest(group_ids=(3,), prompts=("a cat",), prompt_indices=(0,), metadata=({},), step=0, version=1)
    with pytest.raises(RuntimeError, match="holds weights version 0"):
        _emulated().generate(gen)


# ---------------------------------------------------------------------------- the real worker's side


def test_a_generate_request_reaches_the_sampler_whole():
    from verl_digen.workers.sampling import GroupRequest

    gen = GenerateRequest(**_examples()[GenerateRequest])
    groups = GroupRequest.for_generate(gen, group_size=4, seed=7, policy_version=1)
    assert (groups.prompts, groups.group_ids, groups.prompt_indices) == (gen.prompts, gen.group_ids, gen.prompt_indices)
    assert (groups.metadata, groups.samples, groups.training_step) == (gen.metadata, gen.samples, gen.step)
    assert (groups.group_size, groups.seed, groups.policy_version) == (4, 7, 1)
    assert list(groups.sample_range) == [1, 2]


def test_every_role_has_its_capabilities():
    from verl_digen.workers.worker import ROLE_CAPABILITIES, ROLES

    assert ROLES == ("fused", "rollout", "trainer", "reward")
    trains = {r for r, c in ROLE_CAPABILITIES.items() if c.trains}
    loads = {r for r, c in ROLE_CAPABILITIES.items() if c.policy}
    assert trains == {"fused", "trainer"} and loads == {"fused", "rollout", "trainer"}
    assert trains <= loads  # a role trains the policy it loaded
    assert {r for r, c in ROLE_CAPABILITIES.items() if c.scores} == {"fused", "reward"}
    assert ROLE_CAPABILITIES["rollout"].scores_without_reward_pool  # a reward pool scores instead
    assert ROLE_CAPABILITIES["trainer"].scores_when_generating  # TAG without a reward pool
    assert all(not c.offloads or c.trains for c in ROLE_CAPABILITIES.values())  # only training GPUs offload


@pytest.mark.parametrize(("group_size", "micro_groups", "ranks"), [(4, 1, 2), (12, 2, 8), (12, 1, 4), (8, 3, 4), (6, 2, 3)])
def test_each_fsdp_rank_is_sent_exactly_the_chunks_of_its_rows(group_size, micro_groups, ranks):
    """Issue 24 item 9: a gang's ranks get only their generate-output chunks. The chunks the
    executor sends rank r (``rank_chunks``, of the transformer call's rows ``gang_chunk_rows``)
    hold exactly the rows the worker trains (``rank_rows``), in its order."""
    from verl_digen.schedule.strategies import StrategySpec
    from verl_digen.trainer.ray_executor import gang_chunk_rows, rank_chunks
    from verl_digen.workers.sampling import rank_rows

    spec = StrategySpec(placement="disaggregated", rollout_workers=1, trainer_workers=ranks, groups_per_step=micro_groups * 4,
                        group_size=group_size, train_micro_batch_groups=micro_groups, fsdp=True, gap=True)
    m = gang_chunk_rows(spec)
    assert m >= 1 and group_size % m == 0
    groups = tuple(range(10, 10 + micro_groups))
    rows_of = {(g, s): k * group_size + s for k, g in enumerate(groups) for s in range(group_size)}
    seen = []
    for r in range(ranks):
        chunks = rank_chunks(groups, group_size, m, r, ranks)
        rows = [rows_of[(g, first + t)] for g, first in chunks for t in range(m)]
        assert rows == rank_rows(micro_groups * group_size, m, r, ranks)
        seen += rows
    assert sorted(seen) == list(range(micro_groups * group_size))
    unsharded = StrategySpec(placement="disaggregated", rollout_workers=1, trainer_workers=ranks, groups_per_step=4,
                             group_size=group_size, gap=True)
    assert gang_chunk_rows(unsharded) == 0  # whole outputs without a gang
