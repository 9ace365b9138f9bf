"""Shared fixtures: tiny models built once per session, in a temp cache."""

from __future__ import annotations

import os

import pytest


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
    path = str(tmp_path_factory.mktemp("digen_cache"))
    os.environ["VERL_DIGEN_CACHE"] = path  # Ray workers inherit the driver's environment
    return path


@pytest.fixture(scope="session")
def tiny_flux(tiny_cache) -> str:
    from verl_digen.models.tiny import ensure_tiny

    return ensure_tiny("flux")


@pytest.fixture(scope="session")
def tiny_sd3(tiny_cache) -> str:
    from verl_digen.models.tiny import ensure_tiny

    return ensure_tiny("sd3")


def ray_shutdown_if_running() -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()
