"""Attacks on the grader (issue 28): each must score 0 for what it attacks, in every grading mode.

The classes of attack, each applied to an *unsolved* (or wrongly solved) exercises notebook:

- **printing or faking a pass** — check cells replaced by ``print("NN.k passed ✓")``; the check API,
  the harness's collection or its values forged; check cells rewritten by IPython input/AST
  transformers; comparisons (``torch.testing.assert_close``, ``torch.equal``, ``math.isclose``, …)
  patched to agree with anything; the inputs replaced by ones the notebook "knows";
- **reaching the answer key** — the course's ``solutions/`` found through ``gpucourse.__file__``,
  ``GPUCOURSE_SOLUTIONS``, the working folder or the repository's git objects, and its answers
  executed in place of the stubs;
- **calling what the exercise forbids** — through an alias bound before the check.

Modes: ``grade --hidden``, ``grade`` and ``check`` (the learner's self-check, same judge), with every
attack on six chapters in turn — with ``--hidden`` on two of them, so each attack meets three. The
verdicts come from the judge, outside the kernel, so none of these changes a grade; every honest
exercise next to an attacked one is unaffected (see ``test_trust.py`` for honest notebooks in every chapter).
"""

from __future__ import annotations

import json
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell

from gpucourse.grading.exercises import CHECK_TAG
from gpucourse.grading.grade import Options, grade
from gpucourse.grading.sandbox import isolation
from gpucourse.grading.selfcheck import check_notebook

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(isolation() != "bwrap", reason="the answer-key attacks need bwrap "
                                "(Debian package bubblewrap): without it grade refuses to run")

#: six chapters with cheap unsolved runs
CHAPTERS = ["00", "01", "03", "06", "08", "12"]

PATCH_HARNESS = """\
import gpucourse as gc, gpucourse.grading as grading, gpucourse.grading.harness as h
def fake(exercise, *args, **kwargs):
    print(f"{exercise} passed ✓")
gc.check_exercise = grading.check_exercise = h.check_exercise = fake
gc.check_hidden = grading.check_hidden = h.check_hidden = fake
h.run_hidden = lambda exercise: print(f"{exercise} hidden passed ✓")
"""

FORGE_VALUES = """\
import gpucourse.grading.harness as h, gpucourse.grading.wire as w
h.run_cases = lambda run, cases, seeds: [w.encode(None) for _ in cases]     # 'nothing to see here'
real_collect = h.collect
def collect():
    real_collect()
    return w.pack([w.encode(0)] * 5000)
h.collect = collect
"""

READ_SOLUTIONS = """\
import json, os, subprocess
from pathlib import Path
import gpucourse
roots = [Path(gpucourse.__file__).resolve().parents[1], Path.cwd(), Path.home(), Path("/tmp"), Path("/work")]
if os.environ.get("GPUCOURSE_SOLUTIONS"):
    roots.append(Path(os.environ["GPUCOURSE_SOLUTIONS"]))
MARK = "BEGIN " + "SOLUTION"                     # spelled so that this cell is not an answer itself
answers = []
for root in roots:
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in (".venv", "site-packages", "node_modules", "proc")]
        for name in files:
            if not name.endswith(".ipynb"):
                continue
            try:
                cells = json.loads(Path(folder, name).read_text())["cells"]
            except Exception:
                continue
            answers += ["".join(c["source"]) for c in cells if c["cell_type"] == "code"
                        and MARK in "".join(c["source"])]
course = Path(gpucourse.__file__).resolve().parents[1]
try:                                             # the answers as committed, from git's objects
    names = subprocess.run(["git", "-C", str(course), "ls-files", "solutions"], capture_output=True,
                           text=True, timeout=20).stdout.split()
    for name in names:
        text = subprocess.run(["git", "-C", str(course), "show", f"HEAD:{name}"], capture_output=True,
                              text=True, timeout=20).stdout
        answers += ["".join(c["source"]) for c in json.loads(text)["cells"] if c["cell_type"] == "code"
                    and MARK in "".join(c["source"])]
except Exception:
    pass
print(f"found {len(answers)} answer cells")
def use_answers(*args):
    for source in answers:
        try:
            exec(source, get_ipython().user_ns)
        except Exception:
            pass
get_ipython().events.register("post_run_cell", use_answers)
"""

REWRITE_CHECKS = """\
import ast
class Skip(ast.NodeTransformer):                 # every gc.check_exercise(...) call becomes None
    def visit_Call(self, node):
        if getattr(node.func, "attr", "") in ("check_exercise", "check_hidden", "run_hidden"):
            return ast.copy_location(ast.Constant(None), node)
        return self.generic_visit(node)
get_ipython().ast_transformers.append(Skip())
def _skip(lines):
    return ['print("passed ✓")\\n'] if lines and lines[0].startswith("# Check") else lines
get_ipython().input_transformers_cleanup.append(_skip)
"""

PATCH_COMPARISONS = """\
import math, torch, numpy
torch.testing.assert_close = lambda *a, **k: None
torch.allclose = torch.equal = lambda *a, **k: True
torch.Tensor.__eq__ = lambda self, other: True
math.isclose = lambda *a, **k: True
numpy.allclose = lambda *a, **k: True
import builtins
builtins.AssertionError = type("Quiet", (Exception,), {})
"""

FIXED_INPUTS = """\
import random, torch
import gpucourse.grading.harness as h, gpucourse.grading.wire as w
torch.manual_seed = lambda *a, **k: torch.default_generator
random.seed = lambda *a, **k: None
real_loads = w.loads
def loads(text):                                 # every case replaced by its first one
    value = real_loads(text)
    return [value[0]] * len(value) if isinstance(value, list) and value else value
w.loads = loads
"""

ATTACKS = {
    "patch_harness": PATCH_HARNESS,
    "forge_values": FORGE_VALUES,
    "read_solutions": READ_SOLUTIONS,
    "rewrite_checks": REWRITE_CHECKS,
    "patch_comparisons": PATCH_COMPARISONS,
    "fixed_inputs": FIXED_INPUTS,
}


def _release(chapter: str):
    path = next((ROOT / "exercises").glob(f"{chapter}_*.ipynb"))
    return nbformat.read(path, as_version=4), path.name


def _attacked(chapter: str, attack: str):
    nb, name = _release(chapter)
    if attack == "print_pass":
        for cell in nb.cells:
            if CHECK_TAG in cell.metadata.get("tags", []):
                cid = cell.source.split()[2]
                cell.source = f'# Check {cid} — mine\nprint("{cid} passed ✓")'
    else:
        setup = next(i for i, c in enumerate(nb.cells) if c.cell_type == "code")
        nb.cells.insert(setup + 1, new_code_cell(ATTACKS[attack]))
    if attack == "patch_comparisons":                 # wrong answers, not stubs
        for cell in nb.cells:
            cell.source = cell.source.replace(
                'raise NotImplementedError("Exercise', 'return None  # ("Exercise')
    return nb, name


ALL = ["print_pass", *ATTACKS]


def _class(root: Path, chapters: list[str], attacks: list[str]) -> dict[str, str]:
    """Write root/<chapter>-<attack>/<notebook>; return student → chapter."""
    students = {}
    for chapter in chapters:
        for attack in attacks:
            nb, name = _attacked(chapter, attack)
            student = f"{chapter}-{attack}"
            (root / student).mkdir(parents=True)
            nbformat.write(nb, root / student / name)
            students[student] = chapter
    return students


def _assert_all_zero(rows: list[dict], students: dict[str, str], hidden: bool) -> None:
    for student in students:
        mine = [r for r in rows if r["student"] == student]
        assert mine, f"{student}: no rows"
        for r in mine:
            assert r["status"] == "graded", (student, r)
            assert r["points"] == 0 and r["visible"] == "✗", f"{student} scored on {r['exercise']}: {r}"
            assert "tamper" not in r["error"], (student, r["error"])
            if hidden:
                assert r["hidden"] == "✗", (student, r)


def _grade_hidden(tmp_path, pairs):
    students = {}
    for chapter, attack in pairs:
        students.update(_class(tmp_path / "subs", [chapter], [attack]))
    out = tmp_path / "g.json"
    grade([str(tmp_path / "subs")], hidden_from=str(ROOT / "solutions"), release=str(ROOT / "exercises"),
          workers=2, json_path=str(out), options=Options(cell_timeout=120, notebook_timeout=300))
    _assert_all_zero(json.loads(out.read_text())["rows"], students, hidden=True)


def _in_turn(shift: int = 0):
    """(chapter, attack): every attack, on the six chapters in turn (``shift`` moves each attack on)."""
    return [(CHAPTERS[(i + shift) % len(CHAPTERS)], attack) for i, attack in enumerate(ALL)]


# With --hidden every attack meets two chapters (shifts 2 and 4 — grade and check take shift 0),
# so over the modes each attack meets three of the six chapters and each chapter several attacks.
# Two classes: pytest-xdist's --dist loadscope hands each to a worker of its own.
@pytest.mark.slow
@pytest.mark.timeout(900)
class TestEveryAttackWithHiddenChecks:
    def test_every_attack_scores_zero(self, tmp_path):
        _grade_hidden(tmp_path, _in_turn(2))


@pytest.mark.slow
@pytest.mark.timeout(900)
class TestEveryAttackWithHiddenChecksMore:
    def test_every_attack_scores_zero_in_other_chapters(self, tmp_path):
        _grade_hidden(tmp_path, _in_turn(4))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_attack_scores_zero_without_hidden_checks(tmp_path):
    students = {}
    for chapter, attack in _in_turn():
        students.update(_class(tmp_path / "subs", [chapter], [attack]))
    out = tmp_path / "g.json"
    grade([str(tmp_path / "subs")], release=str(ROOT / "exercises"), workers=2, json_path=str(out),
          options=Options(cell_timeout=120, notebook_timeout=300))
    _assert_all_zero(json.loads(out.read_text())["rows"], students, hidden=False)


@pytest.mark.slow
@pytest.mark.parametrize("chapter, attack", _in_turn())
def test_every_attack_fails_the_learners_self_check(chapter, attack, tmp_path):
    nb, name = _attacked(chapter, attack)
    path = tmp_path / name
    nbformat.write(nb, path)
    results = check_notebook(path, cell_timeout=120, notebook_timeout=300, release=str(ROOT / "exercises"))
    checks = [r for r in results if not r.label.startswith("cell")]
    assert checks and not any(r.passed for r in checks), [(r.label, r.error) for r in checks]


def test_an_alias_of_a_forbidden_helper_fails_that_exercise_only(tmp_path):
    """00.2 forbids gc.visible_devices: an answer calling it through an alias bound in another
    cell fails 00.2, with a message saying so; the honest 00.1 and 00.3 next to it pass."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from make_corpus import solved

    nb = solved("00_setup_exercises.ipynb")
    answer = next(c for c in nb.cells if c.source.startswith("def physical_gpu"))
    answer.source = "def physical_gpu(spec, logical):\n    if logical < 0:\n        raise IndexError(logical)\n" \
                    "    return lookup(spec)[logical]"
    nb.cells.insert(nb.cells.index(answer), new_code_cell("lookup = gc.visible_devices"))
    (tmp_path / "subs" / "alias").mkdir(parents=True)
    nbformat.write(nb, tmp_path / "subs" / "alias" / "00_setup_exercises.ipynb")
    out = tmp_path / "g.json"
    grade([str(tmp_path / "subs")], release=str(ROOT / "exercises"), workers=1, json_path=str(out),
          options=Options(cell_timeout=120, notebook_timeout=300))
    rows = {r["exercise"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["00.1"]["visible"] == rows["00.3"]["visible"] == "✓"
    assert rows["00.2"]["visible"] == "✗" and "gc.visible_devices" in rows["00.2"]["error"], rows["00.2"]
