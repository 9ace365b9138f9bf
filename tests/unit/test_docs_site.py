"""The documentation site (docs/, Sphinx + MyST): its configuration reference has a row for every
``digen.*`` key of the dataclasses, and the pages that state what other code relies on say it.
That it builds with warnings as errors (so a broken page link or #anchor fails):
tests/e2e/test_docs_site_e2e.py."""

from __future__ import annotations

import ast
import dataclasses
import os
import re
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = os.path.join(REPO, "docs")
sys.path.insert(0, os.path.join(DOCS, "_ext"))

import digen_config  # noqa: E402  (docs/_ext: the reference's generator)


def _read(*parts: str) -> str:
    with open(os.path.join(REPO, *parts), encoding="utf-8") as f:
        return f.read()


def _digen_keys() -> set[str]:
    """Every leaf key of the ``digen`` tree, walked here from the dataclasses themselves."""
    from verl_digen.config.schema import HYDRA_KEYS, DigenConfig

    keys: set[str] = set()

    def walk(node: object, prefix: str) -> None:
        for f in dataclasses.fields(node):
            value = getattr(node, f.name)
            key = f"{prefix}.{HYDRA_KEYS.get(f.name, f.name)}"
            if dataclasses.is_dataclass(value):
                walk(value, key)
            else:
                keys.add(key)

    walk(DigenConfig(), "digen")
    return keys


# ---------------------------------------------------------------------------- fast lane


def test_every_digen_key_has_a_row_in_the_generated_reference():
    rows = dict(re.findall(r"^\| `(digen\.[\w.]+)` \| .*? \| .*? \| (.*) \|$", digen_config.reference_markdown(), re.M))
    keys = _digen_keys()
    assert len(keys) > 100, "the walk found too few keys: it is broken"
    missing = sorted(keys - set(rows))
    assert not missing, f"digen keys without an entry in the configuration reference: {missing}"
    assert not sorted(set(rows) - keys), "the reference lists keys the dataclasses do not have"
    assert all(doc.strip() for doc in rows.values()), [k for k, d in rows.items() if not d.strip()]
    # the site's page is where the reference is generated
    assert digen_config.MARKER in _read("docs", "configuration.md")


def test_a_field_without_a_comment_stops_the_reference(monkeypatch):
    """The reference is built from the comments: an undocumented key fails the build, naming it."""
    @dataclasses.dataclass
    class Toy:
        documented: int = 1  # what it does
        # a comment above
        # on two lines
        above: str = "x"
        bare: bool = False

    comments = digen_config._field_comments(Toy)
    assert comments == {"documented": "what it does", "above": "a comment above on two lines", "bare": ""}
    entry = digen_config.Entry("digen.bare", "bool", "false", "", "digen")
    monkeypatch.setattr(digen_config, "sections_and_entries", lambda: ([], [entry]))
    with pytest.raises(ValueError, match="digen.bare"):
        digen_config.reference_markdown()


def test_the_reference_shows_types_and_defaults_as_configured():
    by_key = {e.key: e for e in digen_config.entries()}
    assert by_key["digen.batch.group_size"].default == "4" and by_key["digen.batch.group_size"].type == "int"
    assert by_key["digen.model.path"].type == "str | null" and by_key["digen.model.path"].default == "null"
    # a nested default: PoolSpec's devices is 1, the reward pool's 0
    assert by_key["digen.pools.trainer.devices"].default == "1" and by_key["digen.pools.reward.devices"].default == "0"
    assert by_key["digen.async.max_staleness"].doc  # the hydra spelling of the field async_
    assert by_key["digen.sampling.sde_window.mode"].doc  # documented in its dataclass's docstring


def test_gpu_check_is_documented_for_users_with_every_part():
    """``python -m verl_digen.gpu_check`` stays in the installed package for users to check their own
    GPU machine: the getting-started page says so and names every part it runs."""
    tree = ast.parse(_read("verl_digen", "gpu_check.py"))
    (parts,) = [ast.literal_eval(n.value) for n in tree.body
                if isinstance(n, ast.Assign) and any(getattr(t, "id", None) == "PARTS" for t in n.targets)]
    page = _read("docs", "getting_started.md")
    assert "python -m verl_digen.gpu_check" in page
    missing = [p for p in parts if f"`{p}`" not in page]
    assert not missing, f"docs/getting_started.md does not describe the gpu_check parts {missing}"


def test_every_page_is_in_the_site():
    """A page outside every toctree is a warning, hence a failed build; this names it without building."""
    index = _read("docs", "index.md")
    listed = set(re.findall(r"^([\w/]+)$", index, re.M))
    pages = {os.path.splitext(name)[0] for name in os.listdir(DOCS) if name.endswith(".md") and name != "index.md"}
    assert not sorted(pages - listed), f"pages missing from docs/index.md's toctrees: {sorted(pages - listed)}"
