"""The reward server's bearer token: where it comes from (``TOKEN_ENV``), how a request head or
an ``Authorization`` header is checked against it, and the warning for a server that binds a
non-loopback interface without one."""

from __future__ import annotations

import hmac
import ipaddress
import logging

from verl_digen.rewards.serve.errors import RequestError

logger = logging.getLogger("verl_digen.rewards.serve")

TOKEN_ENV = "VERL_DIGEN_REWARD_TOKEN"


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (127.0.0.0/8, ::1)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _head_authorization(head: bytes) -> bytes | None:
    """The first ``Authorization`` header's value in a raw request head, if any."""
    for line in head.split(b"\r\n")[1:]:
        name, sep, value = line.partition(b":")
        if sep and name.strip().lower() == b"authorization":
            return value.strip()
    return None


def head_authorized(token: str | None, head: bytes) -> bool:
    """Whether a raw request head carries the token (always, when there is none)."""
    if not token:
        return True
    value = _head_authorization(head)
    if value is None:
        return False
    scheme, _, provided = value.partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(provided.strip(), token.encode())


def check_auth(token: str | None, header: str | None) -> None:
    """Refuse (401) a request whose ``Authorization`` header does not carry the token, if there is one."""
    if not token:
        return
    challenge = {"WWW-Authenticate": 'Bearer realm="verl-digen-reward"'}
    if not header:
        raise RequestError(401, "missing 'Authorization: Bearer <token>' header", headers=challenge)
    scheme, _, provided = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(provided.strip().encode(), token.encode()):
        raise RequestError(401, "invalid token", headers=challenge)


def warn_if_open(host: str, token: str | None) -> None:
    """Log a loud warning when ``host`` is not loopback and there is no token."""
    if not token and not is_loopback(host):
        logger.warning(
            "\n%s\nWARNING: reward server binding %s (not loopback) WITHOUT a token: anyone who can reach "
            "this port can use it. Set --token or %s.\n%s",
            "!" * 78,
            host,
            TOKEN_ENV,
            "!" * 78,
        )
