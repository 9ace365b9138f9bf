"""Seconds of each phase of a step: a generate call (prompt encoding, denoising steps, VAE decode),
a training pass (forward+backward, the FSDP collectives its compute does not hide, a log-prob
recompute), a micro-batch's training, the optimizer step.

Methods of :class:`~verl_digen.sim.cost_model.CostModel` (a mixin: it reads the model's fields
``model``, ``workload``, ``devices``, ``system``, ``reward`` and calls its other methods)."""

from __future__ import annotations

import math
from typing import Any

from verl_digen.sim.costs.cluster import TrainGroup
from verl_digen.sim.costs.profiles import GB, DeviceProfile


def _passes(images: int, batch: int) -> list[int]:
    """Samples per pass when ``images`` are cut into passes of at most ``batch``."""
    full, rest = divmod(images, batch)
    return [batch] * full + ([rest] if rest else [])


class PhaseCosts:
    """Generate, train and optimizer-step seconds."""

    # ------------------------------------------------------------------ generate

    def encode_seconds(self, prompts: int, dev: DeviceProfile) -> float:
        m = self.model
        flops = 2.0 * m.text_encoder_params * m.text_encoder_tokens * prompts * self.workload.cfg_factor
        return flops / (dev.flops * (dev.encode_mfu or dev.mfu_forward))

    def denoise_seconds(self, samples: int, dev: DeviceProfile, batch: int | None = None,
                        gather_s: float = 0.0) -> float:
        """One denoising step of ``samples`` samples (both CFG branches), run as forwards of at
        most ``batch`` samples (default: one forward over all of them). ``gather_s``: the FSDP
        all-gather each forward makes when the module generating is sharded
        (:meth:`generation_gather_seconds`), hidden behind the forward's compute as a training
        pass's collectives are (:meth:`_pass_seconds`)."""
        b = max(1, min(samples, batch or samples))
        calls = math.ceil(samples / b)
        eff = self.efficiency(dev, b * self.workload.cfg_factor * self.tokens()[1])
        flops = samples * self.workload.cfg_factor * self.forward_flops()
        t = calls * (dev.forward_overhead_s + self.system.engine_call_s) + flops / (dev.flops * eff)
        if gather_s:
            row = self.workload.cfg_factor * self.forward_flops() / (dev.flops * eff)
            full, rest = divmod(samples, b)
            for n, times in ((b, full), (rest, 1 if rest else 0)):
                t += times * self._exposed_comm(dev.forward_overhead_s + n * row, gather_s)
        return t

    def forward_seconds(self, samples: int, dev: DeviceProfile) -> float:
        """One denoiser call on ``samples`` samples (both CFG branches)."""
        return self.denoise_seconds(samples, dev)

    def decode_seconds(self, images: int, dev: DeviceProfile) -> float:
        w = self.workload
        flops = images * w.height * w.width * w.frames * self.model.decode_flops_per_pixel
        return flops / (dev.flops * dev.decode_mfu)

    def generate_seconds(
        self,
        images: int,
        dev: DeviceProfile,
        steps: tuple[int, int] | None = None,
        *,
        final: bool = True,
        batch: int | None = None,
        gather_s: float = 0.0,
    ) -> float:
        """Denoising steps ``[start, end)`` (all by default) of ``images`` samples in forwards of
        at most ``batch`` samples (each paying ``gather_s`` of FSDP all-gather beyond what its
        compute hides: :meth:`denoise_seconds`); prompts are encoded by the stage that starts at
        step 0, latents decoded by the ``final`` one."""
        w = self.workload
        start, end = steps if steps is not None else (0, w.num_steps)
        if not 0 <= start < end <= w.num_steps:
            raise ValueError(f"denoise steps {(start, end)} outside [0, {w.num_steps}] (workload num_steps)")
        t = dev.generate_overhead_s + (end - start) * (self.denoise_seconds(images, dev, batch, gather_s)
                                                       + self.system.denoise_step_s)
        if start == 0:
            t += self.encode_seconds(math.ceil(images / w.group_size), dev)
        if final:
            t += self.decode_seconds(images, dev)
        return t

    def step_profile(self, dev: DeviceProfile, images: int) -> dict[str, Any]:
        """Per-denoising-step seconds of a generate call and its head and tail (what TSP's
        stage balancing measures on a real rollout worker)."""
        w = self.workload
        return {
            "step_s": [self.forward_seconds(images, dev) + self.system.denoise_step_s] * w.num_steps,
            "head_s": dev.generate_overhead_s + self.encode_seconds(math.ceil(images / w.group_size), dev),
            "tail_s": self.decode_seconds(images, dev),
        }

    # ------------------------------------------------------------------ train

    def _pass_seconds(self, compute: float, comm: float) -> float:
        return compute + self._exposed_comm(compute, comm)

    def _exposed_comm(self, compute: float, comm: float) -> float:
        """The part of a call's collectives ``comm`` that its ``compute`` does not hide."""
        return max(0.0, comm - self.system.comm_overlap * compute)

    def train_pass_seconds(self, samples: int, dev: DeviceProfile, group: TrainGroup, pool: str = "trainer",
                           checkpointing: bool | None = None) -> float:
        """One forward+backward pass of ``samples`` samples; ``checkpointing`` None: as decided
        for ``dev`` and ``pool`` (:meth:`checkpointing`)."""
        w = self.workload
        tokens = samples * w.cfg_factor * self.tokens()[1]
        if checkpointing is None:
            checkpointing = self.checkpointing(dev, group, pool)
        flops = self.train_flops(checkpointing)
        compute = dev.train_pass_overhead_s + samples * w.cfg_factor * flops / (
            dev.flops * self.efficiency(dev, tokens, train=True) * self.system.train_efficiency
        )
        return self._pass_seconds(compute, self.fsdp_comm_seconds(dev, group))

    def logprob_pass_seconds(self, samples: int, dev: DeviceProfile, group: TrainGroup) -> float:
        """A forward-only pass that recomputes the behaviour log-probs of one trained step: the
        forward plus the sampler's per-step work (``system.denoise_step_s``: the SDE step's
        log-prob, as the rollout computes it)."""
        w = self.workload
        tokens = samples * w.cfg_factor * self.tokens()[1]
        compute = dev.forward_overhead_s + self.system.denoise_step_s + samples * w.cfg_factor * self.forward_flops() / (
            dev.flops * self.efficiency(dev, tokens)
        )
        return self._pass_seconds(compute, self.fsdp_gather_seconds(dev, group))

    def train_seconds(self, images: int, dev: DeviceProfile, group: TrainGroup, trained_steps: int | None = None,
                      pool: str = "trainer", checkpointing: bool | None = None) -> float:
        """Training ``images`` samples on one rank of ``pool`` on ``dev``; ``checkpointing`` None:
        as decided for them (:meth:`checkpointing`), else that decision (a GAT rollout worker
        trains with the run's)."""
        k = self.workload.trained_steps if trained_steps is None else trained_steps
        key = (images, dev, group, k, pool, checkpointing)
        if key not in self._seconds_memo:
            self._seconds_memo[key] = self._train_seconds(images, dev, group, k, pool, checkpointing)
        return self._seconds_memo[key]

    def _train_seconds(self, images: int, dev: DeviceProfile, group: TrainGroup, k: int, pool: str,
                       checkpointing: bool | None = None) -> float:
        b = self.pass_batch(dev, group, pool)  # a pass that does not fit is reported by memory_problems
        t = k * sum(self.train_pass_seconds(n, dev, group, pool, checkpointing) for n in _passes(images, b))
        if self.system.recompute_logprob:
            bl = self.system.logprob_micro_batch or b
            t += k * sum(self.logprob_pass_seconds(n, dev, group) for n in _passes(images, bl))
        return t

    def optimizer_seconds(self, dev: DeviceProfile, group: TrainGroup) -> float:
        """The step's optimizer work: one Adam update per PPO mini-batch, plus the system's
        per-step overhead (charged here: every training rank waits for it)."""
        s = self.system
        return self.workload.mini_batches * self.update_seconds(dev, group) + s.step_fixed_s + \
            self.state_stream_seconds(dev, group) + self.workload.optimizer_tasks * self.parked_round_trip_seconds(dev, group)

    def parked_round_trip_seconds(self, dev: DeviceProfile, group: TrainGroup) -> float:
        """What one optimizer task of parked trainers adds: the state comes in for the step and
        goes back (0 when :meth:`optimizer_parked` says it stays resident)."""
        if not self.optimizer_parked(dev, group):
            return 0.0
        return 2.0 * self.optimizer_shard_bytes(group) / (dev.host_link_gbps * GB)

    def optimizer_task_seconds(self, dev: DeviceProfile, group: TrainGroup, mini_batch: int = 0) -> float:
        """One OPTIMIZER_STEP task of the plan, the step of mini-batch ``mini_batch``: its share of
        the updates (``mini_batches / optimizer_tasks``); the step's last task also pays the
        per-step overhead and the FSDP state stream, which the runtime does once per weights
        version (``workers/worker.py: DiffusionWorker.optimizer_step``). A step's tasks sum to
        :meth:`optimizer_seconds`."""
        w = self.workload
        t = w.mini_batches // w.optimizer_tasks * self.update_seconds(dev, group)
        t += self.parked_round_trip_seconds(dev, group)
        if mini_batch == w.optimizer_tasks - 1:
            t += self.system.step_fixed_s + self.state_stream_seconds(dev, group)
        return t

    def update_seconds(self, dev: DeviceProfile, group: TrainGroup) -> float:
        """One Adam update of the local shard (+ the HSDP gradient all-reduce across replicas)."""
        s = self.system
        shard = self.trainable_params / group.shard
        # read + write fp32 master, m, v and the gradient of the local shard
        t = s.optimizer_fixed_s + 2.0 * (s.optimizer_bytes_per_param + s.grad_bytes_per_param) * shard / (dev.hbm_tbps * 1e12)
        if group.replicas > 1 and not group.hsdp_per_pass:  # HSDP: all-reduce the gradient shards across replicas once per update
            r = group.replicas
            t += 2.0 * (r - 1) / r * s.grad_bytes_per_param * shard / self.collective_bw(dev, 2)
        return t
