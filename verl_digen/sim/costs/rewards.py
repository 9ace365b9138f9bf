"""Reward costs: scoring images (a scorer's FLOPs, a judge's decoding tail), a reward model that
shares the training devices (``swap``: woken and put back to sleep), and its weights' bytes.

Methods of :class:`~verl_digen.sim.cost_model.CostModel` (a mixin: it reads the model's fields
``model``, ``workload``, ``devices``, ``system``, ``reward`` and calls its other methods)."""

from __future__ import annotations

from verl_digen.schedule.plan import WorkerId
from verl_digen.sim.costs.profiles import GB, RESIDENT, SWAP, DeviceProfile


class RewardCosts:
    """Scoring seconds and the reward model's residency and bytes."""

    def reward_flops_per_image(self) -> float:
        return self.reward.flops if self.reward is not None else self.model.reward_flops_per_image

    def reward_seconds(
        self, images: int, dev: DeviceProfile, *, residency: str = RESIDENT, per_worker: int | None = None
    ) -> float:
        """Scoring ``images`` images on a worker that scores ``per_worker`` images per step
        (default: the whole step's). A judge decodes until its longest answer ends, and each
        judge instance meets that tail once per step: a call carries its images' share of it
        (a swapped judge scores a worker's whole share in one call, so it pays all of it)."""
        t = dev.reward_overhead_s + images * self.reward_flops_per_image() / (dev.flops * dev.mfu_forward)
        r = self.reward
        if r is not None and r.decode_tail_s:
            t += r.decode_tail_s * min(1.0, images / (per_worker or self.workload.images_per_step))
        if residency == SWAP:
            t += self.reward_swap_seconds(dev)
        return t

    def reward_swap_seconds(self, dev: DeviceProfile) -> float:
        """Waking a reward model that shares the training devices and putting it back to sleep:
        its weights (split over its tensor-parallel devices) over the host link, both ways."""
        weights = 2.0 * self.reward.params / max(1, self.reward.tp) if self.reward is not None else 0.0
        return 2.0 * self.system.engine_wake_s + 2.0 * weights / (dev.host_link_gbps * GB)

    def reward_residency(self, worker: WorkerId) -> str:
        return self.system.reward_residency if worker.pool == "fused" else RESIDENT

    def resident_reward_bytes(self, pool: str) -> float:
        """A reward model's weights that stay on a device of ``pool`` while it trains: a fused
        worker's resident reward (a swapped one sleeps on the host while training)."""
        if pool == "fused" and self.reward_residency(WorkerId(pool, 0)) == RESIDENT:
            return self.reward_weight_bytes()
        return 0.0

    def reward_replica_bytes(self) -> float:
        """A whole replica's bf16 weights: a reward pool device holds one (the pool's replicas are
        one device each; a tensor-parallel replica over k devices has the same throughput as k of
        them, so the model charges the pool alike either way)."""
        return 2.0 * self.reward.params if self.reward is not None else 0.0

    def reward_weight_bytes(self) -> float:
        return 2.0 * self.reward.params / max(1, self.reward.tp) if self.reward is not None else 0.0
