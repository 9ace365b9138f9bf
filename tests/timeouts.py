"""Test time limits beyond pytest-timeout's one ``--timeout`` (pyproject.toml), applied by
``conftest.pytest_collection_modifyitems``."""

from __future__ import annotations

import pytest

# What building the pretrained toy (the ``toy_digits`` fixture) may take on a loaded 2-core
# machine: measured 352-361 s in fresh-clone CI runs, with the other worker busy.
TOY_BUILD_S = 900


def toy_build_budget(config: pytest.Config, items: list[pytest.Item]) -> None:
    """pytest-timeout counts a test's fixture set-up in its timeout, and the first test to ask for
    ``toy_digits`` builds it (or waits on the other worker's build): such a test gets the build's
    time on top of its own limit, so a run of 4 minutes after a build of 6 does not fail at 600 s
    (seen in CI: the digits run stopped at step 43 of 60). A test's own ``timeout`` mark is its
    limit without the build, as for any other test."""
    default = config.getoption("timeout", None) or float(config.getini("timeout") or 0)
    if not default:  # --timeout=0 (or none): no limit to extend
        return
    for item in items:
        if "toy_digits" not in getattr(item, "fixturenames", ()):
            continue
        own = item.get_closest_marker("timeout")
        limit = default if own is None else (own.args[0] if own.args else own.kwargs.get("timeout", default))
        limit = float(limit)
        item.add_marker(pytest.mark.timeout(limit + TOY_BUILD_S), append=False)  # read before its own
