"""What the layout must keep, read from the source (an AST scan: nothing is imported or executed).

- No import cycle among the project's modules. An import counts wherever it stands (inside a
  function or under TYPE_CHECKING too), and importing `a.b.c` runs the `__init__` of `a` and `a.b`
  first, so it counts as importing those packages as well: a cycle through a package's `__init__`
  breaks at import time depending on which module happens to be imported first.
- No import upward, with no exception: shared/ is what the gateway and the worker both speak and
  imports nothing above it; the gateway and the worker import neither each other nor what starts or
  loads them (loadtest/, and microturn/: the `microturn` command, `microturn up` and its process
  supervision), which stand on top.

The whole tree is parsed in a fresh interpreter (`in_fresh_process`): inside a long pytest run,
CPython 3.11.7's `ast.parse` now and then fails with "AST constructor recursion depth mismatch"
once something earlier changed the recursion limit (hypothesis does), which a new process avoids.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("shared", "gateway", "worker", "loadtest", "microturn")
# Each package and the packages it must never import (the top floor, loadtest/ and microturn/, may
# import everything below it; a cycle among modules is still caught by the cycle test).
BELOW_ALL_OF = {
    "shared": ("gateway", "worker", "loadtest", "microturn"),
    "gateway": ("worker", "loadtest", "microturn"),
    "worker": ("gateway", "loadtest", "microturn"),
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for package in PACKAGES for p in sorted((REPO / package).rglob("*.py"))}


def imported_names(path: Path, name: str) -> list[tuple[int, str]]:
    """(line, dotted name) of everything the file imports, relative imports resolved."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            found.append((node.lineno, module))
            found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
    return found


def import_graph(known: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the project modules it imports, each with the packages whose __init__ that runs."""
    graph: dict[str, set[str]] = {}
    for name, path in known.items():
        edges = set()
        for _line, imported in imported_names(path, name):
            parts = imported.split(".")
            for end in range(1, len(parts) + 1):
                target = ".".join(parts[:end])
                if target in known and target != name and not name.startswith(target + "."):
                    edges.add(target)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def scan() -> dict[str, object]:
    """What the tests read of the tree: the import graph, and every shared/ module's imports."""
    known = modules()
    return {
        "graph": {name: sorted(edges) for name, edges in import_graph(known).items()},
        "imports": {name: imported_names(path, name) for name, path in known.items()},
    }


def in_fresh_process() -> tuple[dict[str, set[str]], dict[str, list[tuple[int, str]]]]:
    code = "import json; from tests.test_architecture import scan; print(json.dumps(scan()))"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True, timeout=120
    )
    found = json.loads(done.stdout)
    graph = {name: set(edges) for name, edges in found["graph"].items()}
    imports = {
        name: [(line, imported) for line, imported in pairs] for name, pairs in found["imports"].items()
    }
    return graph, imports


def test_no_import_cycle_among_the_project_modules() -> None:
    graph, _ = in_fresh_process()
    assert len(graph) > 100  # the scan sees the project
    assert cycles(graph) == []


def test_the_cycle_finder_sees_a_cycle_through_a_package_init(tmp_path: Path) -> None:
    graph = {"a": {"a.b"}, "a.b": {"c"}, "c": {"a"}, "d": {"c"}}
    assert cycles(graph) == [["a", "a.b", "c"]]
    assert cycles({"x": {"y"}, "y": set()}) == []


def test_importing_a_submodule_counts_its_packages(tmp_path: Path) -> None:
    files = {"p": "p/__init__.py", "p.q": "p/q/__init__.py", "p.q.r": "p/q/r.py", "user": "user.py"}
    for path in files.values():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("")
    (tmp_path / "user.py").write_text("def later():\n    from p.q.r import name\n")
    (tmp_path / "p/q/r.py").write_text("from . import sibling\n")
    graph = import_graph({name: tmp_path / path for name, path in files.items()})
    assert graph["user"] == {"p", "p.q", "p.q.r"}
    assert graph["p.q.r"] == set()  # `from . import sibling` names p.q, the package it lives in


def upward_imports(imports: dict[str, list[tuple[int, str]]]) -> list[str]:
    """Every import from a package into one it must never import (BELOW_ALL_OF), as `module:line`."""
    return [
        f"{name}:{line} imports {imported}"
        for name, pairs in imports.items()
        for line, imported in pairs
        if imported.split(".")[0] in BELOW_ALL_OF.get(name.split(".")[0], ())
    ]


def test_no_package_imports_a_layer_above_it_with_no_exception() -> None:
    _, imports = in_fresh_process()
    assert upward_imports(imports) == []
    # The scan sees imports inside functions: the entry point imports what it starts lazily.
    names = [imported for _, imported in imports["microturn.main"]]
    assert "worker.server.main" in names and "gateway.main" in names
    assert "shared.cli" not in imports and "microturn.stack" in imports  # the operations moved up


def test_the_layer_check_sees_an_upward_import() -> None:
    imports = {
        "shared.store.values": [(3, "gateway.session.machine")],
        "gateway.auth.keys": [(5, "shared.settings"), (9, "microturn.processes")],
        "loadtest.overhead": [(7, "microturn.stack")],  # the top floor may
    }
    assert upward_imports(imports) == [
        "shared.store.values:3 imports gateway.session.machine",
        "gateway.auth.keys:9 imports microturn.processes",
    ]


def test_protocol_names_are_imported_from_their_defining_module() -> None:
    """shared/protocol/__init__.py re-exports nothing, and nothing imports from the bare package.

    Read as text, not parsed: parsing every file of the tree trips CPython 3.11.7's AST bug
    ("AST constructor recursion depth mismatch") now and then, and an import line is plain text.
    """
    init = (REPO / "shared" / "protocol" / "__init__.py").read_text()
    assert not re.search(r"^\s*(from|import)\s", init, re.MULTILINE)
    bare = re.compile(r"^\s*from\s+shared\.protocol\s+import\b", re.MULTILINE)
    offending = [
        str(path.relative_to(REPO))
        for folder in (*PACKAGES, "tests")
        for path in sorted((REPO / folder).rglob("*.py"))
        if bare.search(path.read_text())
    ]
    assert offending == []


def test_the_gateway_session_machine_loads_no_io_library() -> None:
    """Sans-I/O: importing the machine (and all it imports) loads no event loop, socket or Redis code."""
    io = ("asyncio", "redis", "starlette", "websockets", "uvicorn")
    code = f"import sys, gateway.session.machine; print(sorted(set({io!r}) & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
    code = "import sys, gateway.session.client_session; print('asyncio' in sys.modules)"  # can fail
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "True"


# The session's core: the machine's modules (every module of gateway/session/ but its asyncio shell
# and the socket's writer) and the credential it consults. It reads no clock and moves no metric.
SESSION_SHELL = ("gateway/session/client_session.py", "gateway/session/outbox.py")
SESSION_CORE_EXTRA = ("gateway/auth/session_auth.py",)
CLOCK_READERS = frozenset(
    {"time", "time_ns", "monotonic", "monotonic_ns", "perf_counter", "perf_counter_ns", "now", "utcnow"}
    | {"today", "now_ms", "get_running_loop", "get_event_loop"}
)
CLOCK_MODULES = frozenset({"time", "datetime", "asyncio"})
# Reads the clock when called with no time (gateway/auth/api_keys.py): the core must pass one.
CLOCK_DEFAULTING = frozenset({"ms_until_next_day"})


def session_core() -> list[Path]:
    core = [
        p
        for p in sorted((REPO / "gateway" / "session").glob("*.py"))
        if str(p.relative_to(REPO)) not in SESSION_SHELL
    ]
    return core + [REPO / extra for extra in SESSION_CORE_EXTRA]


def clock_and_metric_uses(source: str) -> list[str]:
    """Where `source` imports a clock or a metrics module, calls a clock, or names a metric."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import | ast.ImportFrom):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            for module in modules:
                if module.split(".")[0] in CLOCK_MODULES or "metrics" in module.split("."):
                    found.append(f"{node.lineno}: imports {module}")
            if isinstance(node, ast.ImportFrom):
                found += [f"{node.lineno}: imports {a.name}" for a in node.names if a.name in CLOCK_READERS]
        elif isinstance(node, ast.Call):
            func = node.func
            name = (
                func.attr
                if isinstance(func, ast.Attribute)
                else func.id
                if isinstance(func, ast.Name)
                else ""
            )
            if name in CLOCK_READERS or (name in CLOCK_DEFAULTING and not node.args and not node.keywords):
                found.append(f"{node.lineno}: calls {name}()")
        elif isinstance(node, ast.Attribute | ast.Name | ast.arg):
            name = (
                node.attr
                if isinstance(node, ast.Attribute)
                else node.id
                if isinstance(node, ast.Name)
                else node.arg
            )
            if "metrics" in name:
                found.append(f"{node.lineno}: names {name}")
    return found


def clock_and_metric_uses_in_fresh_process(sources: dict[str, str]) -> dict[str, list[str]]:
    """`clock_and_metric_uses` of each source, parsed in a new interpreter (the module docstring:
    in a long pytest run `ast.parse` failed with "AST constructor recursion depth mismatch" here
    too, once, on a fresh clone's CI)."""
    code = (
        "import json, sys; from tests.test_architecture import clock_and_metric_uses\n"
        "sources = json.load(sys.stdin)\n"
        "print(json.dumps({name: clock_and_metric_uses(text) for name, text in sources.items()}))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        input=json.dumps(sources),
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    found: dict[str, list[str]] = json.loads(done.stdout)
    return found


def test_the_session_core_reads_no_clock_and_moves_no_metric() -> None:
    """Time comes in with the events, counts go out as actions: the machine is a function of its inputs."""
    core = session_core()
    assert {p.name for p in core} >= {"machine.py", "actions.py", "turns.py", "guard.py", "session_auth.py"}
    sources = {str(path.relative_to(REPO)): path.read_text() for path in [*core, REPO / SESSION_SHELL[0]]}
    found = clock_and_metric_uses_in_fresh_process(sources)
    shell = found.pop(SESSION_SHELL[0])
    assert {name: uses for name, uses in found.items() if uses} == {}
    # The shell is where the clocks are read and the counts land: the scan sees it.
    assert any("calls monotonic()" in use for use in shell) and any("metrics" in use for use in shell)


def test_the_clock_check_sees_every_way_in() -> None:
    source = (
        "import time\nfrom gateway.metrics import GatewayMetrics\nfrom time import monotonic\n"
        "def f(self, metrics):\n    self._metrics.chunks += 1\n    return time.time(), ms_until_next_day()\n"
        "def g(at):\n    return ms_until_next_day(at.wall_s), now_ms()\n"
    )
    assert clock_and_metric_uses_in_fresh_process({"f.py": source})["f.py"] == [
        "1: imports time",
        "2: imports gateway.metrics",
        "3: imports time",
        "3: imports monotonic",
        "4: names metrics",
        "5: names _metrics",
        "6: calls time()",
        "6: calls ms_until_next_day()",
        "8: calls now_ms()",
    ]
