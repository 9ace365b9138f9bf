"""Shared fixtures: tiny models built once per session in a temp cache, adapters loaded once per
test module, one-thread torch for the tiny models, loopback traffic that bypasses proxies.

The fast lane (``pytest -m "not e2e"``) is kept honest here: a test that starts Ray or a whole
run without the ``e2e`` marker fails (the hooks of ``helpers/e2e_guard.py``).

The test files sit in one folder per lane (``unit/``, ``e2e/``, ``gpu/``); plain helpers (no
fixtures) are in ``helpers/`` (``runs.py``, ...). Both are imported by name: this module puts them
on ``sys.path`` (``helpers/suite_paths.py``)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import pytest

# Python's bytecode cache for the suite and the processes it starts (Ray workers, CLI runs), also
# where PYTHONDONTWRITEBYTECODE is set (it is on this project's build machines): without it every
# xdist worker rewrites every test module's asserts and compiles the package from source on every
# run (the fast lane's collection: 13 s per worker -> 6 s on a second run). The caches are
# __pycache__ folders, which git ignores.
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

# The shared helpers and the lanes' folders, first on the path: tests import their modules by
# name (``from runs import run``, ``from test_fsdp import TinyDenoiser``), whichever file pytest
# collects first.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "helpers"))
from suite_paths import SEARCH_PATH  # noqa: E402

sys.path[:0] = [path for path in SEARCH_PATH if path not in sys.path]

# The e2e guard's hooks (tests/helpers/e2e_guard.py), registered by being names of this module;
# its pytest_runtest_setup is called by this module's own.
import e2e_guard  # noqa: E402
import lanes  # noqa: E402
from e2e_guard import (  # noqa: E402, F401
    pytest_configure,
    pytest_runtest_makereport,
    pytest_runtest_protocol,
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Each test's lane recorded (``lanes.record``, for test_layout.py), before anything is
    deselected; the e2e guard's marks and gpu deselection; then, under pytest-xdist, the heaviest
    test files first (``heaviest_files_first``)."""
    lanes.record(config, items)
    e2e_guard.pytest_collection_modifyitems(config, items)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        heaviest_files_first(items)


def heaviest_files_first(items: list[pytest.Item]) -> None:
    """Order whole files by their weight, heaviest first, keeping each file's own order.

    ``--dist loadfile --no-loadscope-reorder`` (pyproject.toml; without the second flag xdist
    re-sorts files by their number of tests) hands files to the workers in this order, so a heavy file met
    last keeps one worker busy for minutes while the other has nothing left (seen: 7 minutes
    of one idle core at the end of the suite). Weights are rough: an e2e test 1, a slow one
    4 more. Every worker sorts the same collection the same way, as xdist requires."""
    def weight(item: pytest.Item) -> int:
        e2e, slow = item.get_closest_marker("e2e"), item.get_closest_marker("slow")
        return (1 if e2e is not None else 0) + (4 if slow is not None else 0)

    files: dict[str, list[pytest.Item]] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::")[0], []).append(item)
    weights = {name: sum(weight(i) for i in group) for name, group in files.items()}
    ranked = sorted(files, key=lambda name: -weights[name])  # stable: ties keep collection order
    items[:] = [item for name in ranked for item in shared_ray_first(files[name])]


def shared_ray_first(items: list[pytest.Item]) -> list[pytest.Item]:
    """A file's tests that share the session's Ray instance first, then the rest, each part in its
    own order: every switch between the two stops the shared instance or starts it again
    (:func:`pytest_runtest_setup`, 10-20 s each on 2 cores; a file that alternated paid it
    several times over)."""
    return sorted(items, key=lambda item: "shared_ray" not in getattr(item, "fixturenames", ()))


class LazyDict(dict):
    """A dict whose missing keys are made on first lookup by ``make(key)`` and then kept."""

    def __init__(self, make: Callable):
        super().__init__()
        self._make = make

    def __missing__(self, key):
        value = self[key] = self._make(key)
        return value


@pytest.fixture(scope="session", autouse=True)
def worker_attention_kernels():
    """The attention kernels every worker runs with (``compute_device`` configures them), for the
    tests that call models in-process too: cuDNN's fused attention backward fails on an H100
    (``verl_digen.workers.worker.configure_attention_kernels``)."""
    from verl_digen.workers.worker import configure_attention_kernels

    configure_attention_kernels()
    yield


@pytest.fixture(scope="session", autouse=True)
def isolated_cwd(tmp_path_factory):
    """Run every test from an empty directory: relative defaults (runs/, checkpoints/ for
    trainer.resume_mode=auto) must never leak between tests or into the checkout."""
    old = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("cwd"))
    yield
    os.chdir(old)


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory) -> str:
    """The session's model cache. Under pytest-xdist (``-n 2``) the workers share one, below the
    run's common temp directory: the toy model is built once, not once per worker."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # .../pytest-N/popen-gwK -> .../pytest-N, the same for every worker
    path = os.path.join(str(base), "digen_cache")
    os.makedirs(path, exist_ok=True)
    os.environ["VERL_DIGEN_CACHE"] = path  # Ray workers inherit the driver's environment
    return path


@pytest.fixture(scope="session")
def tiny_dirs(tiny_cache) -> dict[str, str]:
    """``tiny_dirs[arch]``: the tiny ``arch`` model (seed 0) in the session's cache, built on
    first use (``ensure_tiny``)."""
    from verl_digen.models.tiny import ensure_tiny

    cache_dir = os.path.join(tiny_cache, "tiny")  # where ensure_tiny looks in Ray workers too
    return LazyDict(lambda arch: ensure_tiny(arch, cache_dir))


@pytest.fixture(scope="session")
def toy_digits(tiny_cache) -> str:
    """The pretrained toy digits model (``verl_digen.models.toy``) in the session's cache, copied
    from the package on first use (two xdist workers racing is safe: ``ensure_toy`` renames a
    complete copy into place), where Ray workers and ``resolve_model_path`` look."""
    from verl_digen.models.toy import ensure_toy

    return ensure_toy("digits", os.path.join(tiny_cache, "toy"), log=lambda message: None)


@pytest.fixture(scope="session")
def shared_ray(tiny_cache) -> None:
    """The session's one local Ray instance (``runs.shared_ray_up``), started on first use: in-process
    runs reuse it instead of starting and stopping their own (seconds of CPU each on a 2-core
    machine). After ``tiny_cache``: workers see the cache. A test that needs a Ray of its own (a
    cluster, a killed driver, Ray never started) does not ask for it, and finds it stopped
    (:func:`pytest_runtest_setup`, which also starts it again for the next test that asks)."""
    from runs import shared_ray_up

    shared_ray_up()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before any fixture of a test: the e2e guard's check of e2e fixtures; the shared Ray instance
    running if the test asks for it (directly or through its fixtures), else stopped: the test
    may start its own (a module fixture too), or check that nothing started one
    (``ray.is_initialized()`` is False after a refused run)."""
    e2e_guard.pytest_runtest_setup(item)
    if "ray" not in sys.modules:
        return
    import runs

    if "shared_ray" not in getattr(item, "fixturenames", ()):
        runs.shared_ray_down()
    elif runs.shared_ray_stopped():
        runs.shared_ray_up()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    """After a test's fixtures are torn down (monkeypatch undone): Ray's cached auth mode follows
    the restored ``RAY_AUTH_MODE`` again (:func:`runs.ray_auth_follows_env`)."""
    yield
    if "ray" in sys.modules:
        import runs

        runs.ray_auth_follows_env()


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    if "ray" in sys.modules:
        from runs import shared_ray_down

        shared_ray_down()


@pytest.fixture(scope="session")
def tiny_flux(tiny_dirs) -> str:
    return tiny_dirs["flux"]


@pytest.fixture(scope="session")
def tiny_sd3(tiny_dirs) -> str:
    return tiny_dirs["sd3"]


@pytest.fixture(scope="module")
def adapters(tiny_dirs) -> dict:
    """``adapters[arch]``: the tiny ``arch`` model's adapter, loaded on first use and shared by
    the module's tests (a test that changes its adapter loads its own)."""
    from verl_digen.models import load_adapter

    return LazyDict(lambda arch: load_adapter(tiny_dirs[arch]))


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models are too small for intra-op threads to pay off; on a shared 2-core machine they
    only spin against other processes. Restored afterwards. Use per module:
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def loopback_no_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests to the tests' local servers go straight to 127.0.0.1, whatever proxy is set."""
    for var in ("NO_PROXY", "no_proxy"):
        monkeypatch.setenv(var, "127.0.0.1,localhost")


@pytest.fixture
def run_as_main(capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> Callable:
    """``python -m MODULE ARGS...`` in this process: ``run_as_main(module, *args, env=None)``
    returns ``(exit status, stdout, stderr)``.

    ``runpy.run_module(run_name="__main__")`` is what ``python -m`` itself runs (``runpy.
    _run_module_as_main``): the module's ``if __name__ == "__main__":`` block with ``sys.argv``
    set, and the status is what the interpreter makes of the ``SystemExit`` it raises (None 0,
    an int itself, anything else printed and 1). A fresh interpreter would import torch and veRL
    again: seconds of the fast lane per command. Tests of what only a fresh process shows (its
    imports, its environment, a server's lifetime) still start one."""
    import runpy
    import warnings

    def run(module: str, *args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
        for name, value in (env or {}).items():
            monkeypatch.setenv(name, value)
        monkeypatch.setattr(sys, "argv", [module, *args])
        capsys.readouterr()
        status = 0
        try:
            with warnings.catch_warnings():
                # runpy warns that the module was imported before it ran as __main__ (the test's
                # own imports): the module runs again either way, as python -m would run it
                warnings.filterwarnings("ignore", message=".*found in sys.modules.*", category=RuntimeWarning)
                runpy.run_module(module, run_name="__main__", alter_sys=True)
        except SystemExit as exit_:
            code = exit_.code
            if code is None or isinstance(code, int):
                status = code or 0
            else:
                print(code, file=sys.stderr)
                status = 1
        out = capsys.readouterr()
        return status, out.out, out.err

    return run
