"""The reward server's memory and connection budgets (issue: 64 black 1024x1024 PNGs took the
server from 251 MB to 2.0 GB, four at once to 3.9 GB; idle sockets starved token-bearing
clients; the read timeout was not a CLI option).

Servers bind 127.0.0.1 on a free port; subprocess servers are stopped by PID in ``finally``;
every request and wait is bounded in time. The memory helpers are those of
``benchmarks/reward_server_memory.py``, the command behind the numbers in docs/reward_server.md.
"""

from __future__ import annotations

import base64
import concurrent.futures
import http.client
import io
import json
import random
import socket
import sys
import threading
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from verl_digen.rewards import HttpReward, RewardFn, RewardServerError, build_reward
from verl_digen.rewards import serve as serve_module
from verl_digen.rewards.serve import (
    RewardServer,
    ScoreRequest,
    decode_request,
    json_depth_exceeds,
    memory_budget_bytes,
    to_float,
)
from verl_digen.rewards.serve import images as serve_images
from verl_digen.rewards.serve import protocol as serve_protocol

from runs import gate_reward, quantised_rand

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from reward_server_memory import (  # noqa: E402
    black_png_request,
    post,
    read_status_kib,
    reset_peak,
    start_server,
    stop_server,
)

pytestmark = pytest.mark.usefixtures("loopback_no_proxy")
TIMEOUT = 10.0
TOKEN = "memory-test-token"
GIB = 1 << 30


# --------------------------------------------------------------------------- the request


def test_four_concurrent_requests_of_64_black_1024px_pngs_stay_within_the_memory_budget() -> None:
    """The issue's case with the default options: 4 x 64 black 1024x1024 PNGs (a 261 KiB body
    each) at once. Before: 3.7 GiB above idle. Now the peak above idle (VmHWM after a reset at
    idle) stays under the documented budget, itself under 1 GiB; every request is scored or
    refused with a 503 naming the option, and at least one is scored."""
    budget = memory_budget_bytes()
    assert budget < GIB
    body = black_png_request(64, 1024)
    assert len(body) < 300 * 1024
    proc, url, log = start_server([])
    try:
        idle_kib = read_status_kib(proc.pid, "VmRSS")
        reset_peak(proc.pid)  # where the kernel refuses, VmHWM still counts from start-up: stricter
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda _: post(url, body, timeout_s=120.0), range(4)))
        peak_kib = read_status_kib(proc.pid, "VmHWM")
        assert proc.poll() is None
    finally:
        stop_server(proc, log)
    above = (peak_kib - idle_kib) * 1024
    statuses = [status for status, _ in answers]
    assert set(statuses) <= {200, 503}, answers
    assert statuses.count(200) >= 1, answers
    for status, answer in answers:
        if status == 200:
            assert answer == {"rewards": [0.0] * 64}
        else:
            assert "stayed full" in answer["error"] and "--max-decode-pixels" in answer["error"], answer
    assert above < budget, f"peak {above / 2**20:.0f} MiB above idle; budget {budget / 2**20:.0f} MiB"


def test_memory_budget_formula_and_defaults() -> None:
    mib = 1 << 20
    # 3 B x 96 Mi + 4 B x min(96 Mi, 4 x 16 Mi) + 12 B x 16 Mi + 3 x 64 MiB
    assert memory_budget_bytes() == (288 + 256 + 192 + 192) * mib
    assert memory_budget_bytes(max_decode_pixels=8 * mib, score_chunk_pixels=mib, max_body_total_mb=1) == (
        24 + 32 + 12 + 3) * mib
    with pytest.raises(ValueError, match="max_body_mb=65.0 exceeds max_body_total_mb=64"):
        RewardServer("brightness", port=0, max_body_mb=65.0)


# --------------------------------------------------------------------------- decoding


def _encoded(image: Image.Image, fmt: str = "PNG") -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt)
    return out.getvalue()


def _modes() -> list[tuple[str, Image.Image, str]]:
    rng = np.random.default_rng(0)
    rgb = Image.fromarray(rng.integers(0, 256, (37, 700, 3), dtype=np.uint8), "RGB")  # 700 wide: several bands
    palette = rgb.convert("P", palette=Image.Palette.ADAPTIVE, colors=17)
    palette.info["transparency"] = 3
    return [
        ("RGB", rgb, "PNG"),
        ("L", rgb.convert("L"), "PNG"),
        ("1", rgb.convert("1"), "PNG"),
        ("P", palette, "PNG"),
        ("RGBA", rgb.convert("RGBA"), "PNG"),
        ("LA", rgb.convert("LA"), "PNG"),
        ("I;16", Image.fromarray(rng.integers(0, 65536, (37, 700), dtype=np.uint16)), "PNG"),
        ("JPEG", rgb, "JPEG"),
        ("CMYK JPEG", rgb.convert("CMYK"), "JPEG"),
    ]


@pytest.mark.parametrize("name, image, fmt", _modes(), ids=[m[0] for m in _modes()])
def test_decoding_in_bands_equals_pils_whole_image_conversion(
    name: str, image: Image.Image, fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    raw = _encoded(image, fmt)
    with Image.open(io.BytesIO(raw)) as reference:
        expected = np.asarray(reference.convert("RGB"))  # what the server did before
    monkeypatch.setattr(serve_images, "_BAND_PIXELS", 700 * 5)  # 5-row bands, the last one short
    request = ScoreRequest("pickle", ["a", "b"], [{}, {}], [[raw], [raw]], False, 2 * 37 * 700, (1, 37, 700),
                           2 * len(raw))
    pixels = decode_request(request)
    assert pixels.dtype == np.uint8 and pixels.shape == (2, 1, 37, 700, 3)
    np.testing.assert_array_equal(pixels[0, 0], expected)
    np.testing.assert_array_equal(pixels[1, 0], expected)
    assert request.items == [[b""], [b""]]  # the encoded bytes are let go as they are decoded


def test_to_float_layouts_match_the_old_whole_request_conversion() -> None:
    pixels = np.random.default_rng(1).integers(0, 256, (2, 3, 5, 7, 3), dtype=np.uint8)  # [N, F, H, W, 3]
    old = torch.from_numpy(pixels).float().div_(255.0)  # the server's former conversion
    images = to_float(pixels[:, :1], video=False)
    assert images.shape == (2, 3, 5, 7) and images.is_contiguous()
    assert torch.equal(images, old[:, 0].permute(0, 3, 1, 2))
    clips = to_float(pixels, video=True)
    assert clips.shape == (2, 3, 3, 5, 7) and clips.is_contiguous()
    assert torch.equal(clips, old.permute(0, 4, 1, 2, 3))
    frames_first = to_float(pixels, video=True, frames_first=True)
    assert torch.equal(frames_first, clips)
    # RewardFn's frame-by-frame flattening of this view is a view too: no second float copy
    flat = frames_first.permute(0, 2, 1, 3, 4).reshape(6, 3, 5, 7)
    assert flat.data_ptr() == frames_first.data_ptr()


class _Recorder(RewardFn):
    """Brightness that records the shape of every batch it is given."""

    name = "recorder"

    def __init__(self) -> None:
        self.shapes: list[tuple[int, ...]] = []

    def score_images(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        self.shapes.append(tuple(images.shape))
        return images.mean(dim=(1, 2, 3))


def test_requests_are_scored_in_chunks_of_score_chunk_pixels() -> None:
    recorder = _Recorder()
    chunk = 3 * 16 * 16  # three 16x16 images per reward call
    with RewardServer(recorder, port=0, score_chunk_pixels=chunk) as srv:
        images = quantised_rand(7, 3, 16, 16, seed=3)
        scores = HttpReward(srv.url, batch_size=7, timeout_s=TIMEOUT)(images, [str(i) for i in range(7)])
        torch.testing.assert_close(scores, images.mean(dim=(1, 2, 3)), atol=0, rtol=0)
        assert recorder.shapes == [(3, 3, 16, 16), (3, 3, 16, 16), (1, 3, 16, 16)]
        # clips of 2 frames to a frame-by-frame reward: one clip (512 pixels) per call
        recorder.shapes.clear()
        clips = quantised_rand(3, 3, 2, 16, 16, seed=4)
        scores = HttpReward(srv.url, video="clip", timeout_s=TIMEOUT)(clips, ["a", "b", "c"])
        torch.testing.assert_close(scores, build_reward("brightness")(clips, ["a", "b", "c"]), atol=0, rtol=0)
        assert recorder.shapes == [(2, 3, 16, 16)] * 3
        # a sample above the chunk: 413 naming the option
        with pytest.raises(RewardServerError, match=r"HTTP 413.*above the 768 pixels .*--score-chunk-pixels"):
            HttpReward(srv.url, video="clip", timeout_s=TIMEOUT)(quantised_rand(1, 3, 4, 16, 16), ["d"])


# --------------------------------------------------------------------------- the body budget


def test_body_budget_makes_a_request_wait_then_503_naming_the_option() -> None:
    gate = gate_reward()
    body = black_png_request(4, 64)
    encoded = sum(len(base64.b64decode(png)) for png in json.loads(body)["images"])
    total_mb = (len(body) + encoded // 2) / 2**20  # room for one body, not for a second next to 4 images
    with RewardServer(gate, port=0, max_body_mb=total_mb, max_body_total_mb=total_mb, decode_wait_s=0.5) as srv:
        first: dict[str, object] = {}
        thread = threading.Thread(target=lambda: first.update(answer=post(srv.url, body, timeout_s=TIMEOUT)))
        thread.start()
        try:
            assert gate.entered.wait(TIMEOUT)  # the first request's encoded images are held while it is scored
            status, answer = post(srv.url, body, timeout_s=TIMEOUT)
            assert status == 503
            assert "request-body budget of" in answer["error"] and "--max-body-total-mb" in answer["error"]
        finally:
            gate.release.set()
            thread.join(TIMEOUT)
        assert first["answer"] == (200, {"rewards": [0.0] * 4})
        assert post(srv.url, body, timeout_s=TIMEOUT) == (200, {"rewards": [0.0] * 4})  # all released


# --------------------------------------------------------------------------- JSON depth


def _reference_depth(body: bytes) -> tuple[int, bool]:
    """Deepest nesting outside strings, byte by byte; and whether a backslash sits outside strings
    (invalid JSON, which json.loads rejects, so only the rest is compared)."""
    depth = deepest = 0
    in_string = escaped = stray = False
    for ch in body.decode("latin-1"):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch == "\\":
            stray = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest, stray


@pytest.mark.parametrize("chunk", [1 << 20, 1, 2, 3, 7])
def test_json_depth_matches_a_byte_by_byte_reference(chunk: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(serve_protocol, "_DEPTH_CHUNK", chunk)  # small chunks: state carried across boundaries
    rng = random.Random(chunk)
    alphabet = [b"[", b"]", b"{", b"}", b'"', b"\\", b"a", b","]
    compared = 0
    for _ in range(1500):
        weights = [rng.randint(0, 6) for _ in alphabet]
        weights[6] += 1
        body = b"".join(rng.choices(alphabet, weights, k=rng.randint(0, 40)))
        deepest, stray = _reference_depth(body)
        if stray:
            continue
        compared += 1
        assert not json_depth_exceeds(body, deepest), body
        if deepest > 0:
            assert json_depth_exceeds(body, deepest - 1), body
    assert compared > 500
    nested = json.dumps({"a": ["[[[", '\\"[{', {"b": [[[]]]}], "c": "\\\\"}).encode()
    assert not json_depth_exceeds(nested, 6) and json_depth_exceeds(nested, 5)  # { [ { [ [ [ outside strings


def test_json_depth_scratch_memory_is_bounded() -> None:
    """A 32 MiB body of base64-like strings: the depth scan's scratch memory stays a few MiB (the
    regular expression it replaces took 8 bytes per body byte: 256 MiB here)."""
    body = json.dumps({"prompts": ["[" * 1000] * 8, "images": ["QUJD" * (1 << 20)] * 8}).encode()
    tracemalloc.start()
    try:
        assert not json_depth_exceeds(body, 32)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 * 2**20, peak


# --------------------------------------------------------------------------- connections


def test_idle_unauthenticated_sockets_do_not_starve_token_bearing_requests() -> None:
    """64 sockets that never send a byte (the default max_unauthenticated_connections) and a 65th:
    the oldest idle one is closed with a JSON 503, the others stay open, and a request with the
    token (its connection closes the next-oldest idle one) is served at once; without the token
    it is still a 401. Before: every new connection got 503 until the idle ones timed out (60 s)."""
    with RewardServer("brightness", port=0, token=TOKEN) as srv:
        host, port = srv.url.removeprefix("http://").rsplit(":", 1)
        idle = [socket.create_connection((host, int(port)), timeout=TIMEOUT) for _ in range(65)]
        try:
            answer = http.client.HTTPResponse(idle[0])
            answer.begin()
            assert answer.status == 503
            assert "more than 64 connections have not authenticated" in json.loads(answer.read())["error"]
            for sock in idle[1:]:  # the others are still open: nothing was sent to them
                sock.setblocking(False)
                with pytest.raises(BlockingIOError):
                    sock.recv(1)
                sock.setblocking(True)
            images = quantised_rand(2, 3, 8, 8, seed=6)
            scores = HttpReward(srv.url, token=TOKEN, timeout_s=TIMEOUT, max_retries=1)(images, ["a", "b"])
            torch.testing.assert_close(scores, images.mean(dim=(1, 2, 3)))
            with pytest.raises(RewardServerError, match="HTTP 401"):
                HttpReward(srv.url, timeout_s=TIMEOUT, max_retries=1)(images, ["a", "b"])
        finally:
            for sock in idle:
                sock.close()


# --------------------------------------------------------------------------- --read-timeout-s


def test_read_timeout_is_a_cli_option_and_is_honoured() -> None:
    help_text = _cli_help()
    assert "--read-timeout-s" in help_text and "408" in help_text
    proc, url, log = start_server(["--read-timeout-s", "1"], token=TOKEN)
    try:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        # Two stalled connections at once, each on its own deadline: a body that stops arriving
        # and a head that never comes. Both cut after 1 s (the default, 60 s, would outlast
        # these sockets' 20 s).
        with socket.create_connection((host, int(port)), timeout=20) as sock, \
                socket.create_connection((host, int(port)), timeout=20) as silent:
            start = time.monotonic()
            sock.sendall(
                f"POST /score HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompts\"".encode()
            )
            response = http.client.HTTPResponse(sock)
            response.begin()
            held = time.monotonic() - start
            assert response.status == 408
            assert "did not arrive within 1 s (--read-timeout-s)" in json.loads(response.read())["error"]
            answer = silent.recv(4096)  # a head that never comes: the same deadline
        assert held < 15  # bounded generously: cut at the option's deadline, far before the default's
        assert answer.startswith(b"HTTP/1.1 408") and b"request head did not arrive within 1 s" in answer
        assert post(url, black_png_request(1, 8), token=TOKEN, timeout_s=TIMEOUT) == (200, {"rewards": [0.0]})
    finally:
        stop_server(proc, log)


def _cli_help() -> str:
    out = io.StringIO()
    stdout, sys.stdout = sys.stdout, out
    try:
        with pytest.raises(SystemExit):
            serve_module._parse_args(["--help"])
    finally:
        sys.stdout = stdout
    return out.getvalue()
