"""Sphinx configuration of verl-digen's documentation site: MyST markdown pages, as veRL's docs.

Build (what tests/e2e/test_docs_site_e2e.py runs, warnings are errors)::

    .venv/bin/sphinx-build -W --keep-going -b html docs docs/_build/html

The configuration reference (configuration.md) is generated at build time from the ``digen``
dataclasses of ``verl_digen/config/schema.py`` by the extension in ``_ext/digen_config.py``.
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "_ext"))
sys.path.insert(0, os.path.dirname(HERE))  # the checkout's verl_digen, for the configuration reference

project = "verl-digen"
author = "verl-digen contributors"
copyright = "verl-digen contributors, Apache-2.0"
try:
    from verl_digen import __version__ as release
except Exception:  # pragma: no cover - the reference extension reports the real error
    release = ""
version = release

extensions = ["myst_parser", "digen_config"]
source_suffix = {".md": "markdown"}
root_doc = "index"
# Not pages: the build output, the extension, the measured reports (linked as files), pictures.
exclude_patterns = ["_build", "_ext", "_static", "measured", "Thumbs.db", ".DS_Store"]

# MyST: heading anchors, so that [text](page.md#a-heading) and [text](#a-heading) resolve (and a
# broken one is a warning, hence an error under -W); GitHub-style tables, code spans, $ maths off.
myst_heading_anchors = 4
myst_enable_extensions = ["deflist", "colon_fence"]
# A link to a file that is not a page (a measured report, a source file) must exist.
myst_links_external_new_tab = False

html_theme = "alabaster"
html_static_path = ["_static"]
html_title = "verl-digen"
html_theme_options = {"description": "RL post-training of diffusion generators on veRL", "fixed_sidebar": True}
html_show_sourcelink = False
