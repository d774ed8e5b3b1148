"""docs/design.md's section "The path of one chunk": read its tables back, print them anew.

The section has one line with both counts (COUNTS_LINE) and one table per group, under a `### `
heading that starts with the group's title (path_cut.GROUPS): rows `| n | `file` | role |`.
"""

from __future__ import annotations

import re
from typing import Final

from tests.processes import REPO
from tests.system.path_cut import GROUPS, ChunkPath

DESIGN_DOC: Final = REPO / "docs" / "design.md"
SECTION_TITLE: Final = "The path of one chunk"
COUNTS_LINE: Final = "Measured: {path} files on the path, {all} with the engine step."


_ROW: Final = re.compile(r"^\|\s*\d+\s*\|\s*`([^`]+)`\s*\|\s*(.*?)\s*\|\s*$")


def _section(doc: str | None) -> str:
    text = DESIGN_DOC.read_text() if doc is None else doc
    match = re.search(rf"^## [\d. ]*{SECTION_TITLE}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    if match is None:
        raise ValueError(f"docs/design.md has no section '{SECTION_TITLE}'")
    return match.group(1)


def documented_counts(doc: str | None = None) -> tuple[int, int]:
    """The section's (files on the path, files with the engine step)."""
    pattern = re.escape(COUNTS_LINE).replace(r"\{path\}", r"(\d+)").replace(r"\{all\}", r"(\d+)")
    match = re.search(pattern, _section(doc))
    if match is None:
        raise ValueError(f"the section has no line '{COUNTS_LINE}'")
    return int(match.group(1)), int(match.group(2))


def documented(doc: str | None = None) -> dict[str, list[tuple[str, str]]]:
    """The section's tables: group -> [(file, role)], in the doc's order."""
    tables: dict[str, list[tuple[str, str]]] = {}
    current: str | None = None
    for line in _section(doc).splitlines():
        if line.startswith("### "):
            heading = line[4:]
            current = next((key for key, title in GROUPS.items() if heading.startswith(title)), None)
            if current is not None:
                tables[current] = []
        elif current is not None and (row := _ROW.match(line)):
            tables[current].append((row.group(1), row.group(2)))
    return tables


def markdown(path: ChunkPath, doc: str | None = None) -> str:
    """The section's tables for `path`; each file's role is carried over from the doc (TODO if new)."""
    try:
        tables = documented(doc)
    except ValueError:  # no section yet: every role is a TODO
        tables = {}
    lines = [COUNTS_LINE.format(path=path.path_files, all=path.all_files)]
    for key, title in GROUPS.items():
        roles = dict(tables.get(key, []))
        files = path.group(key)
        lines += ["", f"### {title} ({len(files)} files)", "", "| # | file | role |", "|---|---|---|"]
        lines += [f"| {i} | `{file}` | {roles.get(file, 'TODO')} |" for i, file in enumerate(files, 1)]
    return "\n".join(lines)
