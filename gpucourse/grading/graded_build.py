"""The package a graded kernel imports: the course's own, less the helpers an exercise forbids.

An exercise that says "write ``gc.scatter`` yourself" used to be guarded by a gate inside the
student's kernel: a check that swapped the helper's code for one that raises. Whatever guards the
kernel from inside can be switched off from inside (a thread pool hid the caller, the gate kept the
original in a table, ``importlib.reload`` brought it back). So the grader removes the helper instead:

::

    grade ──► plan_runs(chapter): the exercises in groups; each group strips the gc.* helpers its
              │                   exercises forbid, and none that an exercise of the group needs
              ├─► build(stripped) : a copy of gpucourse/ in which each stripped function — or every
              │                     method of a stripped class — raises ForbiddenCall; nothing else
              │                     of it is left (no body, no docstring, no bytecode cache)
              └─► after the notebook's ordinary run, each group whose exercises passed runs again
                  (cut after its last check), in bwrap, with that copy bound read-only where the
                  package is; only that group's checks are collected from it, and their verdicts count
                  — or, where every group strips something, the notebook's first run is made
                  whole with one group's copy (one that no exercise needs and no other cell
                  names) and stands for the ordinary run; only the other groups run again
                  (grade._first_build)

So while an exercise that forbids ``gc.X`` is checked, ``gc.X``'s implementation is not in the
kernel's reach at all: not on disk, not in memory. What remains is copying its source *text* into
the notebook, which the grader cannot tell from writing it (the README says so).

Example::

    >>> plan_runs({"02.1": {"gc.chunk_sizes_of"}, "02.2": {"gc.scatter"}, "02.3": {"gc.gather"},
    ...            "02.4": set(), "02.5": set()},
    ...           {"02.2": {"gc.chunk_sizes_of"}, "02.5": {"gc.scatter", "gc.gather"}})
    [((), ['02.5']), (('gc.chunk_sizes_of', 'gc.gather'), ['02.1', '02.3', '02.4']), (('gc.scatter',), ['02.2'])]
"""

from __future__ import annotations

import ast
import functools
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

from . import torch_ops

__all__ = ["build", "chapter_needs", "plan_for", "plan_runs", "reachable", "strippable"]

_PACKAGE = Path(__file__).resolve().parents[1]
_NAME = re.compile(r"^gc\.[A-Za-z_]\w*(\.[A-Za-z_]\w*)?$")
#: next to a build's package: ``[[file of the build, the file it stands for], …]`` (the sandbox binds each)
OVERLAYS = "overlays.json"


def strippable(name: str) -> bool:
    """Whether a graded build can leave ``name`` out: a course helper (``"gc.scatter"``,
    ``"gc.DistEnv.to_environ"``), or one of PyTorch's operators that :mod:`.torch_ops` can make a
    no-op where this torch exports it (asked in the judge, which imports torch). PyTorch's Python
    classes (``torch.amp.GradScaler``, ``DistributedDataParallel``) stay behind the runtime gate."""
    if _NAME.match(name):
        return True
    return name in torch_ops.OPERATORS and _patchable(name)


@functools.lru_cache(maxsize=None)
def _patchable(name: str) -> bool:
    return torch_ops.patchable(name)


def plan_runs(forbids: dict[str, set[str]], needs: dict[str, set[str]]
              ) -> list[tuple[tuple[str, ...], list[str]]]:
    """Group exercises into as few notebook runs as possible.

    ``forbids[e]``: the strippable helpers exercise ``e`` forbids; ``needs[e]``: the helpers its
    check and its answer use (directly or through other course code). A run strips the union of its
    exercises' forbids, and none of its exercises may need a stripped helper; an exercise that
    forbids nothing joins the first run it is compatible with (a run with nothing stripped if none).
    """
    runs: list[tuple[set[str], list[str]]] = []
    for exercise in forbids:
        f = set(forbids[exercise])
        if not f:
            continue
        for strip, members in runs:
            union = strip | f
            if all(not (needs.get(m, set()) & union) for m in [*members, exercise]):
                strip |= f
                members.append(exercise)
                break
        else:
            runs.append((f, [exercise]))
    for exercise in forbids:
        if forbids[exercise]:
            continue
        home = next((members for strip, members in runs if not (needs.get(exercise, set()) & strip)), None)
        if home is None:
            runs.insert(0, (set(), []))
            home = runs[0][1]
        home.append(exercise)
    order = list(forbids)
    return [(tuple(sorted(strip)), sorted(members, key=order.index)) for strip, members in runs]


def _target(name: str) -> tuple[Path, list[str]]:
    """(file of the module that defines ``gc.X``, its qualified name split) for a helper name."""
    import gpucourse

    parts = name.split(".")[1:]
    obj = getattr(gpucourse, parts[0])
    module = importlib.import_module(obj.__module__)
    qual = [*getattr(obj, "__qualname__", parts[0]).split("."), *parts[1:]]
    return Path(module.__file__).resolve(), qual


def _stub(node, message: str):
    """``node`` (a def) with its body replaced by one ``raise`` — no docstring, no code of its own."""
    raise_ = parse(f"raise __import__('gpucourse.grading.harness', fromlist=['ForbiddenCall'])"
                   f".ForbiddenCall({message!r})").body[0]
    node.body = [raise_]
    node.returns = None
    return node


class _Strip(ast.NodeTransformer):
    def __init__(self, targets: dict[tuple[str, ...], str]):
        self.targets, self.path, self.done = targets, [], set()

    def _visit_def(self, node):
        self.path.append(node.name)
        here = tuple(self.path)
        try:
            if here in self.targets:
                self.done.add(here)
                if isinstance(node, ast.ClassDef):
                    return self._strip_class(node, self.targets[here])
                return _stub(node, self.targets[here])
            if isinstance(node, ast.ClassDef):
                self.generic_visit(node)
            return node
        finally:
            self.path.pop()

    def _strip_class(self, node, message):
        """Every method raises (``__init__`` too, added where the class had none — a dataclass's
        generated one is then not made); the class itself stays, so imports and ``isinstance`` work."""
        body = []
        for item in node.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                item.decorator_list = [d for d in item.decorator_list
                                       if not (isinstance(d, ast.Name) and d.id in ("property",))]
                body.append(_stub(item, message))
            elif isinstance(item, ast.Expr) and isinstance(getattr(item, "value", None), ast.Constant):
                continue                                            # the docstring
            else:
                body.append(item)
        if not any(isinstance(i, ast.FunctionDef) and i.name == "__init__" for i in body):
            body.append(_stub(parse("def __init__(self, *args, **kwargs): pass").body[0], message))
        node.body = body
        return node

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _visit_def


def build(stripped, exercises_of: dict[str, list[str]], root: Path) -> Path:
    """``root/gpucourse``: the package with each helper in ``stripped`` raising ``ForbiddenCall``.

    ``exercises_of[name]``: the exercises that forbid it (named in the message). Checked by importing
    the copy in a fresh interpreter: a helper the package needs at import time cannot be stripped,
    and that is the course's bug to fix, reported here.
    """
    dest = root / "gpucourse"
    if dest.exists():
        return dest
    operators = sorted(n for n in stripped if n in torch_ops.OPERATORS)
    if operators:
        # PyTorch's own operators: a copy of libtorch_cpu.so in which they do nothing, shown by the
        # sandbox where the library is (OVERLAYS lists it)
        lib = torch_ops.write_library(operators, root / "torch" / "libtorch_cpu.so")
        (root / OVERLAYS).write_text(json.dumps([[str(lib), str(torch_ops.library_path())]]))
    stripped = [n for n in stripped if n not in torch_ops.OPERATORS]
    shutil.copytree(_PACKAGE, dest, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    by_file: dict[Path, dict[tuple[str, ...], str]] = {}
    for name in sorted(stripped):
        path, qual = _target(name)
        which = ", ".join(exercises_of.get(name, [])) or "this notebook"
        message = (f"{name} is off limits in exercise {which}: the exercise asks you to write it "
                   "yourself (the package this notebook is graded with does not contain it)")
        by_file.setdefault(path, {})[tuple(qual)] = message
    for path, targets in by_file.items():
        tree = parse(path.read_text())
        strip = _Strip(targets)
        tree = ast.fix_missing_locations(strip.visit(tree))
        missing = set(targets) - strip.done
        if missing:
            raise RuntimeError(f"graded build: {', '.join('.'.join(m) for m in missing)} not found in {path}")
        (dest / path.relative_to(_PACKAGE)).write_text(ast.unparse(tree) + "\n")
    env = dict(os.environ, PYTHONPATH=str(root), PYTHONDONTWRITEBYTECODE="1")
    probe = subprocess.run([sys.executable, "-c", "import gpucourse"], env=env, cwd=root,
                           capture_output=True, text=True, timeout=300)
    if probe.returncode != 0:
        tail = (probe.stderr.strip().splitlines() or ["?"])[-1]
        raise RuntimeError(f"graded build without {', '.join(sorted(stripped))} does not import: {tail}")
    return dest


# --- what each exercise needs (in the judge, which has the course's solutions and the package) ----

def _public() -> dict[int, str]:
    import gpucourse

    return {id(getattr(gpucourse, n)): f"gc.{n}" for n in dir(gpucourse)
            if not n.startswith("_") and callable(getattr(gpucourse, n, None))}


def _course_callables(obj) -> list:
    """The functions ``obj`` consists of: itself, or a class's methods (its course bases' too)."""
    import inspect

    if inspect.isclass(obj):
        out = []
        for klass in obj.__mro__:
            if getattr(klass, "__module__", "").startswith("gpucourse."):
                for member in vars(klass).values():
                    member = getattr(member, "__func__", member)
                    member = getattr(member, "fget", member)
                    if inspect.isfunction(member):
                        out.append(member)
        return out
    return [obj] if inspect.isfunction(obj) else []


def reachable(names: set[str], identifiers: set[str] | None = None) -> set[str]:
    """Every public ``gc.*`` helper that calling ``names`` can reach through the package's own code
    (names looked up in each function's globals, so ``scatter(...)`` inside DataParallel is
    ``gc.scatter`` and a learner's own ``scatter`` is not). ``identifiers``, if given, collects every
    name and attribute that code reads (which PyTorch operators it uses: :func:`_needs`).

    Example::

        >>> "gc.scatter" in reachable({"gc.DataParallel"}), "gc.MoE" in reachable({"gc.scatter"})
        (True, False)
    """
    import inspect
    import textwrap

    import gpucourse

    public = _public()
    found, seen, read = set(names), set(), set()
    todo = [getattr(gpucourse, n.split(".")[1], None) for n in names]
    while todo:
        obj = todo.pop()
        if obj is None or id(obj) in seen:
            continue
        seen.add(id(obj))
        for fn in _course_callables(obj):
            if not getattr(fn, "__module__", "").startswith("gpucourse.") or id(fn) in read:
                continue
            read.add(id(fn))
            try:
                tree = parse(textwrap.dedent(inspect.getsource(fn)))
            except (OSError, TypeError, SyntaxError):
                continue
            g = fn.__globals__
            if identifiers is not None:
                identifiers |= _identifiers(tree)
            for node in ast.walk(tree):
                target = None
                if isinstance(node, ast.Name):
                    target = g.get(node.id)
                elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                    base = g.get(node.value.id)
                    if inspect.ismodule(base) and base.__name__.startswith("gpucourse"):
                        target = getattr(base, node.attr, None)
                if target is None or not (inspect.isfunction(target) or inspect.isclass(target)):
                    continue
                if id(target) in public:
                    found.add(public[id(target)])
                if getattr(target, "__module__", "").startswith("gpucourse."):
                    todo.append(target)
    return found


_AST_LOCK = threading.Lock()


def parse(source: str, mode: str = "exec") -> ast.AST:
    """``ast.parse``, one thread of this process at a time. CPython 3.11 keeps the AST constructor's
    recursion depth in module state: two grading threads parsing at once raised ``SystemError: AST
    constructor recursion depth mismatch`` (python/cpython#106905), and that notebook was "could not
    be graded" (CI saw it once in 2681 tests). Every parse of the grader's process goes through
    here, ``ast.literal_eval`` of a kernel's text too (``literal_eval(parse(text, "eval"))``): a
    parse the lock does not cover can trip a covered one in another thread."""
    with _AST_LOCK:
        return ast.parse(source, mode=mode)


def chapter_needs(nb) -> tuple[set[str], dict[str, set[str]], dict[str, set[str]]]:
    """(what the set-up needs, exercise → what its section needs, exercise → what its section needs
    up to its check): the ``gc.*`` helpers the kernel's code of the solutions notebook names, as
    ``gc.X`` or imported from the package, and all they reach.

    The kernel's code: a hidden check's cell never runs there (the grader runs its cases with the
    visible check's ``run``), and in a check cell the functions passed as ``cases``, ``compare`` and
    ``describe`` run in the judge only (:func:`kernel_code`). Counting them kept 07.4's forbidden
    ``gc.one_f_one_b_schedule`` in the graded build (its ``cases`` draws schedules with it), and a
    public wrapper (``gc.make_schedule``) reached it past the kernel's gate. What an exercise needs
    *up to its check* is what its own stripped run executes (that run ends at the check): a cell
    after 05.6's check that fits a link model kept ``gc.ring_all_reduce_time``, which 05.6 forbids.
    """
    from .exercises import EXERCISE_HEADING

    import gpucourse

    candidates = {f"gc.{n}" for n in dir(gpucourse) if not n.startswith("_")}
    setup: list[str] = []
    sections: dict[str, list[str]] = {}
    at_check: dict[str, list[str]] = {}
    current, checked = None, set()
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            ids = [m["id"] for m in EXERCISE_HEADING.finditer(cell.source)]
            if ids:
                current = ids[0]
            continue
        if cell.cell_type != "code":
            continue
        tags = cell.metadata.get("tags", [])
        if "hidden" in tags:
            continue
        source = kernel_code(cell.source) if "check" in tags else cell.source
        if not current:
            setup.append(source)
            continue
        sections.setdefault(current, []).append(source)
        if current not in checked:
            at_check.setdefault(current, []).append(source)
        if "check" in tags:
            checked.add(current)
    return (_needs(setup, candidates), {e: _needs(srcs, candidates) for e, srcs in sections.items()},
            {e: _needs(srcs, candidates) for e, srcs in at_check.items()})


def _identifiers(tree) -> set[str]:
    """The names and attributes code reads (``torch.amp.GradScaler``: ``torch``, ``amp``, ``GradScaler``)."""
    return {n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(tree)
            if isinstance(n, (ast.Name, ast.Attribute))}


def _needs(sources: list[str], candidates: set[str]) -> set[str]:
    """What notebook code needs: the ``gc.*`` helpers it names and all they reach, and the PyTorch
    operators of :mod:`.torch_ops` that it or those helpers use (``GradScaler`` uses both)."""
    identifiers: set[str] = set()
    for src in sources:
        try:
            identifiers |= _identifiers(parse(src))
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            continue
    helpers = reachable(_named_as_gc(sources, candidates), identifiers)
    return helpers | torch_ops.needed_by(identifiers)


#: the arguments of a check whose functions run in the judge, never in the kernel
JUDGE_ONLY = {"check_exercise": (2, ("cases", "compare", "describe")),
              "check_hidden": (1, ("cases", "compare", "describe"))}


@functools.lru_cache(maxsize=512)
def kernel_code(source: str) -> str:
    r"""A check cell's code as the graded kernel runs it: without the functions and classes only the
    judge calls — those it passes to ``gc.check_exercise`` / ``gc.check_hidden`` as ``cases``,
    ``compare`` or ``describe``, and every helper only they reach. The names the call passes are bound
    to ``None`` instead (in a graded kernel ``check_exercise`` uses ``run`` alone); the other lines,
    comments and the ``# Check`` header included, are kept as written.

    An answer looks a name up when it runs, after the check cell defined it: left in the kernel,
    01.4's ``fitted_time`` (the judge's least-squares fit) and 12.1's ``counted_flops`` (a FLOP
    counter) answered their exercises for full marks. Not defining them also leaves a learner's own
    helper of the same name as it was.

        >>> print(kernel_code("# Check 07.4\ndef fit(t):\n    return 2 * t\n\ndef compare(case, got, want):\n"
        ...                   "    assert fit(got) == fit(want)\n\ndef run(p):\n    return f(p)\n\n"
        ...                   "gc.check_exercise('07.4', run, cases, compare=compare)"))
        # Check 07.4
        <BLANKLINE>
        compare = None
        <BLANKLINE>
        def run(p):
            return f(p)
        <BLANKLINE>
        gc.check_exercise('07.4', run, cases, compare=compare)
    """
    try:
        tree = parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return source
    defs = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    if not defs:
        return source
    judge_args = set()            # the name nodes passed as judge-only arguments
    passed = set()                # and the names they carry
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
        if name in JUDGE_ONLY:
            at, keywords = JUDGE_ONLY[name]
            args = node.args[at:at + 1] + [k.value for k in node.keywords if k.arg in keywords]
            judge_args |= {id(a) for a in args}
            passed |= {a.id for a in args if isinstance(a, ast.Name)}

    def names_in(node) -> set[str]:
        return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and id(n) not in judge_args}

    wanted = set().union(*(names_in(n) for n in tree.body if n not in defs.values())) & defs.keys()
    todo = list(wanted)
    while todo:
        for name in names_in(defs[todo.pop()]) & defs.keys():
            if name not in wanted:
                wanted.add(name)
                todo.append(name)
    if wanted == defs.keys():
        return source
    lines = source.splitlines(keepends=True)
    for node in sorted((n for n in defs.values() if n.name not in wanted), key=lambda n: -n.lineno):
        first = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
        # the call still names it: bound to None (the graded kernel's check_exercise uses run alone)
        lines[first:node.end_lineno] = [f"{node.name} = None\n"] if node.name in passed else []
    return "".join(lines)


def _named_as_gc(sources: list[str], candidates: set[str]) -> set[str]:
    """``gc.X`` / ``gpucourse.X`` attributes and ``from gpucourse import X`` in notebook code."""
    found = set()
    for src in sources:
        try:
            tree = parse(src)
        except (SyntaxError, ValueError, RecursionError, MemoryError):     # not Python, or too deep
            continue
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in ("gc", "gpucourse") and f"gc.{node.attr}" in candidates):
                found.add(f"gc.{node.attr}")
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "gpucourse":
                found.update(f"gc.{a.name}" for a in node.names if f"gc.{a.name}" in candidates)
    return found


_NEEDS: dict[int, tuple] = {}


def plan_for(nb, specs: dict, submitted: dict[str, list[str]] | None = None) -> dict:
    """The judge's answer to a ``plan`` request: the runs a submission is graded in.

    ``nb``: the course's solutions notebook; ``specs``: the judge's checks; ``submitted``: exercise →
    the code cells of the submission's section (they may add needs — a learner's honest answer that
    builds on a helper another exercise forbids is graded in a run that keeps it — but never remove
    what an exercise forbids: that comes from the course alone).
    """
    if id(nb) not in _NEEDS:
        _NEEDS[id(nb)] = chapter_needs(nb)
    setup, needs, at_check = _NEEDS[id(nb)]
    needs = {e: set(n) for e, n in needs.items()}
    import gpucourse

    candidates = {f"gc.{n}" for n in dir(gpucourse) if not n.startswith("_")}
    forbids, gated = {}, {}
    for spec in specs.values():
        if spec.kind != "visible":
            continue
        names = {n for n in spec.forbid if strippable(n)}
        # what the set-up or the exercise's own section up to its check needs cannot be stripped
        # while it runs (its stripped run ends at the check)
        keep = names & (setup | at_check.get(spec.exercise, set()))
        forbids[spec.exercise] = names - keep
        gated[spec.exercise] = sorted(keep | {n for n in spec.forbid if not strippable(n)})
    for exercise, sources in (submitted or {}).items():
        if exercise in forbids:
            needs[exercise] = needs.get(exercise, set()) | (
                reachable(_named_as_gc(sources, candidates)) - forbids[exercise])
    runs = plan_runs(forbids, needs)
    return {"runs": [[list(strip), members] for strip, members in runs], "gated": gated,
            "needs": {e: sorted(n) for e, n in needs.items()},
            "exercises_of": {n: sorted(e for e, f in forbids.items() if n in f)
                             for strip, _ in runs for n in strip}}
