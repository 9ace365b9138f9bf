"""The weight channel as a veRL checkpoint-engine backend: ``"digen_gloo"``.

veRL's actor worker pushes weights through ``CheckpointEngineRegistry.new(backend, ...)``
(``rollout.checkpoint_engine.backend``, with ``custom_backend_module=verl_digen.sync.checkpoint_engine``
so every process imports this module and the backend registers itself). This adapter lets that
path run over :class:`~verl_digen.sync.transport.WeightChannel` on CPU slots (gloo), where
veRL's own engines need cupy/NCCL/RDMA.

Scope: the engine-level protocol (prepare -> build_topology -> init_process_group ->
send_weights / receive_weights -> finalize) fits the channel one-to-one. veRL's
``CheckpointEngineManager`` on top of it does not: it drives LLM ``RolloutReplica`` objects
(abort requests, release KV cache, a ``CheckpointEngineWorker`` bound to a vLLM/SGLang server
adapter), which diffusion rollout workers are not. Our controller calls the engine methods (or
:class:`~verl_digen.sync.transport.WeightSyncMixin`) on the workers itself.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterable, Iterable
from typing import Any

import torch

from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry
from verl_digen.sync.transport import SyncStats, WeightChannel, listen_on_free_port, node_ip_address

logger = logging.getLogger(__name__)

BACKEND_NAME = "digen_gloo"


async def _collect(weights: Iterable[tuple[str, torch.Tensor]] | AsyncIterable[tuple[str, torch.Tensor]]):
    """Drain a (sync or async) named-tensor stream into a dict, on the caller's thread.

    The stream is consumed where it was handed to us because producing a weight may itself be
    a collective over the actor group (FSDP gathers) or CUDA work bound to this thread's
    device; only the finished dict crosses into the transfer thread.
    """
    state: dict[str, torch.Tensor] = {}
    if isinstance(weights, AsyncIterable):
        async for name, tensor in weights:
            state[name] = tensor
    else:
        for name, tensor in weights:
            state[name] = tensor
    return state


@CheckpointEngineRegistry.register(BACKEND_NAME)
class DigenGlooCheckpointEngine(CheckpointEngine):
    """Single-sender broadcast over a private gloo group (actor rank 0 -> every rollout worker).

    Args:
        bucket_size: max payload bytes per message (veRL passes
            ``update_weights_bucket_megabytes << 20``).
        is_master: set on actor rank 0, the only sender.
        rebuild_group: tear the group down in ``finalize`` and rebuild it on the next sync
            (needed when the rollout side changes size); by default it is kept across syncs.
        timeout_s: rendezvous and per-collective timeout.

    The version sent is ``global_steps`` (or an internal counter when it is None); receivers
    check it against the ``global_steps`` they were asked to receive and expose it as
    :attr:`last_version`.
    """

    wire_format = "named_tensors"

    def __init__(
        self,
        bucket_size: int,
        is_master: bool = False,
        rebuild_group: bool = False,
        timeout_s: float = 300.0,
    ) -> None:
        self.bucket_size = bucket_size
        self.is_master = is_master
        self.rebuild_group = rebuild_group
        self.timeout_s = timeout_s
        self.rank: int | None = None
        self.world_size: int | None = None
        self._endpoint: tuple[str, int] | None = None  # master only: where the store listens
        self._listener = None  # master only: the socket listening at _endpoint until the channel takes it
        self._channel: WeightChannel | None = None
        self._channel_key: tuple[int, int, str, int] | None = None
        self._next_version = 0  # used when the caller gives no global_steps
        self.last_version: int | None = None
        self.last_stats: SyncStats | None = None

    # -- topology ----------------------------------------------------------------------

    def prepare(self) -> dict[str, Any]:
        """Master reports its store endpoint (stable while the group is kept); others report nothing."""
        if not self.is_master:
            return {}
        if self._endpoint is None or self._channel is None:
            # Held from now on (a port found free and bound at init_process_group could be taken in between)
            addr = node_ip_address()
            if self._listener is not None:
                self._listener.close()
            self._listener = listen_on_free_port(addr)
            self._endpoint = (addr, int(self._listener.getsockname()[1]))
        addr, port = self._endpoint
        return {"master_addr": addr, "master_port": port}

    @classmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        master = metadata[0]
        if "master_addr" not in master:
            raise ValueError("actor rank 0 must be created with is_master=True (its prepare() names the endpoint)")
        world_size = 1 + rollout_world_size
        common = {"world_size": world_size, "master_addr": master["master_addr"], "master_port": master["master_port"]}
        # Only actor rank 0 sends: with full (unsharded) tensors from the generator, extra
        # senders would add nothing. The other actor ranks get -1 and sit the transfer out.
        actor_kwargs: dict[str, list[Any]] = {"rank": [0] + [-1] * (actor_wg_world_size - 1)}
        rollout_kwargs: dict[str, list[Any]] = {"rank": list(range(1, world_size))}
        for key, value in common.items():
            actor_kwargs[key] = [value] * actor_wg_world_size
            rollout_kwargs[key] = [value] * rollout_world_size
        return actor_kwargs, rollout_kwargs

    def init_process_group(self, rank: int, world_size: int, master_addr: str, master_port: int) -> None:
        """Join the channel (blocks until all members join); a no-op when the same group is open."""
        self.rank, self.world_size = rank, world_size
        if rank < 0:
            return
        key = (rank, world_size, master_addr, int(master_port))
        if self._channel is not None and not self._channel.closed and self._channel_key == key:
            return
        self._close_channel()
        listener = None
        if rank == 0 and self._listener is not None and self._listener.getsockname()[1] == int(master_port):
            listener, self._listener = self._listener, None
        self._channel = WeightChannel(
            "gloo",
            rank,
            world_size,
            master_addr,
            int(master_port),
            timeout_s=self.timeout_s,
            bucket_bytes=self.bucket_size,
            listen_sock=listener,
        )
        self._channel_key = key

    def finalize(self) -> None:
        if self.rebuild_group:
            self._close_channel()
            self._endpoint = None

    def _close_channel(self) -> None:
        if self._channel is not None:
            self._channel.close()
        self._channel, self._channel_key = None, None

    def _require_channel(self) -> WeightChannel:
        if self._channel is None or self._channel.closed:
            raise RuntimeError("digen_gloo checkpoint engine: init_process_group was not called")
        return self._channel

    # -- transfer ----------------------------------------------------------------------

    @torch.no_grad()
    async def send_weights(self, weights, global_steps: int | None = None) -> dict[str, Any]:
        if self.rank is None:
            raise RuntimeError("digen_gloo checkpoint engine: init_process_group was not called")
        if self.rank > 0:
            raise RuntimeError("rollout workers do not send weights")
        # Non-sending actor ranks still walk the generator: producing each weight may be a
        # collective over the actor group that rank 0 is waiting on.
        state = await _collect(weights)
        if self.rank < 0:
            return {}
        version = global_steps if global_steps is not None else self._next_version
        self._next_version = version + 1
        # Blocking collectives go to a thread so the actor's event loop keeps serving calls.
        stats = await asyncio.to_thread(self._require_channel().send, state, version)
        self.last_version, self.last_stats = version, stats
        logger.info("digen_gloo sent version %d: %d bytes in %.3fs", version, stats.nbytes, stats.seconds)
        return {
            "weight_sync/version": stats.version,
            "weight_sync/nbytes": stats.nbytes,
            "weight_sync/seconds": stats.seconds,
        }

    @torch.no_grad()
    async def receive_weights(self, global_steps: int | None = None) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        if self.rank is None or self.rank <= 0:
            raise RuntimeError(f"only rollout ranks (> 0) receive; this engine has rank {self.rank}")
        state, version, stats = await asyncio.to_thread(self._require_channel().recv)
        self.last_version, self.last_stats = version, stats
        if global_steps is not None and version != global_steps:
            # The transfer itself completed (the group is still in step); the caller asked
            # for another version than the trainer sent, which means the controller is off.
            raise RuntimeError(f"received weights of version {version}, expected global_steps={global_steps}")
        for name, tensor in state.items():
            yield name, tensor
