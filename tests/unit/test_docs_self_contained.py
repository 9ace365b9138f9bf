"""README and docs are self-contained: every link points into the repository, and URLs appear
only as placeholders of a command (loopback, a host name the reader substitutes). They read as
reference (no issue numbers, no dated sections), and the README stays short, with CI's command.
The site's own build (every page link and anchor resolves): tests/e2e/test_docs_site_e2e.py."""

from __future__ import annotations

import glob
import os
import re

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = sorted(
    [os.path.join(REPO, "README.md"), os.path.join(REPO, "patches", "README.md")]
    + glob.glob(os.path.join(REPO, "docs", "*.md"))
)
# Hosts of example commands (`url=http://judge:8001`), never a page to read.
PLACEHOLDER_HOSTS = {"127.0.0.1", "localhost", "host", "judge", "judge-host", "reward-host", "0.0.0.0"}


def _text(path: str) -> str:
    with open(path) as f:
        return f.read()


@pytest.mark.parametrize("path", DOCS, ids=lambda p: os.path.relpath(p, REPO))
def test_markdown_links_point_to_files_in_the_repository(path):
    for target in re.findall(r"\]\(([^)\s]+)\)", _text(path)):
        assert "://" not in target, f"{path}: link outside the repository: {target}"
        file = target.split("#", 1)[0]
        if file:
            assert os.path.exists(os.path.join(os.path.dirname(path), file)), f"{path}: broken link {target}"


@pytest.mark.parametrize("path", DOCS, ids=lambda p: os.path.relpath(p, REPO))
def test_urls_are_only_command_placeholders(path):
    hosts = re.findall(r"\bhttps?://([A-Za-z0-9_.-]+)", _text(path))
    outside = sorted({h for h in hosts if h not in PLACEHOLDER_HOSTS and h.upper() != "HOST"})
    assert not outside, f"{path} refers outside the repository: {outside}"


def test_the_design_lives_in_docs():
    assert os.path.exists(os.path.join(REPO, "docs", "design.md"))
    for path in DOCS:
        assert not re.search(r"(?<![\w/])DESIGN\.md", _text(path)), f"{path} names DESIGN.md (now docs/design.md)"


@pytest.mark.parametrize("path", DOCS, ids=lambda p: os.path.relpath(p, REPO))
def test_pages_are_reference_not_a_work_log(path):
    """Results are stated with their command and commit, not as the history of how the work went:
    no issue numbers, no dated sections."""
    text = _text(path)
    assert not re.search(r"\bissues? \d+|\bissue-\d+|\(issues? \d", text, re.I), f"{path} names an issue number"
    assert not re.search(r"^#+ .*\b20\d\d-\d\d-\d\d", text, re.M), f"{path} has a dated section heading"


def test_the_readme_is_short_and_its_test_command_is_what_ci_runs():
    readme = _text(os.path.join(REPO, "README.md"))
    assert len(readme.splitlines()) < 250, "README.md is for the first read: move the details into docs/"
    ci = _text(os.path.join(REPO, ".ci", "run"))
    (command,) = [line for line in ci.splitlines() if "pytest" in line and not line.startswith("#")]
    assert command.strip() == "bash scripts/setup.sh && .venv/bin/python -m pytest -n 2"
    assert command.strip() in readme, "the README's test command must be exactly what .ci/run runs"
    assert "what CI runs" in readme
