"""Plain helpers the tests share (fixtures live in conftest.py).

- end-to-end runs: run the real job quietly, read what it wrote; the Ray instance tests share;
- tiny models: the sample spec each tiny arch is tested at, and the reference Euler sampler;
- process groups: :func:`run_ranks` runs a function on N ranks of a gloo (or NCCL) group, forked
  from a forkserver that imported torch and veRL once (NCCL ranks are spawned);
- local fake servers: random PNG-exact images, a quiet JSON request handler and a context
  manager that serves it on 127.0.0.1 (a free port for a client to fail on:
  ``verl_digen.sync.find_free_port("127.0.0.1")``).

The trainer and config modules (Ray, Hydra) are imported by the run helpers only, so that the
model and reward tests do not import them.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import sys
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import ray_zygote  # the standard library only
import torch
from suite_paths import SEARCH_PATH  # the standard library only

from verl_digen.models.base import DiffusionAdapter, SampleSpec

if TYPE_CHECKING:
    from verl_digen.trainer.loop import RunResult

# ---------------------------------------------------------------------- end-to-end runs

QUIET = ["digen.progress_bar=false", "trainer.logger=[]"]


def run_config(tmp_path, name: str, *overrides: str):
    """The main job's config with quiet output into ``tmp_path / name``."""
    from verl_digen.config.compose import compose_config

    return compose_config(QUIET + [f"digen.output_dir={tmp_path / name}", *overrides])


def assert_same_final_weights(a: RunResult, b: RunResult, *, atol: float, rtol: float) -> None:
    """Two runs saved (``digen.save_final_weights``) the same tensors, equal within the tolerance."""
    from safetensors.torch import load_file

    wa, wb = load_file(a.extra["final_weights"]), load_file(b.extra["final_weights"])
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], atol=atol, rtol=rtol, msg=lambda m, k=k: f"{k}: {m}")


def run(tmp_path, name: str, *overrides: str) -> RunResult:
    from verl_digen.trainer.loop import run_training

    return run_training(run_config(tmp_path, name, *overrides))


# One local Ray instance for the tests that share it (the ``shared_ray`` fixture): a run finds Ray
# initialised, reuses it and leaves it running (``runtime.init_ray`` returns False, ``release``
# kills only the run's actors). Every other test runs with no Ray up (conftest's
# ``pytest_runtest_setup`` stops it, and starts it again for the next test that asks for it), as a
# run that starts and stops its own expects.
SHARED_RAY_CPUS = 8  # logical slots for the largest pool set of any test that shares it
_shared_ray: bool | None = None  # None: never started; then whether it runs


def shared_ray_up() -> None:
    """Start the shared local Ray instance unless it runs: workers on ``SHARED_RAY_CPUS`` CPU
    slots, their output not sent to the driver, the suite's folders on their path (actors defined
    in a test module: ``suite_paths.SEARCH_PATH``). Call after ``VERL_DIGEN_CACHE`` is set: workers
    inherit the environment of now."""
    import ray

    global _shared_ray, _shared_runtime_env
    if _shared_ray:
        return
    assert not ray.is_initialized(), "a test left its own Ray instance running"
    pythonpath = os.pathsep.join(p for p in (*SEARCH_PATH, os.environ.get("PYTHONPATH", "")) if p)
    runtime_env = {"env_vars": {"PYTHONPATH": pythonpath}}
    zygote = _zygote_env(pythonpath)
    if zygote:
        runtime_env = {**zygote, "env_vars": {**runtime_env["env_vars"], **zygote["env_vars"]}}
    with ray_zygote.as_ray_python(_zygote[0].socket_dir) if zygote else contextlib.nullcontext():
        ray.init(num_cpus=SHARED_RAY_CPUS, include_dashboard=False, log_to_driver=False, runtime_env=runtime_env)
    _shared_ray, _shared_runtime_env = True, runtime_env


_shared_runtime_env: dict | None = None  # the shared instance's job runtime environment


def shared_ray_driver_env(cwd: str, *, main_ppo: bool = False) -> dict[str, str]:
    """The environment that makes a driver this test starts as a subprocess (``verl_digen.main``,
    ``main_ppo``) join the shared Ray instance instead of starting its own, as a user's job joins a
    running cluster (``RAY_ADDRESS``): the ~10 s of a new instance and a fresh worker's imports (a
    TaskRunner, every worker) are not paid again. Its workers get the shared instance's runtime
    environment (the zygote, the suite's folders on their path), as the injected job config of a Ray job
    submission that Ray merges with the driver's own, and start in ``cwd``, the driver's directory,
    as the workers of an instance that driver had started would (``ray_zygote.CWD_ENV``).

    ``main_ppo``: for ``verl.trainer.main_ppo``, whose config sets the runtime environment's
    ``py_executable`` itself (null: Ray's default), which Ray would not merge with the job's: the
    job config leaves it out and :func:`shared_ray_main_ppo_overrides` gives it in veRL's key.

    Empty (the driver starts its own instance) when the shared instance is not up (a test that
    did not ask for the ``shared_ray`` fixture) or has no zygote (``DIGEN_TEST_ZYGOTE=0``)."""
    import ray

    if not _joinable():
        return {}
    env = {k: v for k, v in (_shared_runtime_env or {}).items() if not (main_ppo and k == "py_executable")}
    env["env_vars"] = {**env.get("env_vars", {}), ray_zygote.CWD_ENV: str(cwd)}
    return {"RAY_ADDRESS": ray.get_runtime_context().gcs_address,
            "RAY_JOB_CONFIG_JSON_ENV_VAR": json.dumps({"runtime_env": env})}


def shared_ray_main_ppo_overrides() -> list[str]:
    """With :func:`shared_ray_driver_env` ``(main_ppo=True)``: the zygote's worker command in
    ``main_ppo``'s own key (``ray_kwargs.ray_init.runtime_env.py_executable``); none when that
    environment is empty."""
    if not _joinable():
        return []
    return [f"ray_kwargs.ray_init.runtime_env.py_executable='{_shared_runtime_env['py_executable']}'"]


def _joinable() -> bool:
    """Whether a driver subprocess can join the shared instance with its workers from the zygote."""
    import ray

    return bool(_shared_ray) and ray.is_initialized() and _zygote is not None


_zygote: tuple[Any, dict, dict] | None = None  # (the zygote's Popen, its runtime-env fields, its environment)


_ZYGOTE_ENV_IGNORED = ("PYTHONPATH", "PYTHONBREAKPOINT", "PYTEST_CURRENT_TEST")


def _zygote_env(pythonpath: str) -> dict | None:
    """The runtime-env fields that start the shared instance's workers from the suite's zygote
    (``ray_zygote``: forked from an interpreter that imported torch, diffusers and peft once),
    starting it on first use with the workers' ``PYTHONPATH``; None with ``DIGEN_TEST_ZYGOTE=0``
    or off Linux."""
    global _zygote
    if os.environ.get("DIGEN_TEST_ZYGOTE", "1") == "0" or not sys.platform.startswith("linux"):
        return None
    # what the preloaded imports may read: not what pytest sets per test, ray.init sets here
    # (PYTHONBREAKPOINT, read when breakpoint() is called, and RAY_*: Ray is not preloaded) or the
    # zygote's start sets itself (PYTHONPATH)
    env = {k: v for k, v in os.environ.items() if k not in _ZYGOTE_ENV_IGNORED and not k.startswith("RAY_")}
    if _zygote is not None and (_zygote[0].poll() is not None or _zygote[2] != env):
        ray_zygote.stop(_zygote[0])  # gone, or started with another environment (imports read it)
        _zygote = None
    if _zygote is None:
        import atexit
        import tempfile

        saved = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = pythonpath  # the zygote's path is the workers' path
        try:
            _zygote = (*ray_zygote.start(tempfile.mkdtemp(prefix="digen_zygote_")), env)
        except RuntimeError as e:  # plain workers then (slower); test_ray_zygote_e2e.py fails on it
            print(f"[tests] warning: {e}; the shared Ray instance starts plain workers", file=sys.stderr, flush=True)
            return None
        finally:
            if saved is None:
                os.environ.pop("PYTHONPATH")
            else:
                os.environ["PYTHONPATH"] = saved
        atexit.register(ray_zygote.stop, _zygote[0])
    return _zygote[1]


def shared_ray_down() -> None:
    """Stop the shared Ray instance if it runs (a test about to start its own, or none)."""
    import ray

    global _shared_ray
    if _shared_ray:
        ray.shutdown()
        _shared_ray = False


def ray_auth_follows_env() -> bool:
    """Make this process's cached Ray auth mode the one ``RAY_AUTH_MODE`` now says; return whether
    it had to. Ray reads the mode into a per-process config (``ray.init`` re-reads it on connect),
    and a local ``ray.init`` starts its GCS with the environment as it is: a test that set
    ``RAY_AUTH_MODE=disabled`` for a run (monkeypatch undoes only the variable) would leave every
    later local ``ray.init`` of the worker with a token-mode GCS that its own driver cannot join
    ("Authentication token is missing or incorrect. Note: RAY_AUTH_MODE is currently 'disabled'")."""
    if "ray._raylet" not in sys.modules:
        return False
    from ray._raylet import AuthenticationMode, AuthenticationTokenLoader, Config, get_authentication_mode

    want_token = os.environ.get("RAY_AUTH_MODE", "disabled").lower() == "token"
    if (get_authentication_mode() == AuthenticationMode.TOKEN) == want_token:
        return False
    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()
    return True


def shared_ray_stopped() -> bool:
    """Whether the shared instance ran once and was stopped since (to start again on request)."""
    return _shared_ray is False


def _jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def timeline_records(output_dir: str) -> list[dict]:
    return _jsonl(os.path.join(output_dir, "timeline.jsonl"))


def metrics_lines(output_dir: str) -> list[dict]:
    return _jsonl(os.path.join(output_dir, "metrics.jsonl"))


# ---------------------------------------------------------------------- tiny models

PROMPTS = ["a photo of a cat", "a red cube on a table"]
# The size every tiny arch is tested at: 32x32 pixels (16x16 latents); videos have 5 frames.
SPECS = {
    "flux": SampleSpec(height=32, width=32),
    "sd3": SampleSpec(height=32, width=32),
    "qwen_image": SampleSpec(height=32, width=32),
    "wan": SampleSpec(height=32, width=32, num_frames=5),
    "hunyuan_video": SampleSpec(height=32, width=32, num_frames=5),
}
# What a batch of 2 decodes to at SPECS: [B, 3, H, W] images, [B, 3, F, H, W] videos.
PIXEL_SHAPE = {arch: (2, 3, 32, 32) if spec.num_frames == 1 else (2, 3, spec.num_frames, 32, 32)
               for arch, spec in SPECS.items()}


def euler_sample(
    adapter: DiffusionAdapter,
    prompts: list[str],
    spec: SampleSpec,
    num_steps: int,
    seed: int,
    negative_prompt: str | None = None,
) -> torch.Tensor:
    """The deterministic (ODE) sampler: x <- x + (sigma_next - sigma) * v, then decode."""
    batch = len(prompts)
    generator = torch.Generator().manual_seed(seed)
    cond = adapter.encode_prompts(prompts)
    negative = adapter.encode_prompts([negative_prompt]) if negative_prompt is not None else None
    latents = adapter.prepare_latents(batch, spec, generator)
    sigmas = adapter.sigmas(num_steps, spec)
    with torch.no_grad():
        for i in range(num_steps):
            velocity = adapter.predict_velocity(latents, sigmas[i].expand(batch), cond, spec, negative)
            latents = latents + (sigmas[i + 1] - sigmas[i]) * velocity
        return adapter.decode(latents, spec)


# ---------------------------------------------------------------------- local fake servers


def quantised_rand(*shape: int, seed: int = 0) -> torch.Tensor:
    """Random images whose values are exact multiples of 1/255 (survive PNG round trips)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, shape, generator=generator).float() / 255.0


class JsonHandler(http.server.BaseHTTPRequestHandler):
    """Base of the tests' fake servers: logs nothing, reads and writes JSON. A subclass
    implements ``do_POST`` (etc.); :func:`serve` gives it the test's ``state``."""

    state: Any

    def log_message(self, format: str, *args: object) -> None:  # keep pytest output clean
        pass

    def read_json(self) -> Any:
        return json.loads(self.rfile.read(int(self.headers["Content-Length"])))

    def reply(self, status: int, payload: Any) -> None:
        """Answer ``status`` with ``payload`` as JSON (``bytes`` are sent as they are)."""
        body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):  # the client timed out and left
            pass


@contextlib.contextmanager
def serve(handler_cls: type[JsonHandler], state: Any) -> Iterator[str]:
    """Serve ``handler_cls`` (its ``state`` set to ``state``) on 127.0.0.1:<free port> from a
    thread; yields the base URL ``http://127.0.0.1:<port>`` and stops the server on exit."""
    handler = type("Handler", (handler_cls,), {"state": state})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


# ---------------------------------------------------------------------- process groups


# What every rank imports, imported once per pytest process by the forkserver the ranks are forked
# from (run_ranks): a spawned rank imported torch, veRL, peft and diffusers again, seconds of CPU
# per rank on a 2-core machine. Importing them starts no thread, so the fork is clean.
RANK_PRELOAD = ["torch", "torch.distributed.fsdp", "peft", "diffusers", "verl_digen.workers.worker"]


def _rank_entry(rank: int, world: int, port: int, backend: str, fn: Callable[[int, int], Any], out,
                env: dict[str, str], cwd: str, timeout_s: float) -> None:
    import datetime
    import traceback

    import torch.distributed as dist

    # the caller's environment and directory of now, as a spawned rank would start with (the
    # forkserver keeps those of its own start)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    try:
        from verl_digen.workers.worker import configure_attention_kernels

        torch.set_num_threads(1)
        configure_attention_kernels()  # as every worker does (compute_device)
        extra = {}
        if backend == "nccl":
            torch.cuda.set_device(rank)
            extra["device_id"] = torch.device("cuda", rank)  # eager NCCL communicator on this rank's GPU
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            # a collective waits as long as the whole scenario may: on a loaded 2-core machine one
            # rank can lag the other by a minute between two collectives (a 60 s bound failed CI)
            timeout=datetime.timedelta(seconds=timeout_s),
            **extra,
        )
        try:
            result = fn(rank, world)
        finally:
            dist.destroy_process_group()
        out.put((rank, "ok", result))
    except BaseException:  # noqa: BLE001 - report anything to the parent
        out.put((rank, "error", traceback.format_exc()))


def run_ranks(
    fn: Callable[[int, int], Any], world: int = 2, backend: str = "gloo", timeout_s: float = 240.0
) -> dict[int, Any]:
    """``{rank: fn(rank, world)}`` from ``world`` processes in one process group (127.0.0.1, a free
    port), forked by multiprocessing's forkserver with :data:`RANK_PRELOAD` imported (each rank
    gets the caller's environment and working directory of now, as a spawned one would; NCCL
    ranks are spawned). ``fn`` must be a module-level function (it is pickled by name). Any rank's
    exception fails the caller with its traceback; the processes are joined (or terminated)."""
    import queue as queue_mod
    import time

    import torch.multiprocessing as mp

    from e2e_guard import note_start
    from verl_digen.sync import find_free_port

    note_start(f"a process group of {world} ranks (runs.run_ranks)")

    if backend == "nccl":  # CUDA ranks start from a fresh interpreter, as CUDA requires of a child
        ctx = mp.get_context("spawn")
    else:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(RANK_PRELOAD)  # read when the forkserver starts: the first call
    out = ctx.Queue()
    port = find_free_port("127.0.0.1")
    name = getattr(fn, "__name__", repr(fn))
    env, cwd = dict(os.environ), os.getcwd()
    procs = [ctx.Process(target=_rank_entry, args=(r, world, port, backend, fn, out, env, cwd, timeout_s))
             for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    deadline = time.monotonic() + timeout_s
    first_error_at: float | None = None
    try:
        # After a first error the other ranks get a short while to report theirs: a rank that fails
        # tears its process group down, so its peers fail with "Connection reset by peer", and the
        # first report to arrive is often that echo rather than the cause.
        while len(results) + len(errors) < world and not (
                first_error_at is not None and time.monotonic() > first_error_at + 30.0):
            try:
                rank, status, payload = out.get(timeout=1.0)
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead and not errors:
                    errors.append(f"ranks {dead} of {name!r} died without a report")
                    first_error_at = time.monotonic()
                elif time.monotonic() > deadline and not errors:
                    errors.append(f"timed out after {timeout_s}s waiting for the ranks of {name!r}")
                    break
                continue
            if status == "ok":
                results[rank] = payload
            else:
                errors.append(f"rank {rank}:\n{payload}")
                first_error_at = first_error_at or time.monotonic()
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.terminate()
                p.join(10)
    assert not errors, "\n".join(errors)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return results


_HOLD = """
import json, sys, time
from verl_digen.trainer.checkpoint import RootLock
RootLock(sys.argv[1], *json.loads(sys.argv[2])).acquire(json.loads(sys.argv[3]))
print("held", flush=True)
time.sleep(120)
"""


@contextlib.contextmanager
def lock_holder(path: str, holder: dict[str, Any], *lock_args: str) -> Iterator[Any]:
    """Another process holding ``RootLock(path, *lock_args)`` (a second run) until the block ends;
    yields its ``Popen``, killed and reaped on the way out."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", _HOLD, path, json.dumps(lock_args), json.dumps(holder)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=30)


def gate_reward() -> Any:
    """A reward that blocks in ``score_images`` until ``.release`` is set (``.entered`` says it
    was reached), so a request keeps its server budgets while a test sends others."""
    from verl_digen.rewards import RewardFn

    class GateReward(RewardFn):
        name = "gate"

        def __init__(self) -> None:
            self.entered = threading.Event()
            self.release = threading.Event()

        def score_images(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
            self.entered.set()
            assert self.release.wait(20)
            return images.mean(dim=(1, 2, 3))

    return GateReward()
