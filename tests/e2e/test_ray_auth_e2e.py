"""Joining a Ray cluster in its authentication mode, on real raylets: the multi-node recipe of
docs/multi_node.md run as written (private ports and temp dirs, a fresh and a used ``HOME`` per
node, stopped by PID), joined as the job does, and a mismatched driver stopped in one line before
``ray.init``. Why the token matters, and the checks against a stand-in GCS:
tests/unit/test_ray_auth.py."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

from raylets import free_ports, ray_start, stop
from verl_digen.config.schema import ConfigError
from test_ray_auth import AUTH_VARS, ROOT, _recipe


def _run_section(lines: list[str], env: dict[str, str], *, head_home: str, port: int, start_args: list[str],
                 log: str, procs: list) -> None:
    """Run one section's commands as written, on this machine: ``export`` sets ``env``; ``ray start``
    gets the private GCS ``port`` for the recipe's 6379, more private ports and ``--block`` (its
    processes are stopped by PID); ``scp <head-ip>:...`` copies from the head's HOME (the other
    machine here is another HOME)."""
    for line in lines:
        if line.startswith("export "):
            env.update(dict(kv.split("=", 1) for kv in shlex.split(line)[1:]))
        elif line.startswith("ray start"):
            assert "6379" in line, line
            args = shlex.split(line.replace("<head-ip>", "127.0.0.1").replace("6379", str(port)))[2:]
            procs.append(ray_start(*args, *start_args, env=env, log=log))
        elif "scp <head-ip>:" in line:
            mkdir, copy = line.split(" && ")
            subprocess.run(["bash", "-c", mkdir], env=env, check=True, timeout=30)
            src, dst = shlex.split(copy)[1:]
            shutil.copy(os.path.join(head_home, src.split(":", 1)[1]), os.path.expanduser(dst.replace("~", env["HOME"])))
        else:
            proc = subprocess.run(["bash", "-c", line], env=env, capture_output=True, text=True, timeout=120)
            assert proc.returncode == 0, f"{line}: {proc.stdout[-2000:]}{proc.stderr[-2000:]}"


def _gcs_listens(port: int, within_s: float) -> bool:
    import socket

    deadline = time.time() + within_s
    while time.time() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return True
        time.sleep(0.5)
    return False


def _join(env: dict[str, str], code: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """A fresh driver process, as a user starts the job (Ray caches its auth mode per process)."""
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)


INIT_RAY = ("import ray; from verl_digen.config.schema import DigenConfig; from verl_digen.trainer.runtime import "
            "init_ray; init_ray(1, DigenConfig()); print('nodes', sum(n['Alive'] for n in ray.nodes())); "
            "ray.shutdown()")
# main_ppo: the digen mode's check, then veRL's driver's own ray.init (address from RAY_ADDRESS).
MAIN_PPO = ("import ray; from verl_digen.trainer.resolve import preflight_ray; assert not preflight_ray(None); "
            "ray.init(); print('nodes', sum(n['Alive'] for n in ray.nodes())); ray.shutdown()")


@pytest.fixture(scope="module", params=["fresh", "used"])
def recipe_cluster(request):
    """The docs' recipe on two "machines" (two HOMEs) of this one: ``fresh`` HOMEs have no token;
    ``used`` ones each have their own, as a local Ray run leaves it."""
    base = tempfile.mkdtemp(prefix="digen-auth-")  # short: Ray's unix sockets live under it
    head_home, node_home = os.path.join(base, "head"), os.path.join(base, "node")
    clean = {k: v for k, v in os.environ.items() if k not in (*AUTH_VARS, "RAY_ADDRESS")}
    ray_bin = os.path.dirname(sys.executable)
    clean["PATH"] = os.pathsep.join([ray_bin, clean.get("PATH", "")])
    clean["PYTHONPATH"] = os.pathsep.join([ROOT, clean.get("PYTHONPATH", "")])
    clean.update({"RAY_health_check_failure_threshold": "60", "RAY_health_check_timeout_ms": "30000"})
    for h in (head_home, node_home):
        os.makedirs(h)
        if request.param == "used":  # what a local ray.init leaves: a token of this machine's own
            proc = subprocess.run(["ray", "get-auth-token", "--generate"], env={**clean, "HOME": h},
                                  capture_output=True, text=True, timeout=120)
            assert proc.returncode == 0, proc.stderr[-2000:]
    sections = _recipe()
    assert set(sections) >= {"head", "node"}, sections
    port, client_port = free_ports(2)
    log = os.path.join(base, "ray_start.log")
    procs: list = []
    head_env = {**clean, "HOME": head_home}
    try:
        head_lines = [c for c in sections["head"] if not c.startswith("python")]
        _run_section(head_lines, head_env, head_home=head_home, port=port, procs=procs, log=log,
                     start_args=[f"--ray-client-server-port={client_port}",
                                 f"--temp-dir={base}/rt", "--num-cpus=1", "--include-dashboard=false"])
        assert _gcs_listens(port, 180), open(log).read()[-3000:]
        node_env = {**clean, "HOME": node_home}
        _run_section(sections["node"], node_env, head_home=head_home, port=port, procs=procs, log=log,
                     start_args=["--num-cpus=1"])
        yield {"address": f"127.0.0.1:{port}", "head_home": head_home, "node_home": node_home, "env": clean,
               "log": log, "procs": procs}
    finally:
        stop(procs)
        shutil.rmtree(base, ignore_errors=True)


def _nodes_joined(cluster, env: dict[str, str], code: str, want: int, within_s: float = 240) -> str:
    deadline = time.time() + within_s
    while True:
        proc = _join(env, code)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        if f"nodes {want}" in proc.stdout or time.time() > deadline:
            return proc.stdout
        time.sleep(3)


@pytest.mark.e2e
def test_the_documented_recipe_joins_both_nodes_and_the_job_follows_the_token(recipe_cluster):
    """Both nodes join (the second one through the recipe's token copy), and the job's driver,
    with ``RAY_AUTH_MODE`` unset, joins with the head's token: ``verl_digen.main``'s
    ``init_ray`` and ``main_ppo``'s check followed by veRL's plain ``ray.init()``."""
    c = recipe_cluster
    env = {**c["env"], "HOME": c["head_home"], "RAY_ADDRESS": c["address"]}
    out = _nodes_joined(c, env, INIT_RAY, want=2)
    assert "nodes 2" in out, out + open(c["log"]).read()[-3000:]
    assert f"requires token authentication: joining with the token from {c['head_home']}/.ray/auth_token" in out
    out = _join(env, MAIN_PPO)
    assert "nodes 2" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]


@pytest.mark.e2e
def test_a_mismatched_driver_stops_in_one_line_before_ray_init(recipe_cluster):
    c = recipe_cluster
    base = {**c["env"], "RAY_ADDRESS": c["address"]}
    cases = [({"HOME": c["head_home"], "RAY_AUTH_MODE": "disabled"}, "RAY_AUTH_MODE=disabled here"),
             ({"HOME": os.path.join(c["head_home"], "elsewhere")}, "this machine has no token"),
             ({"HOME": c["head_home"], "RAY_AUTH_TOKEN": "not-the-heads"}, "refuses this machine's token")]
    for extra, said in cases:
        proc = _join({**base, **extra}, INIT_RAY, timeout=120)
        assert proc.returncode != 0 and said in proc.stderr, proc.stderr[-3000:]
        assert "ConfigError" in proc.stderr
        # stopped before ray.init, which would retry the cluster for a minute and more
        assert "Connecting to existing Ray cluster" not in proc.stderr + proc.stdout
        assert "Authentication token is missing or incorrect" not in proc.stderr
