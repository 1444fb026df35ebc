"""The guards on the house's layout that ruff and lint-imports cannot state themselves: each deferred import
says why, the banned `from gpt import X` covers every name the package root exports, and the acyclic-siblings
contract covers every room."""

import ast
import re
import sys
from pathlib import Path

import gpt

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def deferred_imports_without_a_reason(source: str) -> list[int]:
    """Line numbers of the imports inside a function that carry no comment on any of their lines."""
    lines = source.splitlines()
    found = []
    for fn in ast.walk(ast.parse(source)):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    if not any("#" in line for line in lines[node.lineno - 1 : node.end_lineno]):
                        found.append(node.lineno)
    return sorted(set(found))


def test_the_check_finds_a_silent_deferred_import():
    source = "import os\n\ndef f():\n    import json\n    from a import (  # lazy: a\n        b,\n    )\n"
    assert deferred_imports_without_a_reason(source) == [4]


def test_every_deferred_import_in_gpt_says_why():
    missing = [
        f"{path.relative_to(ROOT)}:{line}"
        for path in sorted((ROOT / "gpt").rglob("*.py"))
        for line in deferred_imports_without_a_reason(path.read_text())
    ]
    assert not missing, f"a deferred import says why in a trailing comment: {missing}"


def test_the_banned_package_root_imports_are_every_export():
    banned = PYPROJECT["tool"]["ruff"]["lint"]["flake8-tidy-imports"]["banned-api"]
    assert set(banned) == {f"gpt.{name}" for name in gpt.__all__}
    assert "TID251" in PYPROJECT["tool"]["ruff"]["lint"]["select"]


def test_every_room_has_acyclic_siblings():
    contracts = PYPROJECT["tool"]["importlinter"]["contracts"]
    ancestors = {a for c in contracts if c["type"] == "acyclic_siblings" for a in c["ancestors"]}
    rooms = {f"gpt.{p.parent.name}" for p in (ROOT / "gpt").glob("*/__init__.py")}
    assert rooms and rooms <= ancestors


def test_the_console_script_is_the_command():
    scripts = PYPROJECT["project"]["scripts"]
    module, name = scripts["gpt"].split(":")
    assert (module, name) == ("gpt.cli.main", "main")


def test_no_module_in_gpt_is_a_bare_forwarder():
    """`gpt VERB` is the one way in: no module whose body is only imports and a `__main__` call (the old
    `python -m gpt.X` forwarders), except gpt/__main__.py, the door of `python -m gpt` itself."""
    bare = []
    for path in sorted((ROOT / "gpt").rglob("*.py")):
        body = ast.parse(path.read_text()).body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body = body[1:]  # the docstring
        calls_main = any(isinstance(node, ast.If) and "__main__" in ast.unparse(node.test) for node in body)
        only_imports = all(isinstance(node, (ast.Import, ast.ImportFrom, ast.If)) for node in body)
        if calls_main and only_imports and path.relative_to(ROOT).as_posix() != "gpt/__main__.py":
            bare.append(path.relative_to(ROOT).as_posix())
    assert not bare, f"forwarders: {bare}; `gpt VERB` (gpt/cli/main.py) replaces `python -m gpt.VERB`"


def listed_modules(docstring: str) -> set[str]:
    """The modules a room's docstring lists: each `name.py` in backticks (a path with a slash is another
    room's file), and a `__dunder__` module named bare (`__main__`)."""
    return set(re.findall(r"`(\w+\.py)`", docstring)) | {f"{n}.py" for n in re.findall(r"`(__\w+__)`", docstring)}


def test_the_check_reads_a_rooms_module_list():
    doc = "`a.py` the first; `b.py` and `c.py`; gpt/other/d.py and `gpt/x/e.py` elsewhere; `f(x)`; `__main__` runs it"
    assert listed_modules(doc) == {"a.py", "b.py", "c.py", "__main__.py"}


def test_every_room_docstring_lists_its_modules():
    wrong = []
    for init in sorted((ROOT / "gpt").glob("*/__init__.py")):
        present = {p.name for p in init.parent.glob("*.py")} - {"__init__.py"}
        listed = listed_modules(ast.get_docstring(ast.parse(init.read_text())) or "")
        if listed != present:
            room = init.parent.relative_to(ROOT)
            wrong.append(f"{room}: not listed {sorted(present - listed)}, listed but absent {sorted(listed - present)}")
    assert not wrong, "each room's docstring lists its modules as `name.py`:\n" + "\n".join(wrong)
