"""The prompt-cache warm-up of a run: every prompt encoded once per cache directory, not once
per worker (the worker's side: ``workers/prompt_warmup.py``).

1. every worker writes a probe file named after its node into the cache directory, then lists
   the probes it sees: workers that see the same nodes share a directory (a *domain*: one node,
   or several on a shared file system; a node-local directory makes each node its own domain);
2. the workers of each domain encode disjoint shares of the prompt set on their own GPUs;
3. every worker reads the others' rows (encoding anything still missing) and releases its
   encoders.

So a run with D domains encodes each prompt D times (once on one node, or with a shared cache
directory), never once per worker.
"""

from __future__ import annotations

import uuid
from typing import Any, Hashable, Mapping, TypeVar

K = TypeVar("K", bound=Hashable)


def cache_domains(peers: Mapping[K, tuple[str, ...]]) -> list[list[K]]:
    """Workers grouped by the nodes whose probes they see (in the order given): each group
    shares one cache directory. A worker that saw no probe at all (not even its own: the
    directory is not writable) is a domain of its own."""
    groups: dict[Any, list[K]] = {}
    for worker, seen in peers.items():
        key = tuple(sorted(seen)) or ("alone", worker)
        groups.setdefault(key, []).append(worker)
    return list(groups.values())


def warm_prompt_caches(actors: Mapping[K, Any], prompts: list[str], timeout_s: float) -> dict[str, Any]:
    """Warm every actor's prompt cache with ``prompts`` (training, validation and negative
    prompts), each prompt encoded once per cache domain; returns the run's warm-up record."""
    import ray

    workers = list(actors)
    token = uuid.uuid4().hex
    ray.get([actors[w].prompt_cache_probe.remote(token) for w in workers], timeout=timeout_s)
    seen = ray.get([actors[w].prompt_cache_peers.remote(token) for w in workers], timeout=timeout_s)
    domains = cache_domains({w: tuple(s) for w, s in zip(workers, seen)})
    shares = ray.get([actors[w].warm_prompt_cache.remote(prompts, i, len(domain))
                      for domain in domains for i, w in enumerate(domain)], timeout=timeout_s)
    # Several domains encode each prompt apart, and batched encoders may round a row differently in
    # each: the trainer could not read the rollout's rows from its own cache, so they travel.
    shared = len(domains) == 1
    finals = ray.get([actors[w].finish_prompt_cache.remote(prompts, token, shared) for w in workers], timeout=timeout_s)
    return {
        "domains": len(domains),
        "embeddings_travel": not shared,
        "prompts": len(dict.fromkeys(prompts)),
        "encoded_in_shares": sum(s["encoded"] for s in shares),
        "encoded_after_shares": sum(f["encoded_here"] for f in finals),
        "max_memory_bytes": max(f["memory_bytes"] for f in finals),
        "bytes_freed": finals[0]["bytes_freed"],
        "released": all(f["released"] for f in finals),
    }
