"""Planning and bounds: the least device time an image takes, the zero-bubble bound (a small linear
program, :mod:`verl_digen.sim.bound`), and what a cluster rents for.

Methods of :class:`~verl_digen.sim.cost_model.CostModel` (a mixin: it reads the model's fields
``model``, ``workload``, ``devices``, ``system``, ``reward`` and calls its other methods)."""

from __future__ import annotations

from collections import Counter
from typing import Iterable

from verl_digen.sim.bound import max_throughput
from verl_digen.sim.costs.cluster import Cluster
from verl_digen.sim.costs.profiles import DeviceProfile


class BoundCosts:
    """The zero-bubble bound and the cluster's price."""

    def device_seconds_per_image(self, dev: DeviceProfile) -> dict[str, float]:
        """The least device time one image can take on ``dev``: its FLOPs at the device's best
        efficiency, without overheads, collectives, switches, recomputation or a judge's
        decoding tail (what the bound charges)."""
        w = self.workload
        generate = w.num_steps * w.cfg_factor * self.forward_flops() / (dev.flops * dev.mfu_forward)
        generate += self.encode_seconds(1, dev) / w.group_size + self.decode_seconds(1, dev)
        reward = self.reward_flops_per_image() / (dev.flops * dev.mfu_forward)
        best = max(self.bound_train_efficiency, self.system.train_efficiency)
        train = w.trained_steps * w.cfg_factor * self.train_flops(False) / (dev.flops * dev.mfu_train * best)
        return {"generate": generate, "reward": reward, "train": train}

    def zero_bubble_bound(self, devices: Iterable[str]) -> float:
        """Images/s no schedule on ``devices`` (one name per device) can beat.

        Every image must be generated, rewarded and trained; each phase may run on any device
        type, at that type's cost. The best split of the phases over the types is a small linear
        program (:func:`verl_digen.sim.bound.max_throughput`); with one type it is
        ``devices / device-seconds per image``."""
        counts = Counter(devices)
        if not counts:
            return 0.0
        return max_throughput(dict(counts), {n: self.device_seconds_per_image(self.device(n)) for n in counts})

    def usd_per_hour(self, cluster: Cluster) -> float:
        """What the cluster's devices rent for (``usd_per_hour`` of each device profile)."""
        return sum(p.size * self.device(p.device).usd_per_hour for p in cluster.pools.values())
