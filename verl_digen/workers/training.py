"""Policy training on recorded trajectories: FlowGRPO loss, gradient accumulation, optimizer.

A trajectory's loss is a sum of independent per-step terms, and a sample's terms do not
depend on the other samples, so a micro-batch is trained one recorded step and one *pass* at a
time: a pass is one transformer call's rows (``SamplingSettings.forward_rows``, the rollout's
calls), and each pass recomputes the velocity, scores the recorded transitions, and runs its
own backward. Activation memory is therefore bounded by one pass whatever the micro-batch size
(what the memory planner and the cost model charge, ``memory.plan`` and ``sim.cost_model``).
Each backward is scaled so that the gradients accumulated up to an optimizer step equal the
gradient of the mean loss over its batch (the step's, or one PPO mini-batch's), whatever the
order or the grouping of the micro-batches and passes. The ratio is always taken against the
behaviour log-probs recorded at rollout: 1 in the first mini-batch, not after an optimizer step.
"""

from __future__ import annotations

import copy
import math
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from verl import DataProto
from verl_digen.algos.loss import flow_grpo_loss
from verl_digen.algos.sde import sde_step_with_logprob
from verl_digen.config.schema import AlgoConfig, LoraConfigSpec
from verl_digen.models.base import DiffusionAdapter
from verl_digen.models.base import Conditioning
from verl_digen.workers.sampling import (
    SamplingSettings,
    conditioning_from,
    step_latents,
    to_device,
    velocity_in_chunks,
)

Text = tuple[Conditioning, "Conditioning | None"]  # a micro-batch's conditioning and CFG negative


LORA_MARKER = "lora_"  # peft's parameter names (as verl_digen.sync.state)
# The loss terms a micro-batch reports (``actor/<name>``), means over its trained steps.
LOSS_METRICS = ("loss", "policy_loss", "kl_loss", "clip_frac", "approx_kl", "ratio_mean")


def add_lora(adapter: DiffusionAdapter, spec: LoraConfigSpec, dtype: torch.dtype = torch.float32) -> None:
    """Inject LoRA adapters into the denoiser (diffusers' PEFT integration), same init everywhere.

    The LoRA matrices are kept in ``dtype`` (``digen.model.trainable_dtype``, fp32 by default)
    whatever the base weights' dtype: peft would otherwise cast them to the base layer's bf16.
    peft casts a layer's input to the LoRA dtype and the sum back to the base output's dtype, on
    rollout and trainer alike, so both compute the same numbers."""
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
    for name, p in adapter.transformer.named_parameters():
        if LORA_MARKER in name and p.dtype != dtype:
            p.data = p.data.to(dtype)


class MasterWeights:
    """fp32 master copies of trainable parameters that compute in a lower dtype (full fine-tuning
    in bf16), so that rollout and trainer run the very same bf16 weights while the optimizer
    accumulates and steps in fp32.

    Why not FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16)`` over fp32 parameters: it would
    cast *every* parameter of a unit to bf16, including those a diffusers model keeps in fp32
    (``_keep_in_fp32_modules``, e.g. Wan's norms and modulation tables), which the rollout
    computes in fp32; and it does nothing without FSDP. Here the model keeps its loaded dtypes
    (the rollout's), and only the optimizer sees fp32. Works on plain tensors and on FSDP2's
    sharded ``DTensor`` s (each rank keeps the masters of its own shards).

    After every backward, :meth:`accumulate_grads` adds each parameter's (bf16) gradient into its
    master's fp32 gradient and frees it, so micro-batches and steps accumulate in fp32; after the
    optimizer step, :meth:`copy_to_model` rounds the masters into the model's parameters.
    """

    def __init__(self, params: list[torch.nn.Parameter], dtype: torch.dtype) -> None:
        self.model_params = params
        self.masters = [p.detach().to(dtype).clone().requires_grad_(True) for p in params]

    @torch.no_grad()
    def accumulate_grads(self) -> None:
        for p, m in zip(self.model_params, self.masters):
            if p.grad is None:
                continue
            g = p.grad.to(m.dtype)
            if m.grad is None:
                m.grad = g if g is not p.grad else g.clone()
            else:
                m.grad.add_(g)
            p.grad = None

    @torch.no_grad()
    def copy_to_model(self) -> None:
        for p, m in zip(self.model_params, self.masters):
            p.copy_(m)


def trainable_parameters(module: torch.nn.Module, *, lora_only: bool) -> list[torch.nn.Parameter]:
    if lora_only:
        params = [p for n, p in module.named_parameters() if "lora_" in n]
    else:
        params = list(module.parameters())
    return params


def _dtensor_type():
    """DTensor (FSDP2's sharded parameters), or None where this torch has none."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return None
    return DTensor


@dataclass
class TrainSettings:
    algo: AlgoConfig
    sampling: SamplingSettings
    lora_only: bool
    # Images per optimizer step: the step's batch, or one PPO mini-batch of it
    # (digen.batch.mini_batches_per_step); the loss each optimizer step takes is their mean.
    images_per_step: int
    ema_decay: float | None = None  # keep an EMA of the trained weights (validation uses it)
    ema_offload: bool = False  # keep the EMA shadows on CPU (digen.ema.offload)
    trainable_dtype: torch.dtype = torch.float32  # trained parameters and optimizer state
    # The optimizer state waits on the host between optimizer steps and is on the device only
    # for the step (veRL's fsdp_config.optimizer_offload; digen.model.optimizer_offload).
    optimizer_offload: bool = False


class PolicyUpdater:
    """Owns the trainable denoiser's optimizer and gradient accumulation for one rank."""

    def __init__(
        self, adapter: DiffusionAdapter, settings: TrainSettings, *, reference: torch.nn.Module | None = None
    ) -> None:
        """``reference``: the frozen KL reference of a full fine-tune, built by the caller when the
        module is sharded (a sharded module cannot be deep-copied); default: a copy of the
        denoiser in its compute dtype (on CPU when the denoiser is on a GPU, moved in per use)."""
        self.adapter = adapter
        self.settings = settings
        module = adapter.transformer
        for p in module.parameters():
            p.requires_grad_(False)
        self.params = trainable_parameters(module, lora_only=settings.lora_only)
        for p in self.params:
            p.requires_grad_(True)
        # Parameters stored below the trainable dtype (a bf16 full fine-tune) train through fp32
        # masters; LoRA matrices are created in the trainable dtype (add_lora) and train as they are.
        self.master: MasterWeights | None = None
        if any(p.dtype != settings.trainable_dtype for p in self.params):
            self.master = MasterWeights(self.params, settings.trainable_dtype)
        self.opt_params = self.master.masters if self.master is not None else self.params
        algo = settings.algo
        if algo.optimizer == "adamw":
            self.optimizer: torch.optim.Optimizer = torch.optim.AdamW(
                self.opt_params, lr=algo.lr, betas=tuple(algo.betas), eps=algo.eps, weight_decay=algo.weight_decay
            )
        else:
            self.optimizer = torch.optim.SGD(self.opt_params, lr=algo.lr)
        # Frozen reference for the KL term: LoRA -> adapters disabled; full fine-tune -> a frozen
        # copy in the compute dtype (the model's own parameters are that already).
        self.reference: torch.nn.Module | None = reference
        self._reference_offloaded = False
        if algo.kl_beta > 0 and not settings.lora_only and reference is None:
            self.reference = copy.deepcopy(module).requires_grad_(False).eval()
            if self.adapter.device.type == "cuda":
                # A second full copy must not sit on the GPU between uses: it waits in pinned host
                # memory and is copied in once per micro-batch (_reference_on_device).
                self.reference.to("cpu")
                for t in (*self.reference.parameters(), *self.reference.buffers()):
                    t.data = t.data.pin_memory()
                self._reference_offloaded = True
        self.ema = None
        if settings.ema_decay is not None:
            from verl_digen.workers.ema import EMA, named_trainable_parameters

            # The model's parameters (with masters: their bf16 rounding, what validation runs),
            # averaged into fp32 shadows.
            self.ema = EMA(named_trainable_parameters(module), decay=settings.ema_decay, offload=settings.ema_offload)
        self._acc_metrics: list[dict[str, float]] = []
        self.samples_accumulated = 0
        # Where each parked optimizer-state tensor lives when in use (optimizer_offload).
        self._state_homes: dict[tuple[int, str], torch.device] = {}

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
            with self._reference_on_device():
                self.adapter.transformer = self.reference
                try:
                    yield
                finally:
                    self.adapter.transformer = saved

    @contextmanager
    def _reference_on_device(self):
        """An offloaded reference on the GPU for one use: its pinned host tensors are copied in
        (asynchronously) and put back after with no copy out: the reference never changes, so the
        device copies are simply dropped."""
        if not self._reference_offloaded:
            yield
            return
        assert self.reference is not None
        tensors = [*self.reference.parameters(), *self.reference.buffers()]
        host = [t.data for t in tensors]
        for t in tensors:
            t.data = t.data.to(self.adapter.device, non_blocking=True)
        try:
            yield
        finally:
            for t, h in zip(tensors, host):
                t.data = h

    def _reference_means(self, data: DataProto, text: Text, steps: list[int], passes: list[slice]) -> dict[tuple[int, int], torch.Tensor]:
        """The KL reference's SDE means for every trained step and pass of a micro-batch, in one
        visit of the reference weights: a full fine-tune's offloaded reference is copied in once
        per micro-batch (not once per step and pass), LoRA's adapters are switched off once. The
        same forwards as computed one by one, in the same order on every FSDP rank (lockstep)."""
        with torch.no_grad(), self._reference_weights():
            return {(j, k): self._step_terms(data, text, j, rows=rows).mean for j in steps for k, rows in enumerate(passes)}

    # ----------------------------------------------------------------- training

    def recompute_log_probs(self, data: DataProto) -> torch.Tensor:
        """Log-probs ``[B, S]`` of every trained step under the current weights (no grad), 0
        elsewhere: a trajectory carries the latents of its trained steps only. Those are every SDE
        step of the window unless ``digen.sampling.timestep_fraction`` < 1."""
        out = torch.zeros_like(data.batch["log_probs"])
        text = self._text(data)
        with torch.no_grad():
            for j in self._trained_steps(data):
                out[:, j] = self._step_terms(data, text, j).log_prob.cpu()
        return out

    def _text(self, data: DataProto) -> Text:
        """The micro-batch's conditioning, once per call: carried, or read from this worker's
        prompt cache (:func:`~verl_digen.workers.sampling.conditioning_from`)."""
        return conditioning_from(data, self.adapter)

    def _trained_steps(self, data: DataProto) -> list[int]:
        mask = data.batch["train_mask"]
        cols = mask.all(dim=0)
        if not torch.equal(cols, mask.any(dim=0)):
            raise ValueError("every sample of a micro-batch must train the same steps")
        return [int(j) for j in torch.nonzero(cols).flatten()]

    def _step_terms(self, data: DataProto, text: Text, j: int, *, rows: slice = slice(None)):
        """The SDE transition terms of recorded step ``j`` for the samples ``rows`` of ``data``
        (conditioned on ``text``, :meth:`_text`) under the transformer the adapter holds (the
        reference's inside :meth:`_reference_weights`)."""
        device = self.adapter.device
        s = self.settings.sampling
        # Copied in asynchronously (to_device): a blocking copy would be a host sync per pass.
        x = to_device(step_latents(data, j, rows), device)
        x_next = to_device(step_latents(data, j + 1, rows), device)
        sig = to_device(data.batch["sigmas"][rows, j], device)
        sig_next = to_device(data.batch["sigmas"][rows, j + 1], device)
        cond, neg = text
        n = len(data)
        cond = {k: to_device(v[rows], device) for k, v in cond.items()}
        # a per-sample negative conditioning has a row per sample; a shared one (one row) is kept whole
        neg = {k: to_device(v[rows] if v.shape[0] == n else v, device) for k, v in neg.items()} if neg else None
        # no autocast, the same transformer calls as the rollout's denoise()
        v = velocity_in_chunks(self.adapter, x, sig, cond, s.spec, neg, s.forward_rows)
        return sde_step_with_logprob(
            v, x, sig, sig_next, noise_level=s.noise_level, sde_type=s.sde_type, prev_sample=x_next
        )

    def passes(self, n: int) -> list[slice]:
        """The training passes of an ``n``-sample micro-batch: the rollout's transformer calls of
        ``forward_rows`` consecutive samples (one pass of all ``n`` when it is 0 or larger); one
        forward + backward each, so activations never exceed one call's."""
        rows = self.settings.sampling.forward_rows
        if rows <= 0 or rows >= n:
            return [slice(0, n)]
        return [slice(start, min(start + rows, n)) for start in range(0, n, rows)]

    def train_micro_batch(
        self, data: DataProto, advantages: torch.Tensor, *, part: tuple[int, int] | None = None
    ) -> dict[str, float]:
        """Accumulate the gradient of this micro-batch's share of the step loss, one backward
        per trained step and pass (:meth:`passes`).

        ``part=(r, P)`` trains only the trained steps ``[r::P]`` (TSP time-step split): the P
        parts, summed by the optimizer step's all-reduce, give the same gradient as the whole.

        The loss terms are summed on the device (fp64, as Python floats were) and read back once
        at the end: one host sync per micro-batch, not one per term, step and pass.
        """
        algo = self.settings.algo
        device = self.adapter.device
        all_steps = self._trained_steps(data)
        steps = all_steps[part[0] :: part[1]] if part else all_steps
        n = len(data)
        # Share of the optimizer step's mean loss (its mini-batch's): n / images_per_step of the
        # batch, 1/len(all) per trained time step;
        # a pass of m samples carries m / n of its micro-batch's mean.
        scale = n / self.settings.images_per_step / max(len(all_steps), 1)
        adv = to_device(advantages.float(), device)
        old_all = data.batch["log_probs"]
        sums = torch.zeros(len(LOSS_METRICS), dtype=torch.float64, device=device)
        self.adapter.transformer.train()
        passes = self.passes(n)
        text = self._text(data)
        ref_means = self._reference_means(data, text, steps, passes) if algo.kl_beta > 0 else {}
        for j in steps:
            for k, rows in enumerate(passes):
                weight = (rows.stop - rows.start) / n
                out = self._step_terms(data, text, j, rows=rows)
                old = to_device(old_all[rows, j], device)
                ref_mean = ref_means.get((j, k))
                loss = flow_grpo_loss(
                    out.log_prob, old, adv[rows], clip_range=algo.clip_range, adv_clip_max=algo.adv_clip_max,
                    kl_beta=algo.kl_beta, mean=out.mean if algo.kl_beta > 0 else None, ref_mean=ref_mean,
                    std=out.std if algo.kl_beta > 0 else None,
                )
                (loss.loss * (scale * weight)).backward()
                if self.master is not None:
                    self.master.accumulate_grads()
                terms = torch.stack([getattr(loss, key).detach().to(torch.float64) for key in LOSS_METRICS])
                sums += weight * terms
        self.samples_accumulated += n
        # the one read-back (none when this part trains no step: no loss terms then)
        means = (sums / len(steps)).tolist() if steps else []
        metrics = {f"actor/{k}": v for k, v in zip(LOSS_METRICS, means)}
        metrics["actor/trained_steps"] = float(len(steps))
        metrics["actor/passes"] = float(len(steps) * len(passes))
        return metrics

    # ----------------------------------------------------------------- GAT

    def _named_trained(self) -> dict[str, torch.nn.Parameter]:
        ids = {id(p) for p in self.params}
        return {n: p for n, p in self.adapter.transformer.named_parameters() if id(p) in ids}

    @torch.no_grad()
    def take_gradients(self) -> dict[str, torch.Tensor]:
        """GAT, on a rollout worker: the gradients accumulated since the last take, by parameter
        name, on the host; the parameters' gradients are cleared for the next micro-batch."""
        if self.master is not None:
            raise RuntimeError("GAT sends the gradients of parameters trained in their own dtype (LoRA); "
                               "this model trains through fp32 masters")
        out = {}
        for name, p in self._named_trained().items():
            out[name] = p.grad.detach().to("cpu") if p.grad is not None else torch.zeros(p.shape, dtype=p.dtype)
            p.grad = None
        self.samples_accumulated = 0
        return out

    @torch.no_grad()
    def add_gradients(self, named: dict[str, torch.Tensor]) -> None:
        """GAT, before the optimizer step: add a rollout worker's micro-batch gradients (whole, by
        parameter name) to this rank's: trainer 0 adds them whole (the all-reduce then sums);
        an FSDP rank adds its own shard of each (its gradients are reduce-scattered sums
        already). Every trained parameter's, by name and shape, or an error."""
        if self.master is not None:
            raise RuntimeError("GAT adds gradients of parameters trained in their own dtype (LoRA) only")
        params = self._named_trained()
        if set(named) != set(params):
            missing, extra = sorted(set(params) - set(named)), sorted(set(named) - set(params))
            raise RuntimeError(f"GAT gradients do not match the trained parameters: missing {missing[:3]}, "
                               f"unknown {extra[:3]}")
        dtensor = _dtensor_type()
        for name, p in params.items():
            g = named[name]
            if g.shape != p.shape:
                raise RuntimeError(f"GAT gradient of {name} has shape {tuple(g.shape)}, the parameter {tuple(p.shape)}")
            if dtensor is not None and isinstance(p, dtensor):
                from torch.distributed.tensor import distribute_tensor

                # this rank's shard, cut locally from the whole (src_data_rank=None: no collective;
                # it lands on the mesh's device type), added where FSDP keeps this rank's
                # gradient (the host under CPUOffloadPolicy, whose mesh is still the GPUs')
                shard = distribute_tensor(g.to(p.dtype), p.device_mesh, p.placements, src_data_rank=None).to_local()
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                local = p.grad.to_local()
                local.add_(shard.to(local.device))
                continue
            g = g.to(device=p.device, dtype=p.dtype)
            if p.grad is None:
                p.grad = g.clone()
            else:
                p.grad.add_(g)

    def optimizer_step(self, process_group: dist.ProcessGroup | None = None) -> dict[str, float]:
        """All-reduce (sum) the accumulated gradients over the trainer ranks, clip, step.

        One host sync: the gradient norm, read back to decide whether the step is finite."""
        params = self.opt_params
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if process_group is not None and dist.get_world_size(process_group) > 1:
            all_reduce_in_buckets([p.grad for p in params], process_group)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, self.settings.algo.max_grad_norm)
        norm = grad_norm.item()
        finite = math.isfinite(norm)
        if finite:
            self.unpark_optimizer()
            self.optimizer.step()
            self.park_optimizer()
            if self.master is not None:
                self.master.copy_to_model()
            if self.ema is not None:
                self.ema.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.samples_accumulated = 0
        return {
            "actor/grad_norm": norm if finite else math.nan,
            "actor/lr": self.optimizer.param_groups[0]["lr"],
            "actor/skipped_nonfinite": 0.0 if finite else 1.0,
        }

    def park_optimizer(self) -> int:
        """With ``optimizer_offload``: every optimizer-state tensor off the host goes to host
        memory (its device remembered for :meth:`unpark_optimizer`); returns the bytes moved.
        Lossless, so an offloaded run's updates are bitwise those of a resident one. What veRL's
        ``offload_fsdp_optimizer`` does; the state tensors of an FSDP2 module are DTensors, whose
        ``to`` moves the local shard."""
        if not self.settings.optimizer_offload:
            return 0
        moved = 0
        for i, state in enumerate(self.optimizer.state.values()):
            for key, value in state.items():
                if torch.is_tensor(value) and value.device.type != "cpu":
                    self._state_homes[(i, key)] = value.device
                    host = value.to("cpu", non_blocking=True)
                    state[key] = host
                    moved += value.numel() * value.element_size()
        if moved and torch.cuda.is_available():
            torch.cuda.current_stream().synchronize()  # the device copies may be freed only once copied
        return moved

    def unpark_optimizer(self) -> int:
        """Bring the parked optimizer state back to the devices it was on; returns the bytes moved."""
        moved = 0
        for i, state in enumerate(self.optimizer.state.values()):
            for key, value in state.items():
                home = self._state_homes.pop((i, key), None)
                if home is not None:
                    state[key] = value.to(home, non_blocking=True)
                    moved += value.numel() * value.element_size()
        return moved


# Bytes per all-reduce bucket: DDP's default bucket size (25 MiB), for the same reason (large enough
# to amortise the collective's latency, small enough that the staging copy stays small).
ALL_REDUCE_BUCKET_BYTES = 25 * 1024 * 1024


@torch.no_grad()
def all_reduce_in_buckets(
    grads: list[torch.Tensor], group: dist.ProcessGroup, bucket_bytes: int = ALL_REDUCE_BUCKET_BYTES
) -> int:
    """Sum ``grads`` over ``group`` in place, a bucket of at most ``bucket_bytes`` at a time;
    returns the number of collectives. A gradient larger than a bucket is reduced in place on
    its own; smaller ones of one dtype are packed into a staging buffer of one bucket (so the peak
    extra memory is one bucket, not a flat copy of every gradient). Hand-written because DDP's
    reducer (which does the same) needs the model wrapped in ``DistributedDataParallel`` and
    hooks into backward, while our gradients accumulate over many backwards before one reduce.
    """
    calls = 0
    bucket: list[torch.Tensor] = []
    size = 0

    def flush() -> None:
        nonlocal bucket, size, calls
        if not bucket:
            return
        if len(bucket) == 1:
            dist.all_reduce(bucket[0], group=group)
        else:
            flat = torch.cat([g.reshape(-1) for g in bucket])
            dist.all_reduce(flat, group=group)
            offset = 0
            for g in bucket:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
        calls += 1
        bucket, size = [], 0

    for g in grads:
        nbytes = g.numel() * g.element_size()
        if bucket and (size + nbytes > bucket_bytes or g.dtype != bucket[0].dtype or g.device != bucket[0].device):
            flush()
        bucket.append(g)
        size += nbytes
    flush()
    return calls
