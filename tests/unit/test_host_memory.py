"""Memory the planner used not to count: the allocator's configuration every worker starts with,
the communicators each role's rank joins, the reserve above allocated memory, models loaded
straight onto their device, and host RAM per node at load. A real pool's workers starting with
that configuration: tests/e2e/test_host_memory_e2e.py; loading onto a GPU:
tests/gpu/test_host_memory_gpu.py."""

from __future__ import annotations

import dataclasses

import pytest

from verl_digen.placement.pools import EXPANDABLE_SEGMENTS, allocator_conf, worker_env


# ---------------------------------------------------------------------- allocator configuration


def test_worker_env_sets_expandable_segments_when_the_user_set_nothing():
    assert worker_env({}) == {"PYTORCH_CUDA_ALLOC_CONF": EXPANDABLE_SEGMENTS}


def test_worker_env_keeps_the_users_own_allocator_entries_and_appends_ours():
    env = worker_env({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512, garbage_collection_threshold:0.8"})
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == (
        "max_split_size_mb:512,garbage_collection_threshold:0.8," + EXPANDABLE_SEGMENTS)


def test_a_users_own_expandable_segments_or_async_backend_is_left_as_set():
    assert allocator_conf("expandable_segments:False") == "expandable_segments:False"
    assert allocator_conf("backend:cudaMallocAsync") == "backend:cudaMallocAsync"


def test_memory_peaks_record_the_host_high_water_and_no_device_figures_off_cuda():
    """What workers.json records after loading: the process's host RSS high-water mark, at least
    what a fresh 64 MiB buffer makes resident (on CUDA also max allocated and max reserved)."""
    import torch

    from verl_digen.memory.measure import GIB, memory_peaks

    before = memory_peaks(torch.device("cpu"))["host_peak_gib"]
    buffer = torch.ones(16 << 20)  # 64 MiB, written: resident
    peaks = memory_peaks(torch.device("cpu"))
    assert set(peaks) == {"host_peak_gib"}
    assert peaks["host_peak_gib"] >= max(before, buffer.numel() * 4 / GIB)


# ---------------------------------------------------------------------- communicators


def _groups_the_worker_joins(role: str, placement: str, monkeypatch) -> int:
    """The process groups a worker of ``role`` creates through its own code, in this process on
    gloo: the trainer group (``open_rendezvous``, ``_join_trainer_group``), the FSDP mesh over it
    (``training_mesh``) and, in a disaggregated run, the weight channel (``sync_open``; its other
    end, a second worker here, opened concurrently as the driver does): torch's registered groups
    that its calls add, plus its channel (whose backend is built by hand, unregistered)."""
    import threading

    import torch.distributed as dist

    from verl_digen.config.schema import digen_config_from_dict
    from verl_digen.workers.fsdp import training_mesh
    from verl_digen.memory.fsdp_layout import FsdpLayout
    from verl_digen.workers.worker import DiffusionWorker

    for key, value in {"WORLD_SIZE": "1", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0"}.items():
        monkeypatch.setenv(key, value)
    pools = {"rollout": {"devices": 1}, "trainer": {"devices": 1}} if placement == "disaggregated" else {}
    cfg = digen_config_from_dict({"placement": placement, "fsdp": {"enable": True}, "pools": pools})
    worker = DiffusionWorker(role, cfg, model_path="unused: nothing is loaded")
    peer = DiffusionWorker("rollout" if role == "trainer" else "trainer", cfg, model_path="unused")
    assert not dist.is_initialized()
    try:
        worker.open_rendezvous()
        if worker._join_trainer_group() is not None and worker.fsdp:
            training_mesh(FsdpLayout(rows=((0,),), reduce_dtype="fp32"))
        registered = len(dist.distributed_c10d._world.pg_map) if dist.is_initialized() else 0
        if placement == "disaggregated":  # trainer 0 sends to every rollout worker
            sender, receiver = (worker, peer) if role == "trainer" else (peer, worker)
            addr, port = sender.sync_master_endpoint()
            end = threading.Thread(target=receiver.sync_open, args=(1, 2, addr, port, "gloo", 30.0))
            end.start()
            sender.sync_open(0, 2, addr, port, "gloo", 30.0)
            end.join(30)
        return registered + (worker._weight_channel is not None)
    finally:
        worker.sync_close()
        peer.sync_close()
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.parametrize("placement,role", [("disaggregated", "trainer"), ("disaggregated", "rollout"),
                                            ("colocated", "fused")])
def test_communicators_charged_are_the_groups_the_worker_code_creates(placement, role, monkeypatch):
    """One rank per role (all a single process can be): what the planner charges for the rank is
    what the worker's own code creates. Trainer 0 of a disaggregated run: its group (FSDP's mesh
    reuses it) and the weight channel."""
    from verl_digen.memory.plan import nccl_communicators, workload_job

    job = workload_job(family="flux", height=512, width=512, num_frames=1, num_steps=4, cfg_rows=1, group_size=1,
                       groups_per_task=1, micro_batch_samples=1, pass_samples=1, lora=True, lora_rank=8,
                       kl_reference=False, placement=placement, rollout_devices=1, trainer_devices=1,
                       reward_devices=0, fsdp=1, reward_bytes=0, trainers_generate=False, trainers_score=False,
                       rollouts_train=False)
    job = dataclasses.replace(job, fsdp_enabled=True)
    planned = nccl_communicators(job, "colocated" if role == "fused" else role)
    assert planned == _groups_the_worker_joins(role, placement, monkeypatch)


# ---------------------------------------------------------------------- loading onto the device


def _old_load(component_cls, path: str, name: str, dtype, device):
    """The loading this replaced: the whole component on the host, then moved."""
    from diffusers import ModelMixin

    kwargs = {"torch_dtype": dtype} if issubclass(component_cls, ModelMixin) else {"dtype": dtype}
    return component_cls.from_pretrained(path, subfolder=name, **kwargs).to(device)


def test_models_loaded_onto_their_device_are_the_checkpoints_tensors_bitwise(tiny_flux):
    """Loading through the library's ``device_map`` gives the same tensors (values, dtypes,
    requires_grad) as loading on the host and moving, and leaves no dispatch hooks behind."""
    import torch

    from verl_digen.models.registry import ADAPTERS, load_adapter

    adapter = load_adapter(tiny_flux, "flux", device="cpu", dtype=torch.bfloat16)
    for name, component_cls in ADAPTERS["flux"].component_classes.items():
        if not issubclass(component_cls, torch.nn.Module):
            continue
        dtype = torch.float32 if name in ADAPTERS["flux"].fp32_components else torch.bfloat16
        old = _old_load(component_cls, tiny_flux, name, dtype, "cpu")
        new = getattr(adapter, name)
        old_state, new_state = old.state_dict(), new.state_dict()
        assert old_state.keys() == new_state.keys(), name
        for key, tensor in old_state.items():
            assert new_state[key].dtype == tensor.dtype and torch.equal(new_state[key], tensor), (name, key)
        if name == "transformer":
            assert [p.requires_grad for p in new.parameters()] == [p.requires_grad for p in old.parameters()]
        assert not any(hasattr(m, "_hf_hook") for m in new.modules()), name


def test_every_model_component_is_loaded_with_its_device(tiny_flux, monkeypatch):
    """Each model's ``from_pretrained`` is given the worker's device (diffusers: with
    ``low_cpu_mem_usage``), so a shard at a time passes through the host; tokenizers get none.
    Every family loads through this one path (no adapter has its own ``from_pretrained``)."""
    import diffusers
    import torch
    import transformers

    from verl_digen.models.base import DiffusionAdapter, load_components
    from verl_digen.models.registry import ADAPTERS, FAMILY_SPECS

    for family in FAMILY_SPECS:
        assert ADAPTERS[family].from_pretrained.__func__ is DiffusionAdapter.from_pretrained.__func__, family
    calls = []

    def recorder(base):
        original = base.from_pretrained.__func__

        def from_pretrained(cls, *args, **kwargs):
            calls.append((cls.__name__, issubclass(cls, diffusers.ModelMixin), kwargs))
            return original(cls, *args, **kwargs)
        return classmethod(from_pretrained)

    monkeypatch.setattr(diffusers.ModelMixin, "from_pretrained", recorder(diffusers.ModelMixin))
    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", recorder(transformers.PreTrainedModel))
    load_components(tiny_flux, ADAPTERS["flux"].component_classes, device=torch.device("cpu"), dtype=torch.float32)
    models = {c for c in ADAPTERS["flux"].component_classes.values() if issubclass(c, torch.nn.Module)}
    assert {name for name, _, _ in calls} == {c.__name__ for c in models}
    for name, is_diffusers, kwargs in calls:
        assert kwargs.get("device_map") == "cpu", name
        assert kwargs.get("low_cpu_mem_usage") is True or not is_diffusers, name
