"""The documentation site (docs/, Sphinx + MyST) builds with warnings as errors, so a broken page
link or #anchor fails it (a sphinx-build each, tens of seconds). Its configuration reference and
the pages' statements: tests/unit/test_docs_site.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from test_docs_site import DOCS

BUILD_TIMEOUT = 300


def _build(source: str, out: str, builder: str = "html") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", builder,
                           "-d", os.path.join(out, ".doctrees"), source, out],
                          capture_output=True, text=True, timeout=BUILD_TIMEOUT)


# ---------------------------------------------------------------------------- the build


@pytest.mark.e2e
def test_the_site_builds_with_warnings_as_errors(tmp_path):
    proc = _build(DOCS, str(tmp_path / "html"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    html = (tmp_path / "html" / "configuration.html").read_text(encoding="utf-8")
    assert "digen.batch.group_size" in html and "digen-config-reference" not in html
    for page in ("index", "getting_started", "concepts", "planner", "troubleshooting", "results_gpu"):
        assert (tmp_path / "html" / f"{page}.html").is_file(), page
    assert not (tmp_path / "html" / "_build").exists()  # a previous local build is not a page


@pytest.mark.e2e
@pytest.mark.slow
def test_a_broken_link_or_anchor_fails_the_build(tmp_path):
    """Relative page links, #anchors of a page and of another page, and links to files are checked."""
    source = tmp_path / "docs"
    shutil.copytree(DOCS, source, ignore=shutil.ignore_patterns("_build"))
    page = source / "troubleshooting.md"
    good = page.read_text(encoding="utf-8")
    broken = {"no_such_page.md": "[x](no_such_page.md)", "no-such-heading": "[x](#no-such-heading)",
              "'planner': 'no-such-anchor'": "[x](planner.md#no-such-anchor)",
              "measured/no_such_report.json": "[x](measured/no_such_report.json)"}
    page.write_text(good + "\n\n" + "\n\n".join(broken.values()) + "\n", encoding="utf-8")
    proc = _build(str(source), str(tmp_path / "out"), builder="dummy")
    assert proc.returncode != 0, "broken links did not fail the build"
    warnings = [line for line in proc.stderr.splitlines() if "myst.xref_missing" in line]
    for target in broken:
        assert any(target in w for w in warnings), (target, proc.stderr[-3000:])
    page.write_text(good + "\n\n[x](planner.md#one-command) [y](#bad-input) [z](measured/gpu_check_h100.json)\n",
                    encoding="utf-8")
    proc = _build(str(source), str(tmp_path / "out2"), builder="dummy")
    assert proc.returncode == 0, proc.stderr[-3000:]
