"""An exercise that forbids ``gc.X`` cannot reach ``gc.X`` in a graded kernel (issue 37, part 4).

The routes below each scored the point of an exercise that forbids a helper while the forbidding
was a gate inside the student's kernel. With the graded build the helper's implementation is not in
the package the kernel imports while that exercise is checked, so every route meets a function that
raises ``ForbiddenCall`` — whatever frames, tables, file names or reloads it plays with. The names
are spelled so the answer-cell scan cannot see them: the point is what the kernel can *reach*.
"""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from _grading_helpers import grade_class
from nbformat.v4 import new_code_cell, new_markdown_cell

from gpucourse.grading.sandbox import isolation
from gpucourse.grading.selfcheck import check_notebook

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(isolation() != "bwrap", reason="the graded build needs bwrap "
                                "(Debian package bubblewrap)")

HELPER = "getattr(gc, 'visible' + '_devices')"          # gc.visible_devices, unseen by the name scan

#: route → (cells put before 00.2's answer, the answer's body): each answer is right if the helper works
ROUTES_00 = {
    "thread_pool": ([], f"""
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(1) as pool:
        return right(pool.submit({HELPER}, spec).result(), logical)"""),
    "package_file_name": (["import gpucourse\n"
                           f'wrapped = eval(compile("lambda s: {HELPER}(s)", gpucourse.__file__, "eval"), '
                           "{'gc': gc})"], """
    return right(wrapped(spec), logical)"""),
    "saved_original": ([], """
    import gpucourse.grading.harness as h
    original = next(v[0] for k, v in h._FORBIDDEN.items() if k.endswith('_devices'))
    return right(original(spec), logical)"""),
    "replaced_predicate": (["import gpucourse.grading.harness as h\n"
                            "h._called_by_the_course = lambda frame: True"], f"""
    return right({HELPER}(spec), logical)"""),
    "reload": ([], """
    import importlib, gpucourse.runtime.devices as d
    importlib.reload(d)
    return right(getattr(d, 'visible' + '_devices')(spec), logical)"""),
    "function_clone": (["import types\n"
                        f"_f = {HELPER}\n"
                        "clone = types.FunctionType(_f.__code__, _f.__globals__, 'clone', _f.__defaults__, "
                        "_f.__closure__)"], """
    return right(clone(spec), logical)"""),
    "fake_heading": (["## Exercise 00.3 — (not really)"], """
    return right(gc.visible_devices(spec), logical)"""),
}

SUBCLASS_03 = """class MyBalancedDataParallel(getattr(gc, 'Balanced' + 'DataParallel')):
    def __init__(self, gpu0_bsz, module, device_ids=None, dim=0):
        super().__init__(gpu0_bsz, module, device_ids, dim=dim)
"""


def _release(chapter: str):
    path = next((ROOT / "exercises").glob(f"{chapter}_*.ipynb"))
    return nbformat.read(path, as_version=4), path.name


#: the rest of a right answer, given the helper's {logical: physical} mapping (in a cell before it)
RIGHT = """def right(ids, logical):
    if not 0 <= logical < len(ids):
        raise IndexError(logical)
    return ids[logical]"""


def _route_00(route: str):
    nb, name = _release("00")
    before, body = ROUTES_00[route]
    before = [RIGHT, *before]
    at = next(i for i, c in enumerate(nb.cells) if c.source.startswith("def physical_gpu"))
    nb.cells[at].source = "def physical_gpu(spec, logical):" + body
    cells = [new_markdown_cell(s) if s.startswith("##") else new_code_cell(s) for s in before]
    nb.cells[at:at] = cells
    return nb, name


def _subclass_03():
    nb, name = _release("03")
    at = next(i for i, c in enumerate(nb.cells) if c.source.startswith("class MyBalancedDataParallel"))
    nb.cells[at].source = SUBCLASS_03
    return nb, name


def _answered(answers: dict) -> dict:
    """``{chapter: (first line of the answer cell, the answer)}`` → each chapter's release, answered."""
    notebooks = {}
    for chapter, (first_line, answer) in answers.items():
        nb, name = _release(chapter)
        next(c for c in nb.cells if c.source.startswith(first_line)).source = answer
        notebooks[chapter] = (nb, name)
    return notebooks


def _graded_rows(tmp_path, notebooks: dict) -> dict:
    """``grade --hidden`` over ``{student: (notebook, file name)}``: the rows by (student, exercise)."""
    return {(r["student"], r["exercise"]): r for r in grade_class(tmp_path, notebooks)["rows"]}


def _assert_forbidden(row) -> None:
    """The exercise scored 0 because its answer met the stripped helper."""
    assert row["points"] == 0 and row["visible"] == "✗", row
    assert "off limits" in row["error"] or "ForbiddenCall" in row["error"], row["error"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_route_to_a_forbidden_helper_scores_zero(tmp_path):
    notebooks = {f"00-{route}": _route_00(route) for route in ROUTES_00}
    notebooks["03-subclass"] = _subclass_03()
    rows = _graded_rows(tmp_path, notebooks)
    for student in notebooks:
        _assert_forbidden(rows[(student, "03.3" if student.startswith("03") else "00.2")])
    # the exercises next to them, untouched and unsolved, are "not implemented" as ever
    assert rows[("00-thread_pool", "00.1")]["error"].startswith("00.1: not implemented yet")


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("route", ["thread_pool", "reload"])
def test_the_learners_self_check_meets_the_same_build(route, tmp_path):
    nb, name = _route_00(route)
    path = tmp_path / name
    nbformat.write(nb, path)
    results = {r.label: r for r in check_notebook(path, cell_timeout=120, notebook_timeout=300,
                                                  release=str(ROOT / "exercises"))}
    assert not results["00.2"].passed and "off limits" in results["00.2"].error, results["00.2"]


#: chapter → (the answer cell's first line, a wrong answer that reaches the forbidden helper through a
#: public course function that calls it): the helper stayed in the graded build — 07.4's ``cases``
#: (judge-only) and a cell after 05.6's check named it — and the kernel's gate lets course code call
#: it, so both scored full marks, visible and hidden (found 2026-12-07)
WRAPPED = {
    "07": ("def one_f_one_b(stage, p, m)", """def one_f_one_b(stage, p, m):
    return [str(op) for op in gc.make_schedule("1f1b", p, m).ops[stage]]


def peak_in_flight(ops):
    live = peak = 0
    for op in ops:
        live += 1 if op.startswith("F") else -1
        peak = max(peak, live)
    return peak"""),
    "05": ("def collective_time(", """def collective_time(kind, nbytes, world_size, alpha, beta):
    if kind not in ("reduce_scatter", "all_gather", "all_reduce"):
        raise ValueError(f"unknown collective {kind!r}")
    if world_size == 1:
        return 0.0
    link = gc.AlphaBeta(alpha, beta if nbytes else 0.0)
    t = gc.parallelism_comm(1, 1, 1, 1, params=max(nbytes, 1), degree=world_size, dtype_bytes=1,
                            links={"l": link})[1]["l"]
    return t if kind == "all_reduce" else t / 2"""),
}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_forbidden_helper_reached_through_a_course_wrapper_scores_zero(tmp_path):
    notebooks = _answered(WRAPPED)
    rows = _graded_rows(tmp_path, notebooks)
    for chapter, exercise in (("07", "07.4"), ("05", "05.6")):
        _assert_forbidden(rows[(chapter, exercise)])


def test_judge_only_code_of_a_check_is_not_what_the_kernel_needs():
    """Only the kernel's code keeps a forbidden helper in the graded build: not a check's ``cases``,
    ``compare`` or ``describe`` (run by the judge), not a hidden check's cell, and for the exercise's
    own run not the cells after its check (that run ends there)."""
    from gpucourse.grading.graded_build import chapter_needs

    for chapter, exercise, helper in (("07", "07.4", "gc.one_f_one_b_schedule"), ("05", "05.6", "gc.ring_all_reduce_time")):
        nb = nbformat.read(next((ROOT / "solutions").glob(f"{chapter}_*.ipynb")), as_version=4)
        setup, whole, at_check = chapter_needs(nb)
        assert helper not in setup | at_check[exercise], (chapter, exercise)
    assert "gc.ring_all_reduce_time" in whole["05.6"]          # the cell after 05.6's check uses it


def test_the_build_keeps_nothing_of_a_stripped_helper(tmp_path):
    """The copy's source has no body, docstring or bytecode of the helper; the rest still imports."""
    import subprocess
    import sys

    from gpucourse.grading import graded_build

    package = graded_build.build(("gc.visible_devices", "gc.BalancedDataParallel"),
                                 {"gc.visible_devices": ["00.2"]}, tmp_path)
    text = (package / "runtime" / "devices.py").read_text()
    assert "def visible_devices(" in text and "CUDA_VISIBLE_DEVICES" not in text.split(
        "def visible_devices(")[1].split("\ndef ")[0]
    assert not list(package.rglob("__pycache__"))
    probe = ("import gpucourse as gc\n"
             "try:\n    gc.visible_devices('0,1')\nexcept Exception as e:\n    print(type(e).__name__, e)\n"
             "try:\n    gc.BalancedDataParallel(1, None)\nexcept Exception as e:\n    print(type(e).__name__)\n"
             "print(gc.balanced_chunk_sizes(8, 2, 3))")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path,
                       env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}, timeout=120)
    lines = r.stdout.splitlines()
    assert lines[0].startswith("ForbiddenCall gc.visible_devices is off limits in exercise 00.2"), r
    assert lines[1] == "ForbiddenCall" and lines[2] == "[2, 3, 3]", r


#: an ordinary cell at the end of an honest notebook, using the helper 00.2 forbids: named (the
#: grader sees it before running) or reached by a name it cannot see (found when the run meets it)
AFTER_00 = {"named": "print('after:', gc.visible_devices('1,0'))",
            "unseen": f"print('after:', {HELPER}('1,0'))"}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_one_run_grades_an_honest_notebook_and_a_helper_used_outside_the_exercise_costs_a_second(tmp_path):
    """Where one graded build serves every exercise of a chapter (00: it lacks gc.visible_devices,
    which 00.2 forbids and no exercise needs), honest work is graded in one run with that build.
    A cell outside the exercise that uses the helper is no error of the student's: the notebook is
    then graded as before — an ordinary run, and 00.2 again without the helper — full marks both
    ways, and the run that met the helper does not count (three runs where the name was unseen)."""
    solved = ROOT / "solutions" / "00_setup_exercises.ipynb"
    notebooks = {}
    for student, extra in (("plain", None), *AFTER_00.items()):
        nb = nbformat.read(solved, as_version=4)
        if extra:
            nb.cells.append(new_code_cell(extra))
        notebooks[student] = (nb, solved.name)
    data = grade_class(tmp_path, notebooks)
    runs = {n["student"]: n["runs"] for n in data["notebooks"]}
    assert runs == {"plain": 1, "named": 2, "unseen": 3}, runs
    for n in data["notebooks"]:
        assert n["status"] == "graded" and not n["other_errors"] and not n["problem"], n
    for r in data["rows"]:
        assert (r["visible"], r["hidden"]) == ("✓", "✓"), r


# --- a check cell's judge-only helpers never reach the kernel -----------------------------------

#: helpers a check cell defines for its judge (compare, cases) that do part of the exercise
JUDGE_HELPERS = {"01": ("01.4", "fitted_time"), "03": ("03.2", "step_time_032"), "10": ("10.3", "chunk_rows"),
                 "11": ("11.3", "zigzag_shards"), "12": ("12.1", "counted_flops")}


def test_the_kernel_copy_of_a_check_defines_nothing_only_the_judge_calls():
    import ast

    from gpucourse.grading.restore import load_release, restore

    for chapter, (exercise, helper) in JUDGE_HELPERS.items():
        release = load_release(next((ROOT / "exercises").glob(f"{chapter}_*.ipynb")))
        assert f"def {helper}(" in release.checks[exercise].source        # the learner sees it ...
        run, slots, _ = restore(release.nb, release)
        for slot in slots:
            tree = ast.parse(slot.source)                                   # ... the kernel does not
            defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
            assert helper not in defined, (slot.id, helper)
            assert any(isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "check_exercise"
                       for n in ast.walk(tree)), slot.id
    release = load_release(next((ROOT / "exercises").glob("01_*.ipynb")))
    run, slots, _ = restore(release.nb, release)
    kernel = next(s.source for s in slots if s.id == "01.1")
    assert "def sq_dists_and_calls(" in kernel and "class TorchCalls011(" in kernel   # run reaches them
    assert "def compare_sq_dists(" not in kernel and "\ncompare_sq_dists = None\n" in kernel
    assert kernel.startswith("# Check 01.1 — ")          # as written, less what only the judge calls


#: answers that call a helper their check cell defines for the judge (it ran before they are called)
CALLS_THE_JUDGES_HELPER = {
    "01": ("def best_worker_count", "def best_worker_count(times, max_workers):\n"
           "    T = fitted_time(times)\n    return min(range(1, max_workers + 1), key=T)"),
    "12": ("def flops_per_token", "def flops_per_token(layers, hidden, ffn, vocab, seq):\n"
           "    with torch.device('meta'):\n        return counted_flops(layers, hidden, ffn, vocab, seq, batch=1)"),
}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_an_answer_that_calls_its_checks_judge_only_helper_scores_zero(tmp_path):
    notebooks = _answered(CALLS_THE_JUDGES_HELPER)
    nb, name = _release("01")                  # a forged slot marker on a markdown cell: graded as usual
    marked = new_markdown_cell("note")
    marked.metadata["_gpucourse_slot"] = "01.3"
    nb.cells.insert(3, marked)
    notebooks["marker"] = (nb, name)
    rows = _graded_rows(tmp_path, notebooks)
    for chapter, exercise, helper in (("01", "01.4", "fitted_time"), ("12", "12.1", "counted_flops")):
        row = rows[(chapter, exercise)]
        assert row["points"] == 0 and f"NameError: name '{helper}' is not defined" in row["error"], row
    assert rows[("marker", "01.3")]["error"].startswith("01.3: not implemented yet"), rows[("marker", "01.3")]
