"""Weight sync trainer -> rollout: packing, LoRA selection, the private gloo channel between
two veRL worker pools, the ``digen_gloo`` checkpoint-engine backend. On real Ray worker pools:
tests/e2e/test_sync_e2e.py; NCCL between two GPUs: tests/gpu/test_sync_gpu.py."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from peft import LoraConfig, inject_adapter_in_model
from torch import nn

from verl_digen.sync import (
    WeightChannel,
    WeightSyncMixin,
    find_free_port,
    flatten_state,
    iter_buckets,
    load_trainable_state,
    state_digest,
    state_nbytes,
    trainable_state,
    unflatten_state,
)


DIM = 64


class TinyDenoiser(nn.Module):
    """Attention-like projections (LoRA targets) plus a bf16 layer and buffer: mixed dtypes."""

    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.to_q = nn.Linear(dim, dim)
        self.to_k = nn.Linear(dim, dim)
        self.to_v = nn.Linear(dim, dim)
        self.ff = nn.Linear(dim, 4 * dim)
        self.to_out = nn.Linear(4 * dim, dim).to(torch.bfloat16)
        self.register_buffer("time_scale", torch.linspace(0, 1, dim).to(torch.bfloat16))


def make_lora_denoiser(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = TinyDenoiser()
    # init_lora_weights=False: random lora_B too, so two seeds differ on every adapter tensor.
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_k"], init_lora_weights=False)
    return inject_adapter_in_model(config, model)


def make_full_denoiser(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return TinyDenoiser()


def frozen_digest(module: nn.Module, *, lora_only: bool) -> str:
    """Digest of what a sync must NOT touch (the base weights under LoRA)."""
    synced = trainable_state(module, lora_only=lora_only)
    return state_digest({k: v for k, v in module.state_dict().items() if k not in synced})


# ----------------------------------------------------------------------------------------
# (a) unit: state selection and packing
# ----------------------------------------------------------------------------------------


def test_flatten_unflatten_roundtrip_bitwise_mixed_dtypes() -> None:
    torch.manual_seed(0)
    state = {
        "b.weight": torch.randn(7, 3).to(torch.bfloat16),
        "a.weight": torch.randn(5, 4),
        "a.bias": torch.randn(5),
        "c.scalar": torch.tensor(2.5),
        "d.ids": torch.arange(6, dtype=torch.int64).view(2, 3),
        "e.empty": torch.empty(0, 4),
        "f.strided": torch.randn(4, 6).t(),  # non-contiguous source
    }
    buffers, meta = flatten_state(state)
    assert len(buffers) == 3  # one per dtype: fp32, bf16, int64
    assert sorted(meta.buffer_dtypes) == ["bfloat16", "float32", "int64"]
    assert {b.dtype for b in buffers} == {torch.float32, torch.bfloat16, torch.int64}
    assert meta.nbytes == state_nbytes(state)

    import pickle

    meta = pickle.loads(pickle.dumps(meta))  # travels as plain data
    out = unflatten_state(buffers, meta)
    assert list(out) == sorted(state)
    for name, t in state.items():
        assert out[name].dtype == t.dtype and out[name].shape == t.shape
        assert torch.equal(out[name], t)
    assert state_digest(out) == state_digest(state)

    with pytest.raises(ValueError, match="buffers"):
        unflatten_state(buffers[:1], meta)


def test_iter_buckets_bounds_payload() -> None:
    state = {f"t{i}": torch.zeros(10) for i in range(5)}  # 40 bytes each
    buckets = list(iter_buckets(state, bucket_bytes=100))
    assert [list(b) for b in buckets] == [["t0", "t1"], ["t2", "t3"], ["t4"]]
    assert [list(b) for b in iter_buckets({"big": torch.zeros(100)}, bucket_bytes=8)] == [["big"]]
    assert list(iter_buckets({}, bucket_bytes=8)) == [{}]


def test_lora_only_selects_adapter_tensors() -> None:
    model = make_lora_denoiser(0)
    lora = trainable_state(model, lora_only=True)
    full = trainable_state(model, lora_only=False)
    assert list(lora) == sorted(lora) and list(full) == sorted(full)
    assert lora and all("lora_" in name for name in lora)
    assert {n.split(".")[0] for n in lora} == {"to_q", "to_k"}
    assert set(lora) < set(full)
    assert "to_q.base_layer.weight" not in lora and "to_q.base_layer.weight" in full
    assert state_nbytes(lora) * 10 < state_nbytes(full)
    # Tensors alias the module (no copy): packing happens later, on the wire.
    assert lora["to_q.lora_A.default.weight"].data_ptr() == model.to_q.lora_A["default"].weight.data_ptr()

    with pytest.raises(ValueError, match="no tensor named"):
        trainable_state(make_full_denoiser(0), lora_only=True)


def test_load_trainable_state_copies_in_place_and_is_strict() -> None:
    src, dst = make_lora_denoiser(1), make_lora_denoiser(2)
    param_before = dst.to_q.lora_A["default"].weight
    base_before = frozen_digest(dst, lora_only=True)
    load_trainable_state(dst, trainable_state(src, lora_only=True), lora_only=True)
    assert state_digest(trainable_state(dst, lora_only=True)) == state_digest(trainable_state(src, lora_only=True))
    assert dst.to_q.lora_A["default"].weight is param_before  # same Parameter object
    assert frozen_digest(dst, lora_only=True) == base_before  # base weights untouched

    state = dict(trainable_state(src, lora_only=True))
    missing_name = next(iter(state))
    del state[missing_name]
    state["to_q.lora_Z.default.weight"] = torch.zeros(1)
    with pytest.raises(ValueError) as err:
        load_trainable_state(dst, state, lora_only=True)
    assert missing_name in str(err.value) and "to_q.lora_Z.default.weight" in str(err.value)

    bad = dict(trainable_state(src, lora_only=True))
    bad[missing_name] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match="shape mismatch"):
        load_trainable_state(dst, bad, lora_only=True)

    # Full mode accepts a different dtype (copy_ converts): fp32 trainer -> bf16 rollout.
    full_src, full_dst = make_full_denoiser(3), make_full_denoiser(4).to(torch.bfloat16)
    load_trainable_state(full_dst, trainable_state(full_src, lora_only=False), lora_only=False)
    assert torch.equal(full_dst.to_q.weight, full_src.to_q.weight.to(torch.bfloat16))


# ----------------------------------------------------------------------------------------
# Channel in threads (no Ray): streaming in small buckets, versions, several syncs
# ----------------------------------------------------------------------------------------


def _run_ranks(world_size: int, fn: Callable[[int], Any], timeout_s: float = 60) -> list[Any]:
    """Run ``fn(rank)`` for every rank in its own thread; each rank is an independent endpoint."""
    results: list[Any] = [None] * world_size
    errors: list[BaseException] = []

    def body(rank: int) -> None:
        try:
            results[rank] = fn(rank)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    assert not any(t.is_alive() for t in threads), "rank threads hung"
    if errors:
        raise errors[0]
    return results


def test_channel_streams_buckets_and_versions_in_threads() -> None:
    port = find_free_port()
    src = make_lora_denoiser(7)
    expected: list[str] = []

    def endpoint(rank: int) -> list[tuple[str, int, int]]:
        seen = []
        # A 600-byte bucket splits the state into many messages: exercises the streaming path.
        with WeightChannel("gloo", rank, 3, "127.0.0.1", port, timeout_s=30, bucket_bytes=600) as ch:
            for version in (1, 2):
                if rank == 0:
                    state = trainable_state(src, lora_only=False)
                    stats = ch.send(iter(state.items()), version)  # a stream works as well as a dict
                    seen.append((state_digest(state), version, stats.nbytes))
                else:
                    state, got, stats = ch.recv()
                    assert list(state) == sorted(state)
                    seen.append((state_digest(state), got, stats.nbytes))
        return seen

    results = _run_ranks(3, endpoint)
    expected = results[0]
    assert [v for _, v, _ in expected] == [1, 2]
    assert results[1] == expected and results[2] == expected
    assert expected[0][2] == state_nbytes(trainable_state(src, lora_only=False))


def test_mixin_loads_a_streamed_sync_bucket_by_bucket() -> None:
    """WeightSyncMixin.sync_recv copies each bucket into the module as it arrives: the module
    equals the sender's afterwards, and the receiver never holds more than one bucket."""
    from verl_digen.sync.transport import WeightSyncMixin

    port = find_free_port()
    src, dst = make_full_denoiser(7), make_full_denoiser(8)
    bucket_bytes = 600

    class Receiver(WeightSyncMixin):
        sync_module, sync_lora_only, policy_version = dst, False, 0

    receiver = Receiver()
    held: list[int] = []

    def endpoint(rank: int):
        if rank == 0:
            with WeightChannel("gloo", 0, 2, "127.0.0.1", port, timeout_s=30, bucket_bytes=bucket_bytes) as ch:
                return ch.send(trainable_state(src, lora_only=False), 5).nbytes
        receiver._weight_channel = WeightChannel("gloo", 1, 2, "127.0.0.1", port, timeout_s=30, bucket_bytes=bucket_bytes)
        original = receiver._weight_channel.recv_buckets

        def recording():
            for part, version in original():
                held.append(sum(t.numel() * t.element_size() for t in part.values()))
                yield part, version

        receiver._weight_channel.recv_buckets = recording
        try:
            return receiver.sync_recv()
        finally:
            receiver.sync_close()

    sent, stats = _run_ranks(2, endpoint)
    assert stats["version"] == 5 and receiver.policy_version == 5 and stats["nbytes"] == sent
    # A bucket holds at most bucket_bytes, or one tensor larger than that.
    largest = max(t.numel() * t.element_size() for t in trainable_state(src, lora_only=False).values())
    assert len(held) > 1 and max(held) <= max(bucket_bytes, largest) and sum(held) == sent
    assert state_digest(trainable_state(dst, lora_only=False)) == state_digest(trainable_state(src, lora_only=False))


def test_a_background_send_waits_for_late_receivers_and_returns_at_once() -> None:
    """The sender's optimizer step hands the new version to a side thread and goes on: the
    thread waits on the host until every receiver has reached its receive (here: one receiver
    arrives only after the sender's call has returned, as a rollout worker finishing a step's
    generation does; were the call blocking, that receiver would give up waiting for it after
    10 s and arrive anyway, and the test would fail), then sends.
    Two versions in a row arrive in order and bitwise; a send that no receiver joins fails on
    its timeout, and the sender's next join raises that, naming the version."""
    from verl_digen.sync.transport import WeightSyncMixin

    port = find_free_port()
    src = make_full_denoiser(7)
    dsts = [make_full_denoiser(8), make_full_denoiser(9)]
    snapshots = {v: {k: t.clone() + v for k, t in trainable_state(src, lora_only=False).items()} for v in (1, 2)}

    class Endpoint(WeightSyncMixin):
        sync_lora_only, policy_version = False, 0

        def __init__(self, module):
            self.sync_module = module

    sender = Endpoint(src)
    late_arrived = threading.Event()
    returned = {v: threading.Event() for v in (1, 2)}
    arrived_before_return: list[bool] = []

    def endpoint(rank: int):
        if rank == 0:
            sender._weight_channel = WeightChannel("gloo", 0, 3, "127.0.0.1", port, timeout_s=30)
            for v in (1, 2):
                sender.sync_send_in_background(snapshots[v], v, timeout_s=30)
                arrived_before_return.append(late_arrived.is_set())
                returned[v].set()
            return sender.sync_join(30)
        receiver = Endpoint(dsts[rank - 1])
        receiver._weight_channel = WeightChannel("gloo", rank, 3, "127.0.0.1", port, timeout_s=30)
        try:
            got = []
            for v in (1, 2):
                if rank == 2:
                    # still generating with the old version: arrives once the sender's call has
                    # returned (a blocking send never returns without it: this gives up after 10 s)
                    returned[v].wait(10)
                    time.sleep(0.2)  # the send thread meanwhile waits on the host
                    late_arrived.set()
                got.append((receiver.sync_recv()["version"], state_digest(trainable_state(receiver.sync_module, lora_only=False))))
            return got
        finally:
            receiver.sync_close()

    try:
        last, got1, got2 = _run_ranks(3, endpoint)
    finally:
        sender.sync_close()
    want = [(v, state_digest(snapshots[v])) for v in (1, 2)]
    assert got1 == want and got2 == want and last["version"] == 2
    # the first call returned before the late receiver arrived (a blocking send could not have:
    # it needs that receiver); the second joined the first, which needed it
    assert arrived_before_return == [False, True]

    # no receiver comes: the send times out on the host, and the next join says so
    port = find_free_port()
    lonely = Endpoint(src)
    joined = threading.Event()

    def pair(rank: int):
        if rank == 0:
            lonely._weight_channel = WeightChannel("gloo", 0, 2, "127.0.0.1", port, timeout_s=30)
            try:
                lonely.sync_send_in_background(snapshots[1], 1, timeout_s=0.5)
                with pytest.raises(RuntimeError,
                                   match=r"digen-weight-sync-v1 failed on the sender: TimeoutError.*transfer 0"):
                    lonely.sync_join(30)
            finally:
                joined.set()
            return None
        ch = WeightChannel("gloo", 1, 2, "127.0.0.1", port, timeout_s=30)  # joins the channel, never receives
        joined.wait(30)  # stays in the channel until the sender's send has timed out
        ch.close()

    try:
        _run_ranks(2, pair)
    finally:
        lonely.sync_close()


def test_channel_role_errors() -> None:
    port = find_free_port()

    def endpoint(rank: int) -> None:
        ch = WeightChannel("gloo", rank, 2, "127.0.0.1", port, timeout_s=30)
        try:
            if rank == 0:
                with pytest.raises(RuntimeError, match="sender"):
                    ch.recv()
                with pytest.raises(TypeError):
                    ch.send({}, version=1.0)  # type: ignore[arg-type]
            else:
                with pytest.raises(RuntimeError, match="only rank 0"):
                    ch.send({}, 1)
        finally:
            ch.close()
        with pytest.raises(RuntimeError, match="closed"):
            ch._broadcast(torch.zeros(1))

    _run_ranks(2, endpoint)
    with pytest.raises(ValueError):
        WeightChannel("gloo", 0, 1, "127.0.0.1", port)
    with pytest.raises(ValueError):
        WeightChannel("gloo", 0, 2, "127.0.0.1", port, device="cuda:0")


# ----------------------------------------------------------------------------------------
# veRL checkpoint-engine backend "digen_gloo" (threads, no Ray)
# ----------------------------------------------------------------------------------------


def test_digen_gloo_checkpoint_engine_protocol() -> None:
    from verl.checkpoint_engine import CheckpointEngineRegistry

    import verl_digen.sync.checkpoint_engine  # noqa: F401  (registers the backend)

    cls = CheckpointEngineRegistry.get("digen_gloo")
    # Two actor ranks (rank 1 must sit out but drain its generator) -> two rollout workers.
    actors = [CheckpointEngineRegistry.new("digen_gloo", bucket_size=1 << 20, is_master=(i == 0)) for i in range(2)]
    rollouts = [CheckpointEngineRegistry.new("digen_gloo", bucket_size=1 << 20) for _ in range(2)]
    engines = actors + rollouts
    src = make_lora_denoiser(11)
    weights = trainable_state(src, lora_only=True)

    for step in (5, 6):  # second step reuses the group built by the first
        metadata = [e.prepare() for e in engines]
        actor_kwargs, rollout_kwargs = cls.build_topology(len(actors), len(rollouts), metadata)
        assert actor_kwargs["rank"] == [0, -1] and rollout_kwargs["rank"] == [1, 2]
        per_engine = [{k: v[i] for k, v in actor_kwargs.items()} for i in range(len(actors))] + [
            {k: v[i] for k, v in rollout_kwargs.items()} for i in range(len(rollouts))
        ]
        _run_ranks(len(engines), lambda i: engines[i].init_process_group(**per_engine[i]))

        drained: list[str] = []

        def stream():
            for name, t in weights.items():
                drained.append(name)
                yield name, t

        async def act(i: int) -> Any:
            engine = engines[i]
            if i < len(actors):
                return await engine.send_weights(stream() if i == 1 else iter(weights.items()), global_steps=step)
            return {name: t.clone() async for name, t in engine.receive_weights(global_steps=step)}

        results = _run_ranks(len(engines), lambda i: asyncio.run(act(i)))
        assert results[0]["weight_sync/version"] == step
        assert results[0]["weight_sync/nbytes"] == state_nbytes(weights)
        assert results[1] == {} and drained == list(weights)
        for received in results[2:]:
            assert state_digest(received) == state_digest(weights)
        assert all(e.last_version == step for e in rollouts)
        for e in engines:
            e.finalize()

    for e in engines:
        e._close_channel()


def assert_port_held(addr: str, port: int) -> None:
    """Another socket cannot take ``addr:port``: somebody listens on it."""
    import socket

    other = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET, socket.SOCK_STREAM)
    try:
        with pytest.raises(OSError):
            other.bind((addr, port))
            other.listen(1)
    finally:
        other.close()


def test_digen_gloo_master_holds_the_port_it_reports_until_its_channel_opens() -> None:
    """prepare() used to report a port found free and released, bound only at
    init_process_group: another process could take it in between. The master now listens on
    it from prepare() on."""
    from verl.checkpoint_engine import CheckpointEngineRegistry

    import verl_digen.sync.checkpoint_engine  # noqa: F401  (registers the backend)

    master = CheckpointEngineRegistry.new("digen_gloo", bucket_size=1 << 20, is_master=True)
    endpoint = master.prepare()
    addr, port = endpoint["master_addr"], endpoint["master_port"]
    try:
        assert_port_held(addr, port)
    finally:
        if master._listener is not None:
            master._listener.close()


def test_the_sender_holds_the_port_it_names_until_the_channel_opens_on_it() -> None:
    """sync_master_endpoint used to name a port found free and release it, and sync_open bound
    it only later: any process could take it in between and the run failed to start. The
    sender now listens on the port from the moment it names it: a socket that tries to take it
    in between is refused, and the channel opens on it and carries a sync."""
    from verl_digen.sync.transport import WeightSyncMixin

    src, dst = make_lora_denoiser(1), make_lora_denoiser(2)

    class Endpoint(WeightSyncMixin):
        sync_lora_only, policy_version = True, 0

        def __init__(self, module: nn.Module) -> None:
            self.sync_module = module

    sender, receiver = Endpoint(src), Endpoint(dst)
    addr, port = sender.sync_master_endpoint()
    assert_port_held(addr, port)

    def endpoint(rank: int):
        me = (sender, receiver)[rank]
        me.sync_open(rank, 2, addr, port, "gloo", 30.0)
        try:
            return me.sync_send(3) if rank == 0 else me.sync_recv()
        finally:
            me.sync_close()

    sent, got = _run_ranks(2, endpoint)
    assert got["version"] == sent["version"] == 3
    assert state_digest(trainable_state(dst, lora_only=True)) == state_digest(trainable_state(src, lora_only=True))


def test_a_sender_port_taken_by_another_process_fails_naming_the_port_and_the_fix() -> None:
    """Given a port (no socket held) that another process listens on, rank 0 says which port and
    how to avoid the race, not a bare 'Address already in use'."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=rf"127\.0\.0\.1:{port} .*listen_on_free_port"):
            WeightChannel("gloo", 0, 2, "127.0.0.1", port, timeout_s=5)
