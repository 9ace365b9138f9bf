"""Joining a Ray cluster in its authentication mode (issue 23 item 7).

Ray 2.60 writes ``~/.ray/auth_token`` at any local run; ``ray start --head`` on that machine then
requires the token, and a driver given an explicit address (the job always gives one) does not
send it unless ``RAY_AUTH_MODE=token``. The fast tests ask a stand-in GCS (a real gRPC server
answering ``GetClusterId`` as Ray's GCS does: ``UNAUTHENTICATED`` without the right token); the
e2e tests run the multi-node recipe of docs/multi_node.md with real raylets (private ports and temp dirs,
a fresh and a used ``HOME`` per node, stopped by PID) and join it as the job does.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent import futures

import grpc
import pytest
from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

from raylets import free_ports, ray_start, stop
from verl_digen.config.schema import ConfigError
from verl_digen.trainer import ray_auth

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
AUTH_VARS = (ray_auth.AUTH_MODE, ray_auth.AUTH_TOKEN, ray_auth.AUTH_TOKEN_PATH)


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A fresh HOME (no ``~/.ray/auth_token``) and none of Ray's auth variables; afterwards this
    process's Ray config is read again from the restored environment."""
    from ray._raylet import AuthenticationTokenLoader, Config

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for var in AUTH_VARS:
        monkeypatch.setenv(var, "")  # recorded, so undo also removes what the code under test sets
        monkeypatch.delenv(var)
    yield tmp_path / "home"
    monkeypatch.undo()
    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def _write_token(home_dir, token: str) -> None:
    os.makedirs(home_dir / ".ray", exist_ok=True)
    (home_dir / ".ray" / "auth_token").write_text(token)


class _Gcs(gcs_service_pb2_grpc.NodeInfoGcsServiceServicer):
    """Answers ``GetClusterId``; with ``token`` set, only to ``authorization: Bearer <token>``."""

    def __init__(self, token: str | None) -> None:
        self.token = token

    def GetClusterId(self, request, context):  # noqa: N802 (the gRPC method's name)
        sent = dict(context.invocation_metadata()).get("authorization")
        if self.token is not None and sent != f"Bearer {self.token}":
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "InvalidAuthToken: Authentication token is missing")
        return gcs_service_pb2.GetClusterIdReply(cluster_id=b"\x01" * 28)


@pytest.fixture
def gcs():
    """Start a stand-in GCS: ``gcs(token)`` -> its ``host:port``."""
    servers = []

    def start(token: str | None) -> str:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        gcs_service_pb2_grpc.add_NodeInfoGcsServiceServicer_to_server(_Gcs(token), server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return f"127.0.0.1:{port}"

    yield start
    for server in servers:
        server.stop(grace=None)


def test_an_open_cluster_is_joined_as_it_is_with_or_without_a_token_here(home, gcs):
    address = gcs(None)
    assert ray_auth.follow_cluster_auth(address) == ray_auth.OPEN
    _write_token(home, "a-local-run-wrote-this")
    assert ray_auth.follow_cluster_auth(address) == ray_auth.OPEN
    assert ray_auth.AUTH_MODE not in os.environ


def test_a_token_cluster_is_joined_with_this_machines_token(home, gcs, capsys):
    address = gcs("the-heads-token")
    _write_token(home, "the-heads-token")
    assert ray_auth.follow_cluster_auth(address) == ray_auth.TOKEN
    assert os.environ[ray_auth.AUTH_MODE] == "token"
    from ray._raylet import AuthenticationMode, get_authentication_mode

    assert get_authentication_mode() == AuthenticationMode.TOKEN  # Ray's cached config reads it too
    assert f"joining with the token from {home}/.ray/auth_token" in capsys.readouterr().out


def test_ray_auth_token_comes_before_the_file_as_in_ray(home, gcs, monkeypatch):
    address = gcs("the-heads-token")
    _write_token(home, "this-machines-own-token")
    monkeypatch.setenv(ray_auth.AUTH_TOKEN, "the-heads-token")
    assert ray_auth.follow_cluster_auth(address) == ray_auth.TOKEN


def test_auth_mode_disabled_against_a_token_cluster_is_one_line_naming_ray_auth_mode(home, gcs, monkeypatch):
    address = gcs("the-heads-token")
    _write_token(home, "the-heads-token")
    monkeypatch.setenv(ray_auth.AUTH_MODE, "disabled")
    with pytest.raises(ConfigError) as e:
        ray_auth.follow_cluster_auth(address)
    assert "\n" not in str(e.value)
    assert re.search(rf"{address} requires token authentication, but RAY_AUTH_MODE=disabled here; unset "
                     r"RAY_AUTH_MODE or set RAY_AUTH_MODE=token", str(e.value))
    assert os.environ[ray_auth.AUTH_MODE] == "disabled"


def test_no_token_or_a_refused_token_names_ray_auth_token(home, gcs, monkeypatch):
    address = gcs("the-heads-token")
    with pytest.raises(ConfigError, match=rf"this machine has no token \({re.escape(str(home))}/.ray/auth_token "
                                          r"does not exist\).*RAY_AUTH_TOKEN=<`ray get-auth-token` on the head>"):
        ray_auth.follow_cluster_auth(address)
    _write_token(home, "this-machines-own-token")
    with pytest.raises(ConfigError, match=r"refuses this machine's token \(from .*/.ray/auth_token\)"):
        ray_auth.follow_cluster_auth(address)
    monkeypatch.setenv(ray_auth.AUTH_TOKEN, "wrong")
    with pytest.raises(ConfigError, match=r"refuses this machine's token \(from RAY_AUTH_TOKEN\)"):
        ray_auth.follow_cluster_auth(address)
    assert ray_auth.AUTH_MODE not in os.environ


def test_the_job_asks_before_ray_init_in_both_entry_points(home, gcs, monkeypatch):
    """``init_ray`` (verl_digen.main) and ``preflight_ray`` (main_ppo) refuse a mismatch before
    Ray is touched (``ray.init`` would retry the cluster for a minute)."""
    import ray

    from verl_digen.config.schema import DigenConfig
    from verl_digen.trainer.resolve import preflight_ray
    from verl_digen.trainer.runtime import init_ray

    address = gcs("the-heads-token")
    monkeypatch.setenv("RAY_ADDRESS", address)
    with pytest.raises(ConfigError, match="has no token"):
        init_ray(1, DigenConfig())
    with pytest.raises(ConfigError, match="has no token"):
        preflight_ray(None)
    assert not ray.is_initialized()


# ----------------------------------------------------------------------------- the docs' recipe, real raylets


def _recipe() -> dict[str, list[str]]:
    """The multi-node recipe of docs/multi_node.md: its commands per ``# on ...`` section (head,
    other nodes, the job)."""
    text = open(os.path.join(ROOT, "docs", "multi_node.md")).read()
    block = text.split("## The recipe", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    sections: dict[str, list[str]] = {}
    current = ""
    for line in block.replace("\\\n", " ").splitlines():
        if line.startswith("# on "):
            current = line[5:].split()[0]  # "the", "every"
            current = {"the": "head", "every": "node"}.get(current, current)
            sections.setdefault(current, [])
        elif line.strip():
            sections[current].append(line.split("  #", 1)[0].strip())
    return sections


def test_the_documented_recipe_has_the_head_the_other_nodes_and_the_job():
    """What the e2e tests run is the page's recipe (fast: reads the page only)."""
    sections = _recipe()
    assert set(sections) == {"head", "node"}, sections
    head, node = sections["head"], sections["node"]
    assert "export RAY_AUTH_MODE=token" in head and "export RAY_AUTH_MODE=token" in node
    assert any(c.startswith("ray start --head --port=6379") for c in head)
    assert any(c.startswith("ray start --address=<head-ip>:6379") for c in node)
    assert any("scp <head-ip>:.ray/auth_token" in c for c in node)
    (job,) = [c for c in head if c.startswith("python -m verl_digen.main")]
    assert "trainer.nnodes=2" in job and "digen.placement=disaggregated" in job


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


def test_the_suite_puts_rays_cached_mode_back_after_a_test_sets_ray_auth_mode(monkeypatch):
    """The suite's guard (conftest's teardown, ``runs.ray_auth_follows_env``): a test that set
    ``RAY_AUTH_MODE=disabled`` for an in-process run leaves Ray's per-process config saying
    ``disabled``; the next local ``ray.init`` of the worker would start a token-mode GCS that its
    own driver cannot join (the CI failure of stop 32)."""
    from ray._raylet import AuthenticationMode, Config, get_authentication_mode

    from runs import ray_auth_follows_env

    monkeypatch.setenv(ray_auth.AUTH_MODE, "token")
    Config.initialize("")
    with monkeypatch.context() as m:
        m.setenv(ray_auth.AUTH_MODE, "disabled")
        Config.initialize("")  # what ray.init does when it connects
        assert get_authentication_mode() == AuthenticationMode.DISABLED
    assert get_authentication_mode() == AuthenticationMode.DISABLED  # the variable is back; Ray's cache is not
    assert ray_auth_follows_env()
    assert get_authentication_mode() == AuthenticationMode.TOKEN
    assert not ray_auth_follows_env()
