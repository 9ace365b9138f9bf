"""patches/README.md lists every veRL hook verl-digen uses: the list is complete (every
`from verl... import` of the package is in it) and each listed symbol exists in the veRL installed."""

from __future__ import annotations

import ast
import importlib
import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
README = os.path.join(REPO, "patches", "README.md")


def _listed() -> set[tuple[str, str]]:
    with open(README) as f:
        return set(re.findall(r"`(verl(?:\.\w+)*):(\w+)`", f.read()))


def _imported_from_verl() -> dict[tuple[str, str], str]:
    """(module, name) of every ``from verl[.x] import name`` under verl_digen/ -> a file using it."""
    found = {}
    for root, _, files in os.walk(os.path.join(REPO, "verl_digen")):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(root, name)
            with open(path) as f:
                tree = ast.parse(f.read(), path)
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.module and (node.module == "verl" or node.module.startswith("verl.")):
                    for alias in node.names:
                        found[(node.module, alias.name)] = os.path.relpath(path, REPO)
    return found


def test_every_verl_import_of_the_package_is_listed_in_patches_readme():
    used = _imported_from_verl()
    assert used, "no veRL import found: the scan is broken"
    missing = {f"{m}:{n} ({where})" for (m, n), where in used.items() if (m, n) not in _listed()}
    assert not missing, f"add these veRL hooks to patches/README.md: {sorted(missing)}"


def test_every_listed_hook_exists_in_the_installed_verl():
    listed = _listed()
    assert ("verl.plugin.platform", "PlatformRegistry") in listed
    for module, name in sorted(listed):
        assert hasattr(importlib.import_module(module), name), f"{module}:{name}"


def test_tracking_is_finished_only_where_verl_has_finish():
    from verl_digen.trainer.runtime import finish_tracking

    class Finishable:
        finished = False

        def finish(self):
            self.finished = True

    tracker = Finishable()
    finish_tracking(tracker)
    assert tracker.finished
    finish_tracking(object())  # a veRL 0.9.0.dev Tracking: no finish(), nothing to call


def _doctor_verl_line(monkeypatch, verl_version: str) -> tuple[bool, str]:
    import verl_digen.doctor as doctor

    real = doctor.md.version
    monkeypatch.setattr(doctor.md, "version", lambda name: verl_version if name == "verl" else real(name))
    ok, lines = doctor.report()
    (line,) = [x for x in lines if x.startswith("verl ")]
    return ok, line


def test_doctor_accepts_the_tested_veRL(monkeypatch):
    ok, line = _doctor_verl_line(monkeypatch, "0.9.1")
    assert ok and line == "verl 0.9.1 (tested 0.9.1, supported <0.10,>=0.9.0.dev0)"


def test_doctor_accepts_verl_omnis_veRL_as_untested(monkeypatch):
    ok, line = _doctor_verl_line(monkeypatch, "0.9.0.dev0")
    assert ok and "untested: run scripts/verl_contract.sh" in line


def test_doctor_refuses_a_veRL_outside_the_supported_range(monkeypatch):
    ok, line = _doctor_verl_line(monkeypatch, "0.8.3")
    assert not ok and line.endswith("<-- UNSUPPORTED")


def test_doctor_names_a_missing_dependency_of_veRLs_trainer_and_reports_the_rest(monkeypatch):
    """On a GPU machine whose fastapi lacked its `opentelemetry` dependency, the doctor died in a
    traceback at main_ppo's import and reported nothing else. Python's own "halted" import stands
    in for that failure here: the doctor names it and still lists the versions and devices."""
    import sys

    import verl_digen.doctor as doctor

    monkeypatch.setitem(sys.modules, "verl.trainer.ppo.v1.trainer_base", None)
    ok, lines = doctor.report()
    assert not ok
    (line,) = [x for x in lines if x.startswith("main_ppo trainer.v1")]
    assert "its import failed: ModuleNotFoundError" in line and "verl.trainer.ppo.v1.trainer_base" in line
    assert any(x.startswith("verl-digen ") for x in lines) and any(x.startswith("torch ") for x in lines)
    assert any(x.startswith("CPU cores: ") for x in lines)


def test_an_import_failure_names_the_file_that_needs_what_is_missing(tmp_path, monkeypatch):
    import sys

    from verl_digen.doctor import import_failure

    pkg = tmp_path / "needs_a_dependency"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from . import api\n")
    (pkg / "api.py").write_text("import a_dependency_nobody_installed\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        import needs_a_dependency  # noqa: F401
    except ImportError as e:
        text = import_failure(e)
    else:
        raise AssertionError("the import should fail")
    finally:
        sys.modules.pop("needs_a_dependency", None)
        sys.modules.pop("needs_a_dependency.api", None)
    assert text == ("ModuleNotFoundError: No module named 'a_dependency_nobody_installed' "
                    f"(imported by {os.path.join('needs_a_dependency', 'api.py')})")
