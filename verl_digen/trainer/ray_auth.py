"""Join a Ray cluster in the authentication mode it runs in.

Ray 2.60 turns token authentication on for every cluster started where a token exists: a local
``ray.init()`` writes ``~/.ray/auth_token`` (once), and every later ``ray start --head`` on that
machine (``RAY_AUTH_MODE`` unset) requires that token. A driver given an explicit address, which
is how the job always connects (:func:`verl_digen.trainer.runtime.ray_target`), never turns token
mode on by itself: ``ray.init`` then retries the cluster for a minute with nothing but
"Authentication token is missing or incorrect" warnings and ends in a ``ConnectionError`` about
the address. So before connecting, the job asks the cluster's GCS (one gRPC call without a
token, then one with the token this machine has) and follows what the cluster does: a cluster
that requires a token gets ``RAY_AUTH_MODE=token`` in this process (and the processes it starts)
when a token that the cluster accepts is here; every other case stops in one line naming what to
set.
"""

from __future__ import annotations

import os

from verl_digen.config.schema import ConfigError

#: Ray's environment variables: the mode, and the two places of a token other than ~/.ray/auth_token.
AUTH_MODE = "RAY_AUTH_MODE"
AUTH_TOKEN = "RAY_AUTH_TOKEN"
AUTH_TOKEN_PATH = "RAY_AUTH_TOKEN_PATH"
#: How long the GCS has to answer one probe (the TCP probe before it already found it listening).
AUTH_PROBE_S = 10.0

OPEN, TOKEN, REFUSED, UNKNOWN = "open", "token", "refused", "unknown"


def probe(address: str, token: str | None, timeout_s: float = AUTH_PROBE_S) -> str:
    """What the GCS at ``address`` (``host:port``) answers a ``GetClusterId`` call carrying
    ``token`` (None: no token): :data:`OPEN` (answered), :data:`REFUSED` (``UNAUTHENTICATED``:
    the cluster requires a token and this one is missing or wrong), :data:`UNKNOWN` (anything
    else: ``ray.init`` then reports it in its own words)."""
    import grpc
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    metadata = [("authorization", f"Bearer {token}")] if token else None
    with grpc.insecure_channel(address) as channel:
        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        try:
            stub.GetClusterId(gcs_service_pb2.GetClusterIdRequest(), timeout=timeout_s, metadata=metadata)
        except grpc.RpcError as e:
            return REFUSED if e.code() == grpc.StatusCode.UNAUTHENTICATED else UNKNOWN
    return OPEN


def local_token() -> tuple[str | None, str]:
    """The token Ray would send from this process, and where it comes from (Ray's own order:
    ``RAY_AUTH_TOKEN``, then the file ``RAY_AUTH_TOKEN_PATH`` names, then ``~/.ray/auth_token``)."""
    from ray._raylet import AuthenticationTokenLoader

    if os.environ.get(AUTH_TOKEN):
        where = AUTH_TOKEN
    elif os.environ.get(AUTH_TOKEN_PATH):
        where = f"{AUTH_TOKEN_PATH}={os.environ[AUTH_TOKEN_PATH]}"
    else:
        where = os.path.join(os.path.expanduser("~"), ".ray", "auth_token")
    loader = AuthenticationTokenLoader.instance()
    loader.reset_cache()  # HOME or the variables may have changed since Ray last looked
    if not loader.has_token(ignore_auth_mode=True):
        return None, where
    return loader.get_raw_token(ignore_auth_mode=True), where


def follow_cluster_auth(address: str, timeout_s: float = AUTH_PROBE_S) -> str:
    """Make this process join the cluster at ``address`` in its authentication mode, before
    ``ray.init``; return the mode followed (:data:`OPEN`, :data:`TOKEN`, or :data:`UNKNOWN` when
    the GCS answered neither way, e.g. a Ray client ``ray://`` address).

    A cluster that requires a token is followed when ``RAY_AUTH_MODE`` is unset or ``token`` and
    this machine's token (:func:`local_token`) is one the cluster accepts: ``RAY_AUTH_MODE=token``
    is set here, as Ray itself does when it turns token mode on for a local cluster. Stops with a
    one-line :class:`ConfigError` when ``RAY_AUTH_MODE`` says otherwise, when there is no token,
    or when the cluster refuses it. An open cluster needs nothing, whatever the mode here."""
    if "://" in address:
        return UNKNOWN  # a Ray client server, not a GCS: Ray's client authenticates itself
    first = probe(address, None, timeout_s)
    if first != REFUSED:
        return first
    mode = os.environ.get(AUTH_MODE)
    if mode is not None and mode.lower() != "token":
        raise ConfigError(
            f"the Ray cluster at {address} requires token authentication, but {AUTH_MODE}={mode} here; unset "
            f"{AUTH_MODE} or set {AUTH_MODE}=token (with the cluster's token in ~/.ray/auth_token or {AUTH_TOKEN}), "
            f"or start the cluster with {AUTH_MODE}={mode} on every node")
    token, where = local_token()
    if token is None:
        raise ConfigError(
            f"the Ray cluster at {address} requires token authentication and this machine has no token ({where} "
            f"does not exist): copy the head's ~/.ray/auth_token there, or set {AUTH_TOKEN}=<`ray get-auth-token` "
            f"on the head>")
    if probe(address, token, timeout_s) == REFUSED:
        raise ConfigError(
            f"the Ray cluster at {address} requires token authentication and refuses this machine's token (from "
            f"{where}): it was started with another one; copy the head's ~/.ray/auth_token there, or set "
            f"{AUTH_TOKEN}=<`ray get-auth-token` on the head>")
    _enable_token_mode()
    print(f"[verl-digen] the Ray cluster at {address} requires token authentication: joining with the token "
          f"from {where} ({AUTH_MODE}=token)", flush=True)
    return TOKEN


def _enable_token_mode() -> None:
    """``RAY_AUTH_MODE=token`` for this process and the ones it starts; Ray caches its config per
    process, so it is read again (what Ray's own ``_enable_token_auth`` does)."""
    from ray._raylet import Config

    os.environ[AUTH_MODE] = "token"
    Config.initialize("")
