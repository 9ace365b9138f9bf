"""FSDP2 (``torch.distributed.fsdp.fully_shard``) for the trainable denoiser.

All parallelism is applied in one place (:func:`apply_fsdp2`, torchtitan style): each
repeated transformer block becomes one FSDP unit (one all-gather in forward, one in backward,
one reduce-scatter of its gradients), then the root module takes what is left (embedders,
final norm and projection). Parameters become ``DTensor`` s sharded on dim 0 over the mesh
(HSDP, :func:`training_mesh` of a layout with several replicas: over the mesh's ``shard``
dimension, one node's ranks, and replicated across its ``replicate`` dimension, the nodes; each
unit's gradients are then reduce-scattered within the node and the shard all-reduced across
nodes, in the same backward);
the optimizer must therefore be built *after* :func:`apply_fsdp2`, on the module's new
parameters (``fully_shard`` replaces every ``nn.Parameter`` object).

LoRA (peft-injected, e.g. diffusers' ``add_adapter``): frozen base weights and trainable
``lora_A``/``lora_B`` live in the same block, hence the same FSDP unit. FSDP2 supports mixed
``requires_grad`` inside one unit (FSDP1 needed ``use_orig_params=True``): every parameter is
sharded and all-gathered, only those with ``requires_grad`` get gradients, which are
reduce-scattered. Caveats:

- frozen base weights are all-gathered on every forward (and again in backward with
  ``reshard_after_forward=True``): that is the price of sharding them; for LoRA on a model
  that fits one device, plain data parallelism moves less data;
- ``requires_grad`` may change after sharding (FSDP2 copies the sharded parameter's flag onto
  the unsharded one at every all-gather), but set it before the first forward of an
  iteration, never between forward and backward;
- every rank must call the unit's forward/backward the same number of times (they are
  collectives): see the module notes in :func:`apply_fsdp2`;
- peft's ``disable_adapters()`` / ``enable_adapters()`` (the KL reference of LoRA training)
  only flip flags and keep working; ``copy.deepcopy`` of a sharded module does not give a
  usable independent reference, and a dense copy before sharding doubles the load peak (two
  full models on each GPU): :func:`shard_with_reference` builds a full fine-tune's reference
  from the policy's shards;
- FSDP2 warns that some diffusers blocks (FLUX single-stream blocks, the FLUX root) return
  views: an in-place op on such an output would skip the backward all-gather. diffusers and
  the adapters use out-of-place ops there (gradients tested exact); keep it so.

Verified with torch 2.13: ``fully_shard`` runs on CPU over gloo, with ``param_dtype=None``
(fp32) and with ``param_dtype=torch.bfloat16``. Parameter and state-dict names are unchanged
by FSDP2 (no ``_fsdp_wrapped_module.`` prefix as in FSDP1), only the class of each sharded
module becomes a dynamic subclass (``FSDP<Name>``), so ``isinstance`` checks still hold.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn

from verl_digen.sync.state import LORA_MARKER
from verl_digen.memory.fsdp_layout import MESH_DIM_NAMES, FsdpLayout

__all__ = [
    "apply_fsdp2",
    "block_modules",
    "enable_gradient_checkpointing",
    "stream_full_state",
    "is_fsdp",
    "group_layout",
    "reduce_torch_dtype",
    "training_mesh",
    "shard_for_training",
    "shard_with_reference",
]



def _fsdp_api():
    """``fully_shard``, ``FSDPModule``, ``MixedPrecisionPolicy`` (public path since torch 2.6)."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    return fully_shard, FSDPModule, MixedPrecisionPolicy


def _dtensor_cls():
    from torch.distributed.tensor import DTensor

    return DTensor


# ---------------------------------------------------------------------- structure


def block_modules(transformer: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks of a diffusers denoiser, in registration order.

    Every direct ``nn.ModuleList`` child of ``transformer`` contributes its elements (in
    order), whatever the list is called, so all diffusers DiTs are covered without a table:

    - FLUX (``FluxTransformer2DModel``): ``transformer_blocks`` (double-stream MMDiT blocks)
      then ``single_transformer_blocks``;
    - SD3 (``SD3Transformer2DModel``), Qwen-Image: ``transformer_blocks``;
    - Wan2.1 (``WanTransformer3DModel``): ``blocks``;
    - HunyuanVideo: ``transformer_blocks`` then ``single_transformer_blocks`` (its token
      refiner's blocks are nested deeper and stay in the root unit).

    Only the top level is searched (nested lists belong to their block). For FLUX and SD3 the
    registration order is also the execution order. Returns ``[]`` for a module without
    ``ModuleList`` children.
    """
    blocks: list[nn.Module] = []
    for child in transformer.children():
        if isinstance(child, nn.ModuleList):
            blocks.extend(m for m in child if isinstance(m, nn.Module))
    return blocks


def is_fsdp(module: nn.Module) -> bool:
    """Whether ``module`` was sharded with ``fully_shard`` (FSDP2)."""
    _, FSDPModule, _ = _fsdp_api()
    return isinstance(module, FSDPModule)


def enable_gradient_checkpointing(transformer: nn.Module) -> bool:
    """Turn on diffusers' activation checkpointing of the blocks; return whether it is on.

    Uses ``ModelMixin.enable_gradient_checkpointing()`` (non-reentrant
    ``torch.utils.checkpoint`` around each block call) when the model class supports it
    (``_supports_gradient_checkpointing``); any other module is left untouched and ``False``
    is returned. Call it before :func:`apply_fsdp2` (the tested order; diffusers only sets
    flags, so after works the same way). The checkpointed call wraps the block's FSDP hooks:
    FSDP2 supports this, the recomputation in backward all-gathers the block again (tested
    exact against an unsharded, uncheckpointed reference on a tiny FLUX).
    """
    enable = getattr(transformer, "enable_gradient_checkpointing", None)
    if enable is None or not getattr(transformer, "_supports_gradient_checkpointing", False):
        return False
    enable()
    return bool(getattr(transformer, "is_gradient_checkpointing", True))


# ---------------------------------------------------------------------- sharding


def _mesh_device_type() -> str:
    if not dist.is_initialized():
        raise RuntimeError("apply_fsdp2 needs an initialised default process group (or an explicit mesh)")
    return "cuda" if "nccl" in str(dist.get_backend()).lower() else "cpu"


def _default_mesh():
    from torch.distributed.device_mesh import init_device_mesh

    device_type = _mesh_device_type()
    return init_device_mesh(device_type, (dist.get_world_size(),))


def training_mesh(layout: FsdpLayout, timeout_s: float | None = None):
    """The ``DeviceMesh`` of ``layout`` over the default process group: 1-D over every rank
    (flat), or 2-D ``("replicate", "shard")`` whose row ``i`` is the ranks of ``layout.rows[i]``
    (HSDP: one node's ranks; given explicitly because a pool's ranks need not fill nodes in rank
    order). A collective: every rank of the default group builds the same mesh (subgroups).

    ``timeout_s``: the HSDP subgroups' collective timeout (the run's planned deadline). A flat
    mesh is the default group, created with it; the subgroups of a 2-D mesh would otherwise get
    the backend's default (NCCL's 10 minutes: ``split_group`` and ``new_group`` do not inherit
    the parent's), which a shard group's all-gather outwaits while trainer 0 joins a send under
    TCSS."""
    from torch.distributed.device_mesh import DeviceMesh

    world = dist.get_world_size() if dist.is_initialized() else 0
    if sum(len(r) for r in layout.rows) != world:
        raise ValueError(f"FSDP layout of {sum(len(r) for r in layout.rows)} ranks over a process group of {world}")
    if not layout.hsdp:
        return _default_mesh()
    override = None
    if timeout_s is not None:
        options = _group_options(timedelta(seconds=timeout_s))
        override = ((None, options),) * len(MESH_DIM_NAMES)
    return DeviceMesh(_mesh_device_type(), torch.tensor(layout.rows, dtype=torch.int), mesh_dim_names=MESH_DIM_NAMES,
                      backend_override=override)


def _group_options(timeout: timedelta):
    """Process-group options of the default group's backend carrying ``timeout`` (what
    ``DeviceMesh`` hands ``split_group`` / ``new_group`` for each dimension's subgroups)."""
    if "nccl" in str(dist.get_backend()).lower():
        options = dist.ProcessGroupNCCL.Options()
    else:
        options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    return options


def apply_fsdp2(
    transformer: nn.Module,
    *,
    mesh=None,
    param_dtype: torch.dtype | None = torch.bfloat16,
    reduce_dtype: torch.dtype | None = torch.float32,
    reshard_after_forward: bool = True,
    grad_reduce: Literal["mean", "sum"] = "mean",
    cast_forward_inputs: bool = True,
    cpu_offload: bool = False,
) -> nn.Module:
    """Shard ``transformer`` with FSDP2: each block of :func:`block_modules`, then the root.

    Args:
        transformer: the denoiser (LoRA already injected, ``requires_grad`` already set is
            best). Its parameters are moved to the mesh's device (``cuda`` current device for
            an NCCL mesh) and replaced, in place, by sharded ``DTensor`` parameters.
        mesh: ``DeviceMesh`` of the data-parallel ranks: 1-D (flat: parameters sharded over
            every rank) or 2-D ``("replicate", "shard")`` (HSDP, :func:`training_mesh`: sharded
            over a row, replicated across rows; gradients reduce-scattered within the row, then
            all-reduced across rows); default: 1-D over the whole default process group, ``cuda``
            for NCCL, ``cpu`` otherwise (gloo).
        param_dtype: dtype parameters are all-gathered and computed in (``None``: their own,
            i.e. fp32 master weights). The sharded master copy, the gradients handed to the
            optimizer and the optimizer state stay in the parameters' original dtype. The
            root casts floating-point forward inputs to it (``cast_forward_inputs``, at the root
            only: see the body), position ids included (exact in bf16 up to 256, enough for FLUX
            up to 2048 px), unless ``cast_forward_inputs=False``.
        reduce_dtype: dtype of the gradient reduce-scatter (and of HSDP's all-reduce); ``None``:
            the gradients' own. The reduced shard is handed back in the parameter's dtype.
        reshard_after_forward: free gathered parameters after each unit's forward (and
            re-gather in backward). ``False`` keeps them until backward: less communication,
            more memory.
        cast_forward_inputs: let FSDP cast floating forward inputs to ``param_dtype``. The
            workers pass ``False`` with ``param_dtype=None``: the adapters cast each input as the
            diffusers pipeline does (SD3/Wan/HunyuanVideo keep the timestep in fp32), so a
            sharded forward is the unsharded one bit for bit.
        grad_reduce: ``"mean"`` (FSDP default: gradients averaged over ranks; right when every
            rank's loss is the mean over its own equally-sized data) or ``"sum"`` (gradients
            summed: right when each rank scales its loss by its share of the global batch,
            as ``PolicyUpdater.train_micro_batch`` does for the all-reduce it replaces).
            ``"sum"`` forces SUM collectives with no divide, which works on gloo and NCCL
            (a divide factor alone would use NCCL's PREMUL_SUM, which gloo rejects).
        cpu_offload: FSDP2's ``CPUOffloadPolicy``: the sharded parameters, their gradients and
            the optimizer step on the host (``digen.fsdp.param_offload``); the device holds only
            the units being computed. Build the optimizer after, on the host parameters.

    Returns:
        ``transformer`` itself, now an ``FSDPModule`` (same class and attribute names).

    Lockstep: forward and backward of an FSDP unit are collectives. Every rank of the mesh
    must run the same sequence of forwards (with grad or not) and backwards: same number of
    micro-batches, of trained steps per micro-batch, of CFG branches, of KL reference
    forwards; no rank may skip a step with nothing to train (run a zero-weighted one instead).
    """
    fully_shard, FSDPModule, MixedPrecisionPolicy = _fsdp_api()
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    # FSDP2's own host offload (veRL's param_offload): sharded parameters, their gradients and the
    # optimizer step live on the host; each unit's forward and backward copies its shard in.
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()
    if grad_reduce not in ("mean", "sum"):
        raise ValueError(f"grad_reduce={grad_reduce!r}; valid: 'mean', 'sum'")
    if is_fsdp(transformer):
        raise ValueError(f"{type(transformer).__name__} is already sharded with fully_shard")
    if mesh is None:
        mesh = _default_mesh()
    # Inputs are cast once, at the root. Casting at every block too broke activation checkpointing
    # on torch 2.11 (an H100 run): FSDP2 there does not re-cast the inputs of a block that
    # checkpointing recomputes in backward, so the recomputation saw other dtypes than the forward
    # (CheckpointError); newer torch re-casts. Tensors a block receives from the root's own forward
    # (RoPE tables, the timestep embedding) keep the dtype they are computed in, in both passes.
    root_policy = MixedPrecisionPolicy(
        param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=cast_forward_inputs
    )
    block_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False)
    for block in block_modules(transformer):
        fully_shard(block, mesh=mesh, mp_policy=block_policy, reshard_after_forward=reshard_after_forward,
                    offload_policy=offload)
    fully_shard(transformer, mesh=mesh, mp_policy=root_policy, reshard_after_forward=reshard_after_forward,
                offload_policy=offload)
    if grad_reduce == "sum":
        for module in transformer.modules():
            if isinstance(module, FSDPModule):
                # Per-module settings (not recursive): apply to every unit.
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)
    return transformer


def group_layout(node: str, *, mesh: str, reduce: str, lora: bool, weights_dtype: str) -> FsdpLayout:
    """The FSDP layout of the default process group's ranks (a collective): every rank's ``node``
    (where it runs: the worker's Ray node id) is gathered, and the ``digen.fsdp.mesh`` /
    ``digen.fsdp.reduce_dtype`` settings are applied to that placement
    (:func:`verl_digen.memory.fsdp_layout.choose_layout`). Every rank gets the same layout; a
    placement the settings cannot use raises the same ``LayoutError`` on every rank."""
    from verl_digen.memory.fsdp_layout import choose_layout

    nodes: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(nodes, str(node))
    return choose_layout([str(n) for n in nodes], mesh=mesh, reduce=reduce, lora=lora, weights_dtype=weights_dtype)


def reduce_torch_dtype(layout: FsdpLayout) -> torch.dtype:
    """The torch dtype of ``layout.reduce_dtype``."""
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[layout.reduce_dtype]


def shard_for_training(transformer: nn.Module, *, reshard_after_forward: bool = True, mesh=None,
                       cpu_offload: bool = False, reduce_dtype: torch.dtype = torch.float32) -> nn.Module:
    """The workers' FSDP2 sharding of a denoiser (or of its frozen KL reference): parameters
    all-gathered in the dtypes they were loaded in (bf16 base, fp32 LoRA, the fp32 modules a
    diffusers model keeps) and no input casting, so that a sharded forward is the rollout's
    unsharded forward bit for bit; gradients reduced in ``reduce_dtype`` (the layout's:
    :func:`verl_digen.memory.fsdp_layout.reduce_dtype`) and summed (each rank scales its loss by
    its share of the step's batch)."""
    return apply_fsdp2(
        transformer,
        mesh=mesh,
        param_dtype=None,
        reduce_dtype=reduce_dtype,
        cast_forward_inputs=False,
        reshard_after_forward=reshard_after_forward,
        grad_reduce="sum",
        cpu_offload=cpu_offload,
    )


def meta_copy(module: nn.Module) -> nn.Module:
    """An independent copy of ``module``'s structure (submodules, flags, hooks' owners) whose
    parameters and buffers are on the meta device: no bytes. ``copy.deepcopy`` with every
    tensor of the module mapped to a meta stand-in up front."""
    memo: dict[int, object] = {}
    for p in module.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in module.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    import copy

    return copy.deepcopy(module, memo)


def shard_with_reference(transformer: nn.Module, *, reshard_after_forward: bool = True, mesh=None,
                         reference: bool = True, cpu_offload: bool = False,
                         reduce_dtype: torch.dtype = torch.float32) -> nn.Module | None:
    """Shard ``transformer`` for training (:func:`shard_for_training`) and, with ``reference``,
    build its frozen KL reference (a full fine-tune's) from the shards: at most one dense copy of
    the model is ever on the device.

    Order: the reference's structure is copied on the meta device while the policy is still a
    plain module (a sharded one cannot be deep-copied), the policy is sharded (its dense weights
    are freed), the meta copy is sharded over the same mesh, materialised (``to_empty``: each
    rank allocates its shards only) and filled from the policy's shards, rank-local copies with
    no communication. Deep-copying the dense model first would hold two on each GPU at load
    (2 x 38 GiB for Qwen-Image). Returns the reference (frozen, eval) or None."""
    skeleton = meta_copy(transformer).requires_grad_(False).eval() if reference else None
    shard_for_training(transformer, reshard_after_forward=reshard_after_forward, mesh=mesh, cpu_offload=cpu_offload,
                       reduce_dtype=reduce_dtype)
    if skeleton is None:
        return None
    first = next(transformer.parameters())
    mesh = first.device_mesh if isinstance(first, _dtensor_cls()) else mesh
    shard_for_training(skeleton, reshard_after_forward=reshard_after_forward, mesh=mesh, cpu_offload=cpu_offload)
    skeleton.to_empty(device=_local(first).device)
    with torch.no_grad():
        sources = dict(transformer.named_parameters())
        sources.update(transformer.named_buffers())
        for name, t in (*skeleton.named_parameters(), *skeleton.named_buffers()):
            _local(t).copy_(_local(sources[name]))
    return skeleton


def _local(t: Tensor) -> Tensor:
    """A DTensor's local shard, or the tensor itself."""
    return t.to_local() if isinstance(t, _dtensor_cls()) else t


# ---------------------------------------------------------------------- weight sync


def _is_row_sharded(t: Tensor) -> bool:
    """FSDP2's placements: ``Shard(0)`` on a 1-D mesh (flat), or ``(Replicate(), Shard(0))`` on
    a 2-D one (HSDP: every replica holds the whole tensor, sharded over its own ranks)."""
    from torch.distributed.tensor import Replicate, Shard

    placements = tuple(t.placements)
    return (
        t.ndim >= 1
        and len(placements) == t.device_mesh.ndim
        and isinstance(placements[-1], Shard)
        and placements[-1].dim == 0
        and all(isinstance(p, Replicate) for p in placements[:-1])
    )


def _gather_row_sharded(tensors: list[Tensor]) -> list[Tensor]:
    """Full tensors of row-sharded DTensors (:func:`_is_row_sharded`) of one mesh and dtype: one
    all-gather over the mesh's last dimension (HSDP: within this rank's replica, which holds the
    whole tensor; nothing crosses to the other replicas).

    DTensor (and FSDP2) shard dim 0 like ``torch.chunk``: rank ``r`` holds rows
    ``[r*c, min((r+1)*c, n))`` with ``c = ceil(n / world)`` (possibly none). Each local shard
    is padded to ``c`` rows and all are packed into one buffer per rank.
    """
    mesh = tensors[0].device_mesh
    world = mesh.size(mesh.ndim - 1)
    group = mesh.get_group(mesh.ndim - 1)
    locals_ = [t.to_local() for t in tensors]
    device, dtype = locals_[0].device, locals_[0].dtype
    if mesh.device_type == "cuda" and device.type != "cuda":  # host-offloaded shards: gather on the GPU (NCCL)
        device = torch.device("cuda", torch.cuda.current_device())
    layout = []  # (rows n, chunk c, row numel, offset in the per-rank buffer)
    offset = 0
    for t in tensors:
        n = t.shape[0]
        c = math.ceil(n / world) if n else 0
        row = math.prod(t.shape[1:])
        layout.append((n, c, row, offset))
        offset += c * row
    send = torch.zeros(offset, device=device, dtype=dtype)
    for loc, (n, c, row, off) in zip(locals_, layout):
        k = loc.numel()
        if k:
            send[off : off + k].copy_(loc.reshape(-1))
    recv = torch.empty(world * offset, device=device, dtype=dtype)
    # all_gather_single: torch >= 2.13's name for all_gather_into_tensor (deprecated there).
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(recv, send, group=group)
    recv = recv.view(world, offset)
    out = []
    for t, (n, c, row, off) in zip(tensors, layout):
        # reshape copies the strided columns out of recv (a view only when world == 1: clone then).
        full = recv[:, off : off + c * row].reshape(world * c, *t.shape[1:])[:n]
        out.append(full.clone() if world == 1 else full)
    return out


# Bytes gathered per all-gather when streaming a sharded state: one bucket is what a rank holds
# at a time on the device (the weight channel's own default bucket is 1 GiB too).
SYNC_BUCKET_BYTES = 1 << 30


@torch.no_grad()
def stream_full_state(
    module: nn.Module, *, lora_only: bool, bucket_bytes: int = SYNC_BUCKET_BYTES
) -> Iterator[tuple[str, Tensor]]:
    """``(name, full tensor)`` of the weight-sync state of a (possibly FSDP2-sharded) module, in
    sorted name order, gathered bucket by bucket: the stream itself holds at most ``bucket_bytes``
    of full tensors (plus this rank's share of them) at a time, never the whole state; a consumer
    that keeps yielded tensors alive for asynchronous copies holds more (rank 0's host snapshot:
    at most ``CAPTURE_DEVICE_BUCKETS`` buckets, sync/buckets.py).

    A collective when ``module`` is sharded: EVERY rank of its mesh must consume the whole
    stream, in the same order relative to other collectives. Consecutive row-sharded tensors of
    one mesh and dtype share one all-gather (LoRA states are hundreds of tiny matrices); other
    DTensors use ``full_tensor()``; plain tensors are yielded as they are (views: copy them
    before the module changes). A tensor larger than a bucket is gathered alone.

    Same contract as :func:`verl_digen.sync.state.trainable_state` for names: state-dict names
    (FSDP2 adds no prefix; FSDP1/compile/checkpoint-wrapper prefixes are stripped), only names
    containing ``"lora_"`` when ``lora_only``, buffers included in a full state.

    Raises:
        ValueError: ``lora_only`` but the module has no ``lora_`` tensor.
    """
    DTensor = _dtensor_cls()
    sd = module.state_dict()  # FSDP2's pre-hook registers the sharded parameters first
    names = sorted(sd, key=_strip_wrapper_prefixes)
    names = [n for n in names if not lora_only or LORA_MARKER in n]
    if lora_only and not names:
        raise ValueError(f"lora_only=True but {type(module).__name__} has no tensor named '*{LORA_MARKER}*'")
    bucket: list[str] = []
    size = 0

    def flush() -> Iterator[tuple[str, Tensor]]:
        if bucket:
            fulls = _gather_row_sharded([sd[n].detach() for n in bucket])
            yield from zip(bucket, fulls)
            bucket.clear()

    for name in names:
        t = sd[name].detach()
        if isinstance(t, DTensor) and _is_row_sharded(t):
            nbytes = t.numel() * t.element_size()
            first = sd[bucket[0]] if bucket else None
            if bucket and (size + nbytes > bucket_bytes or first.dtype != t.dtype or first.device_mesh != t.device_mesh):
                for n, full in flush():
                    yield _strip_wrapper_prefixes(n), full
                size = 0
            bucket.append(name)
            size += nbytes
            continue
        for n, full in flush():  # keep the sorted order
            yield _strip_wrapper_prefixes(n), full
        size = 0
        yield _strip_wrapper_prefixes(name), (t.full_tensor() if isinstance(t, DTensor) else t)
    for n, full in flush():
        yield _strip_wrapper_prefixes(n), full


_WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_orig_mod.", "_checkpoint_wrapped_module.")


def _strip_wrapper_prefixes(name: str) -> str:
    for p in _WRAPPER_PREFIXES:
        name = name.replace(p, "")
    return name
