"""Where the suite's files are (the standard library only).

The test files sit in one folder per lane: ``tests/unit`` (the fast lane, ``pytest -m "not e2e"``),
``tests/e2e`` (Ray, whole runs, process groups) and ``tests/gpu`` (``pytest -m gpu``); the plain
modules they share are here, in ``tests/helpers``. Tests import both by name (``from runs import
run``, ``from test_fsdp import TinyDenoiser``): ``tests/conftest.py`` puts :data:`SEARCH_PATH` on
``sys.path``, and the processes tests start that unpickle a test's functions or classes by module
name (Ray workers, a test's own raylets) get it on their ``PYTHONPATH``
(``runs.shared_ray_up``); ranks forked by ``runs.run_ranks`` inherit ``sys.path``."""

from __future__ import annotations

import os

#: ``tests/``: conftest.py, the lanes' folders, ``helpers/`` and the test data (``data/``).
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: The checkout.
REPO = os.path.dirname(TESTS)
#: The modules tests share (this one's folder).
HELPERS = os.path.join(TESTS, "helpers")
#: The lanes, each a folder of ``tests/``: its test files' markers say the same (test_layout.py).
LANES = ("unit", "e2e", "gpu")
#: Where a test's modules are imported from by name: the helpers, then each lane's folder.
SEARCH_PATH = [HELPERS, *(os.path.join(TESTS, lane) for lane in LANES)]
