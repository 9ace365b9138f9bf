"""The suite's layout: one folder per lane, and a test file's folder is the lane of every test in it.

- ``tests/unit``: fast-lane tests only (no ``e2e``, ``slow`` or ``gpu`` marker: ``pytest -m "not
  e2e"``);
- ``tests/e2e``: ``e2e`` (or ``slow``) tests that are not ``gpu`` tests;
- ``tests/gpu``: ``gpu`` tests (``pytest -m gpu``);
- no test file anywhere else (``tests/`` itself holds conftest.py, ``helpers/`` the shared modules).

The markers still select the lanes; the folders must agree with them. Read from pytest's own
collection (``helpers/lanes.py``): this session's, when it collected every file."""

from __future__ import annotations

import os

import pytest

from lanes import collected_lanes, misplaced, suite_test_files
from suite_paths import LANES


def test_every_test_file_is_in_the_folder_of_its_tests_lane(request: pytest.FixtureRequest):
    files = collected_lanes(request.config)
    assert os.path.join("unit", "test_layout.py") in files and files.keys() <= suite_test_files()
    problems = misplaced(files)
    assert not problems, "\n".join(problems)


def test_no_test_file_is_outside_the_lanes_folders():
    outside = sorted(p for p in suite_test_files() if p.split(os.sep)[0] not in LANES or p.count(os.sep) != 1)
    assert not outside, f"test files outside tests/{{{','.join(LANES)}}}/: {outside}"


def test_the_check_names_a_test_whose_lane_is_not_its_folders():
    files = {
        os.path.join("unit", "test_a.py"): {"test_fast": "unit", "test_slow[x]": "e2e"},
        os.path.join("e2e", "test_a_e2e.py"): {"test_run": "e2e", "test_device": "gpu"},
        os.path.join("gpu", "test_a_gpu.py"): {"test_device": "gpu"},
        "test_b.py": {"test_fast": "unit"},
    }
    assert misplaced(files) == [
        "tests/e2e/test_a_e2e.py::test_device is in tests/e2e/ but its markers put it in the gpu lane "
        "(move it to tests/gpu/)",
        "tests/test_b.py: a test file outside tests/{unit,e2e,gpu}/",
        "tests/unit/test_a.py::test_slow[x] is in tests/unit/ but its markers put it in the e2e lane "
        "(move it to tests/e2e/)",
    ]


@pytest.mark.parametrize(("markers", "lane"), [
    ((), "unit"),
    (("e2e",), "e2e"),
    (("slow",), "e2e"),  # e2e_guard marks a slow test e2e too
    (("e2e", "slow"), "e2e"),
    (("gpu",), "gpu"),
    (("gpu", "e2e"), "gpu"),  # -m gpu selects it; the plain run and the fast lane leave it out
])
def test_a_tests_lane_is_what_its_markers_select(pytester: pytest.Pytester, markers, lane):
    import lanes

    decorators = "".join(f"@pytest.mark.{m}\n" for m in markers)
    pytester.makeini("[pytest]\nmarkers =\n    e2e: e2e\n    slow: slow\n    gpu: gpu\n")
    pytester.makepyfile(test_one=f"import pytest\n\n{decorators}def test_one():\n    pass\n")
    (item,), _ = pytester.inline_genitems()
    assert lanes.lane(item) == lane
