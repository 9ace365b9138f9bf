"""Trainer -> rollout weight channel: a private broadcast group across two worker pools.

Trainer and rollout run in separate Ray worker groups, each of which owns its *default*
``torch.distributed`` process group. The weight channel therefore never calls
``init_process_group``: every endpoint builds its own ``TCPStore`` + ``ProcessGroupGloo`` /
``ProcessGroupNCCL`` object and calls collectives on it directly, so the pools' default groups
(and their ranks, stores and ports) are left untouched.

Rank 0 of the channel is the sender (one trainer worker); ranks 1..world_size-1 receive (the
rollout workers). All endpoints must be opened concurrently, and every ``send`` must be matched
by a concurrent ``recv`` on every receiver: these are collectives.

Wire protocol, one sync = one or more messages, each:

1. header length (int64[1]) and header (JSON, utf-8 bytes): protocol, version, ``is_last``,
   and the :class:`~verl_digen.sync.state.FlatMetadata` of this message's buffers;
2. each non-empty flat buffer of the message (one per dtype), broadcast as raw bytes.

Messages are bounded by ``bucket_bytes`` so a full-model sync needs one bucket of staging
memory on the sender rather than a packed copy of the model; a LoRA sync is a single message.
"""

from __future__ import annotations

import itertools
import json
import socket
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist

from verl_digen.sync.buckets import DEFAULT_BUCKET_BYTES
from verl_digen.sync.snapshot import HostSnapshot
from verl_digen.sync.state import (
    FlatMetadata,
    TensorSlot,
    flatten_state,
    iter_buckets,
    load_trainable_state,
    state_nbytes,
    trainable_state,
    unflatten_state,
)

Backend = Literal["gloo", "nccl"]

_PROTOCOL = "digen-weight-sync/1"
_STORE_PREFIX = "digen_weight_sync"
_READY_PREFIX = "digen_weight_sync_ready"


@dataclass(frozen=True)
class SyncStats:
    """What one sync moved, as seen by one endpoint."""

    version: int
    nbytes: int  # payload bytes (flat buffers), headers excluded
    seconds: float  # wall time of the whole send/recv, packing and unpacking included
    num_tensors: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def find_free_port(host: str = "") -> int:
    """A TCP port that is free right now on this node (all interfaces by default).

    The port is released before use, so another process can take it before whoever binds it
    next: fine for tests on one machine. A weight channel's sender holds its port from the
    moment it names it instead (:func:`listen_on_free_port`, :meth:`WeightSyncMixin.sync_master_endpoint`).
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _listening_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(1024)
    except OSError as e:
        sock.close()
        raise OSError(e.errno, f"weight channel: cannot listen on {host}:{port} ({e.strerror}); another process "
                      "holds the port. Name the sender's endpoint with a socket already listening on a port the "
                      "OS assigns (listen_on_free_port, WeightSyncMixin.sync_master_endpoint) and hand it to "
                      "rank 0's WeightChannel (listen_sock), or pass another port") from e
    return sock


def listen_on_free_port(host: str) -> socket.socket:
    """A socket listening on ``host`` at a port the OS assigns now: give its port to every
    endpoint and the socket to rank 0's :class:`WeightChannel` (``listen_sock``). The port is
    held from the moment it is named, so no other process can take it before the channel opens
    (as one can a port found free and bound later: :func:`find_free_port`)."""
    return _listening_socket(host, 0)


def node_ip_address() -> str:
    """This node's IP as Ray sees it (what the other endpoints can reach), else a local guess."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address().strip("[]")
    except Exception:  # Ray missing or not connected: fall through to the socket guess.
        pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _metadata_to_json(metadata: FlatMetadata) -> dict[str, Any]:
    return {
        "buffer_dtypes": list(metadata.buffer_dtypes),
        "buffer_numels": list(metadata.buffer_numels),
        "slots": [[s.name, list(s.shape), s.buffer, s.offset, s.numel] for s in metadata.slots],
    }


def _metadata_from_json(obj: dict[str, Any]) -> FlatMetadata:
    return FlatMetadata(
        buffer_dtypes=tuple(obj["buffer_dtypes"]),
        buffer_numels=tuple(int(n) for n in obj["buffer_numels"]),
        slots=tuple(
            TensorSlot(name=n, shape=tuple(int(d) for d in shape), buffer=int(b), offset=int(o), numel=int(k))
            for n, shape, b, o, k in obj["slots"]
        ),
    )


class WeightChannel:
    """One endpoint of the trainer -> rollout broadcast group, living in a worker process.

    Args:
        backend: ``"gloo"`` (CPU tensors) or ``"nccl"`` (CUDA tensors).
        rank: 0 for the sender, 1..world_size-1 for receivers.
        world_size: 1 + number of receivers.
        master_addr, master_port: the sender's node IP and a port there; rank 0 hosts the
            ``TCPStore`` on it.
        device: where the flat buffers live: CPU for gloo, a CUDA device for NCCL. Weights
            are copied to it while packing, whatever device they come from.
        timeout_s: rendezvous and per-collective timeout.
        bucket_bytes: upper bound on one message's payload (a larger single tensor goes alone).
        listen_sock: rank 0 only: a socket already listening on ``master_port``
            (:func:`listen_on_free_port`), which the channel takes over; without it rank 0 binds
            ``master_port`` now, and fails, naming it, if another process has taken it.

    The constructor blocks until all ``world_size`` endpoints have joined.
    """

    def __init__(
        self,
        backend: Backend,
        rank: int,
        world_size: int,
        master_addr: str,
        master_port: int,
        device: torch.device | str | None = None,
        timeout_s: float = 300.0,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        listen_sock: socket.socket | None = None,
    ) -> None:
        if listen_sock is not None and (rank != 0 or listen_sock.getsockname()[1] != master_port):
            raise ValueError(
                f"listen_sock (listening on port {listen_sock.getsockname()[1]}) is for rank 0 on master_port "
                f"{master_port}; this endpoint is rank {rank}: give rank 0 the socket its port was named from, "
                "the other ranks only the port")
        if world_size < 2:
            raise ValueError(f"a weight channel needs a sender and at least one receiver, got world_size={world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} out of range for world_size {world_size}")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        if device is None:
            device = "cpu" if backend == "gloo" else f"cuda:{torch.cuda.current_device()}"
        device = torch.device(device)
        if backend == "gloo" and device.type != "cpu":
            raise ValueError(f"gloo channel needs a CPU device, got {device}")
        if backend == "nccl":
            if device.type != "cuda":
                raise ValueError(f"nccl channel needs a CUDA device, got {device}")
            if device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())

        self.backend: Backend = backend
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.bucket_bytes = bucket_bytes
        self._timeout = timedelta(seconds=timeout_s)

        # Rank 0 hosts the store; wait_for_workers=False because the process-group constructor
        # below performs the real rendezvous (and would otherwise be a second blocking point).
        # The store's server binds only master_addr (the node's address, or 127.0.0.1), not every
        # interface as TCPStore does by itself: we hand it a socket already listening there.
        self._listen_sock: socket.socket | None = None
        listen_fd: dict[str, int] = {}
        if rank == 0:
            self._listen_sock = listen_sock if listen_sock is not None else _listening_socket(master_addr, master_port)
            listen_fd["master_listen_fd"] = self._listen_sock.fileno()
        self._store: dist.Store | None = dist.TCPStore(
            master_addr,
            master_port,
            world_size,
            is_master=(rank == 0),
            timeout=self._timeout,
            wait_for_workers=False,
            **listen_fd,
        )
        prefixed = dist.PrefixStore(_STORE_PREFIX, self._store)
        self._pg: Any = self._make_process_group(prefixed)
        # Receivers say when they have reached a transfer (a key per receiver and transfer), so
        # a sender may wait on the host, not in a device collective (send(wait_for_receivers)).
        self._ready = dist.PrefixStore(_READY_PREFIX, self._store)
        self._transfers = 0  # transfers begun on this endpoint: the sender's and receivers' counts agree
        # The sender's device copy of one flat buffer of a host snapshot (NCCL), reused.
        self._staging: torch.Tensor | None = None
        self.staging_allocations = 0

    # -- construction ------------------------------------------------------------------

    def _make_process_group(self, store: dist.Store) -> Any:
        if self.backend == "gloo":
            # Connects the full mesh now: blocks until every endpoint has constructed its own.
            return dist.ProcessGroupGloo(store, self.rank, self.world_size, self._timeout)
        nccl_cls = getattr(dist, "ProcessGroupNCCL", None)
        if nccl_cls is None or not dist.is_nccl_available():
            raise RuntimeError("this torch build has no NCCL support; use backend='gloo'")
        options = nccl_cls.Options()
        options._timeout = self._timeout
        # Weight sync is bulk traffic: leave the high-priority streams to the training/rollout groups.
        options.is_high_priority_stream = False
        options.group_name = _STORE_PREFIX
        options.global_ranks_in_group = list(range(self.world_size))
        # The NCCL communicator itself is created lazily, on the first collective, for the
        # device of that collective's tensor (always ``self.device``).
        return nccl_cls(store, self.rank, self.world_size, options)

    # -- collectives -------------------------------------------------------------------

    def _require_open(self) -> Any:
        if self._pg is None:
            raise RuntimeError("weight channel is closed")
        return self._pg

    def _broadcast(self, tensor: torch.Tensor) -> None:
        """Broadcast from rank 0 in place; raw bytes, so any dtype goes through either backend."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        opts.timeout = self._timeout
        wire = tensor.view(torch.uint8) if tensor.dtype != torch.uint8 else tensor
        # gloo: wait() blocks the host until done. NCCL: wait() makes the *current* CUDA stream
        # wait for the NCCL stream, so later work on it (unpacking, copies) is ordered after.
        self._require_open().broadcast([wire], opts).wait()

    def _synchronize(self) -> None:
        # NCCL collectives complete asynchronously on the device: before the host reads results
        # or frees/reuses send buffers, drain the current stream (which waited on NCCL above).
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def _send_header(self, header: dict[str, Any]) -> None:
        payload = torch.frombuffer(bytearray(json.dumps(header).encode()), dtype=torch.uint8)
        self._broadcast(torch.tensor([payload.numel()], dtype=torch.int64, device=self.device))
        self._broadcast(payload.to(self.device))

    def _recv_header(self) -> dict[str, Any]:
        length = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._broadcast(length)
        payload = torch.empty(int(length.item()), dtype=torch.uint8, device=self.device)
        self._broadcast(payload)
        header = json.loads(bytes(payload.cpu().numpy()).decode())
        if header.get("protocol") != _PROTOCOL:
            raise RuntimeError(f"unexpected weight-sync header protocol {header.get('protocol')!r}")
        return header

    # -- public API ----------------------------------------------------------------------

    def _await_receivers(self, transfer: int, timeout: timedelta) -> None:
        """Block on the host until every receiver has reached transfer ``transfer``."""
        keys = [f"{transfer}/{r}" for r in range(1, self.world_size)]
        try:
            self._ready.wait(keys, timeout)
        except Exception as e:  # the store raises its own error type on a timeout
            raise TimeoutError(
                f"weight sync: the rollout workers did not reach transfer {transfer} within "
                f"{timeout.total_seconds():.0f} s ({type(e).__name__}: {e})"
            ) from e
        for k in keys:
            self._ready.delete_key(k)

    @torch.no_grad()
    def send(
        self, state: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | HostSnapshot, version: int,
        *, wait_for_receivers: float | None = None,
    ) -> SyncStats:
        """Broadcast ``state`` tagged with ``version`` to every receiver (rank 0 only).

        ``state`` may be a dict or a stream of ``(name, tensor)`` pairs (e.g. a generator that
        gathers sharded weights one at a time), packed and sent bucket by bucket; or a
        :class:`~verl_digen.sync.snapshot.HostSnapshot`, whose buckets are already packed: they
        go as they are when on the channel's device (gloo), else through one reused device
        buffer (NCCL: a ``non_blocking`` copy from pinned memory per flat buffer). The sender's
        tensors must be ready on the current stream. If this raises halfway, receivers fail on
        their timeout and the channel must be closed and reopened.

        ``wait_for_receivers``: seconds to wait on the host until every receiver has entered its
        receive before the first collective (a sender on a side thread, which must not hold a
        device collective open while the receivers still generate); None: go at once.
        """
        if self.rank != 0:
            raise RuntimeError(f"only rank 0 sends; this endpoint is rank {self.rank}")
        if isinstance(version, bool) or not isinstance(version, int):
            raise TypeError(f"version must be an int, got {type(version).__name__}")
        transfer, self._transfers = self._transfers, self._transfers + 1
        if wait_for_receivers is not None:
            self._await_receivers(transfer, timedelta(seconds=wait_for_receivers))
        start = time.perf_counter()
        packed = isinstance(state, HostSnapshot)
        parts = state.parts() if packed else (
            flatten_state(b, device=self.device) for b in iter_buckets(state, self.bucket_bytes))
        nbytes = num_tensors = 0
        current = next(parts)
        # One bucket of look-ahead tells us which message is the last one.
        for following in itertools.chain(parts, [None]):
            buffers, metadata = current
            self._send_header({"protocol": _PROTOCOL, "version": version, "is_last": following is None,
                               "layout": _metadata_to_json(metadata)})
            for buf in buffers:
                if buf.numel():
                    self._broadcast(self._on_device(buf))
            if not packed:  # the packed buffers are dropped next: NCCL must have finished reading them
                self._synchronize()
            nbytes += metadata.nbytes
            num_tensors += len(metadata.slots)
            current = following  # type: ignore[assignment]
        self._synchronize()  # the snapshot's host memory may be refilled once this returns
        return SyncStats(version=version, nbytes=nbytes, seconds=time.perf_counter() - start, num_tensors=num_tensors)

    def _on_device(self, buf: torch.Tensor) -> torch.Tensor:
        """``buf`` where the collective runs: itself, or a view of the reused staging buffer
        holding a copy (queued on the current stream, which waited for the previous broadcast:
        the staging is not overwritten while NCCL still reads it)."""
        if buf.device == self.device:
            return buf
        nbytes = buf.numel() * buf.element_size()
        if self._staging is None or self._staging.numel() < nbytes:
            self._staging = None  # free the smaller one first
            self._staging = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self.staging_allocations += 1
        out = self._staging[:nbytes].view(buf.dtype)
        out.copy_(buf, non_blocking=True)
        return out

    def _recv_parts(self, *, sync_each: bool) -> Iterator[tuple[dict[str, torch.Tensor], int, int]]:
        """The messages of one sync as ``(bucket, version, nbytes)``, checked: one version, no
        tensor twice. ``sync_each``: wait for each bucket's broadcast before yielding it."""
        if self.rank == 0:
            raise RuntimeError("rank 0 is the sender; it cannot recv")
        transfer, self._transfers = self._transfers, self._transfers + 1
        self._ready.set(f"{transfer}/{self.rank}", "1")
        version: int | None = None
        seen: set[str] = set()
        while True:
            header = self._recv_header()
            if version is None:
                version = int(header["version"])
            elif header["version"] != version:
                raise RuntimeError(f"weight sync mixed versions {version} and {header['version']} in one transfer")
            metadata = _metadata_from_json(header["layout"])
            buffers = metadata.empty_buffers(self.device)
            for buf in buffers:
                if buf.numel():
                    self._broadcast(buf)
            if sync_each:
                self._synchronize()
            part = unflatten_state(buffers, metadata)
            duplicated = seen & part.keys()
            if duplicated:
                raise RuntimeError(f"weight sync sent tensors twice: {sorted(duplicated)}")
            seen |= part.keys()
            yield part, version, metadata.nbytes
            if header["is_last"]:
                return

    @torch.no_grad()
    def recv_buckets(self) -> Iterator[tuple[dict[str, torch.Tensor], int]]:
        """Receive one sync message by message (ranks > 0): yields ``(bucket, version)`` as each
        bucket arrives, so the caller can load it and drop it before the next one (one bucket on
        the device at a time instead of the whole state). Consume the generator to the end."""
        for part, version, _ in self._recv_parts(sync_each=True):
            yield part, version

    @torch.no_grad()
    def recv(self) -> tuple[dict[str, torch.Tensor], int, SyncStats]:
        """Receive one sync (ranks > 0): ``(state sorted by name, version, stats)``.

        The tensors are on the channel's device and view freshly allocated buffers, so the
        caller owns them.
        """
        start = time.perf_counter()
        state: dict[str, torch.Tensor] = {}
        version, nbytes = None, 0
        for part, version, size in self._recv_parts(sync_each=False):
            state.update(part)
            nbytes += size
        self._synchronize()
        assert version is not None
        stats = SyncStats(version=version, nbytes=nbytes, seconds=time.perf_counter() - start, num_tensors=len(state))
        return dict(sorted(state.items())), version, stats

    @property
    def closed(self) -> bool:
        return self._pg is None

    def close(self) -> None:
        """Release the group. Idempotent. Close only once no collective is in flight."""
        pg, self._pg = self._pg, None
        if pg is not None and self.backend == "nccl":
            # Frees the NCCL communicator now rather than at garbage collection.
            try:
                pg.shutdown()
            except Exception:  # already torn down / not initialised: nothing left to free
                pass
        # Dropping the store on rank 0 stops its server; gloo's pairs close with the group object.
        self._store = None
        self._ready = None
        self._staging = None
        if self._listen_sock is not None:
            self._listen_sock.close()
            self._listen_sock = None

    def __enter__(self) -> WeightChannel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # Best effort only; callers should close() explicitly.
        try:
            self.close()
        except Exception:
            pass


class WeightSyncMixin:
    """Weight-sync endpoints for a veRL ``Worker`` subclass (trainer or rollout side).

    The worker class provides ``self.sync_module`` (the ``nn.Module`` whose weights are synced),
    ``self.sync_lora_only`` and ``self.policy_version``. These are plain methods: the worker
    author exposes them with ``@register(...)`` (or calls them on ``wg.workers[i]`` directly).
    Controller flow::

        addr, port = ray.get(trainer.sync_master_endpoint.remote())
        ray.get([trainer.sync_open.remote(0, n + 1, addr, port, "gloo")]
                + [w.sync_open.remote(i + 1, n + 1, addr, port, "gloo") for i, w in enumerate(rollouts)])
        ray.get([trainer.sync_send.remote(v)] + [w.sync_recv.remote() for w in rollouts])
    """

    sync_module: torch.nn.Module
    sync_lora_only: bool
    policy_version: int
    _weight_channel: WeightChannel | None = None
    _send_thread: threading.Thread | None = None
    _send_outcome: dict[str, Any] | BaseException | None = None

    _sync_listener: socket.socket | None = None  # the port sync_master_endpoint named, held for sync_open

    def sync_master_endpoint(self) -> tuple[str, int]:
        """``(node ip, port)`` on this worker's node for the channel's store; call it on the
        sender, then :meth:`sync_open` as rank 0 with that port. The port is one the OS assigns,
        and this worker listens on it from now on (:func:`listen_on_free_port`; ``sync_open``
        hands the socket to the channel): a port found free and bound only at ``sync_open``
        could be taken in between, and the run would fail to start."""
        ip = node_ip_address()
        self._close_sync_listener()
        self._sync_listener = listen_on_free_port(ip)
        return ip, int(self._sync_listener.getsockname()[1])

    def _close_sync_listener(self) -> None:
        listener, self._sync_listener = self._sync_listener, None
        if listener is not None:
            listener.close()

    def sync_open(
        self,
        rank: int,
        world_size: int,
        master_addr: str,
        master_port: int,
        backend: Backend = "gloo",
        timeout_s: float = 300.0,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> None:
        """Join the weight channel; blocks until every endpoint has joined (call all concurrently).
        Rank 0 listens on the socket :meth:`sync_master_endpoint` named ``master_port`` from,
        when it did; else it binds ``master_port`` now."""
        listener, self._sync_listener = self._sync_listener, None
        if listener is not None and (rank != 0 or listener.getsockname()[1] != master_port):
            listener.close()  # named for another channel: bind the port given
            listener = None
        self.sync_close()
        self._weight_channel = WeightChannel(
            backend,
            rank,
            world_size,
            master_addr,
            master_port,
            timeout_s=timeout_s,
            bucket_bytes=bucket_bytes,
            listen_sock=listener,
        )

    def _require_sync_channel(self) -> WeightChannel:
        if self._weight_channel is None or self._weight_channel.closed:
            raise RuntimeError("weight channel not open: call sync_open first")
        return self._weight_channel

    def sync_send(self, version: int) -> dict[str, Any]:
        """Broadcast this worker's trainable state as ``version``; also records it as ours.
        A background send still in flight ends first (transfers stay in order)."""
        self.sync_join()
        state = trainable_state(self.sync_module, lora_only=self.sync_lora_only)
        stats = self._require_sync_channel().send(state, version)
        self.policy_version = version
        return stats.as_dict()

    def sync_send_in_background(self, state: Mapping[str, torch.Tensor] | HostSnapshot, version: int,
                                timeout_s: float, join_timeout_s: float | None = None) -> None:
        """Send ``state`` as ``version`` from a side thread and return at once: the thread waits
        (on the host) until every receiver has called :meth:`sync_recv`, then broadcasts, on a
        CUDA stream of its own for NCCL, so the caller's work on its streams goes on meanwhile.
        ``state`` must be a copy the caller does not change until the send is joined (the trained
        weights move on): a :class:`HostSnapshot` (reused for the next version once joined).
        The previous send is joined first (:meth:`sync_join`, within ``join_timeout_s``; None:
        ``timeout_s``): transfers stay in order.

        ``timeout_s``: how long the thread waits for the receivers. Under TCSS they reach the
        sync only after generating a whole step, so a run passes the plan's deadline for that
        wait (:class:`~verl_digen.sim.deadlines.Deadlines` ``send_s``), not one global number."""
        self.sync_join(timeout_s if join_timeout_s is None else join_timeout_s)
        channel = self._require_sync_channel()

        def send() -> None:
            try:
                if channel.device.type == "cuda":
                    with torch.cuda.device(channel.device), torch.cuda.stream(torch.cuda.Stream(channel.device)):
                        stats = channel.send(state, version, wait_for_receivers=timeout_s)
                else:
                    stats = channel.send(state, version, wait_for_receivers=timeout_s)
                self._send_outcome = stats.as_dict()
            except BaseException as e:  # noqa: BLE001 - handed to the next sync_join, which raises it
                self._send_outcome = e

        self._send_outcome = None
        self._send_thread = threading.Thread(target=send, name=f"digen-weight-sync-v{version}", daemon=True)
        self._send_thread.start()

    def sync_join(self, timeout_s: float | None = None) -> dict[str, Any] | None:
        """Wait for the send in flight (:meth:`sync_send_in_background`), if any; its stats, or
        None when there was none. Raises what the send raised, naming the version. ``timeout_s``
        must outlast the send's own wait for the receivers (``Deadlines.join_s`` does), so that a
        send that gave up is reported by its own error, which says what it waited for."""
        thread, self._send_thread = self._send_thread, None
        if thread is None:
            return None
        thread.join(timeout_s)
        if thread.is_alive():
            self._send_thread = thread
            raise TimeoutError(f"weight sync: {thread.name} still sending after {timeout_s:g} s (the plan's "
                               "deadline for this join, digen.task_timeout_s + twice its predicted wait: "
                               "python -m verl_digen.check prints it)")
        outcome, self._send_outcome = self._send_outcome, None
        if isinstance(outcome, BaseException):
            raise RuntimeError(f"weight sync: {thread.name} failed on the sender: "
                               f"{type(outcome).__name__}: {outcome}") from outcome
        return outcome

    def sync_recv(self) -> dict[str, Any]:
        """Receive one sync and load it into ``sync_module`` bucket by bucket (each bucket is
        copied into the module and dropped before the next arrives), then adopt its version.
        Every tensor of the module's sync state must have arrived."""
        start = time.perf_counter()
        expected = set(trainable_state(self.sync_module, lora_only=self.sync_lora_only))
        received: set[str] = set()
        nbytes, version = 0, None
        for part, version in self._require_sync_channel().recv_buckets():
            load_trainable_state(self.sync_module, part, lora_only=self.sync_lora_only, partial=True)
            received |= part.keys()
            nbytes += state_nbytes(part)
            del part
        if received != expected:
            raise ValueError(f"weight sync (lora_only={self.sync_lora_only}) missed {sorted(expected - received)[:5]}")
        assert version is not None
        self.policy_version = version
        return SyncStats(version=version, nbytes=nbytes, seconds=time.perf_counter() - start,
                         num_tensors=len(received)).as_dict()

    def sync_close(self) -> None:
        self._close_sync_listener()
        if self._send_thread is not None:
            # a send still waiting for receivers that will not come (the run is stopping) ends
            # when the channel closes under it; one that is broadcasting gets a moment to finish
            self._send_thread.join(5.0)
            self._send_thread, self._send_outcome = None, None
        if self._weight_channel is not None:
            self._weight_channel.close()
            self._weight_channel = None
