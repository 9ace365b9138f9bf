"""The configuration reference, generated from the ``digen`` dataclasses (one source of truth).

:func:`entries` walks :class:`verl_digen.config.schema.DigenConfig` recursively and yields every
``digen.*`` key with its type, its default and the comment that documents it in
``verl_digen/config/schema.py`` (the comment lines right above the field, or the comment at the
end of its line; for a dataclass documented in its docstring, its ``Attributes:`` section).
:func:`reference_markdown` renders them as MyST markdown: one section per dataclass, one table
row per key.

As a Sphinx extension (``docs/conf.py``), it replaces the block::

    ```{digen-config-reference}
    ```

of a page with that markdown when Sphinx reads the page, so the site's reference is built from
the code at every build. A key without a comment fails the build. ``tests/unit/test_docs_site.py``
checks that every key of the dataclasses has its row.
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import re
import textwrap
import tokenize
from dataclasses import dataclass
from typing import Any, Iterator

MARKER = "```{digen-config-reference}\n```"


@dataclass
class Entry:
    key: str  # digen.model.lora.rank
    type: str  # as annotated, e.g. "int", "str | null"
    default: str  # as a YAML value, e.g. "8", "null", "[to_q, to_k]"
    doc: str  # the field's comment, one paragraph
    section: str  # the dataclass's key, e.g. digen.model.lora


@dataclass
class Section:
    key: str
    cls: type
    doc: str  # the dataclass's docstring, one paragraph ("" when it has none)


# ---------------------------------------------------------------------------- reading the source


def _field_comments(cls: type) -> dict[str, str]:
    """Field name -> its comment in the class source: the comment lines directly above the field
    (no blank line between), then the comment at the end of the field's lines."""
    lines, _ = inspect.getsourcelines(cls)
    source = textwrap.dedent("".join(lines))
    src_lines = source.splitlines()
    comments: dict[int, str] = {}  # line (1-based) -> comment text
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    import ast

    tree = ast.parse(source)
    (node,) = tree.body
    out: dict[str, str] = {}
    for stmt in node.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        above: list[str] = []
        line = stmt.lineno - 1
        while line >= 1 and src_lines[line - 1].strip().startswith("#"):
            above.insert(0, comments.get(line, ""))
            line -= 1
        trailing = [comments[n] for n in range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1) if n in comments]
        text = " ".join(part for part in above + trailing if part)
        text = re.sub(r"\s*\(?noqa[^)]*\)?", "", text).strip()
        out[stmt.target.id] = text
    return out


def _docstring_attributes(cls: type) -> dict[str, str]:
    """A Google-style ``Attributes:`` section of the class docstring: name -> text."""
    doc = inspect.getdoc(cls) or ""
    if "Attributes:" not in doc:
        return {}
    out: dict[str, str] = {}
    current = None
    for line in doc.split("Attributes:", 1)[1].splitlines():
        m = re.match(r"^    (\w+):\s*(.*)$", line)
        if m:
            current = m.group(1)
            out[current] = m.group(2).strip()
        elif current and line.startswith("        "):
            out[current] += " " + line.strip()
        elif line.strip() and not line.startswith(" "):
            break
    return out


def _class_doc(cls: type) -> str:
    """The dataclass's own docstring (not dataclasses' generated signature), its first paragraph
    without an ``Attributes:`` section."""
    doc = cls.__dict__.get("__doc__") or ""
    if not doc or doc.startswith(cls.__name__ + "("):
        return ""
    doc = inspect.cleandoc(doc).split("Attributes:", 1)[0].strip()
    return " ".join(doc.split())


# ---------------------------------------------------------------------------- values


def _type(annotation: Any) -> str:
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    m = re.fullmatch(r"Optional\[(.*)\]", text)
    if m:
        text = f"{m.group(1)} | None"
    return text.replace("None", "null").replace("Any", "any")


def _value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value if value else '""'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_value(v)}" for k, v in value.items()) + "}"
    return repr(value)


# ---------------------------------------------------------------------------- the walk


def sections_and_entries() -> tuple[list[Section], list[Entry]]:
    """Every section (dataclass) and leaf key of the ``digen`` tree, in declaration order."""
    from verl_digen.config.schema import HYDRA_KEYS, DigenConfig

    sections: list[Section] = []
    found: list[Entry] = []

    def walk(cls: type, key: str, instance: Any) -> None:
        sections.append(Section(key, cls, _class_doc(cls)))
        comments = _field_comments(cls)
        attributes = _docstring_attributes(cls)
        nested = []
        for f in dataclasses.fields(cls):
            name = HYDRA_KEYS.get(f.name, f.name)
            value = getattr(instance, f.name)
            if dataclasses.is_dataclass(value):
                nested.append((type(value), f"{key}.{name}", value))
                continue
            doc = comments.get(f.name) or attributes.get(f.name, "")
            # the value of a default-constructed DigenConfig: a nested default (the reward pool's
            # devices=0) wins over the field's own default in its dataclass
            found.append(Entry(f"{key}.{name}", _type(f.type), _value(value), doc, key))
        for args in nested:
            walk(*args)

    walk(DigenConfig, "digen", DigenConfig())
    return sections, found


def entries() -> list[Entry]:
    return sections_and_entries()[1]


def _cell(text: str) -> str:
    """Table-cell text: pipes escaped, and ``<name>`` placeholders kept as text (not HTML)."""
    return text.replace("|", "\\|").replace("<", "\\<")


def reference_markdown(heading: str = "##") -> str:
    """The reference as MyST markdown: per section a heading (``digen.model``), the dataclass's
    docstring and a table of its keys. Raises ``ValueError`` naming every key without a comment."""
    sections, found = sections_and_entries()
    missing = [e.key for e in found if not e.doc]
    if missing:
        raise ValueError("these digen keys have no comment in verl_digen/config/schema.py (the reference is built "
                         f"from them): {', '.join(missing)}")
    out: list[str] = []
    for section in sections:
        rows = [e for e in found if e.section == section.key]
        if not rows:
            continue
        out += [f"{heading} `{section.key}`", ""]
        if section.doc:
            out += [section.doc, ""]
        out += ["| key | type | default | what it does |", "|---|---|---|---|"]
        for e in rows:
            out.append(f"| `{e.key}` | `{_cell(e.type)}` | `{_cell(e.default)}` | {_cell(e.doc)} |")
        out.append("")
    return "\n".join(out)


# ---------------------------------------------------------------------------- Sphinx


def _source_read(app: Any, docname: str, source: list[str]) -> None:
    if MARKER in source[0]:
        source[0] = source[0].replace(MARKER, reference_markdown())


def setup(app: Any) -> dict[str, Any]:
    app.connect("source-read", _source_read)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}


def iter_keys() -> Iterator[str]:
    for e in entries():
        yield e.key
