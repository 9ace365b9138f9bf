"""Bounds of the HTTP reward client and of the reward server (issue 18, items 2 and 3), and the
pickle protocol's restricted unpickler.

Every server is real and on 127.0.0.1 (the test's own ``http.server`` handlers where a server
must misbehave on purpose: redirect, oversize, drip; our FastAPI/uvicorn server otherwise);
every request and every wait is bounded in time.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import pickle
import socket
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from verl_digen.rewards import HttpReward, RewardServerError, UnsafePickleError, safe_dumps, safe_loads
from verl_digen.rewards.serve import MAX_JSON_DEPTH, RewardServer

from runs import JsonHandler, gate_reward, quantised_rand, serve

pytestmark = pytest.mark.usefixtures("loopback_no_proxy")
TIMEOUT = 10.0


# --------------------------------------------------------------------------- restricted unpickler


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def test_safe_loads_accepts_plain_data() -> None:
    value = {"scores": [0.5, 1, -2.0], "nested": ({"a": b"\xff\x00", "b": None, "c": True}, {1, 2}, frozenset({3})),
             "text": "é", "big": 10**30, "c": 1 + 2j}
    for protocol in range(0, pickle.HIGHEST_PROTOCOL + 1):
        assert safe_loads(pickle.dumps(value, protocol=protocol)) == value
    assert safe_loads(safe_dumps(value)) == value


@pytest.mark.parametrize(
    ("payload", "named"),
    [
        (_Evil(), "posix.system"),
        (np.ma.masked_array([1.0]), "numpy.ma"),
        (np.matrix([[1.0]]), "numpy.matrix"),
        (threading.Lock, "_thread"),
    ],
    ids=["os.system", "numpy-masked-array", "numpy-matrix", "a-class"],
)
def test_safe_loads_refuses_globals_by_name(payload, named: str) -> None:
    data = pickle.dumps({"scores": [payload]})
    with pytest.raises(UnsafePickleError, match=rf"refusing to unpickle global '{named}"):
        safe_loads(data)


@pytest.mark.parametrize("protocol", range(0, pickle.HIGHEST_PROTOCOL + 1))
def test_safe_loads_accepts_numpy_numbers_and_plain_arrays(protocol: int) -> None:
    """What scorer services answer (HPS: float32 scores) and clients send (Flow-GRPO's
    UnifiedReward client: prompts as a str array), pickled by numpy 2 (numpy._core), every protocol."""
    values = {"scores": np.array([0.25, 1.0], dtype=np.float32), "one": np.float32(0.5), "n": np.int64(3),
              "ok": np.bool_(True), "mask": np.array([[True], [False]]), "fortran": np.asfortranarray(np.eye(2, 3)),
              "prompts": np.array(["a cat", "a dog"]), "raw": np.array([b"x"]), "c": np.complex64(1 + 2j)}
    out = safe_loads(pickle.dumps(values, protocol=protocol))
    for key, value in values.items():
        assert type(out[key]) is type(value) and out[key].dtype == value.dtype, key
        assert np.array_equal(out[key], value), key


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (np.array([1, "a"], dtype=object), r"refusing numpy dtype dtype\('O'\)"),
        (np.zeros(2, dtype=[("x", "f4"), ("y", "i4")]), r"refusing numpy dtype"),
        (np.array([np.datetime64("2020-01-01")]), r"refusing numpy dtype"),
    ],
    ids=["object-array", "structured", "datetime"],
)
def test_safe_loads_refuses_numpy_data_that_is_not_plain(payload, message: str) -> None:
    for protocol in (2, 4, 5):
        with pytest.raises(UnsafePickleError, match=message):
            safe_loads(pickle.dumps({"scores": payload}, protocol=protocol))


def test_safe_loads_never_calls_the_array_class_itself() -> None:
    """``numpy.ndarray((10**12,))`` in a crafted pickle would allocate any shape: the class
    unpickles to a marker only ``_reconstruct`` takes."""
    crafted = b"\x80\x02cnumpy\nndarray\nJ\x00\x10\xa5\xd4\x85\x86q\x00R."  # ndarray((10**12,))
    with pytest.raises(UnsafePickleError):
        safe_loads(crafted)


def test_safe_loads_corrupt_is_named() -> None:
    with pytest.raises(UnsafePickleError, match="not a valid pickle"):
        safe_loads(pickle.dumps([1, 2, 3])[:-3])


# --------------------------------------------------------------------------- misbehaving servers


@dataclass
class Seen:
    requests: int = 0
    auth: list = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


class _Recorder(JsonHandler):
    """Records every request (and its Authorization header), answers a valid score."""

    state: Seen

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        with self.state.lock:
            self.state.requests += 1
            self.state.auth.append(self.headers.get("Authorization"))
        self.reply(200, {"rewards": [1.0]})

    do_GET = do_POST


class _Redirector(JsonHandler):
    state: dict

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.state["hits"] = self.state.get("hits", 0) + 1
        self.send_response(self.state["status"])
        self.send_header("Location", self.state["to"])
        self.send_header("Content-Length", "0")
        self.end_headers()


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
def test_client_never_follows_redirects_nor_leaks_the_token(status: int) -> None:
    thief = Seen()
    state: dict = {"status": status}
    with serve(_Recorder, thief) as thief_url, serve(_Redirector, state) as url:
        state["to"] = thief_url + "/steal"
        reward = HttpReward(url + "/score", token="s3cret", max_retries=3, backoff_s=0.01, timeout_s=TIMEOUT)
        with pytest.raises(RewardServerError, match=rf"answered HTTP {status} redirecting to .*/steal.*not followed"):
            reward(quantised_rand(1, 3, 4, 4), ["a"])
        assert state.get("hits") == 1  # asked once: a redirect is not retried
    assert thief.requests == 0 and thief.auth == []  # the redirect target never heard from us


class _Big(JsonHandler):
    """Answers ``size`` bytes of a JSON-looking body, with or without a Content-Length."""

    state: dict

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        size, declared = self.state["size"], self.state["declared"]
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        if declared:
            self.send_header("Content-Length", str(size))
        else:
            self.send_header("Connection", "close")
        self.end_headers()
        chunk = b" " * 65536
        sent = 0
        try:
            while sent < size:
                self.wfile.write(chunk)
                sent += len(chunk)
            with self.state["lock"]:
                self.state["sent_all"] += 1
        except (BrokenPipeError, ConnectionResetError):  # the client stopped reading: what we want
            pass


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "streamed"])
def test_client_caps_the_response_size(declared: bool) -> None:
    state = {"size": 64 * 1024 * 1024, "declared": declared, "sent_all": 0, "lock": threading.Lock()}
    with serve(_Big, state) as url:
        reward = HttpReward(url, max_response_mb=1, max_retries=2, backoff_s=0.01, timeout_s=TIMEOUT)
        with pytest.raises(RewardServerError, match=r"answered with .*\d+ bytes, above the limit"):
            reward(quantised_rand(1, 3, 4, 4), ["a"])
    assert state["sent_all"] == 0  # the client hung up long before 64 MiB


class _Drip(JsonHandler):
    """Sends a valid header, then one byte of the body every 0.1 s for ~15 s."""

    state: dict

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        body = b'{"rewards": [1.0]}'.rjust(150)
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            for byte in body:
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
                time.sleep(0.1)
        except (BrokenPipeError, ConnectionResetError):
            pass


def test_client_deadline_is_total_not_per_read() -> None:
    with serve(_Drip, {}) as url:
        # Each byte arrives well within 0.5 s (a per-read timeout would never fire), the whole
        # answer would take 15 s: the 0.5 s deadline per attempt must cut both attempts short.
        reward = HttpReward(url, timeout_s=0.5, max_retries=2, backoff_s=0.01)
        start = time.monotonic()
        with pytest.raises(RewardServerError, match=r"unreachable after 2 attempts: timed out.*timeout_s=0.5 s"):
            reward(quantised_rand(1, 3, 4, 4), ["a"])
        elapsed = time.monotonic() - start
    assert elapsed < 10.0, elapsed  # 2 x 0.5 s (+ slack on a loaded machine), never 15 s


class _EvilPickle(JsonHandler):
    state: dict

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.reply(200, pickle.dumps({"scores": [_Evil()]}))


class _NumpyPickle(JsonHandler):
    state: dict

    def do_POST(self) -> None:
        request = pickle.loads(self.rfile.read(int(self.headers["Content-Length"])))
        n = len(request["prompts"])
        scores = self.state["scores"](n)
        self.reply(200, pickle.dumps({"scores": scores}))


@pytest.mark.parametrize("make", [lambda n: [np.float32(0.25)] * n, lambda n: np.full(n, 0.25, dtype=np.float32)],
                         ids=["float32-scalars", "float32-array"])
def test_client_reads_a_pickle_servers_numpy_scores(make) -> None:
    """HPS's scorer service answers numpy float32 scores; veRL-Omni's client reads them, so does ours."""
    with serve(_NumpyPickle, {"scores": make}) as url:
        reward = HttpReward(url, protocol="pickle", timeout_s=TIMEOUT, backoff_s=0.01)
        assert reward(quantised_rand(2, 3, 4, 4), ["a", "b"]).tolist() == [0.25, 0.25]


class _PickleTraceback(JsonHandler):
    state: dict

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        trace = "Traceback (most recent call last):\n" + "  File \"app.py\", line 1, in score\n" * 40
        self.reply(500, pickle.dumps({"error": trace + "KeyError: 'meta_datas'"}))


def test_a_pickled_error_body_is_shown_as_its_text_with_the_exception() -> None:
    """flow_grpo's reward-server apps answer a failure with a pickled ``{"error": traceback}``."""
    with serve(_PickleTraceback, {}) as url:
        reward = HttpReward(url, protocol="pickle", timeout_s=TIMEOUT, max_retries=1, backoff_s=0.01)
        with pytest.raises(RewardServerError, match=r"(?s)HTTP 500 .*KeyError: 'meta_datas'") as info:
            reward(quantised_rand(1, 3, 4, 4), ["a"])
    assert "\\x80" not in str(info.value) and "\x80" not in str(info.value)


def test_client_refuses_a_pickle_answer_that_is_not_plain_data() -> None:
    with serve(_EvilPickle, {}) as url:
        reward = HttpReward(url, protocol="pickle", timeout_s=TIMEOUT, backoff_s=0.01)
        with pytest.raises(RewardServerError, match=r"malformed response: refusing to unpickle global 'posix.system'"):
            reward(quantised_rand(1, 3, 4, 4), ["a"])


# --------------------------------------------------------------------------- server limits


def _raw(url: str, head: bytes, body: bytes = b"", timeout: float = TIMEOUT) -> tuple[int, dict]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(head + body)
        response = http.client.HTTPResponse(sock)
        response.begin()
        assert response.getheader("Content-Type", "").startswith("application/json")
        return response.status, json.loads(response.read())


def _post_head(length: str | list[str], extra: str = "") -> bytes:
    lengths = [length] if isinstance(length, str) else length
    lines = "".join(f"Content-Length: {v}\r\n" for v in lengths)
    return f"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{extra}{lines}\r\n".encode()


def _score_body(n: int = 1, size: int = 4) -> bytes:
    from verl_digen.rewards import encode_images_png_b64

    return json.dumps({"prompts": ["p"] * n, "images": encode_images_png_b64(quantised_rand(n, 3, size, size))}).encode()


def test_server_strict_content_length() -> None:
    body = _score_body()
    with RewardServer("brightness", port=0) as srv:
        status, data = _raw(srv.url, _post_head("1_0"), body)
        assert status == 400 and "invalid Content-Length '1_0'" in data["error"]
        status, data = _raw(srv.url, _post_head([str(len(body))] * 2), body)
        assert status == 400 and "2 Content-Length headers" in data["error"]
        status, data = _raw(srv.url, _post_head([str(len(body)), "5"]), body)
        assert status == 400 and "Content-Length" in data["error"]
        status, data = _raw(srv.url, _post_head("+12"), body)
        assert status == 400
        status, data = _raw(srv.url, _post_head(str(len(body))), body)  # and it still serves
        assert status == 200 and len(data["rewards"]) == 1


def test_server_malformed_http_is_a_json_400() -> None:
    with RewardServer("brightness", port=0) as srv:
        status, data = _raw(srv.url, b"POST /score HTTP/1.1\r\nHost x\r\n\r\n")
        assert status == 400 and "malformed HTTP request" in data["error"]


def test_server_deep_json_is_400_not_500() -> None:
    with RewardServer("brightness", port=0) as srv:
        for depth in (MAX_JSON_DEPTH + 1, 100_000):
            body = b"[" * depth + b"]" * depth
            status, data = _raw(srv.url, _post_head(str(len(body))), body)
            assert status == 400 and f"deeper than {MAX_JSON_DEPTH}" in data["error"]
        # brackets inside strings do not count
        body = json.dumps({"prompts": ["[" * 5000], "images": [], "metadata": None}).encode()
        status, data = _raw(srv.url, _post_head(str(len(body))), body)
        assert status == 400 and "got 1 prompts but 0 images" in data["error"]


@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE", "PATCH", "OPTIONS"])
def test_server_json_error_for_every_method(method: str) -> None:
    with RewardServer("brightness", port=0) as srv:
        for path, status in (("/score", 405), ("/nowhere", 404)):
            if method == "GET" and path == "/score":
                status = 405
            head = f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n".encode()
            got, data = _raw(srv.url, head)
            assert got == status and isinstance(data["error"], str) and data["error"]


def test_server_per_request_pixel_budget_is_413() -> None:
    with RewardServer("brightness", port=0, max_request_pixels=3 * 16 * 16, max_decode_pixels=3 * 16 * 16) as srv:
        ok = HttpReward(srv.url, batch_size=3, timeout_s=TIMEOUT)(quantised_rand(3, 3, 16, 16), list("abc"))
        assert ok.shape == (3,)
        over = r"HTTP 413.*1024 pixels, above the server's per-request budget of 768 \(--max-request-pixels\)"
        with pytest.raises(RewardServerError, match=over):
            HttpReward(srv.url, batch_size=4, timeout_s=TIMEOUT)(quantised_rand(4, 3, 16, 16), list("abcd"))


def test_server_global_decode_budget_makes_concurrent_requests_wait_then_503() -> None:
    gate = gate_reward()
    budget = 2 * 16 * 16  # one 2-image request fills it
    with RewardServer(gate, port=0, max_request_pixels=budget, max_decode_pixels=budget, decode_wait_s=0.5) as srv:
        images = quantised_rand(2, 3, 16, 16)
        results: dict[str, object] = {}

        def first() -> None:
            results["first"] = HttpReward(srv.url, timeout_s=TIMEOUT)(images, ["a", "b"])

        thread = threading.Thread(target=first)
        thread.start()
        assert gate.entered.wait(TIMEOUT)  # the first request holds the whole budget, inside the reward
        body = _score_body(1, size=16)
        start = time.monotonic()
        status, data = _raw(srv.url, _post_head(str(len(body))), body)
        waited = time.monotonic() - start
        assert status == 503 and "decode budget of 512 pixels stayed full" in data["error"]
        assert "--max-decode-pixels" in data["error"]  # the message names the option that raises it
        assert 0.4 < waited < 5.0  # it waited decode_wait_s for room, then gave up
        # A waiting request gets its turn as soon as the budget frees up.
        second: dict[str, object] = {}
        waiter = threading.Thread(
            target=lambda: second.update(r=HttpReward(srv.url, timeout_s=TIMEOUT, max_retries=5, backoff_s=0.2)(
                images, ["c", "d"]))
        )
        waiter.start()
        time.sleep(0.2)
        gate.release.set()
        thread.join(TIMEOUT)
        waiter.join(TIMEOUT)
        torch.testing.assert_close(results["first"], images.mean(dim=(1, 2, 3)))
        torch.testing.assert_close(second["r"], images.mean(dim=(1, 2, 3)))


def test_server_slow_client_does_not_block_another_and_is_cut_at_the_deadline() -> None:
    with RewardServer("brightness", port=0, read_timeout_s=3.0, decode_threads=1) as srv:
        host, port = srv.url.removeprefix("http://").rsplit(":", 1)
        body = _score_body()
        with socket.create_connection((host, int(port)), timeout=TIMEOUT) as slow:
            slow.sendall(_post_head(str(len(body))) + body[:10])  # then drips: one byte per 0.3 s
            start = time.monotonic()
            # Meanwhile another client is served at once.
            images = quantised_rand(2, 3, 8, 8)
            torch.testing.assert_close(HttpReward(srv.url, timeout_s=TIMEOUT)(images, ["a", "b"]),
                                       images.mean(dim=(1, 2, 3)))
            assert time.monotonic() - start < 2.5  # before the slow request's 3 s deadline
            response = http.client.HTTPResponse(slow)
            status = None
            for byte in body[10:60]:
                try:
                    slow.sendall(bytes([byte]))
                except OSError:
                    break
                time.sleep(0.3)
                ready = __import__("select").select([slow], [], [], 0)[0]
                if ready:
                    break
            response.begin()
            status, data = response.status, json.loads(response.read())
            held = time.monotonic() - start
        assert status == 408 and "did not arrive within 3 s" in data["error"]
        assert held < 9.0  # a total deadline, although every byte came within 0.3 s (50 bytes: 15 s)


def test_server_dripping_head_is_cut_at_the_deadline() -> None:
    with RewardServer("brightness", port=0, read_timeout_s=0.5) as srv:
        host, port = srv.url.removeprefix("http://").rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=TIMEOUT) as sock:
            start = time.monotonic()
            answer = b""
            for byte in b"POST /score HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100:
                try:
                    sock.sendall(bytes([byte]))
                except OSError:
                    break
                time.sleep(0.05)  # every byte well within the deadline; the whole head: 6.5 s
                if __import__("select").select([sock], [], [], 0)[0]:
                    answer = sock.recv(4096)
                    break
            held = time.monotonic() - start
        assert answer.startswith(b"HTTP/1.1 408") and b"request head did not arrive within 0.5 s" in answer
        assert held < 3.0


def test_server_bounds_connections_with_a_json_503() -> None:
    """Two connection budgets (issue: 64 idle sockets made every request get 503 for 60 s).
    Connections that have not sent a request head yet no longer count against
    ``max_connections``: with 3 idle sockets and max_connections=3 a request is still served;
    those that have (here: keep-alive connections, no token configured) do, and the next one
    over the cap gets the JSON 503. One idle socket over ``max_unauthenticated_connections``
    closes the oldest idle one with a JSON 503 (the test before the two budgets expected a 503
    for the request after 3 idle sockets)."""
    with RewardServer("brightness", port=0, max_connections=3, max_unauthenticated_connections=4) as srv:
        host, port = srv.url.removeprefix("http://").rsplit(":", 1)
        body = _score_body()
        idle = [socket.create_connection((host, int(port)), timeout=TIMEOUT) for _ in range(3)]
        kept: list[http.client.HTTPConnection] = []
        try:
            status, data = _raw(srv.url, _post_head(str(len(body))), body)
            assert status == 200 and len(data["rewards"]) == 1  # idle sockets do not starve it
            for _ in range(3):  # three connections that sent a request, kept alive (uvicorn: 5 s)
                conn = http.client.HTTPConnection(host, int(port), timeout=TIMEOUT)
                conn.request("POST", "/score", body=body, headers={"Content-Type": "application/json"})
                response = conn.getresponse()
                assert response.status == 200, response.read()
                response.read()
                kept.append(conn)
            status, data = _raw(srv.url, _post_head(str(len(body))), body)
            assert status == 503 and "more than 3 authenticated connections (--max-connections)" in data["error"]
            for _ in range(2):  # a fourth idle socket fits; a fifth closes the oldest
                idle.append(socket.create_connection((host, int(port)), timeout=TIMEOUT))
            answer = http.client.HTTPResponse(idle[0])  # the oldest idle one is closed with a 503
            answer.begin()
            assert answer.status == 503
            assert "more than 4 connections have not authenticated (--max-unauthenticated-connections)" in json.loads(
                answer.read())["error"]
        finally:
            for sock in idle:
                sock.close()
            for conn in kept:
                conn.close()
        deadline = time.monotonic() + TIMEOUT
        while True:  # the server notices the closed keep-alive connections
            status, data = _raw(srv.url, _post_head(str(len(body))), body)
            if status == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert status == 200


class _GenEvalServices(JsonHandler):
    """The two GenEval apps users run, as they read a request: the GenEval scorer service reads
    ``payload["metadata"]["meta_datas"]`` and ``only_strict`` beside them; flow_grpo's
    reward-server app reads top-level ``meta_datas`` and ``only_strict``; both answer ``scores``."""

    state: dict

    def do_POST(self) -> None:
        data = pickle.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.state["shape"] == "service":
            records, strict = data["metadata"]["meta_datas"], data["metadata"]["only_strict"]
        else:
            records, strict = data["meta_datas"], data["only_strict"]
        self.state["seen"].append((records, strict))
        self.reply(200, pickle.dumps({"scores": [float(len(r["tag"])) for r in records]}))


@pytest.mark.parametrize("shape", ["service", "reward-server"])
def test_our_pickle_client_talks_to_both_geneval_apps(shape: str) -> None:
    records = [{"tag": "colors", "prompt": "a red cat", "include": []}, {"tag": "position", "prompt": "x", "include": []}]
    state = {"shape": shape, "seen": []}
    with serve(_GenEvalServices, state) as url:
        reward = HttpReward(url, protocol="pickle", timeout_s=TIMEOUT, extra_fields={"only_strict": False})
        scores = reward(quantised_rand(2, 3, 4, 4), ["a red cat", "x"], records)
    assert scores.tolist() == [6.0, 8.0] and state["seen"] == [(records, False)]
    with pytest.raises(ValueError, match="metadata_format"):
        HttpReward("http://h:1", protocol="pickle", metadata_format="dict")


class _DeqaApp(JsonHandler):
    state: dict

    def do_POST(self) -> None:
        data = pickle.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.reply(200, pickle.dumps({"outputs": [0.5] * len(data["images"])}))


def test_our_pickle_client_reads_the_deqa_apps_outputs() -> None:
    with serve(_DeqaApp, {}) as url:
        assert HttpReward(url, protocol="pickle", timeout_s=TIMEOUT)(quantised_rand(2, 3, 4, 4), ["a", "b"]).tolist() == [0.5, 0.5]


GENEVAL_TAGS = ["single_object", "two_object", "counting", "colors", "position", "color_attr"]


class _GenEvalAnswers(JsonHandler):
    """reward-server's GenEval app's answer, shaped as its ``compute_geneval`` builds it: per
    sample ``scores``, ``rewards`` (correct), ``strict_rewards``; per tag in ``group_rewards`` /
    ``group_strict_rewards`` a value for every sample, -10.0 where the sample has another tag."""

    state: dict

    def do_POST(self) -> None:
        data = pickle.loads(self.rfile.read(int(self.headers["Content-Length"])))
        records = data["meta_datas"]
        correct, strict = self.state["correct"][:len(records)], self.state["strict"][:len(records)]
        self.state["correct"], self.state["strict"] = self.state["correct"][len(records):], self.state["strict"][len(records):]
        groups = {k: [c if r["tag"] == k else -10.0 for r, c in zip(records, correct)] for k in GENEVAL_TAGS}
        strict_groups = {k: [s if r["tag"] == k else -10.0 for r, s in zip(records, strict)] for k in GENEVAL_TAGS}
        self.reply(200, pickle.dumps({"scores": [0.5 * c + 0.25 for c in correct], "rewards": correct,
                                      "strict_rewards": strict, "group_rewards": groups,
                                      "group_strict_rewards": strict_groups}))


def test_our_client_reads_genevals_strict_and_group_answers_as_flow_grpo_names_them() -> None:
    """Per-sample ``accuracy``, ``strict_accuracy`` and ``<tag>_accuracy`` / ``<tag>_strict_accuracy``
    (NaN for samples of other tags), over request chunks; the scores stay ``scores``."""
    records = [{"tag": "colors", "prompt": "a"}, {"tag": "counting", "prompt": "b"}, {"tag": "colors", "prompt": "c"}]
    state = {"correct": [1.0, 0.0, 1.0], "strict": [0.0, 0.0, 1.0]}
    with serve(_GenEvalAnswers, state) as url:
        reward = HttpReward(url, protocol="pickle", timeout_s=TIMEOUT, batch_size=2, extra_fields={"only_strict": False})
        scores = reward(quantised_rand(3, 3, 4, 4), ["a", "b", "c"], records)
        extras = reward.take_extras()
        assert reward.take_extras() == {}  # handed over once
    assert scores.tolist() == [0.75, 0.25, 0.75]
    got = {k: [None if math.isnan(x) else x for x in v.tolist()] for k, v in extras.items()}
    assert got["accuracy"] == [1.0, 0.0, 1.0] and got["strict_accuracy"] == [0.0, 0.0, 1.0]
    assert got["colors_accuracy"] == [1.0, None, 1.0] and got["colors_strict_accuracy"] == [0.0, None, 1.0]
    assert got["counting_accuracy"] == [None, 0.0, None] and got["position_accuracy"] == [None, None, None]
    assert set(got) == {"accuracy", "strict_accuracy", *(f"{t}_{m}" for t in GENEVAL_TAGS
                                                        for m in ("accuracy", "strict_accuracy"))}


def test_a_plain_servers_rewards_are_not_taken_for_genevals() -> None:
    with serve(_NumpyPickle, {"scores": lambda n: [0.5] * n}) as url:
        reward = HttpReward(url, protocol="pickle", timeout_s=TIMEOUT)
        reward(quantised_rand(2, 3, 4, 4), ["a", "b"])
        assert reward.take_extras() == {}
