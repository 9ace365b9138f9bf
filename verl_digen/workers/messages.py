"""What the controller and a worker say to each other: one frozen dataclass per request and
result of a task, and :class:`WorkerTasks`, the task methods every worker answers.

The controller (``trainer/ray_executor.py``) builds the requests and reads the results; the real
worker (``workers/worker.py``) and the emulated one (``workers/emulated.py``) read the requests
and build the results. A field added here is added for all three, and a field a receiver does
not know fails at construction (``TypeError: unexpected keyword argument``) instead of being
dropped on the way, as a key of a dict would be. Every message crosses processes through Ray,
so each one pickles; frozen, so nothing changes a message after it is sent.

Nothing here imports torch at module level: emulated actors stay small (their reward vectors
become tensors when the driver unpickles them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch


# ---------------------------------------------------------------------------- requests


@dataclass(frozen=True)
class GenerateRequest:
    """Sample ``group_ids`` (or one TSP stage of them) with the weights of ``version``.

    ``prompts[k]`` / ``prompt_indices[k]`` / ``metadata[k]``: group ``group_ids[k]``'s prompt,
    its dataset index and its record (ground truth, ...; ``{}`` when the data has none), which
    every sample of the group carries to the reward. ``step``: the training step (it picks the
    SDE window). ``denoise = (start, end)``: only those denoising steps (a TSP stage); None: all.
    ``samples = (start, end)``: only that slice of each group's samples; None: all of them.
    ``chunk_rows > 0`` (FSDP gangs; a final stage only): return one object per ``chunk_rows``
    samples of one group, in (group, sample) order, so that each trainer rank deserialises only
    the chunks it trains (:func:`verl_digen.workers.sampling.rank_rows` deals whole chunks).
    """

    group_ids: tuple[int, ...]
    prompts: tuple[str, ...]
    prompt_indices: tuple[int, ...]
    metadata: tuple[dict[str, Any], ...]
    step: int
    version: int
    denoise: tuple[int, int] | None = None
    samples: tuple[int, int] | None = None
    chunk_rows: int = 0


@dataclass(frozen=True)
class TrainRequest:
    """Train one micro-batch: the rows of ``groups`` (in that order), ``advantages`` ``[rows]``
    one per row of the selection. ``train_part = (r, P)``: only the trained steps ``[r::P]``
    (TSP time-step split). ``row_part = (r, n)``: FSDP rank ``r`` of ``n``, or row slice ``r`` of
    ``n`` of a pulled micro-batch (``digen.units.train_slices``), trains that share of
    the rows (:func:`verl_digen.workers.sampling.rank_rows`). ``presliced``: the trajectories
    passed are exactly that share (the generate outputs' chunks of this rank), not the whole
    micro-batch; ``advantages`` stay the whole micro-batch's. ``return_gradients`` (GAT, a
    rollout worker): the call returns two objects, the :class:`TrainResult` and the micro-batch's
    :class:`Gradients`, which the executor hands to trainer 0's optimizer step unread."""

    groups: tuple[int, ...]
    advantages: torch.Tensor
    train_part: tuple[int, int] | None = None
    row_part: tuple[int, int] | None = None
    presliced: bool = False
    return_gradients: bool = False


@dataclass(frozen=True)
class OptimizerRequest:
    """Step on the gradients accumulated since the last optimizer step: PPO mini-batch
    ``mini_batch`` of a training step. ``final``: the step's last mini-batch, the only one
    that makes the next weights version (versions count rollout batches; ``schedule/plan.py``),
    which rollout receives and checkpoints save."""

    mini_batch: int = 0
    final: bool = True
    # GAT: the groups of each micro-batch whose Gradients come with the call, in their order (a
    # receiver checks what it got against it: nothing lost, nothing of another mini-batch)
    gradients_of: tuple[tuple[int, ...], ...] = ()


# ---------------------------------------------------------------------------- results


@dataclass(frozen=True)
class RewardResult:
    """Rewards of whole groups, one row per sample: ``group_id`` ``[B]`` int64, ``rewards``
    ``[B]`` float32, ``policy_version`` ``[B]`` int64 (the weights each sample was drawn with)."""

    group_id: torch.Tensor
    rewards: torch.Tensor
    policy_version: torch.Tensor
    # the reward's per-sample extras (RewardFn.take_extras): name -> [B] float32, NaN where absent
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    # digen.rollout_data_dir set: each sample's jsonl row (its media already written by the
    # worker), for the controller to write once the step is scored (workers/rollout_dump.py)
    rollout_rows: tuple[dict[str, Any], ...] = ()
    # the measured bytes of the trajectories scored (memory/object_store.py: trajectory_payload_bytes):
    # every generate output is scored once, so a step's sum is what crossed the object store
    trajectory_bytes: int = 0
    # memory/measure.py interval_peaks: the scoring worker's peaks since its previous report
    # (``memory``), and the max of those the generating workers put in the scored outputs'
    # meta_info (``generator_memory``; a TSP group's: the max over its stages). Empty: none
    # measured (emulated workers).
    memory: dict[str, float] = field(default_factory=dict)
    generator_memory: dict[str, float] = field(default_factory=dict)

    def of_group(self, group: int) -> tuple[torch.Tensor, int]:
        """Group ``group``'s rewards ``[G]`` and the weights version it was sampled with."""
        rows = self.group_id == group
        return self.rewards[rows], int(self.policy_version[rows][0])


@dataclass(frozen=True)
class TrainResult:
    """One micro-batch trained: ``metrics`` (``actor/*``: means over its trained steps) and the
    staleness of its samples (the worker's version minus the versions they were drawn with)."""

    metrics: dict[str, float]
    staleness_max: float
    staleness_min: float
    # the worker's memory peaks since its previous report (memory/measure.py interval_peaks)
    memory: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Gradients:
    """GAT: one micro-batch's accumulated gradients of the trained (LoRA) parameters, by name, on
    the host, computed by a rollout worker with the trainers' weights of ``version``; trainer 0
    adds them to its own before the optimizer step (the same sum the trainers would make)."""

    tensors: dict[str, torch.Tensor]
    version: int
    groups: tuple[int, ...]


@dataclass(frozen=True)
class OptimizerResult:
    """One optimizer step: its ``actor/*`` statistics and the weights version it made."""

    metrics: dict[str, float]
    policy_version: int
    # the worker's memory peaks since its previous report (memory/measure.py interval_peaks)
    memory: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class SyncResult:
    """What one weight sync moved, as seen by one endpoint (sender or receiver)."""

    version: int
    nbytes: int  # payload bytes (flat buffers), headers excluded
    seconds: float  # wall time of the whole send/recv
    num_tensors: int = 0


def check_assisted_gradients(request: OptimizerRequest, gradients: tuple[Gradients, ...], version: int,
                             worker: str) -> None:
    """GAT: the gradients an optimizer step received are those its request names, in order, of
    the weights version the worker holds; anything else is an error naming the mismatch."""
    got = tuple(g.groups for g in gradients)
    if got != tuple(request.gradients_of):
        raise RuntimeError(f"{worker}: optimizer step of mini-batch {request.mini_batch} expected GAT gradients of "
                           f"groups {list(request.gradients_of)}, got {list(got)}")
    stale = [g.groups for g in gradients if g.version != version]
    if stale:
        raise RuntimeError(f"{worker} holds version {version} but got gradients of groups {list(stale)} computed "
                           f"with another version")


MESSAGES = (GenerateRequest, TrainRequest, RewardResult, TrainResult, Gradients, OptimizerResult, SyncResult)


# ---------------------------------------------------------------------------- the task methods


@runtime_checkable
class WorkerTasks(Protocol):
    """The calls the controller makes on a worker: ``DiffusionWorker`` and ``EmulatedWorker``
    both provide them with these parameters (``tests/unit/test_worker_messages.py`` compares the
    signatures). Trajectories are whatever the worker's ``generate`` returns (a ``DataProto``,
    a TSP stage's ``GroupsInFlight``, an emulated record): the controller only passes them on."""

    def open_rendezvous(self) -> int | None:
        """Rank 0 of a training group: the port its process group's store listens on (the OS's
        choice), which the driver hands to every rank's ``init_model``; None elsewhere."""
        ...

    def init_model(self, rendezvous_port: int | None = None) -> dict[str, Any]:
        """Build what the worker's role needs; a record of it for the run's ``workers.json``."""
        ...

    def generate(self, request: GenerateRequest, previous: Any = None) -> Any:
        """Sample (``previous``: the previous TSP stage's in-flight state)."""
        ...

    def compute_reward(self, *slices: Any) -> RewardResult:
        """Score whole groups (one generate output, or a group's sample slices)."""
        ...

    def train_micro_batch(self, request: TrainRequest, *trajectories: Any) -> TrainResult | tuple[TrainResult, Gradients]:
        """Accumulate one micro-batch's gradients (``request.return_gradients``: return them)."""
        ...

    def optimizer_step(self, request: OptimizerRequest = OptimizerRequest(), *gradients: Gradients) -> OptimizerResult:
        """Step on the accumulated gradients plus ``gradients`` (GAT's, trainer 0 only); the
        step's last mini-batch makes the next weights version (the weight-sync sender, trainer 0
        of a disaggregated run, starts sending it in the background)."""
        ...

    def sync_join(self, timeout_s: float | None = None) -> Any:
        """Wait for the background send of the last version (the sender; others: nothing)."""
        ...

    def sync_recv(self) -> SyncResult:
        """Receive the next weights version."""
        ...

    def profile_step_costs(self, prompt: str, repeats: int = 2) -> dict[str, Any]:
        """Seconds of a sampling's head, each denoising step and tail (TSP stage balancing), on
        one group of ``prompt``, a training prompt (cached when the prompt cache is on)."""
        ...

    def refresh_full_state(self) -> int:
        """FSDP trainers, all together: gather this version's full weights unless gathered
        already (a colocated run does it only before they are read); returns the version."""
        ...

    def weights_digest(self) -> str:
        """A hash of the weights (equal across workers iff bitwise equal)."""
        ...

    def get_policy_version(self) -> int:
        """The weights version the worker holds."""
        ...

    def ping(self) -> str:
        """The worker's name (an answer at all means the process is alive)."""
        ...
