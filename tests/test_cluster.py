"""Cluster scale (issue 11): joining an existing Ray cluster, pools placed per node.

The two-node test starts a real two-raylet Ray cluster on this machine with ``ray start``
(head + one more node, each with its own logical CPU slots, private ports and temp dir),
runs the job through ``RAY_ADDRESS`` and stops every process it started by PID.
"""

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
from verl_digen.placement.pools import (
    ClusterSpec,
    RayNode,
    assign_nodes,
    check_accelerator_types,
    check_cluster,
    cluster_nodes,
    node_counts,
)
from verl_digen.platform.nodes import PlacementError


# ----------------------------------------------------------------------------- placement


def _nodes(*devices: int) -> list[RayNode]:
    return [RayNode(f"node{i}", d) for i, d in enumerate(devices)]


def test_the_cluster_must_offer_nnodes_times_n_gpus_per_node():
    assert [n.node_id for n in check_cluster(_nodes(8, 8, 8), ClusterSpec(8, 2), "cuda")] == ["node0", "node1"]
    with pytest.raises(ConfigError, match=r"trainer.nnodes=2 x trainer.n_gpus_per_node=8.*1 such node.*node0: 8, node1: 4"):
        check_cluster(_nodes(8, 4), ClusterSpec(8, 2), "cuda")
    with pytest.raises(ConfigError, match="CPU slots"):
        check_cluster(_nodes(1), ClusterSpec(2, 1), "cpu")


def test_device_counts_come_from_the_cluster_resources_of_alive_nodes():
    listed = [{"NodeID": "a", "Alive": True, "Resources": {"CPU": 16.0, "GPU": 8.0}},
              {"NodeID": "b", "Alive": False, "Resources": {"CPU": 16.0, "GPU": 8.0}},
              {"NodeID": "c", "Alive": True, "Resources": {"CPU": 4.0}}]
    assert cluster_nodes(listed, "cuda") == [RayNode("a", 8), RayNode("c", 0)]
    assert cluster_nodes(listed, "cpu") == [RayNode("a", 16), RayNode("c", 4)]


def test_the_trainer_pool_is_packed_on_as_few_nodes_as_possible():
    placed = assign_nodes({"rollout": 6, "trainer": 6, "reward": 4}, _nodes(8, 8), per_node=8)
    assert placed["trainer"] == ["node0"] * 6  # one node: NVLink for its collectives
    every = placed["trainer"] + placed["rollout"] + placed["reward"]
    assert every.count("node0") == every.count("node1") == 8  # the rest anywhere, every device used
    across = assign_nodes({"trainer": 12, "rollout": 4}, _nodes(8, 8), per_node=8)
    assert across["trainer"] == ["node0"] * 8 + ["node1"] * 4


def test_pools_of_any_size_fill_part_of_a_node_and_share_it():
    """10 rollout + 22 trainers on 4 x 8: the trainers fill two nodes and 6 devices of a third,
    whose 2 free devices and the fourth node take the rollout workers; every device is used once."""
    placed = assign_nodes({"rollout": 10, "trainer": 22}, _nodes(8, 8, 8, 8), per_node=8)
    assert placed["trainer"] == ["node0"] * 8 + ["node1"] * 8 + ["node2"] * 6
    assert sorted(placed["rollout"]) == ["node2"] * 2 + ["node3"] * 8
    assert node_counts({"rollout": 10, "trainer": 22}, 8, 4) == {"trainer": (8, 8, 6, 0), "rollout": (0, 0, 2, 8)}
    assert node_counts({"rollout": 3, "trainer": 5, "reward": 1}, 8, 2) == {
        "trainer": (5, 0), "rollout": (0, 3), "reward": (0, 1)}  # each to the node with most free devices
    with pytest.raises(PlacementError, match="need 33 devices but the nodes offer 32"):
        node_counts({"rollout": 11, "trainer": 22}, 8, 4)
    with pytest.raises(ConfigError, match="invalid config: the pools need 33 devices but the nodes offer 32"):
        assign_nodes({"rollout": 11, "trainer": 22}, _nodes(8, 8, 8, 8), per_node=8)


def test_rollout_workers_spread_over_the_free_devices():
    placed = assign_nodes({"rollout": 2, "trainer": 1}, _nodes(2, 2), per_node=2)
    assert placed == {"trainer": ["node0"], "rollout": ["node1", "node0"]}


def _typed(*nodes: tuple[int, str]) -> list[RayNode]:
    return [RayNode(f"node{i}", d, frozenset([t]) if t else frozenset()) for i, (d, t) in enumerate(nodes)]


def test_accelerator_types_come_from_rays_accelerator_type_resources():
    listed = [{"NodeID": "a", "Alive": True, "Resources": {"GPU": 8.0, "accelerator_type:H100": 1.0}},
              {"NodeID": "b", "Alive": True, "Resources": {"GPU": 8.0, "accelerator_type:L40S": 1.0, "L40S": 1.0}},
              {"NodeID": "c", "Alive": True, "Resources": {"CPU": 4.0}}]
    assert [n.accelerator_types for n in cluster_nodes(listed, "cuda")] == [
        frozenset({"H100"}), frozenset({"L40S"}), frozenset()]  # a bare "L40S" resource is not Ray's type


def test_a_typed_pool_goes_only_to_nodes_of_its_type():
    nodes = _typed((4, "H100"), (4, "L40S"), (4, "L40S"))
    placed = assign_nodes({"rollout": 6, "trainer": 4}, nodes, per_node=4, pool_types={"rollout": "L40S"})
    assert sorted(placed["rollout"]) == ["node1"] * 3 + ["node2"] * 3
    assert placed["trainer"] == ["node0"] * 4  # untyped: what the typed pool left
    both = assign_nodes({"rollout": 2, "trainer": 2}, nodes[:2], per_node=4,
                        pool_types={"rollout": "accelerator_type:L40S", "trainer": "H100"})  # Ray's spelling too
    assert both == {"trainer": ["node0"] * 2, "rollout": ["node1"] * 2}
    # without types the trainer would take the first node whatever it is: the sim's rule is unchanged
    assert assign_nodes({"rollout": 4, "trainer": 4}, nodes[:2], per_node=4)["trainer"] == ["node0"] * 4


def test_a_type_no_node_has_is_refused_naming_the_key_and_the_types_there_are():
    nodes = _typed((4, "H100"), (4, "L40S"), (4, None))
    with pytest.raises(ConfigError, match=r"digen.pools.rollout.accelerator_type='A100'; no node .* "
                                          r"'accelerator_type:A100'. Accelerator types of its nodes: H100, L40S"):
        assign_nodes({"rollout": 1, "trainer": 1}, nodes, per_node=4, pool_types={"rollout": "A100"})
    with pytest.raises(ConfigError, match=r"digen.pools.rollout.accelerator_type='L40S': the rollout pool needs 5 "
                                          r"devices of that type but its nodes have 4 free"):
        assign_nodes({"rollout": 5, "trainer": 1}, nodes, per_node=4, pool_types={"rollout": "L40S"})
    with pytest.raises(ConfigError, match="Accelerator types of its nodes: none"):
        check_accelerator_types({"trainer": "H800"}, _nodes(8))


def test_the_nodes_the_job_uses_include_those_of_the_wanted_types():
    nodes = _typed((8, "H100"), (8, "H100"), (8, "L40S"))
    chosen = check_cluster(nodes, ClusterSpec(8, 2), "cuda", frozenset({"L40S"}))
    assert [n.node_id for n in chosen] == ["node2", "node0"]
    assert [n.node_id for n in check_cluster(nodes, ClusterSpec(8, 2), "cuda")] == ["node0", "node1"]


def test_a_typed_pools_bundles_ask_for_rays_resource_name():
    from verl_digen.placement.pools import accelerator_resource, pool_layout
    from verl_digen.config.schema import digen_config_from_dict

    cfg = digen_config_from_dict({"placement": "disaggregated", "pools": {
        "rollout": {"devices": 1, "accelerator_type": "L40S"}, "trainer": {"devices": 1}}})
    layout = pool_layout(cfg, ClusterSpec(2, 1))
    assert layout.accelerator_types == {"rollout": "L40S", "trainer": None}
    assert accelerator_resource("L40S") == accelerator_resource("accelerator_type:L40S") == "accelerator_type:L40S"
    from ray._common.utils import RESOURCE_CONSTRAINT_PREFIX  # Ray's own prefix, as the raylet sets it

    assert accelerator_resource("L40S") == RESOURCE_CONSTRAINT_PREFIX + "L40S"


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
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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


# ----------------------------------------------------------------------------- device kind


def test_the_device_kind_comes_from_the_cluster_not_the_driver():
    from verl_digen.trainer.runtime import device_kind

    assert device_kind("cuda", 16.0) == "cuda"  # a GPU cluster, whatever the driver's node has
    assert device_kind("cuda", 0.0) == "cpu"  # no GPU anywhere: CPU slots, said once
    assert device_kind("cpu", 16.0) == "cpu"
    with pytest.raises(ConfigError, match=r"trainer.device='tpu'; valid: cuda, cpu"):
        device_kind("tpu", 0.0)


def test_an_unknown_trainer_device_is_refused_before_ray_starts(tmp_path):
    from runs import run_config
    from verl_digen.trainer.loop import DigenTrainer

    with pytest.raises(ConfigError, match=r"trainer.device='npu'"):
        DigenTrainer(run_config(tmp_path, "npu", "trainer.device=npu"))
    assert not ray.is_initialized()


@pytest.mark.gpu
@pytest.mark.e2e
def test_a_gpu_nodes_detected_type_is_what_a_typed_pool_asks_for(tmp_path):
    """On a GPU machine Ray detects the card's type (H100, H200, ...) as ``accelerator_type:<type>``:
    cluster_nodes reads it, and a bundle built as the pools build theirs becomes ready."""
    from ray.util.placement_group import placement_group, remove_placement_group

    from verl_digen.placement.pools import accelerator_resource

    ray.init(num_gpus=1, num_cpus=2, include_dashboard=False, log_to_driver=False,
             _temp_dir=tempfile.mkdtemp(prefix="digen-ray-"))
    try:
        (node,) = cluster_nodes(ray.nodes(), "cuda")
        assert node.devices == 1 and len(node.accelerator_types) == 1, node
        (kind,) = node.accelerator_types
        assert kind in torch.cuda.get_device_name(0)  # "NVIDIA H100 80GB HBM3" -> "H100"
        assert assign_nodes({"rollout": 1}, [node], 1, {"rollout": kind}) == {"rollout": [node.node_id]}
        pg = placement_group([{"CPU": 1, "GPU": 1, accelerator_resource(kind): 1e-4}], strategy="PACK")
        ray.get(pg.ready(), timeout=60)
        remove_placement_group(pg)
    finally:
        ray.shutdown()
