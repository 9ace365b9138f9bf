"""Weight sync trainer -> rollout on real Ray: a trainer pool of 1 and a rollout pool of 2, each
with its own default gloo group, sync LoRA and full weights over the private channel. Packing,
the channel in threads and the tiny denoisers: tests/unit/test_sync.py."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

from verl_digen.sync import WeightSyncMixin, state_digest, trainable_state
from test_sync import frozen_digest, make_full_denoiser, make_lora_denoiser

RAY_TIMEOUT_S = 120


@torch.no_grad()
def perturb(module: nn.Module, *, lora_only: bool, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for t in trainable_state(module, lora_only=lora_only).values():
        t.add_(torch.randn(t.shape, generator=gen).to(device=t.device, dtype=t.dtype))


# ----------------------------------------------------------------------------------------
# (b) real Ray: trainer pool of 1 -> rollout pool of 2, each with its own default gloo group
# ----------------------------------------------------------------------------------------

try:
    from verl.single_controller.base import Worker
except ImportError:  # pragma: no cover - verl is a hard dependency of the package
    Worker = object  # type: ignore[assignment,misc]


class SyncTestWorker(WeightSyncMixin, Worker):
    """Holds a LoRA denoiser and a plain one; ``use(mode)`` picks which one is synced."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        # Each pool's own default group, as real workers have: the channel must not disturb it.
        dist.init_process_group(
            "gloo",
            init_method="env://",
            rank=self.rank,
            world_size=self.world_size,
            timeout=timedelta(seconds=60),
        )
        # Different seeds per pool *and* per rank: any equality afterwards comes from the sync.
        worker_seed = seed + 100 * self.rank
        self.models = {"lora": make_lora_denoiser(worker_seed), "full": make_full_denoiser(worker_seed)}
        self.use("lora")

    def use(self, mode: str) -> None:
        self.sync_module = self.models[mode]
        self.sync_lora_only = mode == "lora"
        self.policy_version = 0

    def perturb(self, seed: int) -> None:
        perturb(self.sync_module, lora_only=self.sync_lora_only, seed=seed)

    def frozen_digest(self) -> str:
        return frozen_digest(self.sync_module, lora_only=self.sync_lora_only)

    def weights_digest(self) -> str:
        """sha256 of the synced state, as DiffusionWorker.weights_digest reports its own."""
        return state_digest(trainable_state(self.sync_module, lora_only=self.sync_lora_only))

    def get_policy_version(self) -> int:
        return self.policy_version

    def default_group_allreduce(self) -> tuple[int, float]:
        x = torch.tensor([float(self.rank + 1)])
        dist.all_reduce(x)
        return dist.get_world_size(), float(x.item())


@pytest.fixture(scope="module")
def worker_groups(shared_ray):
    """Workers unpickle the test classes by module name: the shared instance puts the suite's
    folders (tests/e2e among them) on their path."""
    import ray
    from ray.util.placement_group import remove_placement_group
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

    remote_cls = ray.remote(SyncTestWorker)
    trainer_pool = RayResourcePool([1], use_gpu=False, max_colocate_count=1, name_prefix="sync_trainer")
    rollout_pool = RayResourcePool([2], use_gpu=False, max_colocate_count=1, name_prefix="sync_rollout")
    trainer_wg = RayWorkerGroup(trainer_pool, RayClassWithInitArgs(remote_cls, seed=1), device_name="cpu")
    rollout_wg = RayWorkerGroup(rollout_pool, RayClassWithInitArgs(remote_cls, seed=2), device_name="cpu")
    yield trainer_wg.workers[0], list(rollout_wg.workers)
    if not ray.is_initialized():
        # A later test of this module that does not ask for the shared instance stopped it
        # (conftest.pytest_runtest_setup), and these workers with it; ray.kill would start a
        # new local instance (Ray's auto-init) and leave it running.
        return
    for w in trainer_wg.workers + rollout_wg.workers:
        ray.kill(w)
    for pg in (trainer_pool.pgs or []) + (rollout_pool.pgs or []):  # their CPU slots, for the next test
        remove_placement_group(pg)


def _get(refs):
    import ray

    return ray.get(refs, timeout=RAY_TIMEOUT_S)


def _sync_round(trainer, rollouts, versions: tuple[int, ...], backend: str = "gloo") -> list[dict]:
    """Open a channel, perturb + send each version while all receivers recv, close. Returns send stats."""
    everyone = [trainer, *rollouts]
    world_size = len(everyone)
    addr, port = _get(trainer.sync_master_endpoint.remote())
    _get(
        [w.sync_open.remote(rank, world_size, addr, port, backend, 60.0) for rank, w in enumerate(everyone)]
    )
    sent = []
    try:
        for version in versions:
            _get(trainer.perturb.remote(1000 + version))
            send_ref = trainer.sync_send.remote(version)  # non-blocking: receivers join concurrently
            recv_refs = [w.sync_recv.remote() for w in rollouts]
            send_stats, *recv_stats = _get([send_ref, *recv_refs])
            assert send_stats["version"] == version
            assert all(s["version"] == version and s["nbytes"] == send_stats["nbytes"] for s in recv_stats)
            digests = _get([w.weights_digest.remote() for w in everyone])
            assert len(set(digests)) == 1, f"weights differ after sync of version {version}: {digests}"
            assert _get([w.get_policy_version.remote() for w in everyone]) == [version] * world_size
            sent.append(send_stats)
    finally:
        _get([w.sync_close.remote() for w in everyone])
    return sent


@pytest.mark.e2e
def test_ray_weight_sync_lora_and_full(worker_groups) -> None:
    trainer, rollouts = worker_groups
    everyone = [trainer, *rollouts]
    nbytes: dict[str, int] = {}
    for mode in ("lora", "full"):
        _get([w.use.remote(mode) for w in everyone])
        before = _get([w.weights_digest.remote() for w in everyone])
        assert len(set(before)) == len(everyone), "workers must start from different weights"
        frozen_before = _get([w.frozen_digest.remote() for w in rollouts])

        versions = (1, 2) if mode == "lora" else (1,)  # LoRA also re-syncs on the open channel
        stats = _sync_round(trainer, rollouts, versions)
        nbytes[mode] = stats[0]["nbytes"]

        # Under LoRA the rollout's base weights stay its own.
        assert _get([w.frozen_digest.remote() for w in rollouts]) == frozen_before
        # Each pool's default process group is intact and still scoped to its own pool.
        assert _get(trainer.default_group_allreduce.remote()) == (1, 1.0)
        assert _get([w.default_group_allreduce.remote() for w in rollouts]) == [(2, 3.0), (2, 3.0)]

    assert nbytes["lora"] * 10 < nbytes["full"], nbytes
