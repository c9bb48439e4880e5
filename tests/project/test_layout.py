"""The package keeps the course's shape: one folder per part, and the one rule of dependency
(runtime imports no other part; parts import each other's public names only)."""

import ast
from pathlib import Path

import pytest

import gpucourse as gc

PKG = Path(gc.__file__).resolve().parent
PARTS = sorted(p.name for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").exists())


def _relative_imports(path: Path):
    """(level, module, names) of every ``from .x import y`` in a file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            yield node.level, node.module or "", [a.name for a in node.names], node.lineno
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gpucourse."):
            yield 0, node.module, [a.name for a in node.names], node.lineno


def test_no_flat_modules_left():
    flat = sorted(p.name for p in PKG.glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    assert flat == [], f"modules outside a part's folder: {flat}"
    assert {"runtime", "grading", "data", "basics", "data_parallel", "distributed", "cluster",
            "precision", "pipeline"} <= set(PARTS)


@pytest.mark.parametrize("part", PARTS)
def test_parts_import_only_public_names_of_other_parts(part):
    bad = []
    for path in sorted((PKG / part).rglob("*.py")):
        for level, module, names, line in _relative_imports(path):
            where = f"{path.relative_to(PKG)}:{line}"
            if level == 0:          # absolute gpucourse.<part>.<module> imports inside the package
                bad.append(f"{where}: absolute import of {module}")
                continue
            if level == 1:
                continue            # same part: free
            target = module.split(".")
            if part == "runtime":
                bad.append(f"{where}: runtime must not import another part ({module})")
            elif len(target) > 1:
                bad.append(f"{where}: imports a module inside another part ({module}); use its public names")
            elif any(n.startswith("_") for n in names):
                bad.append(f"{where}: imports private names {names} from {module}")
    assert bad == []


def test_top_level_reexports_every_part_public_name():
    import importlib

    missing = []
    for part in PARTS:
        mod = importlib.import_module(f"gpucourse.{part}")
        for name in getattr(mod, "__all__", []):
            if part == "grading" or part == "runtime" and (name.startswith("check_") or name in ("listen_on", "reap_children", "group_info", "same_on_every_rank", "in_kernel", "run_main",
                                                                     "EndOfBackward", "graph_nodes", "output_tensors", "hide_check_frames", "warm_parent")):
                continue    # grading's engine, runtime's validators, its loopback listener and reaper, its
                            # autograd-graph helpers, its launcher's warm-up are tools
            if getattr(gc, name, None) is not getattr(mod, name):
                missing.append(f"{part}.{name}")
    assert missing == []


def test_one_argument_validator_for_the_whole_package():
    """Int checks go through runtime/validate.py, not per-module copies of it."""
    import re

    copies = []
    for path in sorted(PKG.rglob("*.py")):
        rel = str(path.relative_to(PKG))
        if rel == "runtime/validate.py":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.match(r"\s*def _check_(int|chunks|world|size)\b", line):
                copies.append(f"{rel}:{n}: {line.strip()}")
            # a scalar int check written out by hand (lists of ints are checked element-wise)
            if re.search(r"if isinstance\((\w+), bool\) or not isinstance\(\1, int\)(:| or \1 < )", line):
                copies.append(f"{rel}:{n}: {line.strip()}")
    assert copies == [], "use gpucourse.runtime.validate.check_int:\n" + "\n".join(copies)


def test_test_files_have_unique_names():
    """tests/<part>/ folders are not packages: pytest imports each test file by its basename, so two
    files with one name in different folders break collection ("import file mismatch")."""
    from collections import Counter

    tests = Path(__file__).resolve().parents[1]
    names = Counter(p.name for p in tests.rglob("test_*.py"))
    assert [n for n, c in names.items() if c > 1] == []


def test_top_level_is_lazy_and_every_name_resolves():
    """`gpucourse/__init__.py` maps each public name to its part (PEP 562): the map is the whole
    stable API, each name is its part's own public object, and a clean interpreter gets none of
    the parts (nor torch) from `import gpucourse` alone."""
    import importlib
    import subprocess
    import sys

    assert len(gc.__all__) == len(set(gc.__all__)), "a name is mapped to two parts"
    assert set(gc._PARTS) <= set(PARTS)
    wrong = []
    for name in gc.__all__:
        part = importlib.import_module(f"gpucourse.{gc._WHERE[name]}")
        if name not in getattr(part, "__all__", []) or getattr(gc, name) is not getattr(part, name):
            wrong.append(f"{gc._WHERE[name]}.{name}")
    assert wrong == []
    assert set(gc.__all__) | set(PARTS) <= set(dir(gc))
    assert all(getattr(gc, part) is importlib.import_module(f"gpucourse.{part}") for part in PARTS)
    with pytest.raises(AttributeError, match="no_such_name"):
        gc.no_such_name
    code = ("import sys, gpucourse as gc; parts = [m for m in sys.modules if m.startswith('gpucourse.')]; "
            "n = len(gc.__all__); print(parts, 'torch' in sys.modules, gc.launch.__module__, "
            "'torch' in sys.modules, len(set(dir(gc)) & set(gc.__all__)) == n)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.stdout.split() == ["[]", "False", "gpucourse.runtime.launcher", "True", "True"], r.stderr
