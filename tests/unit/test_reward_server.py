"""Tests for verl_digen.rewards.serve: the reward server against the real HttpReward client.

Every server binds 127.0.0.1 on a free port and is stopped by its fixture; every request
has a timeout. A real CUDA out-of-memory answered as a 503: tests/gpu/test_reward_server_gpu.py."""

from __future__ import annotations

import asyncio
import base64
import http.client
import io
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from verl_digen.rewards.safe_pickle import safe_loads
from verl_digen.rewards import HttpReward, RewardFn, RewardServerError, build_reward, encode_images_png_b64
from verl_digen.rewards.serve import RewardServer, is_loopback
from verl_digen.sync import find_free_port

from runs import quantised_rand

TIMEOUT = 10.0
TOKEN = "s3cret-token"

pytestmark = pytest.mark.usefixtures("loopback_no_proxy")


@pytest.fixture
def server() -> Iterator[RewardServer]:
    """A brightness server, no token, small limits (4 KiB bodies, 4 images)."""
    with RewardServer("brightness", port=0, max_body_mb=4 / 1024, max_batch=4, read_timeout_s=5.0) as srv:
        yield srv


@pytest.fixture
def token_server() -> Iterator[RewardServer]:
    with RewardServer("brightness", port=0, token=TOKEN, read_timeout_s=5.0) as srv:
        yield srv


def raw_request(
    srv_or_url: RewardServer | str,
    method: str,
    path: str,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, Any], Any]:
    """One request with http.client (full control over headers); returns (status, json, headers)."""
    url = srv_or_url.url if isinstance(srv_or_url, RewardServer) else srv_or_url
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=TIMEOUT)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        response = conn.getresponse()
        payload = response.read()
        # an answer to a pickle request is a pickle (errors included)
        data = safe_loads(payload) if payload[:1] == b"\x80" else json.loads(payload)
        return response.status, data, response.msg  # header names case-insensitive
    finally:
        conn.close()


def score_body(n: int = 2, size: int = 4, seed: int = 0) -> tuple[bytes, torch.Tensor]:
    images = quantised_rand(n, 3, size, size, seed=seed)
    body = json.dumps({"prompts": [f"p{i}" for i in range(n)], "images": encode_images_png_b64(images)}).encode()
    return body, images


def post_json(srv: RewardServer, payload: Any, path: str = "/score", **headers: str) -> tuple[int, dict[str, Any]]:
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    status, data, _ = raw_request(srv, "POST", path, body, {"Content-Type": "application/json", **headers})
    return status, data


def assert_still_serving(srv: RewardServer, **headers: str) -> None:
    body, images = score_body(2, seed=123)
    status, data = post_json(srv, body, **headers)
    assert status == 200, data
    torch.testing.assert_close(torch.tensor(data["rewards"]), images.mean(dim=(1, 2, 3)))


# --------------------------------------------------------------------------- happy path


def test_round_trip_with_http_reward_equals_local_brightness(server: RewardServer) -> None:
    images = quantised_rand(7, 3, 8, 8, seed=1)
    prompts = [f"prompt {i}" for i in range(7)]
    remote = HttpReward(server.url + "/score", batch_size=3, timeout_s=TIMEOUT)(images, prompts)
    local = build_reward("brightness")(images, prompts)
    assert remote.dtype == torch.float32 and remote.shape == (7,)
    torch.testing.assert_close(remote, local)
    # "/" is accepted as well as "/score", and video goes frame by frame
    videos = quantised_rand(2, 3, 3, 6, 6, seed=2)
    remote_video = HttpReward(server.url, batch_size=4, timeout_s=TIMEOUT)(videos, ["a", "b"])
    torch.testing.assert_close(remote_video, build_reward("brightness")(videos, ["a", "b"]))


def test_health(server: RewardServer) -> None:
    status, data, _ = raw_request(server, "GET", "/health")
    assert (status, data) == (200, {"status": "ok", "reward": "brightness", "latency_s": 0.0})


def test_health_needs_no_token(token_server: RewardServer) -> None:
    status, data, _ = raw_request(token_server, "GET", "/health")
    assert (status, data) == (200, {"status": "ok", "reward": "brightness", "latency_s": 0.0})


def test_latency_s_holds_every_answer_and_overlaps_concurrent_requests() -> None:
    """--latency-s: a stand-in for a remote judge on its own GPU (benchmarks). Each answer comes
    no sooner than the latency after the request; three concurrent requests are all held at
    once (the server counts them), as a judge serving them together would; bad values refused."""
    import threading
    import time

    with RewardServer("brightness", latency_s=0.6) as srv:
        assert raw_request(srv, "GET", "/health")[1]["latency_s"] == 0.6
        body, images = score_body(2)
        t0 = time.monotonic()
        status, data = post_json(srv, body)
        assert status == 200 and time.monotonic() - t0 >= 0.6
        torch.testing.assert_close(torch.tensor(data["rewards"]), images.mean(dim=(1, 2, 3)))
        held, peak, lock = [0], [0], threading.Lock()
        real_sleep = asyncio.sleep

        async def counting_sleep(seconds: float, *args: Any) -> None:
            if seconds != 0.6:  # asyncio is shared: only the server's hold is counted
                return await real_sleep(seconds, *args)
            with lock:
                held[0] += 1
                peak[0] = max(peak[0], held[0])
            try:
                await real_sleep(seconds)
            finally:
                with lock:
                    held[0] -= 1

        import verl_digen.rewards.serve.app as serve_module

        original = serve_module.asyncio.sleep
        serve_module.asyncio.sleep = counting_sleep
        try:
            threads = [threading.Thread(target=post_json, args=(srv, body)) for _ in range(3)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(TIMEOUT)
        finally:
            serve_module.asyncio.sleep = original
        assert peak[0] == 3
    for bad in (-1.0, float("inf"), True):
        with pytest.raises(ValueError, match="latency_s must be a finite number >= 0"):
            RewardServer("brightness", latency_s=bad)


def test_empty_batch(server: RewardServer) -> None:
    assert post_json(server, {"prompts": [], "images": []}) == (200, {"rewards": []})


def test_embeds_a_reward_instance_and_context_manager() -> None:
    class Constant(RewardFn):
        name = "constant"

        def score_images(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
            return torch.full((images.shape[0],), 0.25)

    with RewardServer(Constant(), port=0) as srv:
        scores = HttpReward(srv.url, timeout_s=TIMEOUT)(quantised_rand(3, 3, 4, 4), ["a", "b", "c"])
        assert scores.tolist() == [0.25, 0.25, 0.25]
        assert raw_request(srv, "GET", "/health")[1]["reward"] == "constant"


# --------------------------------------------------------------------------- auth


def test_auth_rejects_missing_and_wrong_token(token_server: RewardServer) -> None:
    body, _ = score_body()
    status, data = post_json(token_server, body)
    assert status == 401 and "missing" in data["error"]
    status, data = post_json(token_server, body, Authorization="Bearer wrong")
    assert (status, data) == (401, {"error": "invalid token"})
    status, data = post_json(token_server, body, Authorization=TOKEN)  # no "Bearer" scheme
    assert status == 401
    _, _, headers = raw_request(token_server, "POST", "/score", body, {"Content-Type": "application/json"})
    assert headers.get("WWW-Authenticate", "").startswith("Bearer")
    assert_still_serving(token_server, Authorization=f"Bearer {TOKEN}")


@pytest.mark.parametrize("content_type", [None, "application/octet-stream", "application/x-pickle"])
def test_a_pickle_client_without_the_token_gets_a_401_it_can_unpickle(token_server: RewardServer,
                                                                       content_type: str | None) -> None:
    """Flow-GRPO's clients (requests: no Content-Type) and veRL-Omni's (aiohttp: octet-stream)
    unpickle every answer; the 401 comes before the body is read, so its protocol is taken from
    the Content-Type: missing or a pickle type, a pickle."""
    import pickle

    headers = {"Content-Type": content_type} if content_type else {}
    conn = http.client.HTTPConnection(token_server.host, token_server.port, timeout=TIMEOUT)
    try:
        conn.request("POST", "/", body=pickle.dumps({"images": [_jpeg(0)], "prompts": ["a"]}), headers=headers)
        response = conn.getresponse()
        status, payload = response.status, response.read()
    finally:
        conn.close()
    assert status == 401 and response.getheader("Content-Type") == "application/octet-stream"
    assert pickle.loads(payload) == {"error": "missing 'Authorization: Bearer <token>' header"}


def test_http_reward_with_right_token(token_server: RewardServer) -> None:
    images = quantised_rand(3, 3, 8, 8, seed=3)
    scores = HttpReward(token_server.url + "/score", token=TOKEN, timeout_s=TIMEOUT)(images, ["a", "b", "c"])
    torch.testing.assert_close(scores, images.mean(dim=(1, 2, 3)))


@pytest.mark.parametrize("token", [None, "wrong"])
def test_http_reward_with_wrong_token_fails_fast_without_retries(token_server: RewardServer, token: str | None) -> None:
    reward = HttpReward(token_server.url + "/score", token=token, timeout_s=TIMEOUT, max_retries=5, backoff_s=5.0)
    start = time.monotonic()
    with pytest.raises(RewardServerError, match=r"rejected the request: HTTP 401") as info:
        reward(quantised_rand(2, 3, 8, 8), ["a", "b"])
    assert time.monotonic() - start < 4.0  # one attempt: a retry would sleep backoff_s = 5 s
    assert token_server.url in str(info.value)


def test_is_loopback() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1") and is_loopback("127.1.2.3")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.1") and not is_loopback("reward-host")


def test_warns_loudly_without_token_on_non_loopback(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import verl_digen.rewards.serve.auth as serve

    caplog.set_level(logging.WARNING, logger="verl_digen.rewards.serve")
    RewardServer("brightness", port=0).stop()  # loopback: quiet
    RewardServer("brightness", port=0, token=TOKEN).stop()
    assert not caplog.records
    # Pretend 127.0.0.1 is a public interface (tests only ever bind loopback).
    monkeypatch.setattr(serve, "is_loopback", lambda host: False)
    RewardServer("brightness", port=0, token=TOKEN).stop()  # with a token: quiet
    assert not caplog.records
    RewardServer("brightness", port=0).stop()
    assert any("WITHOUT a token" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)


# --------------------------------------------------------------------------- limits


def test_content_length_over_limit_is_413_without_reading_the_body(server: RewardServer) -> None:
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=TIMEOUT) as sock:
        # Announce 10 MB but send no body at all: the answer must not wait for it.
        sock.sendall(
            b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 10000000\r\n\r\n"
        )
        start = time.monotonic()
        response = http.client.HTTPResponse(sock)
        response.begin()
        payload = json.loads(response.read())
        assert time.monotonic() - start < 20.0  # not the 60 s read timeout a wait for the body would take
    assert response.status == 413
    assert "10000000 bytes exceeds the server limit of 4096 bytes" in payload["error"]
    assert_still_serving(server)


def test_http_reward_over_body_limit_gets_413(server: RewardServer) -> None:
    images = quantised_rand(4, 3, 32, 32, seed=4)  # 4 noisy 32x32 PNGs: > 4 KiB of JSON
    with pytest.raises(RewardServerError, match=r"rejected the request: HTTP 413.*exceeds the server limit"):
        HttpReward(server.url, batch_size=4, timeout_s=TIMEOUT, backoff_s=0.01)(images, list("abcd"))
    assert_still_serving(server)


def test_batch_over_max_is_413(server: RewardServer) -> None:
    body, _ = score_body(5, size=1)
    status, data = post_json(server, body)
    assert status == 413 and "batch of 5 images exceeds the server limit of 4" in data["error"]
    assert_still_serving(server)


def test_missing_content_length_is_411(server: RewardServer) -> None:
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=TIMEOUT) as sock:
        sock.sendall(b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\r\n")
        response = http.client.HTTPResponse(sock)
        response.begin()
        payload = json.loads(response.read())
    assert response.status == 411 and "Content-Length" in payload["error"]
    assert_still_serving(server)


# --------------------------------------------------------------------------- malformed requests


def png_b64(array_hwc: Any, fmt: str = "PNG") -> str:
    buffer = io.BytesIO()
    Image.fromarray(array_hwc).save(buffer, format=fmt)
    return base64.b64encode(buffer.getvalue()).decode()


def _bad_requests() -> list[tuple[str, Any, str]]:
    import numpy as np

    good = png_b64(np.zeros((4, 4, 3), dtype=np.uint8))
    other_size = png_b64(np.zeros((5, 4, 3), dtype=np.uint8))
    jpeg = png_b64(np.zeros((4, 4, 3), dtype=np.uint8), fmt="JPEG")
    truncated = base64.b64encode(base64.b64decode(good)[:30]).decode()
    return [
        ("bad_json", b'{"prompts": ["a"], "images": [', "not valid JSON"),
        ("not_utf8", b"\xff\xfe\x00", "not UTF-8"),
        ("not_object", [1, 2], "must be a JSON object"),
        ("missing_images", {"prompts": ["a"]}, "missing field(s) ['images']"),
        ("prompts_not_list", {"prompts": "a", "images": [good]}, "'prompts' must be a list"),
        ("mismatched_lengths", {"prompts": ["a", "b"], "images": [good]}, "got 2 prompts but 1 images"),
        ("prompt_not_str", {"prompts": [3], "images": [good]}, "prompt 0 must be a string"),
        ("image_not_str", {"prompts": ["a"], "images": [3]}, "image 0 must be a base64 string"),
        ("bad_base64", {"prompts": ["a", "b"], "images": [good, "not base64!!"]}, "image 1 is not valid base64"),
        ("not_png", {"prompts": ["a"], "images": [jpeg]}, "image 0 is not a PNG"),
        ("truncated_png", {"prompts": ["a"], "images": [truncated]}, "image 0 could not be decoded as PNG"),
        ("size_mismatch", {"prompts": ["a", "b"], "images": [good, other_size]}, "image 1 has size"),
    ]


@pytest.mark.parametrize(("case", "payload", "message"), _bad_requests(), ids=[c[0] for c in _bad_requests()])
def test_malformed_request_is_400_and_server_keeps_serving(
    server: RewardServer, case: str, payload: Any, message: str
) -> None:
    status, data = post_json(server, payload)
    assert status == 400, data
    assert message in data["error"]
    assert_still_serving(server)


def test_image_over_pixel_limit_is_400() -> None:
    import numpy as np

    with RewardServer("brightness", port=0, max_image_pixels=100) as srv:
        status, data = post_json(srv, {"prompts": ["a"], "images": [png_b64(np.zeros((11, 10, 3), dtype=np.uint8))]})
        assert status == 400 and "above the limit of 100 pixels" in data["error"]


def test_unknown_path_and_wrong_method(server: RewardServer) -> None:
    body, _ = score_body()
    assert post_json(server, body, path="/nope")[0] == 404
    status, data, headers = raw_request(server, "GET", "/score")
    assert status == 405 and headers.get("Allow") == "POST"
    assert raw_request(server, "PUT", "/score", body)[0] == 405
    assert post_json(server, body, path="/score?x=1")[0] == 200  # query strings are ignored
    assert_still_serving(server)


# --------------------------------------------------------------------------- reward failures


class _Flaky(RewardFn):
    name = "flaky"

    def __init__(self) -> None:
        self.mode: Any = "raise"
        self.calls = 0

    def score_images(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        self.calls += 1
        if isinstance(self.mode, BaseException):
            raise self.mode
        if self.mode == "raise":
            raise RuntimeError("model exploded")
        if self.mode == "nan":
            return torch.full((images.shape[0],), float("nan"))
        return torch.ones(images.shape[0])


def test_reward_failure_is_422_answered_once_and_server_recovers() -> None:
    """A reward that raises, or returns non-finite values, fails the same way on every retry:
    422 (no client retries it: Flow-GRPO's retry 500 only, veRL-Omni's and ours 408/429/5xx), so
    no client loops on it; the reward is called once per request and the server keeps serving."""
    flaky = _Flaky()
    with RewardServer(flaky, port=0) as srv:
        body, _ = score_body()
        status, data = post_json(srv, body)
        assert status == 422 and data["error"] == "reward 'flaky' failed: RuntimeError: model exploded"
        flaky.mode = "nan"
        status, data = post_json(srv, body)
        assert status == 422 and "non-finite" in data["error"]
        flaky.calls = 0
        with pytest.raises(RewardServerError, match=r"rejected the request: HTTP 422.*non-finite"):
            HttpReward(srv.url, max_retries=5, backoff_s=0.01, timeout_s=TIMEOUT)(quantised_rand(1, 3, 4, 4), ["a"])
        assert flaky.calls == 1  # not retried
        flaky.mode = "ok"
        assert post_json(srv, body) == (200, {"rewards": [1.0, 1.0]})


@pytest.mark.parametrize("error", [MemoryError("no room"), torch.cuda.OutOfMemoryError("CUDA out of memory")])
def test_reward_out_of_memory_is_a_retryable_503(error: BaseException) -> None:
    """Running out of memory passes (another request finishes): 503 with Retry-After, which
    veRL-Omni's client and ours retry."""
    flaky = _Flaky()
    flaky.mode = error
    with RewardServer(flaky, port=0) as srv:
        status, data, headers = raw_request(srv, "POST", "/score", score_body()[0], {"Content-Type": "application/json"})
        assert status == 503 and data["error"].startswith("reward 'flaky' ran out of memory") and headers["Retry-After"]


def test_flow_grpo_client_does_not_loop_on_a_failing_reward() -> None:
    """Flow-GRPO's clients mount ``Retry(total=1000, backoff_factor=1, status_forcelist=[500])``
    and post a pickle with no Content-Type: a reward that always fails is answered once, with a
    pickled error it can read."""
    import pickle

    import requests
    from requests.adapters import HTTPAdapter, Retry

    flaky = _Flaky()
    with RewardServer(flaky, port=0) as srv, requests.Session() as sess:
        sess.mount("http://", HTTPAdapter(max_retries=Retry(total=1000, backoff_factor=1, status_forcelist=[500],
                                                            allowed_methods=False)))
        response = sess.post(srv.url, data=pickle.dumps({"images": [_jpeg(0)], "prompts": ["a"]}), timeout=TIMEOUT)
        assert response.status_code == 422 and flaky.calls == 1
        assert safe_loads(response.content) == {"error": "reward 'flaky' failed: RuntimeError: model exploded"}


# --------------------------------------------------------------------------- CLI


@pytest.fixture
def cli_server() -> Iterator[tuple[subprocess.Popen, str]]:
    port = find_free_port("127.0.0.1")
    env = {
        **os.environ,
        "VERL_DIGEN_REWARD_TOKEN": TOKEN,
        "NO_PROXY": "127.0.0.1,localhost",
        "no_proxy": "127.0.0.1,localhost",
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "verl_digen.rewards.serve", "--reward", "brightness", "--port", str(port)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        yield proc, f"http://127.0.0.1:{port}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def test_cli_serves_and_terminates_cleanly(cli_server: tuple[subprocess.Popen, str]) -> None:
    proc, url = cli_server
    deadline = time.monotonic() + 25.0
    while True:  # wait for the server to come up (importing torch takes a few seconds)
        assert proc.poll() is None, f"server exited early: {proc.communicate(timeout=5)}"
        try:
            status, data, _ = raw_request(url, "GET", "/health")
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    assert (status, data) == (200, {"status": "ok", "reward": "brightness", "latency_s": 0.0})

    images = quantised_rand(3, 3, 8, 8, seed=5)
    scores = HttpReward(url + "/score", token=TOKEN, timeout_s=TIMEOUT)(images, ["a", "b", "c"])
    torch.testing.assert_close(scores, images.mean(dim=(1, 2, 3)))
    with pytest.raises(RewardServerError, match="HTTP 401"):  # the token came from the env var
        HttpReward(url + "/score", timeout_s=TIMEOUT)(images, ["a", "b", "c"])

    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=15)
    assert proc.returncode == 0, stderr
    assert "received SIGTERM, shutting down" in stderr and "reward server stopped" in stderr


def test_cli_rejects_bad_reward_kwargs() -> None:
    from verl_digen.rewards.serve import main

    with pytest.raises(SystemExit):
        main(["--reward", "brightness", "--reward-kwargs", "[1]"])
    assert main(["--reward", "jpeg_compressibility", "--reward-kwargs", '{"qualty": 3}', "--port", "0"]) == 2


# --------------------------------------------------------------------------- protocols, metadata, clips


class _EchoGroundTruth(RewardFn):
    name = "echo_gt"

    def __init__(self) -> None:
        self.seen: list = []

    def score_images(self, images: torch.Tensor, prompts: list[str], metadata) -> torch.Tensor:
        self.seen.append((tuple(images.shape), list(prompts), [dict(m) for m in metadata]))
        return torch.tensor([float(m["ground_truth"]) for m in metadata]) + images.flatten(1).mean(dim=1)


@pytest.mark.parametrize("protocol", ["json", "pickle"])
def test_protocols_carry_metadata_to_the_served_reward(protocol: str) -> None:
    echo = _EchoGroundTruth()
    with RewardServer(echo, port=0) as srv:
        images = quantised_rand(3, 3, 8, 8, seed=9)
        records = [{"ground_truth": 1, "tag": "a"}, {"ground_truth": 2}, {"ground_truth": 3, "nested": {"k": [1]}}]
        reward = HttpReward(srv.url, protocol=protocol, batch_size=2, timeout_s=TIMEOUT)
        scores = reward(images, ["p0", "p1", "p2"], records)
    expected = torch.tensor([1.0, 2.0, 3.0]) + images.mean(dim=(1, 2, 3))
    # JSON sends lossless PNG; the pickle protocol sends JPEG (quality 95), as flow_grpo does
    torch.testing.assert_close(scores, expected, atol=0 if protocol == "json" else 0.02, rtol=0)
    assert [seen[2] for seen in echo.seen] == [records[:2], records[2:]]
    assert [seen[1] for seen in echo.seen] == [["p0", "p1"], ["p2"]]


def test_clip_level_video_reaches_a_clip_reward() -> None:
    """temporal_smoothness needs whole clips: video='clip' sends them; frame by frame cannot work."""
    with RewardServer("temporal_smoothness", port=0) as srv:
        videos = quantised_rand(2, 3, 4, 8, 8, seed=10)
        videos[0] = videos[0, :, :1]  # a still clip: smoothness 0
        for protocol in ("json", "pickle"):
            clip = HttpReward(srv.url, video="clip", fps=8, protocol=protocol, timeout_s=TIMEOUT)(videos, ["a", "b"])
            if protocol == "json":  # lossless PNG frames: exactly the local score
                torch.testing.assert_close(clip, build_reward("temporal_smoothness")(videos, ["a", "b"]), atol=0, rtol=0)
            assert clip[0] == 0.0 and clip[1] < -0.05  # JPEG frames: the still clip is still still
        with pytest.raises(RewardServerError, match=r"rejected the request: HTTP 422.*scores videos"):
            HttpReward(srv.url, video="frames", timeout_s=TIMEOUT, max_retries=1)(videos, ["a", "b"])


def test_clip_fps_reaches_the_reward_as_metadata() -> None:
    echo = _EchoGroundTruth()
    echo.supports_video = True
    with RewardServer(echo, port=0) as srv:
        videos = quantised_rand(1, 3, 2, 4, 4)
        HttpReward(srv.url, video="clip", fps=12.5, timeout_s=TIMEOUT)(videos, ["a"], [{"ground_truth": 0}])
    (shape, _, records), = echo.seen
    assert shape == (1, 3, 2, 4, 4) and records == [{"ground_truth": 0, "fps": 12.5}]


def test_pickle_can_be_switched_off_and_unsafe_pickles_are_refused() -> None:
    import pickle

    with RewardServer("brightness", port=0, allow_pickle=False) as srv:
        with pytest.raises(RewardServerError, match=r"HTTP 415.*does not accept pickle"):
            HttpReward(srv.url, protocol="pickle", timeout_s=TIMEOUT)(quantised_rand(1, 3, 4, 4), ["a"])
    with RewardServer("brightness", port=0) as srv:
        class Evil:
            def __reduce__(self):
                return (os.system, ("true",))

        body = pickle.dumps({"prompts": ["a"], "images": [Evil()]})
        status, data, _ = raw_request(srv, "POST", "/score", body, {"Content-Type": "application/octet-stream"})
        assert status == 400 and "refusing to unpickle global 'posix.system'" in data["error"]


# --------------------------------------------------------------------------- other systems' clients

def _jpeg(seed: int) -> bytes:
    from PIL import Image

    array = (np.random.default_rng(seed).random((8, 8, 3)) * 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="JPEG", quality=95)
    return buf.getvalue()


def _post_pickle(srv: RewardServer, payload: dict) -> tuple[int, Any]:
    """As those clients post: a pickle body, no Content-Type (requests) or octet-stream (aiohttp)."""
    import pickle

    status, data, _ = raw_request(srv, "POST", "/", pickle.dumps(payload), {})
    return status, data


def test_our_server_answers_verl_omni_and_flow_grpo_clients_as_they_send() -> None:
    """Request payloads shaped exactly as the clients build them: veRL-Omni's HTTP scorer client
    (one JPEG, its ground truth as the prompt, ``metadata: {}``), Flow-GRPO's GenEval client (no
    prompts; ``meta_datas`` records and ``only_strict``), its UnifiedReward client (prompts as a
    numpy str array; it reads ``outputs``)."""
    import numpy as np

    with RewardServer("brightness", port=0) as srv:
        status, data = _post_pickle(srv, {"images": [_jpeg(0)], "prompts": ["OPEN"], "metadata": {}})
        assert status == 200 and len(data["scores"]) == 1 and 0.0 <= float(data["scores"][0]) <= 1.0
        records = [{"tag": "single_object", "prompt": "a photo of a cat", "include": [{"class": "cat", "count": 1}]},
                   {"tag": "two_object", "prompt": "a cat and a dog", "include": [{"class": "cat", "count": 1}]}]
        status, data = _post_pickle(srv, {"images": [_jpeg(1), _jpeg(2)], "meta_datas": records, "only_strict": False})
        assert status == 200 and len(data["scores"]) == 2
        status, data = _post_pickle(srv, {"images": [_jpeg(1), _jpeg(2)],
                                          "prompts": np.array(["a cat", "a dog"])})
        assert status == 200 and data["outputs"] == data["scores"] and len(data["outputs"]) == 2
        # the GenEval scorer service's shape, which our client sends by default, is read too
        status, data = _post_pickle(srv, {"images": [_jpeg(1)], "prompts": ["a"],
                                          "metadata": {"meta_datas": [records[0]], "only_strict": True}})
        assert status == 200 and len(data["scores"]) == 1


def test_the_records_reach_the_reward_whichever_shape_carries_them() -> None:
    from verl_digen.rewards.serve import parse_score_request
    import pickle

    limits = {"max_batch": 8, "max_image_pixels": 1 << 20, "max_request_pixels": 1 << 22}
    record = {"prompt": "a cat", "ground_truth": "cat"}
    for payload in ({"images": [_jpeg(0)], "prompts": ["p"], "metadata": [record]},
                    {"images": [_jpeg(0)], "prompts": ["p"], "meta_datas": [record]},
                    {"images": [_jpeg(0)], "prompts": ["p"], "metadata": {"meta_datas": [record], "only_strict": 1}}):
        assert parse_score_request(pickle.dumps(payload), "pickle", **limits).metadata == [record]
    no_records = parse_score_request(pickle.dumps({"images": [_jpeg(0)], "prompts": ["p"], "metadata": {}}), "pickle",
                                     **limits)
    assert no_records.metadata == [{}]
    from verl_digen.rewards.serve import RequestError

    with pytest.raises(RequestError, match=r"'metadata' must be a list of 1 records, \{\} or \{'meta_datas'"):
        parse_score_request(pickle.dumps({"images": [_jpeg(0)], "prompts": ["p"], "metadata": {"x": 1}}), "pickle",
                            **limits)


class _PromptLength(RewardFn):
    """A reward that reads its prompts (as most do): the prompt's length."""

    name = "prompt_length"

    def score_images(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        return torch.tensor([float(len(p)) for p in prompts])


def test_deqa_clients_images_only_request_is_scored_by_a_reward_that_ignores_prompts() -> None:
    """Flow-GRPO's DeQA client sends ``{"images": [<JPEG>, ...]}`` alone and reads ``outputs``: a
    reward that declares it reads no prompts scores it; one that reads them refuses it with a
    400, pickled, naming the reward and what it needs."""
    with RewardServer("brightness", port=0) as srv:
        status, data = _post_pickle(srv, {"images": [_jpeg(3), _jpeg(4)]})
        decoded = torch.stack([torch.from_numpy(np.array(Image.open(io.BytesIO(_jpeg(s))))) for s in (3, 4)])
        expected = decoded.permute(0, 3, 1, 2).float().div(255).mean(dim=(1, 2, 3))
        assert status == 200
        torch.testing.assert_close(torch.tensor(data["outputs"]), expected)
    with RewardServer(_PromptLength(), port=0) as srv:
        status, data = _post_pickle(srv, {"images": [_jpeg(3)]})
        assert status == 400
        assert data["error"].startswith("reward 'prompt_length' reads prompts and the request has none")


def test_which_rewards_read_prompts() -> None:
    """``reads_prompts`` is False exactly on the rewards that score the pixels alone; a weighted
    reward reads them when any component does."""
    from verl_digen.rewards.base import reward_class

    assert RewardFn.reads_prompts is True
    for name in ("brightness", "colorfulness", "jpeg_compressibility", "jpeg_incompressibility", "aesthetic",
                 "temporal_smoothness"):
        assert reward_class(name).reads_prompts is False, name
    for name in ("clip_score", "pickscore", "hpsv2", "imagereward", "ocr", "digit_classifier", "vlm_judge", "http",
                 "custom"):
        assert reward_class(name).reads_prompts is True, name
    pixels_only = build_reward("weighted", components=[{"name": "brightness"}, {"name": "colorfulness"}])
    assert pixels_only.reads_prompts is False
    assert build_reward("weighted", components=[{"name": "brightness"}, (_PromptLength(), 1.0)]).reads_prompts is True
