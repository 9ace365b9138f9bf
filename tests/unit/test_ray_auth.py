"""Joining a Ray cluster in its authentication mode (issue 23 item 7).

Ray 2.60 writes ``~/.ray/auth_token`` at any local run; ``ray start --head`` on that machine then
requires the token, and a driver given an explicit address (the job always gives one) does not
send it unless ``RAY_AUTH_MODE=token``. The tests here ask a stand-in GCS (a real gRPC server
answering ``GetClusterId`` as Ray's GCS does: ``UNAUTHENTICATED`` without the right token) and
read the recipe of docs/multi_node.md; tests/e2e/test_ray_auth_e2e.py runs that recipe with real
raylets."""

from __future__ import annotations

import os
import re
from concurrent import futures

import grpc
import pytest
from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

from verl_digen.config.schema import ConfigError
from verl_digen.trainer import ray_auth

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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
