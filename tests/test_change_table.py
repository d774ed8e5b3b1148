"""docs/design.md's "Where to make a change" is true: each row names every file its change touches.

Each row has three cells: what to add, the files the change touches, what to read first. Every path
the table names exists. For the rows in PROBES, the source files the `touch` cell names (those under
the packages; `tests/` and `docs/` paths are only checked to exist) are exactly the files the code
says such a change touches, found from the concept's existing instances: the registered attention
backends, the host KV tier, the current eviction order, the OpenAI client events, the per-key limits.
A row goes stale when a file joins or leaves its concept; the failure names the files to add to the
row or drop from it.

After a refactor moves a concept (a class merged, renamed or moved), update its anchor in the block
below (the one place the probes name code) and the row in docs/design.md.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import pickle
import re
import subprocess
import sys
import typing
from collections.abc import Callable, Iterable
from functools import cache
from pathlib import Path
from typing import Any, Final

import pytest

from tests.test_architecture import PACKAGES, REPO

# ---- the anchors: the code each probe starts from (update these when a concept moves) ------------

# The per-key limits and the records that carry them past the handshake (issue #37 merges them).
LIMIT_CLASSES: Final = (
    "shared.protocol.key_limits:KeyLimits",
    "shared.protocol.key_limits:AuthLimits",
)
# Every client event of the OpenAI dialect is a member of this union; `EVENT_BUILDER` builds a
# server event (each one's shape is written once, in the function that calls it).
OPENAI_CLIENT_EVENTS: Final = "gateway.openai.client_events:ClientEvent"
EVENT_BUILDER: Final = "_event"
# The KV memory's owner (its `sorted(..., key=...)` calls are the eviction order) and the host tier:
# the module that holds its memory and copies, and the word its names carry (`host_pages`, ...).
MEMORY_OWNER: Final = "worker.engine.memory.manager:KVManager"
HOST_TIER_MODULE: Final = "worker.engine.memory.page_copy"
HOST_TIER_WORD: Final = "host"
# The attention backends' registry.
ATTENTION_REGISTRY: Final = "worker.attention:BACKENDS"

# Where a typical change lands: `loadtest/` configures and measures what exists (a benchmark of a
# new tier or limit is welcome, not required), so the probes look only at the serving code.
SERVING: Final = tuple(package for package in PACKAGES if package != "loadtest")

# ---- the table --------------------------------------------------------------------------------

DESIGN_DOC: Final = REPO / "docs" / "design.md"
TABLE_TITLE: Final = "### Where to make a change"
_PATH: Final = re.compile(r"`([\w./-]+\.(?:py|md|lua|js|html|toml|yaml)|[\w./-]+/)`")


@dataclasses.dataclass(frozen=True)
class Row:
    change: str
    touch: str
    read_first: str


def named_paths(cell: str) -> set[str]:
    """The paths a cell names in backticks: files by their suffix, folders by their final `/`."""
    return set(_PATH.findall(cell))


def documented(doc: str | None = None) -> dict[str, Row]:
    """The table's rows by their first cell."""
    text = DESIGN_DOC.read_text() if doc is None else doc
    start = text.index(TABLE_TITLE)
    rows: dict[str, Row] = {}
    for line in text[start:].splitlines()[1:]:
        if line.startswith("#"):
            break
        if not line.startswith("|") or line.startswith("|---") or line.startswith("| to add"):
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split(" | ")]
        assert len(cells) == 3, f"a row of '{TABLE_TITLE}' has {len(cells)} cells, not 3: {line[:80]}"
        rows[cells[0]] = Row(*cells)
    return rows


def source(paths: Iterable[str]) -> set[str]:
    return {path for path in paths if path.split("/")[0] in PACKAGES}


# ---- reading the code -------------------------------------------------------------------------


def _load(target: str) -> Any:
    """`module:name` -> the object."""
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def _relative(path: str | Path) -> str:
    return Path(path).resolve().relative_to(REPO).as_posix()


def _file_of(target: str) -> str:
    return _relative(inspect.getfile(importlib.import_module(target.partition(":")[0])))


@cache
def _serving_files() -> tuple[Path, ...]:
    return tuple(path for package in SERVING for path in sorted((REPO / package).rglob("*.py")))


# Parses `sys.argv[1]` and writes its AST, pickled, to stdout (`_tree`'s fallback).
_PARSE_IN_FRESH_PROCESS: Final = (
    "import ast, pickle, sys; "
    "sys.stdout.buffer.write(pickle.dumps(ast.parse(open(sys.argv[1]).read(), sys.argv[1])))"
)


@cache
def _tree(path: Path) -> ast.Module:
    try:
        return ast.parse(path.read_text(), filename=str(path))
    except SystemError:
        # CPython 3.11.7's `ast.parse` now and then fails with "AST constructor recursion depth
        # mismatch" late in a long pytest run (tests/test_architecture.py says when; CI hit it here
        # once in 958 tests): a fresh interpreter parses the same file, as that test's scan does.
        parsed = subprocess.run(
            [sys.executable, "-c", _PARSE_IN_FRESH_PROCESS, str(path)], capture_output=True, check=True
        )
        tree: ast.Module = pickle.loads(parsed.stdout)
        return tree


def _names(path: Path, *, variables: bool = True) -> set[str]:
    """Every identifier the file uses or defines: attributes, keywords, defs, class fields, and
    with `variables` plain names and imports too."""
    found = {field for _, field in _declared_fields(path)}
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Name) and variables:
            found.add(node.id)
        elif isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, ast.alias) and variables:
            found.add((node.asname or node.name).split(".")[-1])
        elif isinstance(node, ast.keyword) and node.arg:
            found.add(node.arg)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            found.add(node.name)
    return found


def _strings(path: Path) -> set[str]:
    return {
        node.value
        for node in ast.walk(_tree(path))
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    }


def _files_naming(names: set[str]) -> set[str]:
    return {_relative(path) for path in _serving_files() if _names(path) & names}


def _declared_fields(path: Path) -> set[tuple[str, str]]:
    """(class, field) for each annotated class attribute the file declares."""
    return {
        (node.name, item.target.id)
        for node in ast.walk(_tree(path))
        if isinstance(node, ast.ClassDef)
        for item in node.body
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
    }


# ---- the probes: from the code, the source files each checked row must name ---------------------


def per_key_limit() -> set[str]:
    """The files that spell a limit one by one: where each class is defined, and every file that
    reads, stores or reports one of their fields by name. Fields some other class also declares
    (`max_sessions`: the worker's too) are left out: their name does not say which is meant."""
    classes = [_load(target) for target in LIMIT_CLASSES]
    fields = {field.name for cls in classes for field in dataclasses.fields(cls)}
    ours = {cls.__name__ for cls in classes}
    elsewhere = {
        field for path in _serving_files() for owner, field in _declared_fields(path) if owner not in ours
    }
    distinctive = fields - elsewhere
    assert distinctive, "no limit field is distinctive: the probe sees nothing"
    # Attributes, keywords, properties and fields, not local variables: `max_tokens = ...` in the
    # OpenAI reader is a response's budget, not a limit. A Redis field is a string ending in one.
    spelled = {
        _relative(path)
        for path in _serving_files()
        if _names(path, variables=False) & distinctive
        or any(text == f or text.endswith(f"_{f}") for text in _strings(path) for f in distinctive)
    }
    return {_file_of(target) for target in LIMIT_CLASSES} | spelled


def openai_event() -> set[str]:
    """The files that name a client event (its definition, its parsing, its dispatch, what
    consumes it) and the one that builds the server events a reply is made of."""
    members = {cls.__name__ for cls in typing.get_args(_load(OPENAI_CLIENT_EVENTS))}
    assert len(members) > 3, "the client events' union has too few members to be the union"
    builders = {
        _relative(path)
        for path in _serving_files()
        if any(
            isinstance(node, ast.FunctionDef) and node.name == EVENT_BUILDER for node in ast.walk(_tree(path))
        )
    }
    assert builders, f"no module defines {EVENT_BUILDER}()"
    return _files_naming(members) | builders


def kv_tier() -> set[str]:
    """The files that name the host tier: what its module defines, every identifier carrying the
    tier's word (`host_pages`, `host_kv_tokens`, `host_pages_total`, ...) and the memory figures
    of the tier's types (offloads, restores). A new tier touches the same places, and has a module
    of its own in the host tier's folder."""
    tier = importlib.import_module(HOST_TIER_MODULE)
    defined = {
        name for name, value in vars(tier).items() if getattr(value, "__module__", None) == tier.__name__
    }
    word = re.compile(rf"(^|_){HOST_TIER_WORD}_")
    worded = {name for path in _serving_files() for name in _names(path) if word.search(name)}
    owner = importlib.import_module(MEMORY_OWNER.partition(":")[0])
    stats = {
        field.name
        for cls in vars(owner).values()
        if dataclasses.is_dataclass(cls) and isinstance(cls, type)
        for field in dataclasses.fields(cls)
        if str(field.type) in defined
    }
    assert defined and worded and stats, "the host tier's anchors found nothing"
    # A new tier's memory and copies are a module of their own beside the host tier's.
    module = _file_of(HOST_TIER_MODULE)
    return _files_naming(defined | worded | stats) - {module} | {str(Path(module).parent) + "/"}


def eviction_policy() -> set[str]:
    """The memory owner, and the files that keep the signal its eviction order sorts by (the
    attributes its `sorted(..., key=lambda s: s.<attribute>)` calls read)."""
    owner_file = REPO / _file_of(MEMORY_OWNER)
    keys = {
        attribute.attr
        for node in ast.walk(_tree(owner_file))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "sorted"
        for keyword in node.keywords
        if keyword.arg == "key" and isinstance(keyword.value, ast.Lambda)
        for attribute in ast.walk(keyword.value.body)
        if isinstance(attribute, ast.Attribute)
    }
    assert keys, "the memory owner sorts by nothing: where is the eviction order?"
    return {_relative(owner_file)} | _files_naming(keys)


def attention_backend() -> set[str]:
    """The folder of the backends' files, the registry's module, and every other source file
    that lists the registered backends' names (one string naming them all)."""
    registry = _load(ATTENTION_REGISTRY)
    modules = [entry.target.partition(":")[0] for entry in registry.values()]
    folders = {str(Path(_file_of(module)).parent) + "/" for module in modules}
    assert len(folders) == 1, f"the backends live in one folder, not {sorted(folders)}"
    names = set(registry)
    listing = {
        _relative(path)
        for path in _serving_files()
        if any(all(name in text for name in names) for text in _strings(path))
        and not _relative(path).startswith(tuple(folders))
    }
    return folders | {_file_of(ATTENTION_REGISTRY)} | listing


# The row's first cell -> its probe.
PROBES: Final[dict[str, Callable[[], set[str]]]] = {
    "a per-key limit": per_key_limit,
    "an OpenAI client event": openai_event,
    "a KV tier": kv_tier,
    "an eviction policy": eviction_policy,
    "an attention backend": attention_backend,
}

# ---- the tests --------------------------------------------------------------------------------


def test_every_path_the_table_names_exists() -> None:
    rows = documented()
    assert set(PROBES) <= set(rows), f"rows the probes check are missing: {sorted(set(PROBES) - set(rows))}"
    for row in rows.values():
        for path in named_paths(row.touch) | named_paths(row.read_first):
            assert (REPO / path).exists(), f"'{row.change}' names {path}, which does not exist"


@pytest.mark.parametrize("change", list(PROBES))
def test_a_checked_row_names_exactly_the_files_its_change_touches(change: str) -> None:
    row = documented()[change]
    named, found = source(named_paths(row.touch)), PROBES[change]()
    assert named == found, (
        f"docs/design.md 'Where to make a change', row '{change}': "
        f"add {sorted(found - named)}, drop {sorted(named - found)} "
        f"(found from the code by {PROBES[change].__name__})"
    )


def test_the_table_reader_reads_three_cells_and_only_paths() -> None:
    doc = (
        f"{TABLE_TITLE}\n\n| to add | touch | read first |\n|---|---|---|\n"
        "| a thing | `gateway/app.py` (its `handler`), `tests/x/`; `docs/a.md` | `shared/` |\n"
        "\n## 3. Next\n| not | a | row |\n"
    )
    rows = documented(doc)
    assert list(rows) == ["a thing"]
    row = rows["a thing"]
    assert named_paths(row.touch) == {"gateway/app.py", "tests/x/", "docs/a.md"}
    assert source(named_paths(row.touch)) == {"gateway/app.py"} and named_paths(row.read_first) == {"shared/"}
