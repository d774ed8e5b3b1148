"""Every Lua script is one file in shared/store/lua/, read through `lua_script`; none is inline or unused."""

from __future__ import annotations

import ast
from pathlib import Path

from shared.store.schema import lua_code, lua_script

REPO = Path(__file__).resolve().parents[2]
SOURCES = ("shared", "gateway", "worker", "loadtest")
LUA_DIR = REPO / "shared" / "store" / "lua"


def _python_files() -> list[Path]:
    return [path for folder in SOURCES for path in (REPO / folder).rglob("*.py")]


def _script_names_used() -> set[str]:
    names: set[str] = set()
    for path in _python_files():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "lua_script":
                names |= {arg.value for arg in node.args if isinstance(arg, ast.Constant)}
    return names


def test_every_script_named_in_the_code_is_a_file_and_every_file_is_used() -> None:
    files = {path.stem for path in LUA_DIR.glob("*.lua")}
    assert _script_names_used() == files


def test_no_lua_is_written_inline_in_python() -> None:
    inline = [str(path.relative_to(REPO)) for path in _python_files() if "redis.call(" in path.read_text()]
    assert inline == []


def test_a_prelude_comes_first_and_each_script_reads_whole() -> None:
    admit = lua_script("now_ms", "key_admit")
    assert admit.index("local now") < admit.index("ZREMRANGEBYSCORE")
    assert lua_script("place").startswith("-- place.lua")


def test_a_script_sent_whole_with_every_call_is_sent_without_its_comments() -> None:
    script = lua_script("log_append")
    code = lua_code(script)
    assert not any(line.lstrip().startswith("--") for line in code.splitlines())
    assert [line for line in script.splitlines() if not line.lstrip().startswith("--")] == code.splitlines()
