"""Every parse in the grader's process holds the AST lock (``graded_build.parse``).

CPython 3.11 keeps the AST constructor's recursion depth in module state, shared by all threads
(python/cpython#106905): two grading threads parsing at once raised ``SystemError: AST constructor
recursion depth mismatch`` and a notebook was "could not be graded". A lock only helps if *every*
parse takes it — ``ast.literal_eval`` of a string parses too — so this reads the grader's modules
and names any parse that does not go through ``graded_build.parse``.

``judge.py`` runs in the judges' processes (one thread each; the host starts none) and
``harness.py`` in the student's kernel: neither shares the grader's threads.
"""

import ast
from pathlib import Path

import pytest

import gpucourse.grading as grading

GRADING = Path(grading.__file__).parent
OTHER_PROCESSES = {"judge.py", "harness.py"}


def _bindings(tree: ast.Module) -> tuple[set[str], dict[str, str]]:
    """What the module's imports bind: the names bound to the ``ast`` module (``import ast as a``),
    and each name bound to a parse — ``"ast.parse"``, ``"ast.literal_eval"`` (``from ast import
    parse as p``) or ``"locked"`` (``graded_build.parse``)."""
    modules, names = set(), {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules |= {a.asname or a.name for a in node.names if a.name == "ast"}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == "ast":
            names |= {a.asname or a.name: f"ast.{a.name}" for a in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[-1] == "graded_build":
            names |= {a.asname or a.name: "locked" for a in node.names if a.name == "parse"}
    return modules, names


def _unlocked_parses(source: str, filename: str) -> list[str]:
    tree = ast.parse(source)
    modules, names = _bindings(tree)
    # graded_build defines the locked parse itself: its name is locked there, and its body is the lock
    own = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "parse"
           and filename == "graded_build.py"]
    if own:
        names["parse"] = "locked"
    inside_parse = {id(n) for d in own for n in ast.walk(d)}

    def meaning(f) -> str | None:
        """``"ast.parse"``, ``"ast.literal_eval"``, ``"locked"``, ``"compile"`` or None (anything else)."""
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in modules:
            return f"ast.{f.attr}"
        if isinstance(f, ast.Name):
            return names.get(f.id, "compile" if f.id == "compile" else None)
        return None

    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or id(node) in inside_parse:
            continue
        what, where = meaning(node.func), f"{filename}:{node.lineno}"
        if what == "ast.parse":
            found.append(f"{where} ast.parse")
        elif what == "ast.literal_eval":
            arg = node.args[0] if node.args else None
            if not (isinstance(arg, ast.Call) and meaning(arg.func) == "locked"):
                found.append(f"{where} literal_eval of a string (it parses it, without the lock)")
        elif what == "compile" and any(isinstance(a, ast.Attribute) and a.attr == "PyCF_ONLY_AST"
                                       for a in ast.walk(node)):
            found.append(f"{where} compile(..., PyCF_ONLY_AST)")
    return found


def test_every_parse_of_the_grader_process_takes_the_lock():
    modules = sorted(p for p in GRADING.glob("*.py") if p.name not in OTHER_PROCESSES)
    assert len(modules) > 5, modules
    unlocked = [hit for p in modules for hit in _unlocked_parses(p.read_text(), p.name)]
    assert not unlocked, ("parses outside graded_build.parse (its lock) in the grader's process: "
                          + "; ".join(unlocked))


@pytest.mark.parametrize("source, expected", [
    ("import ast\nast.literal_eval(text)\n", ["m.py:2 literal_eval of a string"]),
    ("import ast\nast.parse(s)\n", ["m.py:2 ast.parse"]),
    ("import ast\nfrom .graded_build import parse\nast.literal_eval(parse(text, 'eval'))\n", []),
    ("from .graded_build import parse\nparse(s)\n", []),
    # the same names, bound elsewhere: what the name stands for decides, not its spelling
    ("from ast import parse\nparse(s)\n", ["m.py:2 ast.parse"]),
    ("import ast as a\nfrom .graded_build import parse\na.literal_eval(parse(s, 'eval'))\na.parse(s)\n",
     ["m.py:4 ast.parse"]),
    ("from ast import literal_eval, parse\nliteral_eval(parse(s, 'eval'))\n",
     ["m.py:2 literal_eval of a string", "m.py:2 ast.parse"]),
    ("import ast\nimport ast as a\nclass P:\n    def parse(self, s): ...\nP().parse(s)\na.dump(x)\n", []),
])
def test_the_scan_sees_an_unlocked_parse(source, expected):
    hits = _unlocked_parses(source, "m.py")
    assert len(hits) == len(expected) and all(h.startswith(e) for h, e in zip(hits, expected)), hits
