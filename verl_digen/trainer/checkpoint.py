"""Checkpoints with veRL's layout and keys, written atomically, verified on resume.

Layout (as veRL's trainers): ``<trainer.default_local_dir>/global_step_<k>/`` plus
``latest_checkpointed_iteration.txt``. A checkpoint directory is built under a temporary
name and renamed into place only once every file is written and fsynced and ``meta.json``
(the completion marker, written last) lists the SHA-256 and size of every file; a crash
mid-save never leaves a directory that looks complete. :func:`find_latest` requires
``meta.json`` with ``complete: true`` (the newest such directory wins, whatever the tracker says); resuming verifies every checksum and, in ``auto``
mode, falls back to the newest intact checkpoint when the latest is corrupt (saying so).

Contents of ``global_step_<k>`` (policy version k):

- ``state/``               torch.distributed.checkpoint: the trained state (LoRA-only when LoRA
  is on), the optimizer and the EMA, written by every trainer rank from its own shards
  (:mod:`verl_digen.workers.sharded_state`); it loads onto any number of trainer ranks
- ``trainer_rank<r>.pt``   trainer rank ``r``'s RNG state, written by that rank
- ``controller.pt``        data position (prompt sampler state), metrics history, step: the
  only file the driver writes besides the marker
- ``meta.json``            step, strategy, model path, file checksums, ``complete: true`` (last)

The driver never holds tensor state: it creates the temporary directory, asks the trainer ranks
to write into it, receives the names and checksums of their files, writes its own small files
and the marker, and renames. (Checkpoints of the earlier layout, ``weights.safetensors`` +
``trainer.pt`` written by the driver, are still read by :meth:`Checkpoint.weights` for export;
nothing writes that layout any more.)

Checkpoint files come from outside (they are shared between people and machines): the
``.pt`` files are read with ``torch.load(weights_only=True)``, which unpickles only tensors
and plain containers and refuses anything that could run code; the weights are safetensors.

One run at a time writes a checkpoint root: :class:`RootLock` holds an exclusive ``flock`` on
``<root>/.digen.lock`` for the whole run (released by the OS if the process dies) and records
its holder, so a second run on the same directory stops with an error naming the first.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import socket
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

# The rank side reads checkpoint files too (workers/ may not import trainer/): its error and
# safe loader are the ones used here.
from verl_digen.config.schema import IDENTITY_KEYS
from verl_digen.config.verl_keys import VerlTrainerKeys
from verl_digen.workers.sharded_state import CheckpointError, file_record, load_pt

TRACKER = "latest_checkpointed_iteration.txt"
LOCK_FILE = ".digen.lock"
CONTROLLER_FILE = "controller.pt"
LEGACY_WEIGHTS = "weights.safetensors"  # the driver-written layout before sharded checkpoints
_STEP_DIR = re.compile(r"^global_step_(\d+)$")


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: str) -> None:
    try:
        _fsync_file(path)
    except OSError:  # some filesystems cannot fsync a directory; the data files are synced
        pass


@dataclass
class Checkpoint:
    path: str
    step: int

    def _file(self, name: str) -> str:
        return os.path.join(self.path, name)

    @property
    def sharded(self) -> bool:
        """Written by the trainer ranks (``state/``), not in the earlier driver-written layout."""
        from verl_digen.workers.sharded_state import STATE_DIR

        return os.path.isdir(self._file(STATE_DIR))

    def weights(self) -> dict[str, torch.Tensor]:
        """The trained tensors, full, by name (read in this process: export, inspection)."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        if self.sharded:
            from verl_digen.workers.sharded_state import read_full_weights

            try:
                return read_full_weights(self.path)
            except Exception as e:
                raise CheckpointError(f"{self._file('state')}: cannot be read ({e.__class__.__name__}: {e})") from None
        try:
            return load_file(self._file(LEGACY_WEIGHTS))
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{self._file(LEGACY_WEIGHTS)}: cannot be read ({e})") from None

    def controller_state(self) -> dict[str, Any]:
        return load_pt(self._file(CONTROLLER_FILE))

    def meta(self) -> dict[str, Any]:
        with open(self._file("meta.json")) as f:
            meta = json.load(f)
        if not isinstance(meta, dict):
            raise ValueError(f"holds a JSON {type(meta).__name__}, not an object")
        return meta

    def verify(self) -> None:
        """Check every file against the checksums in ``meta.json``; raise naming the first bad one."""
        try:
            files = self.meta().get("files")
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{self._file('meta.json')}: unreadable ({e})") from None
        if files is None:  # written before checksums existed: nothing to check against
            return
        if not isinstance(files, dict) or not all(isinstance(w, dict) and {"bytes", "sha256"} <= set(w)
                                                  for w in files.values()):
            raise CheckpointError(f"{self._file('meta.json')}: malformed 'files' (expected name -> sha256 and bytes)")
        for name, want in files.items():
            path = self._file(name)
            if not os.path.isfile(path):
                raise CheckpointError(f"{path}: missing (listed in meta.json)")
            size = os.path.getsize(path)
            if size != want["bytes"]:
                raise CheckpointError(f"{path}: {size} bytes, meta.json says {want['bytes']} (truncated or replaced)")
            if _sha256(path) != want["sha256"]:
                raise CheckpointError(f"{path}: SHA-256 does not match meta.json (the file is corrupt)")


def _atomic_write_text(path: str, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path))


def is_complete(path: str) -> bool:
    try:
        return bool(Checkpoint(path, 0).meta().get("complete"))
    except (OSError, ValueError):
        return False


def save_checkpoint(
    root: str,
    step: int,
    *,
    controller_state: dict[str, Any],
    meta: dict[str, Any],
    write_state: Callable[[str], dict[str, dict[str, Any]]] | None = None,
    max_to_keep: int | None = None,
) -> Checkpoint:
    """Write ``global_step_<step>`` atomically, update the tracker, prune old checkpoints.

    ``write_state(tmp_dir)``: has the trainer ranks write their files into the temporary
    directory and returns ``{relative path: {"sha256", "bytes"}}`` of what they wrote (fsynced).
    ``controller.pt`` and the marker ``meta.json`` (last) are written here.
    """
    os.makedirs(root, exist_ok=True)
    final = os.path.join(root, f"global_step_{step}")
    tmp = tempfile.mkdtemp(dir=root, prefix=f".tmp-global_step_{step}-")
    try:
        files: dict[str, dict[str, Any]] = dict(write_state(tmp)) if write_state is not None else {}
        torch.save(controller_state, os.path.join(tmp, CONTROLLER_FILE))
        files[CONTROLLER_FILE] = file_record(os.path.join(tmp, CONTROLLER_FILE))
        missing = [name for name in files if not os.path.isfile(os.path.join(tmp, name))]
        if missing:
            raise CheckpointError(f"files reported written but absent from {tmp}: {missing[:5]}")
        if os.path.isdir(os.path.join(tmp, "state")):
            _fsync_dir(os.path.join(tmp, "state"))
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump({**meta, "step": step, "files": files, "complete": True}, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        if os.path.exists(final):
            _replace_existing(Checkpoint(final, step))
        os.replace(tmp, final)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _atomic_write_text(os.path.join(root, TRACKER), str(step))
    if max_to_keep is not None and max_to_keep > 0:
        for old_step, path in sorted(_complete_steps(root))[:-max_to_keep]:
            shutil.rmtree(path, ignore_errors=True)
    return Checkpoint(final, step)


def _replace_existing(ckpt: Checkpoint) -> None:
    """Make room for a new checkpoint of the same step (a fresh start in a used directory): an
    intact one is removed, as veRL's trainers overwrite theirs; a damaged one is never written
    over but moved aside to ``global_step_<k>.damaged[-n]``, which no resume picks up."""
    try:
        ckpt.verify()
        if not is_complete(ckpt.path):
            raise CheckpointError(f"{ckpt.path}: no meta.json with complete=true")
    except CheckpointError as e:
        aside = f"{ckpt.path}.damaged"
        n = 0
        while os.path.exists(aside):
            n += 1
            aside = f"{ckpt.path}.damaged-{n}"
        os.replace(ckpt.path, aside)
        print(f"[verl-digen] {ckpt.path} is damaged ({e}); kept as {aside}, not overwritten", flush=True)
        return
    shutil.rmtree(ckpt.path)


def _step_dirs(root: str) -> list[tuple[int, str]]:
    """Every ``global_step_<k>`` directory under ``root``, complete or not."""
    if not os.path.isdir(root):
        return []
    out = []
    for name in os.listdir(root):
        m = _STEP_DIR.match(name)
        path = os.path.join(root, name)
        if m and os.path.isdir(path):
            out.append((int(m.group(1)), path))
    return out


def _complete_steps(root: str) -> list[tuple[int, str]]:
    return [(step, path) for step, path in _step_dirs(root) if is_complete(path)]


def find_latest(root: str) -> Checkpoint | None:
    """The newest complete checkpoint under ``root``; not verified.

    The directory scan decides, not ``latest_checkpointed_iteration.txt``: the tracker is
    written after a checkpoint is renamed into place (for veRL's tools), so a crash between the
    two leaves it one step behind a complete checkpoint.
    """
    steps = _complete_steps(root)
    if not steps:
        return None
    step, path = max(steps)
    return Checkpoint(path, step)


def damage(ckpt: Checkpoint) -> str | None:
    """Why ``ckpt`` cannot be resumed from (None: intact): no usable completion marker, a file
    that does not match its checksum, or DCP metadata that is refused or unreadable."""
    try:
        meta = ckpt.meta()
    except FileNotFoundError:
        return f"{ckpt._file('meta.json')}: missing (the checkpoint was never completed, or is not verl-digen's)"
    except (OSError, ValueError) as e:
        return f"{ckpt._file('meta.json')}: unreadable ({e.__class__.__name__}: {e})"
    if not isinstance(meta, dict) or not meta.get("complete"):
        return f"{ckpt._file('meta.json')}: not marked complete"
    try:
        ckpt.verify()
        if ckpt.sharded:  # read here, before any worker, with the same safe reader the ranks use
            from verl_digen.workers.sharded_state import SafeFileSystemReader

            SafeFileSystemReader(ckpt._file("state")).read_metadata()
    except CheckpointError as e:
        return str(e)
    return None


def find_latest_intact(root: str) -> Checkpoint | None:
    """The newest checkpoint that is complete and whose files match their checksums; every
    directory skipped on the way is named with why."""
    intact, _ = scan_checkpoints(root)
    return intact


def scan_checkpoints(root: str) -> tuple[Checkpoint | None, list[str]]:
    """The newest intact checkpoint under ``root`` and, newest first, why each newer
    ``global_step_<k>`` directory was skipped (each printed as it is skipped)."""
    skipped = []
    for step, path in sorted(_step_dirs(root), reverse=True):
        ckpt = Checkpoint(path, step)
        if not os.path.lexists(ckpt._file("meta.json")):  # never completed, or not verl-digen's: not a checkpoint
            print(f"[verl-digen] ignoring {path}: no meta.json (not a verl-digen checkpoint)", flush=True)
            continue
        why = damage(ckpt)
        if why is None:
            return ckpt, skipped
        skipped.append(why)
        print(f"[verl-digen] skipping damaged checkpoint {path}: {why}", flush=True)
    return None, skipped


def checkpoint_at(path: str) -> Checkpoint:
    """A specific checkpoint directory (``trainer.resume_from_path``), checked for completeness."""
    m = _STEP_DIR.match(os.path.basename(os.path.normpath(path)))
    if not os.path.isdir(path):
        raise CheckpointError(f"trainer.resume_from_path={path!r} does not exist")
    if m is None:
        raise CheckpointError(f"trainer.resume_from_path={path!r} is not a global_step_<k> checkpoint directory")
    if not is_complete(path):
        raise CheckpointError(f"trainer.resume_from_path={path!r} is incomplete (no meta.json with complete=true)")
    return Checkpoint(path, int(m.group(1)))


class RootLock:
    """An exclusive lock on a run's directory for the lifetime of the run (``fcntl.flock``):
    the checkpoint root (``trainer.default_local_dir``) or the run output (``digen.output_dir``)."""

    def __init__(self, root: str, key: str = "trainer.default_local_dir",
                 what: str = "two runs writing one checkpoint directory would overwrite each other's checkpoints") -> None:
        self.root = root
        self.key, self.what = key, what
        self.path = os.path.join(root, LOCK_FILE)
        self._fd: int | None = None

    def acquire(self, holder: dict[str, Any]) -> None:
        import fcntl

        os.makedirs(self.root, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            with os.fdopen(fd) as f:
                who = f.read().strip() or "unknown holder"
            raise CheckpointError(
                f"{self.key}={self.root} is in use by another run ({who}); {self.what}: give this run its own "
                f"{self.key}, or wait for the other to finish"
            ) from None
        os.ftruncate(fd, 0)
        info = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S"), **holder}
        os.write(fd, json.dumps(info).encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            import fcntl

            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def remove_stale_temporaries(root: str) -> list[str]:
    """Remove the temporary directories and files a killed run left under ``root``
    (``.tmp-global_step_*`` being written when it died). Call only while holding
    :class:`RootLock`: no live run can be writing them then. Returns what was removed."""
    removed = []
    if not os.path.isdir(root):
        return removed
    for name in sorted(os.listdir(root)):
        if not name.startswith(".tmp-"):
            continue
        path = os.path.join(root, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.remove(path)
        removed.append(path)
        print(f"[verl-digen] removed {path}, left by a run that stopped while writing a checkpoint", flush=True)
    return removed


@contextlib.contextmanager
def locked_run_directories(output_dir: str, checkpoint_root: str | None) -> Iterator[None]:
    """Hold the run's output directory and (unless None) its checkpoint root for the run, then
    remove the temporaries a killed run left in the root (no live run writes them then)."""
    locks = [RootLock(output_dir, "digen.output_dir",
                      "two runs writing one output directory would interleave their metrics and images")]
    if checkpoint_root is not None and os.path.realpath(checkpoint_root) != os.path.realpath(output_dir):
        locks.append(RootLock(checkpoint_root))
    held: list[RootLock] = []
    try:
        for lock in locks:
            lock.acquire({"output_dir": output_dir})
            held.append(lock)
        if checkpoint_root is not None:
            remove_stale_temporaries(checkpoint_root)
        yield
    finally:
        for lock in reversed(held):
            lock.release()


# ---------------------------------------------------------------------------- the same run?

def model_fingerprint(path: str) -> str:
    """SHA-256 naming a model directory's content without reading its weights: every file's
    relative path and size, configs and other small files by content, and each safetensors
    file's header (tensor names, shapes, dtypes, offsets). Another model, or the same one with
    other weights files, gets another fingerprint; a copy of the same files the same one."""
    import struct

    h = hashlib.sha256()
    for root, dirs, files in os.walk(path, followlinks=True):
        # Dot-files and folders are not the model (hf download's .cache/ rewrites its metadata).
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(f for f in files if not f.startswith(".")):
            file = os.path.join(root, name)
            rel = os.path.relpath(file, path)
            size = os.path.getsize(file)
            h.update(f"\0{rel}\0{size}\0".encode())
            with open(file, "rb") as f:
                if name.endswith(".safetensors") and size >= 8:
                    (n,) = struct.unpack("<Q", f.read(8))
                    h.update(f.read(min(n, size - 8)))
                elif size <= (1 << 20):
                    h.update(f.read())
    return h.hexdigest()


def run_identity(cfg: Any, model_path: str) -> dict[str, Any]:
    """What a checkpoint records, and a resume compares, to say it is the same run (see
    :data:`IDENTITY_KEYS`); ``cfg`` is the run's ``DigenConfig``."""
    from verl_digen.models.registry import detect_arch

    lora = cfg.model.lora
    return {
        "model_path": model_path,
        "model_fingerprint": model_fingerprint(model_path),
        "arch": cfg.model.arch or detect_arch(model_path),
        "lora_only": bool(lora.enable),
        "lora_rank": lora.rank if lora.enable else None,
        "lora_alpha": float(lora.alpha) if lora.enable else None,
        "lora_target_modules": sorted(lora.target_modules) if lora.enable else None,
        "dtype": cfg.model.dtype,
        "trainable_dtype": cfg.model.trainable_dtype,
        "group_size": cfg.batch.group_size,
        "ema": bool(cfg.ema.enable),
    }


def check_same_run(ckpt: Checkpoint, identity: dict[str, Any], allow_changes: list[str] | tuple[str, ...] = ()) -> None:
    """Refuse to resume ``ckpt`` into a run that differs from the one that wrote it, listing
    every difference; ``allow_changes`` (``digen.resume.allow_changes``) names the identity keys
    that may differ. Checkpoints written before identities were recorded are not compared."""
    saved = ckpt.meta().get("identity")
    if not isinstance(saved, dict):
        print(f"[verl-digen] {ckpt.path} was written before checkpoints recorded their run's identity "
              "(model, LoRA, dtype, group size): not compared", flush=True)
        return
    diffs = []
    for key, where in IDENTITY_KEYS.items():
        if key in allow_changes or saved.get(key) == identity.get(key):
            continue
        if key == "model_fingerprint":
            diffs.append(f"  - {where}: the checkpoint was trained from {saved.get('model_path')}, this run loads "
                         f"{identity.get('model_path')}, and their files differ")
        else:
            diffs.append(f"  - {where}: checkpoint {saved.get(key)!r}, this run {identity.get(key)!r}")
    if diffs:
        raise CheckpointError(
            f"{ckpt.path} was written by a different run:\n" + "\n".join(diffs) + "\n"
            "Resume with the checkpoint's settings, start fresh (trainer.resume_mode=disable or another "
            "trainer.default_local_dir), or accept a change on purpose with digen.resume.allow_changes=["
            + ",".join(k for k in IDENTITY_KEYS if any(IDENTITY_KEYS[k] in d for d in diffs)) + "]"
        )
    if saved.get("model_path") != identity.get("model_path"):
        print(f"[verl-digen] resuming with the model at {identity.get('model_path')} (the checkpoint names "
              f"{saved.get('model_path')}; same files)", flush=True)


# ---------------------------------------------------------------------------- a run's checkpoints


def select_resume(trainer: VerlTrainerKeys, root: str, *, fresh_if_damaged: bool = False) -> Checkpoint | None:
    """The checkpoint ``trainer.resume_mode`` asks for (None: start fresh); ``trainer``: veRL's
    ``trainer.*`` keys, typed (the mode and its path were checked when they were read).

    ``auto`` with checkpoints present but none intact stops, listing each and why, unless
    ``fresh_if_damaged`` (``digen.resume.fresh_if_damaged``): a fresh run never writes over
    them (see :func:`save_checkpoint`)."""
    mode = trainer.resume_mode
    if mode == "disable":
        return None
    if mode == "auto":
        ckpt, skipped = scan_checkpoints(root)
        if ckpt is None and skipped and not fresh_if_damaged:
            listing = "\n".join(f"  - {why}" for why in skipped)
            raise CheckpointError(
                f"trainer.resume_mode=auto: {root} holds {len(skipped)} checkpoint(s) and none is intact:\n{listing}\n"
                "Repair or remove them, resume a specific one with trainer.resume_mode=resume_path, or start "
                "fresh anyway with digen.resume.fresh_if_damaged=true (damaged checkpoints are then kept aside "
                "as global_step_<k>.damaged, never overwritten)"
            )
        if ckpt is None and skipped:
            print(f"[verl-digen] digen.resume.fresh_if_damaged=true: starting fresh; the {len(skipped)} damaged "
                  "checkpoint(s) stay where they are and are moved aside, not overwritten, if a step collides",
                  flush=True)
        return ckpt
    ckpt = checkpoint_at(str(trainer.resume_from_path))  # resume_path
    why = damage(ckpt)
    if why is not None:
        raise CheckpointError(why)
    return ckpt


def resume_point(trainer: VerlTrainerKeys, root: str, cfg: Any, model_path: str) -> tuple[Checkpoint | None, dict[str, Any]]:
    """The checkpoint to resume (None: start fresh), checked to be this run's, and this run's
    identity for the checkpoints it writes; ``cfg`` is the run's ``DigenConfig``."""
    identity = run_identity(cfg, model_path)
    ckpt = select_resume(trainer, root, fresh_if_damaged=cfg.resume.fresh_if_damaged)
    if ckpt is not None:
        check_same_run(ckpt, identity, cfg.resume.allow_changes)
    return ckpt, identity


class RunCheckpoints:
    """Saves and restores a running job's state through its workers.

    A checkpoint after step ``s`` holds the trainer state at policy version ``s`` and the prompt
    sampler's position before step ``s + 1``'s prompts were drawn (TCSS look-ahead may already
    have drawn them): :meth:`note_sampler` records those positions as prompts are assigned.
    """

    def __init__(self, root: str, spec: Any, *, meta: dict[str, Any], max_to_keep: int | None, timeout_s: float) -> None:
        self.root = root
        self.spec = spec
        self.meta = meta
        self.max_to_keep = max_to_keep
        self.timeout_s = timeout_s
        self.sampler_before: dict[int, dict[str, Any]] = {}
        self.last_saved = 0
        self.failed_saves: list[BaseException] = []  # Ray errors of failed saves, for the run's error.log

    def note_sampler(self, step: int, state: dict[str, Any]) -> None:
        """The sampler's position before step ``step``'s prompts were drawn."""
        self.sampler_before.setdefault(step, state)

    def save(self, actors: dict[Any, Any], step: int, metrics: list[dict[str, Any]]) -> str:
        """Checkpoint after ``step``: every trainer rank writes its own shards (DCP) into the
        checkpoint's temporary directory; the driver receives their file names and checksums.

        A trainer rank's failure (a full disk) raises a one-line :class:`runtime.WorkerError`
        naming its cause instead of Ray's traceback of every rank; the Ray error is kept in
        :attr:`failed_saves` for the run's ``error.log``."""
        import ray

        from verl_digen.trainer import runtime

        try:
            return self._save(actors, step, metrics)
        except ray.exceptions.RayError as e:
            self.failed_saves.append(e)
            raise runtime.WorkerError(runtime.error_summary(e)) from e

    def _save(self, actors: dict[Any, Any], step: int, metrics: list[dict[str, Any]]) -> str:
        import ray

        trainer_actors = [actors[w] for w in self.spec.trainers]

        def write_state(tmp: str) -> dict[str, dict[str, Any]]:
            replies = ray.get([a.save_checkpoint_shard.remote(tmp) for a in trainer_actors], timeout=self.timeout_s)
            versions = {r["version"] for r in replies}
            if versions != {step}:
                raise RuntimeError(f"trainer ranks hold versions {sorted(versions)} at the end of step {step}")
            return {name: entry for r in replies for name, entry in r["files"].items()}

        ckpt = save_checkpoint(
            self.root,
            step,
            write_state=write_state,
            controller_state={"step": step, "sampler": self.sampler_before[step], "metrics": metrics[:step]},
            meta={**self.meta, "strategy": self.spec.name, "max_staleness": self.spec.max_staleness,
                  "trainer_ranks": len(trainer_actors), "layout": "sharded"},
            max_to_keep=self.max_to_keep,
        )
        self.last_saved = step
        return ckpt.path

    def load(self, ckpt: Checkpoint, actors: dict[Any, Any], sampler: Any) -> list[dict[str, Any]]:
        """Every model-holding worker loads ``ckpt`` itself (trainer ranks together, resharded to
        their count); the driver reads only the controller state. Returns the metrics so far."""
        import ray

        if not ckpt.sharded:
            raise CheckpointError(
                f"{ckpt.path} has the earlier layout ({LEGACY_WEIGHTS} + trainer.pt, written by the driver), "
                "which this version does not resume; export its weights with `python -m verl_digen.export`"
            )
        ctrl = ckpt.controller_state()
        loaders = [a for w, a in actors.items() if w.pool != "reward"]
        try:
            digests = ray.get([a.load_checkpoint_shard.remote(ckpt.path, ckpt.step) for a in loaders],
                              timeout=self.timeout_s)
        except ray.exceptions.RayTaskError as e:
            if isinstance(e.cause, CheckpointError):  # a refused or damaged file, named by the worker
                raise CheckpointError(str(e.cause)) from None
            raise
        if len(set(digests)) != 1:
            raise RuntimeError(f"workers disagree on the weights loaded from {ckpt.path}")
        sampler.load_state_dict(ctrl["sampler"])
        self.last_saved = ckpt.step
        print(f"[verl-digen] resumed from {ckpt.path} (step {ckpt.step}, policy version {ckpt.step})")
        return list(ctrl["metrics"])

    def on_stop(self, error: BaseException, done: int, actors: dict[Any, Any], metrics: list[dict[str, Any]]) -> str:
        """Checkpoint what completed before a failure (when it can) and say how to resume."""
        saved = None
        if done > self.last_saved and done > 0:
            try:
                saved = self.save(actors, done, metrics)
            except Exception as e:  # the trainer itself may be the one that died
                saved = f"not written ({e.__class__.__name__}: {e})"
        elif self.last_saved > 0:
            saved = os.path.join(self.root, f"global_step_{self.last_saved}")
        if self.last_saved > 0 or (saved and not str(saved).startswith("not")):
            how = f"resume with trainer.resume_mode=auto trainer.default_local_dir={self.root}"
        elif saved:
            how = "no checkpoint could be written, none was written before"
        else:
            how = "no checkpoint exists yet (set trainer.save_freq to write them)"
        kind = "interrupted" if isinstance(error, KeyboardInterrupt) else "stopped"
        return (f"[verl-digen] run {kind} after {done} completed steps: {error}\n"
                f"[verl-digen] checkpoint: {saved or 'none'}; {how}")
