"""Holds the flashinfer backend, and the CPU reference of flashinfer the tests use, against the
pinned flashinfer-python wheel's own source: no import, no CUDA (the wheel is pure Python).

Every call the backend makes on the flashinfer module (`self._flashinfer.NAME(...)`) and on the
wrapper it builds (`self._wrapper.METHOD(...)`) is read from the backend's source, so the list
cannot drift from the code. For each one the wheel must define that function, class or method
with every keyword the backend passes, in the order the backend passes them, and no required
parameter the backend leaves out; and the reference must declare the same parameters in the same
order as far as it goes.

    python scripts/check_flashinfer_api.py PATH/flashinfer_python-*.whl   # exit 0: all match
    python scripts/check_flashinfer_api.py PATH/...whl --backend FILE      # check another backend source
    python scripts/check_flashinfer_api.py --pin    # the requirement pinned in pyproject's gpu extra
"""

from __future__ import annotations

import ast
import sys
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BACKEND = REPO / "worker" / "attention" / "flashinfer_backend.py"
REFERENCE = REPO / "tests" / "worker" / "flashinfer_reference.py"
MODULE_ATTR, WRAPPER_ATTR = "_flashinfer", "_wrapper"


@dataclass(frozen=True)
class Call:
    owner: str | None  # the wrapper class for a method call; None for a module-level name
    name: str
    positional: int
    keywords: tuple[str, ...]


def pinned_requirement() -> str:
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    return next(req for req in extras["gpu"] if req.startswith("flashinfer-python"))


def _self_attr(node: ast.expr, attr: str) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and node.attr == attr
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    )


def backend_calls(source: str) -> list[Call]:
    """The flashinfer calls in the backend's source, the wrapper's class named from its construction."""
    tree = ast.parse(source)
    wrapper_class = None
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign | ast.AnnAssign) and isinstance(node.value, ast.Call):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            func = node.value.func
            if any(_self_attr(t, WRAPPER_ATTR) for t in targets) and isinstance(func, ast.Attribute):
                wrapper_class = func.attr
    calls = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        keywords = tuple(k.arg for k in node.keywords if k.arg is not None)
        if _self_attr(node.func.value, MODULE_ATTR):
            calls.append(Call(None, node.func.attr, len(node.args), keywords))
        elif _self_attr(node.func.value, WRAPPER_ATTR):
            calls.append(Call(wrapper_class, node.func.attr, len(node.args), keywords))
    return calls


def _parameters(fn: ast.FunctionDef) -> tuple[list[str], set[str]]:
    """(positional-or-keyword then keyword-only parameter names without self, the required ones)."""
    args = fn.args
    plain = [a.arg for a in args.posonlyargs + args.args]
    required = set(plain[: len(plain) - len(args.defaults)])
    required |= {a.arg for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True) if d is None}
    names = plain + [a.arg for a in args.kwonlyargs]
    if names and names[0] == "self":
        names = names[1:]
    required.discard("self")
    return names, required


def definitions(sources: dict[str, str]) -> dict[tuple[str | None, str], ast.FunctionDef]:
    """Every module-level function and every class's method (a class by its `__init__`, keyed as
    (None, class name)); the last definition wins, as at run time (overloads come first)."""
    found: dict[tuple[str | None, str], ast.FunctionDef] = {}
    for source in sources.values():
        for node in ast.parse(source).body:
            if isinstance(node, ast.FunctionDef):
                found[(None, node.name)] = node
            elif isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, ast.FunctionDef):
                        found[(node.name, item.name)] = item
                        if item.name == "__init__":
                            found[(None, node.name)] = item
    return found


def exported(init_source: str) -> dict[str, str]:
    """Each name `flashinfer/__init__.py` exports -> the wheel file it comes from."""
    names = {}
    for node in ast.parse(init_source).body:
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
            path = "flashinfer/" + node.module.replace(".", "/")
            for alias in node.names:
                names[alias.asname or alias.name] = path
    return names


def defining_file(sources: dict[str, str], path: str) -> dict[str, str]:
    """The one source a name is exported from (a module file, or a package's __init__)."""
    for candidate in (f"{path}.py", f"{path}/__init__.py"):
        if candidate in sources:
            return {candidate: sources[candidate]}
    return {}


def check(
    call: Call,
    wheel: dict[tuple[str | None, str], ast.FunctionDef],
    reference: dict[tuple[str | None, str], ast.FunctionDef],
    reference_owner: str | None,
) -> list[str]:
    where = f"{call.owner}.{call.name}" if call.owner else f"flashinfer.{call.name}"
    fn = wheel.get((call.owner, call.name))
    if fn is None:
        return [f"{where}: not defined in the wheel"]
    names, required = _parameters(fn)
    problems = []
    if call.positional > len(names):
        problems.append(f"{where}: {call.positional} positional arguments, the wheel takes {len(names)}")
    given = names[: call.positional] + list(call.keywords)
    missing = [k for k in call.keywords if k not in names]
    if missing:
        problems.append(f"{where}: no parameter {missing} in the wheel ({names})")
    elif [n for n in names if n in call.keywords] != list(call.keywords):
        problems.append(f"{where}: keywords {list(call.keywords)} out of the wheel's order {names}")
    left_out = sorted(required - set(given))
    if left_out:
        problems.append(f"{where}: required parameters {left_out} not passed")
    ref = reference.get((reference_owner, call.name) if call.owner else (None, call.name))
    if ref is None:
        problems.append(f"{where}: the CPU reference does not define it")
    else:
        ref_names, _ = _parameters(ref)
        if ref_names != names[: len(ref_names)]:
            problems.append(f"{where}: the reference's parameters {ref_names} are not the wheel's {names}")
        elif not set(given) <= set(ref_names):
            problems.append(f"{where}: the reference lacks {sorted(set(given) - set(ref_names))}")
    return problems


def wheel_sources(wheel: Path) -> dict[str, str]:
    with zipfile.ZipFile(wheel) as archive:
        return {
            name: archive.read(name).decode()
            for name in archive.namelist()
            if name.startswith("flashinfer/") and name.endswith(".py")
        }


def main(argv: list[str]) -> int:
    if argv == ["--pin"]:
        print(pinned_requirement())
        return 0
    backend = BACKEND
    if len(argv) == 3 and argv[1] == "--backend":
        backend = Path(argv[2])
    elif len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    sources = wheel_sources(Path(argv[0]))
    public = exported(sources["flashinfer/__init__.py"])
    reference = definitions({"reference": REFERENCE.read_text()})
    calls = backend_calls(backend.read_text())
    problems = []
    for call in calls:
        exported_name = call.owner or call.name  # a method is looked up in its class's file
        if exported_name not in public:
            problems.append(f"flashinfer.{exported_name}: not exported by flashinfer/__init__.py")
            continue
        wheel = definitions(defining_file(sources, public[exported_name]))
        # The reference's wrapper is the same class name.
        problems += check(call, wheel, reference, call.owner)
        shown = ", ".join([f"<{call.positional} positional>"] * bool(call.positional) + list(call.keywords))
        print(f"{pinned_requirement()}: {call.owner or 'flashinfer'}.{call.name}({shown})")
    for problem in problems:
        print(f"MISMATCH {problem}")
    print(f"{len(calls)} calls checked, {len(problems)} mismatches")
    return 1 if problems or not calls else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
