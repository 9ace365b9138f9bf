"""Policy training on recorded trajectories: FlowGRPO loss, gradient accumulation, optimizer.

A trajectory's loss is a sum of independent per-step terms, so a micro-batch is trained
one recorded step at a time (recompute the velocity, score the recorded transition, clipped
surrogate, backward), scaled so that the gradients accumulated over a whole step equal the
gradient of the batch-mean loss, whatever the order or the grouping of the micro-batches.
"""

from __future__ import annotations

import copy
import math
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist

from verl import DataProto
from verl_digen.algos.loss import flow_grpo_loss
from verl_digen.algos.sde import sde_step_with_logprob
from verl_digen.config.schema import AlgoConfig, LoraConfigSpec
from verl_digen.models.base import DiffusionAdapter
from verl_digen.workers.sampling import SamplingSettings, autocast_context, conditioning_from


def add_lora(adapter: DiffusionAdapter, spec: LoraConfigSpec) -> None:
    """Inject LoRA adapters into the denoiser (diffusers' PEFT integration), same init everywhere."""
    from peft import LoraConfig

    present = {name.split(".")[-1] for name, _ in adapter.transformer.named_modules()}
    present |= {".".join(name.split(".")[-2:]) for name, _ in adapter.transformer.named_modules()}
    targets = [t for t in spec.target_modules if t in present]
    if not targets:
        raise ValueError(
            f"digen.model.lora.target_modules={spec.target_modules} match no module of "
            f"{type(adapter.transformer).__name__}"
        )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.init_seed)
        adapter.transformer.add_adapter(
            LoraConfig(r=spec.rank, lora_alpha=spec.alpha, init_lora_weights="gaussian", target_modules=targets)
        )


def trainable_parameters(module: torch.nn.Module, *, lora_only: bool) -> list[torch.nn.Parameter]:
    if lora_only:
        params = [p for n, p in module.named_parameters() if "lora_" in n]
    else:
        params = list(module.parameters())
    return params


@dataclass
class TrainSettings:
    algo: AlgoConfig
    sampling: SamplingSettings
    lora_only: bool
    images_per_step: int
    ema_decay: float | None = None  # keep an EMA of the trained weights (validation uses it)


class PolicyUpdater:
    """Owns the trainable denoiser's optimizer and gradient accumulation for one rank."""

    def __init__(self, adapter: DiffusionAdapter, settings: TrainSettings) -> None:
        self.adapter = adapter
        self.settings = settings
        module = adapter.transformer
        for p in module.parameters():
            p.requires_grad_(False)
        self.params = trainable_parameters(module, lora_only=settings.lora_only)
        for p in self.params:
            p.requires_grad_(True)
        algo = settings.algo
        if algo.optimizer == "adamw":
            self.optimizer: torch.optim.Optimizer = torch.optim.AdamW(
                self.params, lr=algo.lr, betas=tuple(algo.betas), eps=algo.eps, weight_decay=algo.weight_decay
            )
        else:
            self.optimizer = torch.optim.SGD(self.params, lr=algo.lr)
        # Frozen reference for the KL term: LoRA -> adapters disabled; full fine-tune -> a copy.
        self.reference: torch.nn.Module | None = None
        if algo.kl_beta > 0 and not settings.lora_only:
            self.reference = copy.deepcopy(module).requires_grad_(False).eval()
        self.ema = None
        if settings.ema_decay is not None:
            from verl_digen.workers.ema import EMA, named_trainable_parameters

            self.ema = EMA(named_trainable_parameters(module), decay=settings.ema_decay)
        self._acc_metrics: list[dict[str, float]] = []
        self.samples_accumulated = 0

    # ----------------------------------------------------------------- reference

    @contextmanager
    def _reference_weights(self):
        module = self.adapter.transformer
        if self.settings.lora_only:
            module.disable_adapters()
            try:
                yield
            finally:
                module.enable_adapters()
        else:
            assert self.reference is not None
            saved = self.adapter.transformer
            self.adapter.transformer = self.reference
            try:
                yield
            finally:
                self.adapter.transformer = saved

    # ----------------------------------------------------------------- training

    def recompute_log_probs(self, data: DataProto) -> torch.Tensor:
        """Log-probs ``[B, S]`` of every recorded SDE step under the current weights (no grad)."""
        out = torch.zeros_like(data.batch["log_probs"])
        with torch.no_grad():
            for j in self._trained_steps(data, all_window=True):
                out[:, j] = self._step_terms(data, j).log_prob.cpu()
        return out

    def _trained_steps(self, data: DataProto, *, all_window: bool = False) -> list[int]:
        mask = data.batch["train_mask"]
        if all_window:
            # Every SDE step of the window, trained or not.
            mask = mask | data.batch["sde_mask"]
        cols = mask.all(dim=0)
        if not torch.equal(cols, mask.any(dim=0)):
            raise ValueError("every sample of a micro-batch must train the same steps")
        return [int(j) for j in torch.nonzero(cols).flatten()]

    def _step_terms(self, data: DataProto, j: int, *, reference: bool = False):
        device = self.adapter.device
        s = self.settings.sampling
        latents = data.batch["latents"]
        x = latents[:, j].to(device)
        x_next = latents[:, j + 1].to(device)
        sig = data.batch["sigmas"][:, j].to(device)
        sig_next = data.batch["sigmas"][:, j + 1].to(device)
        cond, neg = conditioning_from(data)
        cond = {k: v.to(device) for k, v in cond.items()}
        neg = {k: v.to(device) for k, v in neg.items()} if neg else None
        ctx = self._reference_weights() if reference else nullcontext()
        with ctx, autocast_context(device, s.autocast_bf16):
            v = self.adapter.predict_velocity(x, sig, cond, s.spec, negative_cond=neg)
        return sde_step_with_logprob(
            v.float(), x, sig, sig_next, noise_level=s.noise_level, sde_type=s.sde_type, prev_sample=x_next
        )

    def train_micro_batch(
        self, data: DataProto, advantages: torch.Tensor, *, part: tuple[int, int] | None = None
    ) -> dict[str, float]:
        """Accumulate the gradient of this micro-batch's share of the step loss.

        ``part=(r, P)`` trains only the trained steps ``[r::P]`` (TSP time-step split): the P
        parts, summed by the optimizer step's all-reduce, give the same gradient as the whole.
        """
        algo = self.settings.algo
        device = self.adapter.device
        all_steps = self._trained_steps(data)
        steps = all_steps[part[0] :: part[1]] if part else all_steps
        n = len(data)
        # Share of the step's mean loss: (n / images_per_step) of the batch, 1/len(all) per step.
        scale = n / self.settings.images_per_step / max(len(all_steps), 1)
        adv = advantages.to(device=device, dtype=torch.float32)
        sums: dict[str, float] = {}
        self.adapter.transformer.train()
        for j in steps:
            out = self._step_terms(data, j)
            old = data.batch["log_probs"][:, j].to(device)
            ref_mean = None
            if algo.kl_beta > 0:
                with torch.no_grad():
                    ref_mean = self._step_terms(data, j, reference=True).mean
            loss = flow_grpo_loss(
                out.log_prob, old, adv, clip_range=algo.clip_range, adv_clip_max=algo.adv_clip_max,
                kl_beta=algo.kl_beta, mean=out.mean if algo.kl_beta > 0 else None, ref_mean=ref_mean,
                std=out.std if algo.kl_beta > 0 else None,
            )
            (loss.loss * scale).backward()
            for key in ("loss", "policy_loss", "kl_loss", "clip_frac", "approx_kl", "ratio_mean"):
                sums[key] = sums.get(key, 0.0) + float(getattr(loss, key).detach())
        self.samples_accumulated += n
        metrics = {f"actor/{k}": v / max(len(steps), 1) for k, v in sums.items()}
        metrics["actor/trained_steps"] = float(len(steps))
        return metrics

    def optimizer_step(self, process_group: dist.ProcessGroup | None = None) -> dict[str, float]:
        """All-reduce (sum) the accumulated gradients over the trainer ranks, clip, step."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        if process_group is not None and dist.get_world_size(process_group) > 1:
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=process_group)
            offset = 0
            for p, g in zip(self.params, grads):
                k = g.numel()
                p.grad = flat[offset : offset + k].view_as(g).clone()
                offset += k
        else:
            for p, g in zip(self.params, grads):
                p.grad = g
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.settings.algo.max_grad_norm)
        finite = bool(torch.isfinite(grad_norm))
        if finite:
            self.optimizer.step()
            if self.ema is not None:
                self.ema.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.samples_accumulated = 0
        return {
            "actor/grad_norm": float(grad_norm) if finite else math.nan,
            "actor/lr": self.optimizer.param_groups[0]["lr"],
            "actor/skipped_nonfinite": 0.0 if finite else 1.0,
        }
