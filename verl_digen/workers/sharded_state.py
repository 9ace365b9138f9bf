"""A trainer rank's checkpoint, saved and loaded by the rank itself with torch.distributed.checkpoint.

Inside ``global_step_<k>/``:

- ``state/``              DCP: ``model`` (the trained tensors: LoRA-only when LoRA is on),
  ``optimizer`` (keyed by parameter name, so it reshards) and ``ema``; every trainer rank writes
  its own shards (``__<rank>_<n>.distcp``), the coordinator (rank 0) writes ``.metadata``;
- ``trainer_rank<r>.pt``  rank ``r``'s RNG state and weights version (a few KB, weights-only).

DCP stores a tensor by its global shape and each rank's share of it, so a checkpoint written by
``n`` FSDP ranks loads onto any number of ranks (or one unsharded module, or an offline reader:
:func:`read_full_weights`). Replicated tensors (unsharded trainers, the EMA's full copies) are
written once. Nothing passes through the driver: it receives file names and checksums only.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import re
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from verl_digen.sync.state import trained_entries

STATE_DIR = "state"
MODEL_KEY = "model"
_DATA_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")


class CheckpointError(RuntimeError):
    """A checkpoint asked for cannot be used; the message names it and why."""


def load_pt(path: str) -> dict[str, Any]:
    """A checkpoint ``.pt`` file, unpickling only tensors and plain containers."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # UnpicklingError for refused globals, RuntimeError/EOFError for damage
        raise CheckpointError(
            f"{path}: refused or unreadable ({e.__class__.__name__}: {str(e).splitlines()[0][:300]}); "
            "checkpoint files hold only tensors and plain containers"
        ) from None


def rank_file(rank: int) -> str:
    return f"trainer_rank{rank}.pt"


def _model_state(module: torch.nn.Module, *, lora_only: bool) -> dict[str, torch.Tensor]:
    """The trained tensors by name, those a weight sync carries (FSDP2: this rank's ``DTensor``
    shards; DCP's own state-dict reader, which names them as a checkpoint must)."""
    return trained_entries(get_model_state_dict(module), lora_only=lora_only, owner=type(module).__name__)


def _master_state(module: torch.nn.Module, master: Any, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """The fp32 master copies of a bf16 full fine-tune (``workers.training.MasterWeights``) and
    their optimizer state, by the model parameter's name (FSDP2: this rank's ``DTensor`` shards,
    which DCP reshards like the model's). The optimizer steps the masters, not the module's
    parameters, so ``get_optimizer_state_dict(module, ...)`` cannot name them: done here."""
    names = {id(p): n for n, p in module.named_parameters()}
    fqns = [names[id(p)] for p in master.model_params]
    masters = dict(zip(fqns, master.masters))
    return masters, {n: optimizer.state[m] for n, m in masters.items()}


@torch.no_grad()
def _init_optimizer_state(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
    """Allocate the optimizer's state of ``params`` (zeros) for DCP to load into: one step with
    zero gradients at learning rate 0 (what ``torch.distributed.checkpoint.state_dict`` does for
    module parameters), which leaves the parameters as they are."""
    if all(p in optimizer.state for p in params):
        return
    lrs = [g["lr"] for g in optimizer.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    for g in optimizer.param_groups:
        g["lr"] = 0.0
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, lrs):
        g["lr"] = lr
    for p in params:
        p.grad = None


def _dcp_args(group: dist.ProcessGroup | None) -> dict[str, Any]:
    # Explicit: a rank outside any trainer group (world 1, a rollout worker) must not pick up
    # some other default group.
    return {"process_group": group} if group is not None else {"no_dist": True}


# ---------------------------------------------------------------- reading DCP without running code
#
# torch.distributed.checkpoint reads two pickles from a checkpoint directory: ``.metadata``
# (``FileSystemReader.read_metadata``: plain ``pickle.load``) and every non-tensor item of the
# ``.distcp`` files (``DefaultLoadPlanner.load_bytes``: ``torch.load(weights_only=False)``).
# Checkpoints come from outside and meta.json's checksums can be rewritten by whoever writes
# the files, so both would run a crafted payload. DCP has no restricted mode; the pickle
# documentation's way ("Restricting Globals": override ``find_class``) is used for the
# metadata, and torch's own ``weights_only`` unpickler for the items.

# Every global DCP's metadata pickle names (torch 2.11-2.13, FileSystemWriter): the metadata
# dataclasses, the file index entry, torch.Size, the layout helper torch registers with copyreg,
# the checkpoint id path, and torch dtypes (checked below as any ``torch.<name>`` that is a dtype).
_DCP_METADATA_GLOBALS = frozenset({
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    *((module, name) for module in ("pathlib", "pathlib._local") for name in ("PosixPath", "PurePosixPath")),
})  # pathlib._local: how Python 3.13 names the path classes in a pickle


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _DCP_METADATA_GLOBALS or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"global '{module}.{name}' is not a type checkpoint metadata holds")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError(f"persistent id {pid!r} is not something checkpoint metadata holds")


def _refused(path: Any, e: BaseException) -> CheckpointError:
    return CheckpointError(
        f"{path}: refused ({e.__class__.__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}); a checkpoint "
        "holds only tensors, plain containers and torch.distributed.checkpoint's metadata, and this file holds "
        "something else (a damaged or crafted file): do not resume from or export this checkpoint"
    )


class SafeFileSystemReader(dcp.FileSystemReader):
    """DCP's file reader with its ``.metadata`` unpickled through :class:`_MetadataUnpickler`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        path = os.path.join(str(self.path), ".metadata" if rank is None else f"__{rank}.metadata")
        try:
            with open(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except OSError as e:
            raise CheckpointError(f"{path}: unreadable ({e})") from None
        except Exception as e:  # UnpicklingError for a refused global, anything else for damage
            raise _refused(path, e) from None
        if not isinstance(metadata, Metadata):
            raise _refused(path, TypeError(f"holds a {type(metadata).__name__}, not DCP Metadata"))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner with every non-tensor item read by torch's ``weights_only``
    unpickler first (tensors and plain containers only); what passes is then loaded as DCP does."""

    def __init__(self, state_dir: str) -> None:
        super().__init__()
        self.state_dir = state_dir

    def load_bytes(self, read_item: Any, value: Any) -> None:
        try:
            torch.load(value, weights_only=True)
        except Exception as e:
            info = (self.metadata.storage_data or {}).get(read_item.storage_index) if self.metadata else None
            where = getattr(info, "relative_path", None) or "a .distcp file"
            raise _refused(f"{self.state_dir}/{where} (item {read_item.dest_index.fqn})", e) from None
        value.seek(0)
        super().load_bytes(read_item, value)


def dcp_load(state: dict[str, Any], path: str, **dist_args: Any) -> None:
    """``dcp.load`` of ``state`` from ``path`` with the safe reader and planner; a refused file
    or a failure on any rank raises :class:`CheckpointError` naming the file.

    torch's ``CheckpointException`` (raised for a failure on any rank) derives from
    ``BaseException``, so ``except Exception`` alone would let it through unnamed.
    """
    # One process: read (and refuse) the metadata here first, since inside dcp.load a refused
    # global metadata is followed by a per-rank lookup and reported as an AssertionError of both.
    # With a process group every rank must enter dcp.load, which gathers a failure on any rank.
    if dist_args.get("no_dist"):
        SafeFileSystemReader(path).read_metadata()
    try:
        dcp.load(state, checkpoint_id=path, storage_reader=SafeFileSystemReader(path),
                 planner=SafeLoadPlanner(path), **dist_args)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as e:
        raise _first_cause(e, path) from None


def _first_cause(e: BaseException, path: str) -> CheckpointError:
    """The error of the first failed rank (a :class:`CheckpointError` as it was raised), or one
    naming ``path`` and DCP's own reason (a missing key, a shape that does not fit)."""
    if isinstance(e, CheckpointException):
        for _rank, (cause, _trace) in sorted(e.failures.items()):
            if isinstance(cause, CheckpointError):
                return cause
            return _first_cause(cause, path)
    return CheckpointError(f"{path}: cannot be loaded into this model ({e.__class__.__name__}: "
                           f"{(str(e).splitlines() or [''])[0][:300]})")


def file_record(path: str) -> dict[str, Any]:
    """A written checkpoint file, synced to disk, as ``meta.json`` records it: sha256 and size."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
        os.fsync(f.fileno())
    return {"sha256": h.hexdigest(), "bytes": os.path.getsize(path)}


def save_rank_state(
    directory: str,
    *,
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    ema: Any,
    lora_only: bool,
    version: int,
    rank: int,
    group: dist.ProcessGroup | None,
    master: Any = None,
) -> dict[str, dict[str, Any]]:
    """Write this rank's part of a checkpoint into ``directory``; a collective over ``group``.

    Returns ``{relative path: {"sha256", "bytes"}}`` of the files this rank wrote (rank 0 also
    lists DCP's ``.metadata``), for the completion marker.
    """
    state: dict[str, Any] = {MODEL_KEY: _model_state(module, lora_only=lora_only)}
    if master is None:
        state["optimizer"] = get_optimizer_state_dict(module, optimizer)
    else:  # bf16 full fine-tune: the fp32 masters and their optimizer state
        state["master"], state["master_optimizer"] = _master_state(module, master, optimizer)
    if ema is not None:
        state["ema"] = ema.state_dict()
    path = os.path.join(directory, STATE_DIR)
    dcp.save(state, checkpoint_id=path, **_dcp_args(group))
    torch.save({"rng": torch.get_rng_state(), "version": version}, os.path.join(directory, rank_file(rank)))
    files = {rank_file(rank): file_record(os.path.join(directory, rank_file(rank)))}
    for name in sorted(os.listdir(path)):
        m = _DATA_FILE.match(name)
        if (m and int(m.group(1)) == rank) or (m is None and rank == 0):
            files[f"{STATE_DIR}/{name}"] = file_record(os.path.join(path, name))
    return files


def load_rank_state(
    directory: str,
    *,
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    ema: Any,
    lora_only: bool,
    rank: int,
    group: dist.ProcessGroup | None,
    master: Any = None,
) -> None:
    """Load a checkpoint into this rank (resharded to its module's layout); a collective over
    ``group``. ``optimizer=None`` (a rollout worker): the weights only.

    The RNG comes from ``trainer_rank<rank>.pt``, or rank 0's when the checkpoint was written by
    fewer ranks.
    """
    state: dict[str, Any] = {MODEL_KEY: _model_state(module, lora_only=lora_only)}
    if optimizer is not None and master is not None:
        _init_optimizer_state(optimizer, master.masters)  # allocates Adam's state to fill
        state["master"], state["master_optimizer"] = _master_state(module, master, optimizer)
    elif optimizer is not None:
        state["optimizer"] = get_optimizer_state_dict(module, optimizer)  # allocates Adam's state to fill
    if optimizer is not None:
        if ema is not None:
            state["ema"] = ema.state_dict()
    dcp_load(state, os.path.join(directory, STATE_DIR), **_dcp_args(group))
    set_model_state_dict(module, state[MODEL_KEY], options=StateDictOptions(strict=False))
    if optimizer is None:
        return
    if master is not None:  # loaded in place; the model takes their rounding
        master.copy_to_model()
    else:
        set_optimizer_state_dict(module, optimizer, state["optimizer"])
    if ema is not None:
        ema.load_state_dict(state["ema"])
    own = os.path.join(directory, rank_file(rank))
    extra = load_pt(own if os.path.exists(own) else os.path.join(directory, rank_file(0)))
    torch.set_rng_state(extra["rng"])


def read_full_weights(directory: str) -> dict[str, torch.Tensor]:
    """The checkpoint's trained tensors as full CPU tensors, by name, in one process (export).

    Allocates each ``model`` tensor at its global shape from DCP's metadata and lets DCP fill
    it from every rank's shards.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = os.path.join(directory, STATE_DIR)
    metadata = SafeFileSystemReader(path).read_metadata()
    prefix = MODEL_KEY + "."
    weights = {
        key[len(prefix):]: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)
    }
    dcp_load({MODEL_KEY: weights}, path, no_dist=True)
    return dict(sorted(weights.items()))
