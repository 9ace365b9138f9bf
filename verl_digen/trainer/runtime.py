"""The Ray side of a run: the cluster, the worker groups, the weight channel, the final check.

Worker groups come from a *factory* ``layout -> (groups, actors)``: :func:`real_worker_groups`
builds ``DiffusionWorker`` groups on Ray resource pools; the emulated cluster
(:func:`verl_digen.workers.emulated.emulated_worker_groups`) builds workers that sleep for the
cost model's seconds. The loop does not know which it drives.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import Any, Callable, Iterator

from verl_digen.config.schema import DEVICES, ConfigError, DigenConfig
from verl_digen.placement.pools import (
    ClusterSpec,
    PoolLayout,
    assign_nodes,
    build_worker_groups,
    check_cluster,
    cluster_nodes,
)
from verl_digen.schedule.plan import WorkerId

WorkerGroupFactory = Callable[[PoolLayout], "tuple[dict[str, Any], dict[WorkerId, Any]]"]

# Keep the console for the progress bar and the metrics, not per-worker loading bars.
QUIET_ENV = {
    "TOKENIZERS_PARALLELISM": "false",
    "TRANSFORMERS_VERBOSITY": "error",
    "DIFFUSERS_VERBOSITY": "error",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
}


def quiet_logs() -> None:
    """Quiet the driver's libraries (workers get the same through Ray's runtime env)."""
    for k, v in QUIET_ENV.items():
        os.environ.setdefault(k, v)


class RunInterrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM reached the driver: the run stops cleanly (checkpoint, message, exit
    ``128 + signal``)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    def __str__(self) -> str:
        return f"{signal.Signals(self.signum).name} received"


_received: list[int] = []  # signals caught by stop_signals' handler, latest last


def as_interrupt(error: KeyboardInterrupt) -> RunInterrupted:
    """The :class:`RunInterrupted` behind a ``KeyboardInterrupt``: Ray's blocking calls catch the
    handler's exception and raise a plain ``KeyboardInterrupt`` of their own, so the signal is
    looked up in what the handler recorded."""
    if isinstance(error, RunInterrupted):
        return error
    return RunInterrupted(_received[-1] if _received else signal.SIGINT)


@contextlib.contextmanager
def stop_signals() -> Iterator[None]:
    """Inside, SIGINT and SIGTERM raise :class:`RunInterrupted` in the driver's main thread.

    The run installs its own handlers rather than relying on Python's default SIGINT handler:
    a process started from a non-interactive shell's background job inherits SIGINT as
    *ignored*, and Ray installs its own SIGTERM handler that exits without a checkpoint. The
    previous handlers come back on exit. Outside the main thread (no handlers can be set) this
    does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raise_interrupt(signum: int, _frame: Any) -> None:
        _received.append(signum)
        raise RunInterrupted(signum)

    previous = {s: signal.signal(s, raise_interrupt) for s in (signal.SIGINT, signal.SIGTERM)}
    _received.clear()
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def ray_address(explicit: str | None) -> str | None:
    """The Ray cluster to connect to, or None to start a local instance.

    In order: ``explicit`` (``ray_kwargs.ray_init.address``), ``RAY_ADDRESS``, then the cluster
    that ``ray start`` last started on this machine (the address file Ray itself reads:
    ``ray.init()`` with no address connects to it too). Ray's own lookup is used so that the
    job finds exactly the cluster ``ray.init()`` would.
    """
    from ray._private.services import get_ray_address_from_environment

    if explicit:
        return explicit
    return get_ray_address_from_environment(None, None)


def init_ray(devices: int, cfg: DigenConfig, *, address: str | None = None, num_cpus: int | None = None) -> bool:
    """Connect to the Ray cluster there is, or start a local one; return whether the job did
    (then :func:`release` disconnects, or stops the local instance); False when the caller had
    already initialised Ray.

    ``address``: ``ray_kwargs.ray_init.address`` (see :func:`ray_address` for the others).
    Connecting passes no resource counts: the cluster's nodes declared theirs at ``ray start``
    (and Ray refuses counts from a connecting driver), so ``digen.ray_num_cpus`` /
    ``ray_kwargs.ray_init.num_cpus`` set while connecting is an error.

    The instance the job starts is a single node: every Ray process (GCS, raylet, workers,
    dashboard agent) listens on 127.0.0.1 only, and no dashboard is started; ``devices``
    (and at least the machine's cores) CPU slots, unless a count is given.
    """
    import ray

    if ray.is_initialized():
        return False
    env = {"env_vars": {**QUIET_ENV, "OMP_NUM_THREADS": "1"}}
    target = ray_address(address)
    counts = cfg.ray_num_cpus or num_cpus
    if target is not None:
        if counts:
            key = "digen.ray_num_cpus" if cfg.ray_num_cpus else "ray_kwargs.ray_init.num_cpus"
            raise ConfigError(
                f"invalid config: {key}={counts} sizes a Ray instance the job starts, but the job connects to the "
                f"Ray cluster at {target} (whose nodes declared their resources at `ray start`); unset it"
            )
        ray.init(address=target, log_to_driver=True, runtime_env=env)
        print(f"[verl-digen] connected to the Ray cluster at {target} ({len(ray.nodes())} node(s))", flush=True)
        return True
    with _loopback_node():
        ray.init(
            num_cpus=counts or max(devices + 2, os.cpu_count() or 1),
            include_dashboard=False,
            ignore_reinit_error=True,
            log_to_driver=True,
            runtime_env=env,
        )
    return True


def device_kind(trainer_device: str, cluster_gpus: float) -> str:
    """``cuda`` or ``cpu``: what the job's devices are, from ``trainer.device`` and the GPUs the
    Ray cluster offers (``ray.cluster_resources()["GPU"]``).

    Decided from the cluster's resources, not the driver's own CUDA (a driver on a CPU-only
    head node still runs a GPU cluster's job on its GPUs). ``trainer.device=cpu`` always runs
    on CPU slots; ``cuda`` (veRL's default) runs on GPUs when the cluster has any, and on CPU
    slots, saying so, when it has none.
    """
    if trainer_device not in DEVICES:
        raise ConfigError(f"invalid config: trainer.device={trainer_device!r}; valid: {', '.join(DEVICES)}")
    if trainer_device == "cpu":
        return "cpu"
    if cluster_gpus > 0:
        return "cuda"
    print("[verl-digen] the Ray cluster has no GPU: trainer.device=cuda runs on CPU slots", flush=True)
    return "cpu"


@contextlib.contextmanager
def _loopback_node() -> Iterator[None]:
    """Make ``ray.init`` give a new local node the loopback address.

    Ray picks the node's routable address on Linux and then binds its gRPC servers on every
    interface; with the loopback address it binds 127.0.0.1 only. Ray has no public switch for
    this: its own ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` (read once, at import) sets the
    constant below, which we flip for the duration of the call. Guarded: if a Ray version lacks
    the constant, nothing is changed (tests/test_hardening.py checks the bound addresses).
    """
    from ray._private import ray_constants

    if not isinstance(getattr(ray_constants, "ENABLE_RAY_CLUSTER", None), bool):
        yield
        return
    before = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = before


def release(groups: dict[str, Any], owns_ray: bool) -> None:
    """Kill the run's actors, free their placement groups, and stop (or disconnect from) Ray if
    the job initialised it."""
    import ray
    from ray.util.placement_group import remove_placement_group

    for wg in groups.values():
        for a in wg.workers:
            ray.kill(a, no_restart=True)
        for pg in getattr(wg.resource_pool, "pgs", None) or []:
            remove_placement_group(pg)
    if owns_ray:
        ray.shutdown()


def finish_tracking(tracker: Any) -> None:
    """Flush and close veRL's loggers. ``Tracking.finish`` exists from veRL 0.9.0; the 0.9.0.dev
    builds before it (verl-omni's pinned veRL commit among them) close them in ``__del__`` only, so
    there is nothing to call (patches/README.md: supported veRL versions)."""
    finish = getattr(tracker, "finish", None)
    if finish is not None:
        finish()


def real_worker_groups(
    cfg: DigenConfig, model_path: str, *, use_gpu: bool, devices: int, cluster: ClusterSpec
) -> WorkerGroupFactory:
    """The factory of ``DiffusionWorker`` groups, one Ray resource pool per role.

    ``cluster``: ``trainer.nnodes`` x ``trainer.n_gpus_per_node``, checked against the Ray
    cluster's nodes; the pools are placed per node (:func:`verl_digen.placement.pools.assign_nodes`).
    """
    import ray

    threads = max(1, (os.cpu_count() or 1) // max(devices, 1)) if not use_gpu else 4
    kind = "cuda" if use_gpu else "cpu"

    def build(layout: PoolLayout) -> tuple[dict[str, Any], dict[WorkerId, Any]]:
        nodes = check_cluster(cluster_nodes(ray.nodes(), kind), cluster, kind)
        placement = assign_nodes(layout.worker_counts, nodes, cluster.n_devices_per_node)
        return build_worker_groups(layout, config=cfg, model_path=model_path, use_gpu=use_gpu, num_threads=threads,
                                   placement=placement)

    return build


def open_weight_channel(spec: Any, actors: dict[WorkerId, Any], cfg: DigenConfig, use_gpu: bool) -> None:
    """Connect trainer rank 0 to every rollout worker (gloo or NCCL) and check they agree."""
    import ray

    backend = cfg.sync.backend
    if backend == "auto":
        backend = "nccl" if use_gpu else "gloo"
    sender = actors[WorkerId("trainer", 0)]
    receivers = [actors[WorkerId("rollout", r)] for r in range(spec.rollout_workers)]
    addr, port = ray.get(sender.sync_master_endpoint.remote(), timeout=60)
    world = len(receivers) + 1
    ray.get(
        [sender.sync_open.remote(0, world, addr, port, backend)]
        + [w.sync_open.remote(i + 1, world, addr, port, backend) for i, w in enumerate(receivers)],
        timeout=cfg.task_timeout_s,
    )
    digests = ray.get([sender.weights_digest.remote(), receivers[0].weights_digest.remote()], timeout=60)
    if digests[0] != digests[1]:
        raise RuntimeError("rollout and trainer start from different weights (same model dir and LoRA seed expected)")


def finish_weights(spec: Any, actors: dict[WorkerId, Any], cfg: DigenConfig, output_dir: str, *, save: bool) -> dict[str, Any]:
    """Check rollout holds the trainer's final weights; optionally save them."""
    import ray

    extra: dict[str, Any] = {}
    source = actors[spec.trainers[0]]
    if spec.placement == "disaggregated":
        digests = ray.get(
            [source.weights_digest.remote()] + [actors[w].weights_digest.remote() for w in spec.generators], timeout=120
        )
        extra["weights_in_sync"] = all(d == digests[0] for d in digests[1:])
        if not extra["weights_in_sync"]:
            raise RuntimeError("after the final sync, rollout weights differ from the trainer's")
    if save:  # written by the first trainer rank itself: the weights never pass through the driver
        path = os.path.join(output_dir, "final_weights.safetensors")
        extra["final_weights"] = ray.get(source.save_final_weights.remote(path), timeout=cfg.task_timeout_s)
    return extra
