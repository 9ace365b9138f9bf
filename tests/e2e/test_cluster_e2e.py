"""Cluster scale (issue 11) on real raylets: joining an existing Ray cluster, pools placed per node
and per accelerator type.

The two-node test starts a real two-raylet Ray cluster on this machine with ``ray start``
(head + one more node, each with its own logical CPU slots, private ports and temp dir),
runs the job through ``RAY_ADDRESS`` and stops every process it started by PID. The placement
rules alone: tests/unit/test_cluster.py."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

import pytest
import ray
import torch
from safetensors.torch import load_file

from raylets import free_ports as _free_ports
from raylets import ray_start as _ray_start
from raylets import stop as _stop
from runs import QUIET, metrics_lines, ray_auth_follows_env, run
from suite_paths import SEARCH_PATH
from verl_digen.config.schema import ConfigError


# ----------------------------------------------------------------------------- two raylets


def _alive_nodes(address: str) -> int:
    ray.init(address=address, log_to_driver=False)
    try:
        return sum(1 for n in ray.nodes() if n["Alive"])
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def two_node_cluster(tiny_flux):
    """``ray start --head`` + ``ray start --address``: two raylets, 4 logical CPUs each."""
    yield from _two_raylets([], [])


@pytest.fixture(scope="module")
def typed_cluster(tiny_flux):
    """Two raylets of different accelerator types, declared as Ray names a node's type: the
    head ``accelerator_type:L40S``, the other ``accelerator_type:H100``."""
    yield from _two_raylets(['--resources={"accelerator_type:L40S": 1}'], ['--resources={"accelerator_type:H100": 1}'])


def _head_address(temp: str, head, within_s: float) -> str:
    """The loopback address of the GCS whose port ``ray start --head --temp-dir=temp`` wrote
    (``temp/ray_current_cluster``), once it accepts connections."""
    path = os.path.join(temp, "ray_current_cluster")
    deadline = time.time() + within_s
    while time.time() < deadline:
        assert head.poll() is None, f"ray start --head exited with {head.returncode}"
        if os.path.exists(path):
            # its port; the host there is the machine's own address, the loopback is what the nodes use
            port = open(path).read().strip().rsplit(":", 1)[-1]
            with socket.socket() as s:
                if port.isdigit() and s.connect_ex(("127.0.0.1", int(port))) == 0:
                    return f"127.0.0.1:{port}"
        time.sleep(0.5)
    raise AssertionError(f"the head wrote no reachable GCS address into {path} within {within_s} s")


def _two_raylets(head_args: list[str], other_args: list[str]):
    """Start a head and a second raylet (extra ``ray start`` arguments each), yield the address,
    then stop both by PID."""
    assert not ray.is_initialized()
    temp = tempfile.mkdtemp(prefix="digen-ray-")  # short: Ray's unix sockets live under it
    (client_port,) = _free_ports(1)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    # Ray's token auth (on by default once ~/.ray/auth_token exists) would need RAY_AUTH_MODE=token
    # in the driver, and Ray caches that mode per process; this private loopback cluster goes without.
    env["RAY_AUTH_MODE"] = "disabled"
    # A loaded 2-core machine (CI, other jobs) can starve a raylet for seconds and a worker's
    # imports (torch, diffusers, veRL) for over a minute: bound Ray's own waits generously so
    # a slow machine is not mistaken for a dead node or a failed worker.
    env.update({"RAY_health_check_failure_threshold": "60", "RAY_health_check_timeout_ms": "30000",
                "RAY_worker_register_timeout_seconds": "600"})
    # Workers of an existing cluster inherit the raylet's environment, not the driver's.
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join([root, *SEARCH_PATH, env.get("PYTHONPATH", "")])
    # --port=0: the GCS binds a port of its own and `ray start` writes the address into the temp
    # dir (a port picked here could be taken by another Ray of this machine before the GCS binds it)
    procs = [_ray_start("--head", "--port=0", f"--ray-client-server-port={client_port}", f"--temp-dir={temp}",
                        "--num-cpus=4", "--include-dashboard=false", *head_args, env=env)]
    try:
        address = _head_address(temp, procs[0], within_s=180)
        procs.append(_ray_start(f"--address={address}", "--num-cpus=4", *other_args, env=env))
        deadline = time.time() + 180
        while _alive_nodes(address) < 2:
            assert time.time() < deadline, "the second raylet did not join"
            time.sleep(2)
        yield address
    finally:
        if ray.is_initialized():
            ray.shutdown()
        _stop(procs)
        shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.e2e
def test_a_run_on_two_nodes_through_ray_address_equals_the_single_node_run(
    tmp_path, tiny_flux, two_node_cluster, monkeypatch
):
    """Disaggregated + GAP + TCSS, 3 steps, pools across both raylets; same seeds as one node."""
    common = ["digen.placement=disaggregated", "digen.gap.enable=true", "digen.async.max_staleness=1",
              "trainer.nnodes=2", "trainer.n_gpus_per_node=2", "digen.pools.rollout.devices=2",
              "digen.pools.trainer.devices=1", "digen.batch.groups_per_step=2", "trainer.total_training_steps=3",
              "digen.save_final_weights=true"]
    # The job runs as users run it, from the command line with RAY_ADDRESS set: a fresh driver
    # process, so nothing an earlier test did to this process's Ray state can leak into it.
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "RAY_ADDRESS": two_node_cluster, "RAY_AUTH_MODE": "disabled",
           "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    multi_dir = tmp_path / "two_nodes"
    proc = subprocess.run(
        [sys.executable, "-m", "verl_digen.main", *QUIET, f"digen.output_dir={multi_dir}", *common,
         f"trainer.default_local_dir={tmp_path}/ck_multi"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "connected to the Ray cluster at" in proc.stdout
    multi = SimpleNamespace(output_dir=str(multi_dir),
                            extra={"final_weights": str(multi_dir / "final_weights.safetensors")})
    assert not ray.is_initialized()
    workers = json.loads(open(os.path.join(multi.output_dir, "workers.json")).read())
    assert len({w["node_id"] for w in workers}) == 2, workers  # the pools span both nodes
    trainer_nodes = {w["node_id"] for w in workers if w["role"] == "trainer"}
    assert len(trainer_nodes) == 1

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    single = run(tmp_path, "one_node", *[c.replace("nnodes=2", "nnodes=1").replace("per_node=2", "per_node=3")
                                         for c in common], f"trainer.default_local_dir={tmp_path}/ck_single")
    keys = ("reward_mean", "reward_std", "actor/loss", "policy_version", "max_staleness_seen")
    assert [{k: m[k] for k in keys} for m in metrics_lines(multi.output_dir)] == \
        [{k: m[k] for k in keys} for m in metrics_lines(single.output_dir)]
    a, b = load_file(multi.extra["final_weights"]), load_file(single.extra["final_weights"])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.e2e
def test_resource_counts_are_refused_when_joining_a_cluster(two_node_cluster, tmp_path):
    from verl_digen.config.schema import DigenConfig
    from verl_digen.trainer.runtime import init_ray

    with pytest.raises(ConfigError, match=r"digen.ray_num_cpus=4 .* connects to the Ray cluster at 127.0.0.1"):
        init_ray(1, DigenConfig(ray_num_cpus=4), address=two_node_cluster)
    assert not ray.is_initialized()


@pytest.mark.e2e
def test_a_cluster_smaller_than_declared_is_named(two_node_cluster, tmp_path, tiny_flux, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", two_node_cluster)
    with pytest.raises(ConfigError, match=r"trainer.nnodes=3 x trainer.n_gpus_per_node=1 needs 3 node"):
        run(tmp_path, "too_big", "trainer.nnodes=3", "trainer.n_gpus_per_node=1", "trainer.total_training_steps=1")
    assert not ray.is_initialized()


TYPED = ["digen.placement=disaggregated", "trainer.nnodes=2", "trainer.n_gpus_per_node=2",
         "digen.pools.rollout.devices=2", "digen.pools.trainer.devices=1", "digen.batch.groups_per_step=2",
         "trainer.total_training_steps=1"]


@pytest.mark.e2e
def test_pools_of_an_accelerator_type_run_on_the_nodes_of_that_type(typed_cluster, tmp_path, tiny_flux, monkeypatch):
    """Rollout on the L40S node, trainer on the H100 node of a real two-raylet cluster (before
    the fix the bundles asked for a resource named ``L40S`` and the job waited until it timed out)."""
    monkeypatch.setenv("RAY_ADDRESS", typed_cluster)
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    # an earlier local ray.init of this worker left Ray's cached mode at token: this driver's own
    # server would then refuse the open cluster's workers (its actors never start)
    ray_auth_follows_env()
    result = run(tmp_path, "typed", *TYPED, "digen.pools.rollout.accelerator_type=L40S",
                 "digen.pools.trainer.accelerator_type=H100", "digen.task_timeout_s=300")
    workers = json.loads(open(os.path.join(result.output_dir, "workers.json")).read())
    ray.init(address=typed_cluster, log_to_driver=False)
    try:
        types = {n["NodeID"]: {k for k in n["Resources"] if k.startswith("accelerator_type:")}
                 for n in ray.nodes() if n["Alive"]}
    finally:
        ray.shutdown()
    assert {r: {t for w in workers if w["role"] == r for t in types[w["node_id"]]} for r in ("rollout", "trainer")} == {
        "rollout": {"accelerator_type:L40S"}, "trainer": {"accelerator_type:H100"}}


@pytest.mark.e2e
def test_a_type_the_cluster_lacks_is_named_before_ray_waits(typed_cluster, tmp_path, tiny_flux, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", typed_cluster)
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    # an earlier local ray.init of this worker left Ray's cached mode at token: this driver's own
    # server would then refuse the open cluster's workers (its actors never start)
    ray_auth_follows_env()
    with pytest.raises(ConfigError, match=r"digen.pools.rollout.accelerator_type='A100'; no node of the Ray cluster "
                                          r"has the resource 'accelerator_type:A100'. Accelerator types of its nodes: "
                                          r"H100, L40S"):
        run(tmp_path, "no_a100", *TYPED, "digen.pools.rollout.accelerator_type=A100")
    assert not ray.is_initialized()
