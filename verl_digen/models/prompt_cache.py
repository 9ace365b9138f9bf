"""Prompt-embedding cache: run the text encoders once per unique prompt, then release them.

An RL run samples the same few thousand prompts (and one negative prompt) over and over; the
text encoders (T5-XXL, Qwen2.5-VL-7B, UMT5-XXL, Llama-3-8B: 5-8B parameters, 10-16 GB in bf16)
recompute identical embeddings every step and sit in device memory next to the denoiser.
:class:`PromptEmbeddingCache` wraps an adapter's ``encode_prompts``:

- ``encode(prompts)`` looks every prompt up (memory, then disk), encodes only the misses in ONE
  batched call of the adapter (repeated prompts of a request are encoded once) with offloaded
  text encoders on the adapter's device for the call (:func:`~.base.onloaded`), stores each
  prompt's row (``[1, ...]`` CPU tensors per conditioning key) and returns the request's batch in
  request order on the adapter's device: the same dict of tensors ``encode_prompts`` returns;
- ``warm(prompts, batch_size=...)`` precomputes a prompt set (the training prompts, validation
  prompts and the negative prompt, or a worker's share of them) before training, ``batch_size``
  prompts per encoder call, the offloaded encoders on the device for the whole warm-up;
- ``release_encoders()`` then drops the adapter's text encoders and tokenizers
  (:meth:`DiffusionAdapter.release_text_encoders`); a later miss raises a ``RuntimeError``
  naming the prompt instead of computing anything;
- ``install()`` makes ``adapter.encode_prompts`` go through the cache, so that the sampling
  code (``begin_groups`` calls ``adapter.encode_prompts``) needs no change.

Host memory. The in-memory rows are a least-recently-used set bounded in bytes
(``max_memory_bytes``; ``digen.prompt_cache.max_host_mb`` in a run) and in count; with a disk
cache an evicted row is read back from disk when needed, so a worker holds at most that many
bytes of embeddings, whatever the number of prompts.

Disk layout (shared by processes and runs)::

    <cache_dir>/<model_key>/<sha256(prompt)[:2]>/<sha256(prompt)>.safetensors

one file per prompt, written atomically (temporary file + ``os.replace``), its metadata holding
the format, the model key, the prompt text and a SHA-256 of the tensors. A file is used only if
all four check out and its tensors have the layout of the other rows; anything else (a
truncated or corrupted file, a hash collision, an entry of another model) is recomputed and
rewritten, never returned. ``model_key`` comes from :func:`model_cache_key`: a hash of the text
encoders' and tokenizers' files (configs and tokenizer files by content, weights by size and
mtime) and of the adapter's encoding settings (sequence lengths, prompt template, encoder dtype
and device type), so that a different model or setting never reuses embeddings.

Exactness. A cached row is the row the adapter produced for that prompt in the batch that first
encoded it, stored bit for bit. So ``cache.encode(batch)`` equals ``adapter.encode_prompts(batch)``
bitwise whenever the encoder gives a prompt the same row in whatever batch it appears: on the
tiny models (CPU, fp32) this holds for FLUX, Wan and HunyuanVideo. SD3's CLIP projections
(batch-size-dependent GEMM kernels) and Qwen-Image's encoder (pads each batch to its longest
prompt) give a prompt rows that differ by a few ulp between batches, i.e. a fresh encode is
itself not a function of the prompt alone; the cache then returns the rows of one fresh encode
(the first), which is as exact as two fresh encodes are to each other (tests/unit/test_prompt_cache.py
checks both cases). Real models on GPUs are usually in the second case (cuBLAS picks kernels by
batch size); with the cache every prompt keeps one embedding for the whole run.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
import threading
import time
import warnings
from collections import OrderedDict
from collections.abc import Iterable, Mapping

import torch

from .base import Conditioning, DiffusionAdapter, has_component, onloaded, read_model_index

FORMAT = "verl_digen.prompt_cache/1"
# Weight files are keyed by name, size and mtime (hashing gigabytes would take minutes); every
# other file of a text-encoder or tokenizer folder (configs, vocabularies) by content.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".msgpack", ".h5", ".onnx")
_KEY_PATTERN = re.compile(r"[A-Za-z0-9._+-]+")
# Adapter attributes that change what encode_prompts returns for a prompt.
_ENCODING_ATTRS = ("max_sequence_length", "clip_max_length", "crop_start", "prompt_template")


def prompt_digest(prompt: str) -> str:
    """SHA-256 (hex) of the prompt's UTF-8 bytes: its file name in the disk cache."""
    return hashlib.sha256(prompt.encode("utf-8")).hexdigest()


def encoding_signature(adapter: DiffusionAdapter) -> dict:
    """What besides the weights decides an adapter's embeddings: its class, sequence lengths,
    prompt template, and each text encoder's dtype and device type (CPU and GPU kernels round
    differently). Must be taken before the encoders are released."""
    if getattr(adapter, "text_encoders_released", False):
        raise ValueError("the adapter's text encoders were released: take the model key before releasing them")
    sig: dict = {"class": f"{type(adapter).__module__}.{type(adapter).__qualname__}"}
    for attr in _ENCODING_ATTRS:
        if hasattr(adapter, attr):
            sig[attr] = getattr(adapter, attr)
    for name, value in sorted(vars(adapter).items()):
        if name.startswith("text_encoder") and isinstance(value, torch.nn.Module):
            p = next(value.parameters(), None)
            sig[name] = None if p is None else {"dtype": str(p.dtype), "device": p.device.type}
    return sig


def model_cache_key(model_path: str, adapter: DiffusionAdapter | None = None) -> str:
    """A directory name that changes whenever the embeddings of ``model_path`` could.

    Hashes ``model_index.json``, then every file of the ``text_encoder*`` / ``tokenizer*``
    component folders it lists (weights by relative path, size and mtime; everything else by
    content) and, with ``adapter``, :func:`encoding_signature`. A copied or re-downloaded model
    gets a new mtime and so a new key: the cache is then recomputed, never wrong.
    """
    index = read_model_index(model_path)
    h = hashlib.sha256()
    h.update(FORMAT.encode())
    h.update(json.dumps(index, sort_keys=True, default=str).encode())
    components = sorted(
        name for name in index if name.startswith(("text_encoder", "tokenizer")) and has_component(index, name)
    )
    for name in components:
        folder = os.path.join(model_path, name)
        h.update(f"\0component:{name}".encode())
        if not os.path.isdir(folder):
            h.update(b"\0missing")
            continue
        for root, dirs, files in os.walk(folder):
            dirs.sort()
            for fname in sorted(files):
                full = os.path.join(root, fname)
                rel = os.path.relpath(full, model_path).replace(os.sep, "/")
                st = os.stat(full)
                if fname.endswith(WEIGHT_SUFFIXES):
                    h.update(f"\0weights:{rel}:{st.st_size}:{st.st_mtime_ns}".encode())
                else:
                    h.update(f"\0file:{rel}:{st.st_size}:".encode())
                    with open(full, "rb") as f:
                        for chunk in iter(lambda: f.read(1 << 20), b""):
                            h.update(chunk)
    if adapter is not None:
        h.update(b"\0adapter:" + json.dumps(encoding_signature(adapter), sort_keys=True, default=str).encode())
    slug = re.sub(r"[^A-Za-z0-9._+-]+", "_", os.path.basename(os.path.normpath(os.path.abspath(model_path))))[:40]
    return f"{slug or 'model'}-{h.hexdigest()[:20]}"


def _row_bytes(row: Mapping[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in row.values())


def _tensor_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for key in sorted(tensors):
        t = tensors[key].detach().cpu().contiguous()
        h.update(f"\0{key}:{t.dtype}:{tuple(t.shape)}:".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def prompt_cache_of(adapter: DiffusionAdapter) -> "PromptEmbeddingCache | None":
    """The cache serving ``adapter.encode_prompts`` (:meth:`PromptEmbeddingCache.install`), or None."""
    owner = getattr(getattr(adapter, "encode_prompts", None), "__self__", None)
    return owner if isinstance(owner, PromptEmbeddingCache) else None


class PromptEmbeddingCache:
    """Per-prompt cache of an adapter's ``encode_prompts`` output, in memory (LRU) and on disk.

    Args:
        adapter: the adapter whose embeddings are cached. Its ``encode_prompts`` is captured
            now, so that :meth:`install` (or any later replacement of ``adapter.encode_prompts``
            by this cache's :meth:`encode`) does not recurse.
        model_key: the cache's namespace (a directory name); use :func:`model_cache_key`.
        cache_dir: root of the disk cache, or ``None`` for memory only.
        max_memory_items: prompts kept in memory (least recently used ones are dropped first;
            with a disk cache they are read back when needed).
        max_memory_bytes: bytes of rows kept in memory (``None``: no byte bound), the same LRU
            order; a row larger than the bound is not kept (disk only).
    """

    def __init__(
        self,
        adapter: DiffusionAdapter,
        *,
        model_key: str,
        cache_dir: str | None,
        max_memory_items: int = 100_000,
        max_memory_bytes: int | None = None,
    ) -> None:
        if not isinstance(model_key, str) or not _KEY_PATTERN.fullmatch(model_key) or model_key in (".", ".."):
            raise ValueError(f"model_key must be a non-empty directory name of [A-Za-z0-9._+-], got {model_key!r}")
        if max_memory_items < 0:
            raise ValueError(f"max_memory_items must be >= 0, got {max_memory_items}")
        if max_memory_bytes is not None and max_memory_bytes < 0:
            raise ValueError(f"max_memory_bytes must be >= 0 or None, got {max_memory_bytes}")
        self.adapter = adapter
        self.model_key = model_key
        self.cache_dir = None if cache_dir is None else os.path.abspath(cache_dir)
        # Whether every worker of the run serves this cache's rows: one cache directory (one
        # domain, trainer/warmup.py). Rows encoded apart (node-local directories on several
        # nodes) may differ in their last bits, so a trajectory then carries its rows instead of
        # their digests (workers/sampling.py: finish_groups).
        self.rows_shared = True
        self.max_memory_items = int(max_memory_items)
        self.max_memory_bytes = None if max_memory_bytes is None else int(max_memory_bytes)
        self._memory_bytes = 0
        # Prompts whose disk file this object wrote or verified: files are replaced only
        # atomically by valid ones, so they are not read again just to check they are there.
        self._on_disk: set[str] = set()
        self._encode_fn = adapter.encode_prompts  # the adapter's own encoder, bound now
        self._memory: OrderedDict[str, dict[str, torch.Tensor]] = OrderedDict()
        self._layout: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None
        # SHA-256 of each prompt's row as served (digest()); dropped when the prompt is encoded again
        self._digests: dict[str, str] = {}
        self._warmed: dict[str, None] = {}  # insertion-ordered set of the prompts given to warm()
        self._released = False
        self._lock = threading.RLock()
        self._stats = dict.fromkeys(
            (
                "requests", "rows", "lookups", "memory_hits", "disk_hits", "misses", "encode_calls",
                "encoded_prompts", "disk_writes", "disk_rejects", "disk_write_errors", "bytes_freed",
            ),
            0,
        )
        self._stats["encode_seconds"] = 0.0

    def __repr__(self) -> str:
        return (
            f"PromptEmbeddingCache(model_key={self.model_key!r}, cache_dir={self.cache_dir!r}, "
            f"memory_items={len(self._memory)}, released={self._released})"
        )

    # ------------------------------------------------------------------ public API

    def encode(self, prompts: list[str], *, device: torch.device | str | None = None) -> Conditioning:
        """``adapter.encode_prompts(prompts)`` served from the cache: the misses are encoded in one
        batched call, the result is in request order on the adapter's device (or ``device``: the
        trainer takes host rows, copied in asynchronously per pass)."""
        prompts = self._check_prompts(prompts)
        with self._lock:
            self._stats["requests"] += 1
            self._stats["rows"] += len(prompts)
            rows = self._resolve(list(dict.fromkeys(prompts)), batch_size=None)
            keys = list(rows[prompts[0]])
            out = {k: torch.cat([rows[p][k] for p in prompts], dim=0) for k in keys}
        device = self.adapter.device if device is None else device
        return {k: v.to(device) for k, v in out.items()}

    __call__ = encode

    def digest(self, prompt: str) -> str:
        """SHA-256 of the row :meth:`encode` serves for ``prompt`` (its tensors' bytes, keys,
        dtypes and shapes): equal in two processes iff they serve the same row bit for bit. A
        trajectory carries it instead of the row (``workers/sampling.py``); computed once per
        prompt and kept (64 bytes), until the prompt is encoded again."""
        with self._lock:
            known = self._digests.get(prompt)
            if known is None:
                # the row just served is in memory (not counted as a lookup: the request was);
                # else on disk, else encoded as encode() would
                row = self._memory.get(prompt) or self._load(prompt)
                if row is None:
                    row = self._resolve([self._check_prompts(prompt)[0]], batch_size=None)[prompt]
                known = self._digests[prompt] = _tensor_digest(row)
            return known

    def warm(self, prompts: Iterable[str], *, batch_size: int | None = None) -> int:
        """Make every prompt of ``prompts`` cached (encoding the misses ``batch_size`` at a time;
        ``None``: all in one call) and remember them as needed by :meth:`release_encoders`.
        Returns the number of prompts encoded."""
        prompts = self._check_prompts(list(prompts), allow_empty=True)
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"batch_size must be >= 1 or None, got {batch_size}")
        unique = list(dict.fromkeys(prompts))
        with self._lock:
            before = self._stats["encoded_prompts"]
            self._resolve(unique, batch_size=batch_size, keep=False)
            self._warmed.update(dict.fromkeys(unique))
            return self._stats["encoded_prompts"] - before

    def is_cached(self, prompt: str) -> bool:
        """Whether ``prompt`` is served without encoding (in memory, or a valid file on disk)."""
        with self._lock:
            if prompt in self._memory or prompt in self._on_disk:
                return True
            if self._load(prompt) is None:
                return False
            self._on_disk.add(prompt)
            return True

    def release_encoders(self, needed: Iterable[str] | None = None) -> int:
        """Release the adapter's text encoders; returns the bytes freed.

        Only once every prompt the run will need is cached: ``needed`` (default: every prompt
        given to :meth:`warm`) is checked first and a ``RuntimeError`` names a missing one.
        Without a disk cache the needed prompts must also fit in memory. Afterwards a miss
        raises ``RuntimeError`` naming the prompt.
        """
        with self._lock:
            if needed is None:
                if not self._warmed:
                    raise RuntimeError(
                        "release_encoders(): warm() the cache with every prompt the run needs (training, "
                        "validation and negative prompts) first, or pass them as `needed`"
                    )
                required = list(self._warmed)
            else:
                required = list(dict.fromkeys(self._check_prompts(list(needed), allow_empty=True)))
            if self.cache_dir is None and len(required) > self.max_memory_items:
                raise RuntimeError(
                    f"release_encoders(): {len(required)} needed prompts do not fit in max_memory_items="
                    f"{self.max_memory_items} and there is no disk cache (cache_dir=None)"
                )
            missing = [p for p in required if not self.is_cached(p)]
            if missing:
                raise RuntimeError(
                    f"release_encoders(): {len(missing)} needed prompt(s) are not cached, e.g. {missing[0]!r}; "
                    "warm() them before releasing the text encoders (without a disk cache, rows evicted from "
                    "memory by max_memory_items / max_memory_bytes are gone)"
                )
            already = getattr(self.adapter, "text_encoders_released", False)
            freed = 0 if already else int(self.adapter.release_text_encoders())
            self._released = True
            self._stats["bytes_freed"] += freed
            return freed

    def install(self) -> "PromptEmbeddingCache":
        """Route ``adapter.encode_prompts`` through this cache (an instance attribute shadowing
        the method), so code that calls ``adapter.encode_prompts`` (the rollout's
        ``begin_groups``) uses the cache unchanged. Returns ``self``."""
        self.adapter.encode_prompts = self.encode
        return self

    @property
    def released(self) -> bool:
        return self._released or bool(getattr(self.adapter, "text_encoders_released", False))

    def stats(self) -> dict[str, float]:
        """Counters since construction: ``hits`` (= memory_hits + disk_hits) and ``misses`` count
        unique prompts per request; ``encode_calls`` / ``encoded_prompts`` / ``encode_seconds`` the
        adapter calls made; ``rows`` the prompts requested (with repeats)."""
        with self._lock:
            out = dict(self._stats)
            out["hits"] = out["memory_hits"] + out["disk_hits"]
            out["memory_items"] = len(self._memory)
            out["memory_bytes"] = self._memory_bytes
            out["released"] = self.released
            return out

    # ------------------------------------------------------------------ lookups

    @staticmethod
    def _check_prompts(prompts, *, allow_empty: bool = False) -> list[str]:
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        if not prompts and not allow_empty:
            raise ValueError("encode() needs at least one prompt")
        for p in prompts:
            if not isinstance(p, str):
                raise TypeError(f"prompts must be strings, got {type(p).__name__}: {p!r}")
        return prompts

    def _resolve(
        self, unique: list[str], *, batch_size: int | None, keep: bool = True
    ) -> dict[str, dict[str, torch.Tensor]]:
        """Rows of ``unique`` prompts (distinct), encoding the misses; ``keep=False`` returns none."""
        rows: dict[str, dict[str, torch.Tensor]] = {}
        missing: list[str] = []
        for p in unique:
            self._stats["lookups"] += 1
            row = self._memory.get(p)
            if row is not None:
                self._memory.move_to_end(p)
                self._stats["memory_hits"] += 1
            else:
                row = self._load(p)
                if row is None:
                    missing.append(p)
                    continue
                self._stats["disk_hits"] += 1
                self._on_disk.add(p)
                self._remember(p, row)
            if keep:
                rows[p] = row
        if missing:
            self._stats["misses"] += len(missing)
            if self.released:
                more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
                raise RuntimeError(
                    f"prompt embedding cache {self.model_key!r}: prompt {missing[0]!r}{more} is not cached and "
                    "the text encoders were released; warm() the cache with every prompt the run needs "
                    "(training, validation and negative prompts) before release_encoders()"
                )
            self._encode_misses(missing, batch_size, rows if keep else None)
        return rows

    def _encode_misses(self, missing: list[str], batch_size: int | None, rows: dict | None) -> None:
        """Encode ``missing`` ``batch_size`` at a time, the offloaded text encoders on the adapter's
        device for all the batches (moved there once, back to CPU after: :func:`onloaded`)."""
        step = len(missing) if batch_size is None else batch_size
        with onloaded(self.adapter, self.adapter.text_encoder_names):
            for start in range(0, len(missing), step):
                chunk = missing[start : start + step]
                for p, row in zip(chunk, self._encode_batch(chunk)):
                    self._digests.pop(p, None)  # a new encode may differ in the last bits
                    self._remember(p, row)
                    self._store(p, row)
                    if rows is not None:
                        rows[p] = row

    def _encode_batch(self, prompts: list[str]) -> list[dict[str, torch.Tensor]]:
        """One call of the adapter's encoder; its output split into per-prompt CPU rows."""
        t0 = time.perf_counter()
        out = self._encode_fn(list(prompts))
        if not isinstance(out, Mapping) or not out:
            raise TypeError(f"{type(self.adapter).__name__}.encode_prompts returned {type(out).__name__}, not a dict")
        rows: list[dict[str, torch.Tensor]] = [{} for _ in prompts]
        for key, value in out.items():
            if not torch.is_tensor(value) or value.dim() == 0 or value.shape[0] != len(prompts):
                raise ValueError(
                    f"{type(self.adapter).__name__}.encode_prompts returned {key!r} of shape "
                    f"{tuple(getattr(value, 'shape', ()))} for {len(prompts)} prompts (expected batch-first tensors)"
                )
            value = value.detach().to("cpu")  # waits for the device: the timing covers the encode
            for i, row in enumerate(rows):
                row[key] = value[i : i + 1].clone()
        self._stats["encode_seconds"] += time.perf_counter() - t0
        self._stats["encode_calls"] += 1
        self._stats["encoded_prompts"] += len(prompts)
        for row in rows:
            problem = self._layout_problem(row)
            if problem:
                raise ValueError(
                    f"{type(self.adapter).__name__}.encode_prompts returned rows that cannot be batched with the "
                    f"cached ones ({problem}); each conditioning tensor must have a fixed shape per prompt, and a "
                    "cache directory's model_key must change whenever the encoding does"
                )
            if self._layout is None:
                self._layout = {k: (tuple(v.shape[1:]), v.dtype) for k, v in row.items()}
        return rows

    def _layout_problem(self, row: Mapping[str, torch.Tensor]) -> str | None:
        if self._layout is None:
            return None
        if set(row) != set(self._layout):
            return f"keys {sorted(row)} != {sorted(self._layout)}"
        for k, v in row.items():
            shape, dtype = self._layout[k]
            if v.shape[0] != 1 or tuple(v.shape[1:]) != shape or v.dtype != dtype:
                return f"{k}: {tuple(v.shape)} {v.dtype} vs [1, {', '.join(map(str, shape))}] {dtype}"
        return None

    def _remember(self, prompt: str, row: dict[str, torch.Tensor]) -> None:
        """Keep ``row`` in memory, evicting the least recently used rows beyond the bounds."""
        old = self._memory.pop(prompt, None)
        if old is not None:
            self._memory_bytes -= _row_bytes(old)
        self._memory[prompt] = row
        self._memory_bytes += _row_bytes(row)
        limit = self.max_memory_bytes
        while self._memory and (len(self._memory) > self.max_memory_items
                                or (limit is not None and self._memory_bytes > limit)):
            _, dropped = self._memory.popitem(last=False)
            self._memory_bytes -= _row_bytes(dropped)

    # ------------------------------------------------------------------ disk

    def _path(self, prompt: str) -> str:
        digest = prompt_digest(prompt)
        return os.path.join(self.cache_dir, self.model_key, digest[:2], digest + ".safetensors")

    def _store(self, prompt: str, row: dict[str, torch.Tensor]) -> None:
        if self.cache_dir is None:
            return
        from safetensors.torch import save

        path = self._path(prompt)
        tmp = None
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tensors = {k: v.contiguous() for k, v in row.items()}
            meta = {
                "format": FORMAT,
                "model_key": self.model_key,
                "prompt": prompt,
                "keys": json.dumps(list(tensors)),  # the adapter's key order (safetensors sorts them)
                "digest": _tensor_digest(tensors),
            }
            data = save(tensors, metadata=meta)
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-", suffix=".safetensors")
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)  # atomic: readers see the old file or the whole new one
            tmp = None
            self._on_disk.add(prompt)
            self._stats["disk_writes"] += 1
        except OSError as e:  # a full or read-only disk degrades to memory only
            self._stats["disk_write_errors"] += 1
            warnings.warn(f"prompt embedding cache: could not write {path}: {e}", RuntimeWarning, stacklevel=3)
        finally:
            if tmp is not None and os.path.exists(tmp):
                os.unlink(tmp)

    def _load(self, prompt: str) -> dict[str, torch.Tensor] | None:
        """The prompt's row from disk, or ``None`` when absent or not trustworthy (then recomputed)."""
        if self.cache_dir is None:
            return None
        path = self._path(prompt)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        except OSError as e:
            warnings.warn(f"prompt embedding cache: could not read {path}: {e}", RuntimeWarning, stacklevel=3)
            return None
        try:
            from safetensors.torch import load

            n = int.from_bytes(data[:8], "little")
            meta = json.loads(data[8 : 8 + n]).get("__metadata__") or {}
            if meta.get("format") != FORMAT:
                raise ValueError(f"format {meta.get('format')!r}")
            if meta.get("model_key") != self.model_key:
                raise ValueError(f"model_key {meta.get('model_key')!r}")
            if meta.get("prompt") != prompt:
                raise ValueError("the stored prompt differs (hash collision)")
            loaded = load(data)
            keys = json.loads(meta.get("keys", "[]"))
            if not loaded or sorted(keys) != sorted(loaded):
                raise ValueError(f"tensors {sorted(loaded)} do not match the recorded keys {keys}")
            tensors = {k: loaded[k] for k in keys}
            if _tensor_digest(tensors) != meta.get("digest"):
                raise ValueError("tensor checksum mismatch")
            problem = self._layout_problem(tensors)
            if problem:
                raise ValueError(problem)
        except Exception as e:  # noqa: BLE001 - any unreadable entry is recomputed
            self._stats["disk_rejects"] += 1
            warnings.warn(
                f"prompt embedding cache: ignoring {path} ({type(e).__name__}: {e}); recomputing",
                RuntimeWarning,
                stacklevel=3,
            )
            return None
        if self._layout is None:
            self._layout = {k: (tuple(v.shape[1:]), v.dtype) for k, v in tensors.items()}
        # What digest() vouches for is the row served now: another worker of this directory may
        # have replaced the file since this process last read or wrote it (finish() encodes what
        # it could not see yet), and the row it served before may have been evicted since.
        self._digests[prompt] = meta["digest"]
        return tensors
