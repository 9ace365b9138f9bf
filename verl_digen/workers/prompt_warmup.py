"""A worker's part of the prompt-cache warm-up: encode a share of the prompt set once per run.

Every generating or training worker needs every prompt's embedding, but the text encoders
(5-8B parameters) should run once per prompt per run, on GPUs, in bounded batches. The
controller (``trainer/warmup.py``) drives three calls on every worker:

1. :func:`write_probe` / :func:`visible_nodes`: each worker drops a file named after its node
   into ``<cache root>/.probes/<token>/`` and then lists the directory. Workers that see the same
   nodes share one cache directory (one node always does; several nodes do when the directory is
   on a shared file system). The disk cache's directory may be node-local, so sharing across nodes
   is detected, never assumed;
2. :func:`warm_share`: the workers of one sharing domain encode disjoint shares
   (:func:`share_of`) into the shared disk cache, ``digen.prompt_cache.encode_batch_size``
   prompts per encoder call, the offloaded encoders on the worker's GPU meanwhile
   (:func:`~verl_digen.models.base.onloaded`, through the cache);
3. :func:`finish`: every worker checks that every prompt is cached (reading what the others wrote,
   encoding whatever is still missing, e.g. a file another worker could not write), routes
   ``encode_prompts`` through the cache, and releases the encoders when asked to.

Each worker keeps at most ``digen.prompt_cache.max_host_mb`` of rows in host memory (a bytes-
bounded LRU backed by the disk cache).
"""

from __future__ import annotations

import os
from typing import Any

from verl_digen.config.schema import PromptCacheConfig
from verl_digen.models.base import DiffusionAdapter
from verl_digen.models.prompt_cache import PromptEmbeddingCache, model_cache_key

MIB = 1 << 20
PROBES = ".probes"


def cache_root(pc: PromptCacheConfig) -> str:
    """The disk cache's root: ``digen.prompt_cache.dir``, else ``$VERL_DIGEN_CACHE/prompt_embeds``,
    else ``~/.cache/verl_digen/prompt_embeds``."""
    if pc.dir:
        return os.path.abspath(pc.dir)
    base = os.environ.get("VERL_DIGEN_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "verl_digen")
    return os.path.join(base, "prompt_embeds")


def open_cache(adapter: DiffusionAdapter, model_path: str, pc: PromptCacheConfig) -> PromptEmbeddingCache:
    """The worker's cache: disk-backed, its host memory bounded by ``max_host_mb``."""
    return PromptEmbeddingCache(adapter, model_key=model_cache_key(model_path, adapter), cache_dir=cache_root(pc),
                                max_memory_bytes=int(pc.max_host_mb * MIB))


def _probe_dir(root: str, token: str) -> str:
    if not token.isalnum():
        raise ValueError(f"a probe token is alphanumeric, got {token!r}")
    return os.path.join(root, PROBES, token)


def write_probe(root: str, token: str, node_id: str) -> None:
    """Mark ``node_id`` as able to write ``root`` (the run's ``token`` keeps runs apart)."""
    folder = _probe_dir(root, token)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, node_id), "w") as f:
        f.write(node_id)


def visible_nodes(root: str, token: str) -> list[str]:
    """The nodes whose probes this process sees under ``root``: the nodes it shares the cache with."""
    try:
        return sorted(os.listdir(_probe_dir(root, token)))
    except FileNotFoundError:
        return []


def remove_probe(root: str, token: str, node_id: str) -> None:
    """Remove this node's probe (and the run's probe folder once empty); best effort."""
    folder = _probe_dir(root, token)
    for path, remove in ((os.path.join(folder, node_id), os.unlink), (folder, os.rmdir)):
        try:
            remove(path)
        except OSError:
            pass  # another worker of the node removed it first, or the folder is not empty yet


def share_of(prompts: list[str], index: int, count: int) -> list[str]:
    """Share ``index`` of ``count`` of the distinct ``prompts``: disjoint, together all of them,
    sizes within one of each other."""
    if not 0 <= index < count:
        raise ValueError(f"share {index} of {count}")
    return list(dict.fromkeys(prompts))[index::count]


def warm_share(cache: PromptEmbeddingCache, prompts: list[str], index: int, count: int,
               batch_size: int) -> dict[str, Any]:
    """Encode this worker's share of ``prompts`` (the misses), ``batch_size`` per encoder call."""
    share = share_of(prompts, index, count)
    encoded = cache.warm(share, batch_size=batch_size)
    return {"share": len(share), "encoded": encoded}


def finish(cache: PromptEmbeddingCache, prompts: list[str], *, batch_size: int, release: bool,
           rows_shared: bool = True) -> dict[str, Any]:
    """Make every prompt cached (encoding what no share produced), install the cache and release
    the encoders when ``release``; the cache's counters, ``encoded_here`` and ``bytes_freed``.
    ``rows_shared``: every worker of the run reads this cache directory (one domain); else the
    trajectories this worker generates carry their embeddings."""
    cache.rows_shared = rows_shared
    encoded = cache.warm(prompts, batch_size=batch_size)
    cache.install()
    freed = cache.release_encoders() if release else 0
    return {**cache.stats(), "encoded_here": encoded, "bytes_freed": freed}
