"""Serve any registered reward over HTTP (FastAPI on uvicorn), in the protocols of :class:`HttpReward`.

Run a heavy reward (a large scoring model, a reward with conflicting dependencies) in its
own process, environment or machine, and point the trainer at it with the ``http`` reward::

    VERL_DIGEN_REWARD_TOKEN=s3cret python -m verl_digen.rewards.serve \\
        --reward clip_score --reward-kwargs '{"model_path": "/ckpt/clip"}' --port 8000

Protocols (see :mod:`verl_digen.rewards.http_client`)::

    POST / or /score   Content-Type: application/json
                       {"prompts": [str, ...], "images": [<base64 PNG>, ...] | "videos": [{"frames": [...], "fps": f}],
                        "metadata": [{...}, ...]}                               (metadata optional)
                       -> 200 {"rewards": [float, ...]}
    POST / or /score   Content-Type: application/octet-stream (or no type, a pickle body)
                       pickle {"images": [<JPEG/PNG bytes>, ...] | "videos": [...], "prompts": [...],
                               "metadata" or "meta_datas": [...]}
                       -> 200 pickle {"scores": [float, ...], "rewards": [...], "outputs": [...]}

The pickle form also takes what the flow_grpo / veRL-Omni clients send: ``metadata`` as ``{}``
(veRL-Omni's HTTP scorer client) or ``{"meta_datas": [...]}`` (the GenEval service's shape);
``prompts`` as a numpy ``str`` array (Flow-GRPO's UnifiedReward client) or left out when each
record carries its ``prompt`` (Flow-GRPO's GenEval client), or left out altogether (its DeQA
client) when the served reward reads no prompts (``RewardFn.reads_prompts``); the answer's
``outputs`` is what Flow-GRPO's UnifiedReward and DeQA clients read.
    GET  /health       -> 200 {"status": "ok", "reward": NAME}   (never needs the token)

Pickle bodies are read with the restricted unpickler (:mod:`verl_digen.rewards.safe_pickle`):
plain data only; ``allow_pickle=False`` (``--no-pickle``) refuses them.

Every error is an object ``{"error": "<message>"}``, whatever the method or status: JSON, or a
pickle when the request was one (those clients unpickle every answer):

* 400: body not JSON (or not a plain-data pickle) / not UTF-8 / nested deeper than
  ``MAX_JSON_DEPTH``; not an object; ``images`` missing, ``prompts`` missing (to a reward
  that reads them), either not a list; a prompt that is not a string; lengths that differ; an image that is not a string (bytes for pickle),
  not valid base64, not a PNG (JSON) / PNG or JPEG (pickle), undecodable, larger than
  ``max_image_pixels``, or of a different size than image 0; an invalid or duplicated
  ``Content-Length``; a malformed HTTP request.
* 401: token configured and the ``Authorization: Bearer`` header missing or wrong (answered
  before the body: a pickle when the Content-Type is missing or a pickle type).
* 404: unknown path. 405: a method other than POST on ``/`` or ``/score`` (other than GET on ``/health``).
* 408: the request (head and body) did not arrive within ``read_timeout_s`` in total.
* 411: no Content-Length (chunked bodies are not accepted).
* 413: Content-Length above ``max_body_mb`` (answered before reading the body), more samples
  than ``max_batch``, more pixels than ``max_request_pixels`` in one request, or one sample
  (an image, a clip) of more pixels than ``score_chunk_pixels``.
* 415: a pickle body when pickle is off.
* 422: the reward raised (message: exception type and text), or returned a wrong shape or
  non-finite values: it would again, so no client retries it (Flow-GRPO's clients retry 500
  up to 1000 times). 500: a bug in the server's own handling only.
* 503: the reward ran out of memory (``Retry-After``); more than ``max_connections`` authenticated connections; a new connection while
  ``max_unauthenticated_connections`` others have not authenticated (the oldest of those is
  closed with this answer); the body budget (``max_body_total_mb`` of bodies across concurrent
  requests) or the decode budget (``max_decode_pixels``) stayed full for ``decode_wait_s``
  (``Retry-After`` is set; clients retry 503). Every message names the option that raises it.

Memory: a request's body is held (counted against ``max_body_total_mb``) while it is read and
parsed; its images are then decoded straight into one uint8 ``[N, F, H, W, 3]`` array (3 bytes
per pixel, counted against ``max_decode_pixels``; PIL's decoded image, 4 bytes per pixel of
the image being decoded, is copied out in bands), and converted to float32 for the reward a
chunk of at most ``score_chunk_pixels`` at a time, under the reward lock (so one float chunk
exists at a time). Peak above idle, worst case: 3 B x ``max_decode_pixels`` + 4 B x
min(``max_decode_pixels``, ``decode_threads`` x ``max_image_pixels``) + 12 B x
``score_chunk_pixels`` + 3 x ``max_body_total_mb`` (body, text and parsed strings), plus the
reward's own working memory: 928 MiB with the defaults (``docs/reward_server.md``; measured by
``benchmarks/reward_server_memory.py``).

Bounds: the event loop reads requests without a thread per connection; parsing, decoding and
scoring run on ``decode_threads`` threads; reward calls are serialised with a lock (rewards
are not assumed thread-safe), so one slow client never blocks another. Connections that have
not authenticated (no request head with the token yet; without a token: no request head yet)
have a budget of their own, so idle sockets never starve token-bearing clients. Binds
127.0.0.1 by default; binding another interface without a token logs a loud warning.

The parts: :mod:`~verl_digen.rewards.serve.app` (the FastAPI app and :class:`RewardServer`),
:mod:`~verl_digen.rewards.serve.protocol` (the JSON and pickle protocols: a body to a
:class:`ScoreRequest`), :mod:`~verl_digen.rewards.serve.images` (measuring, decoding and converting
its images), :mod:`~verl_digen.rewards.serve.scoring` (the reward's calls under its lock),
:mod:`~verl_digen.rewards.serve.limits` (defaults, budgets, body size and time limits),
:mod:`~verl_digen.rewards.serve.connection` (connection budgets, the head's deadline),
:mod:`~verl_digen.rewards.serve.auth` (the token), :mod:`~verl_digen.rewards.serve.errors`
(:class:`RequestError`) and :mod:`~verl_digen.rewards.serve.cli` (the command line).
"""

from __future__ import annotations

from verl_digen.rewards.serve.app import RewardServer
from verl_digen.rewards.serve.auth import TOKEN_ENV, is_loopback
from verl_digen.rewards.serve.cli import _parse_args, main, reward_kwargs_on_device
from verl_digen.rewards.serve.errors import RequestError
from verl_digen.rewards.serve.images import ScoreRequest, decode_request, to_float
from verl_digen.rewards.serve.limits import (
    DEFAULT_DECODE_THREADS,
    DEFAULT_DECODE_WAIT_S,
    DEFAULT_MAX_BODY_MB,
    DEFAULT_MAX_BODY_TOTAL_MB,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_DECODE_PIXELS,
    DEFAULT_MAX_IMAGE_PIXELS,
    DEFAULT_MAX_REQUEST_PIXELS,
    DEFAULT_MAX_UNAUTHENTICATED_CONNECTIONS,
    DEFAULT_READ_TIMEOUT_S,
    DEFAULT_SCORE_CHUNK_PIXELS,
    Budget,
    memory_budget_bytes,
)
from verl_digen.rewards.serve.protocol import (
    HEALTH_PATH,
    MAX_JSON_DEPTH,
    SCORE_PATHS,
    json_depth_exceeds,
    parse_score_request,
)

__all__ = ["RewardServer", "RequestError", "TOKEN_ENV", "MAX_JSON_DEPTH", "memory_budget_bytes", "main"]
