"""Plant a wrong answer, run a check the way the grader does, read the judge's verdict — in-process.

Every chapter keeps its plausible wrong answers in ``tests/grading/mutations/test_chNN.py``::

    VISIBLE = {"08.1": {"rounds down": "return (2 + 2 + k) * num_params // world_size", ...}}
    HIDDEN = {"08.1": {"float, not int": "..."}}
    (test_visible_check_rejects, test_hidden_check_rejects, test_solution_passes_and_mutations_are_kept,
     test_trivial_answers_fail) = chapter_tests("08", VISIBLE, HIDDEN)

A wrong answer is the body of the exercise's solution region (a list: one entry per region of
the exercise, ``None`` keeping that region). ``VISIBLE`` answers must fail the visible check;
``HIDDEN`` answers must pass the visible check and fail the hidden one (the hidden check earns its
place). Every visible check must reject at least :data:`MIN_VISIBLE` wrong answers, and the
trivial ones (``return None``, ``return 0`` in every region).

How one answer is run (what ``grade`` does, minus the kernel and the sandbox)::

    judge  = Judge(chapter, solutions/)         # the course's answers, in this process
    student namespace: the solutions notebook's code cells up to the exercise's check, with the
                       exercise's solution regions replaced by the wrong answer
    harness.prime(slot, judge.cases(slot, seed)); exec(check cell) → values (wire text)
    judge.compare(slot, seed, values)            # passed / message

Each answer is judged on :data:`SEEDS` (fixed, so a failure reproduces): a visible check that
catches a wrong answer on one seed and not another is too weak, and fails this test.
"""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path

import nbformat
import pytest

from gpucourse.grading import harness
from gpucourse.grading.exercises import BEGIN, END, EXERCISE_HEADING, exercise_index
from gpucourse.grading.judge import Judge

ROOT = Path(__file__).resolve().parents[2]
SOLUTIONS = ROOT / "solutions"
#: the seeds every planted answer is judged with (``GPUCOURSE_MUTATION_SEEDS=n`` tries n more)
SEEDS = [11, 12] + list(range(1000, 1000 + int(os.environ.get("GPUCOURSE_MUTATION_SEEDS", "0"))))
#: a visible check must reject at least this many plausible wrong answers of its exercise
MIN_VISIBLE = 3

_judges: dict[str, Judge] = {}


def judge_of(chapter: str) -> Judge:
    if chapter not in _judges:
        _judges[chapter] = Judge(chapter, SOLUTIONS)
        assert not _judges[chapter].errors, _judges[chapter].errors
    return _judges[chapter]


def plant(source: str, answers: list) -> str:
    """Replace the k-th solution region of ``source`` by ``answers[k]`` (None keeps the region)."""
    out, inside, keep, k = [], False, False, 0
    for line in source.splitlines():
        stripped = line.strip()
        if stripped == BEGIN:
            inside, indent = True, line[: len(line) - len(line.lstrip())]
            keep = answers[k] is None
            if not keep:
                out.extend(indent + l if l else l for l in answers[k].splitlines())
            k += 1
        elif stripped == END:
            inside = False
        elif not inside or keep:
            out.append(line)
    assert k == len(answers), f"{k} solution regions, {len(answers)} answers"
    return "\n".join(out)


def _notebook(chapter: str):
    path = next(SOLUTIONS.glob(f"{chapter}_*.ipynb"))
    return nbformat.read(path, as_version=4), path.name


def _student_namespace(chapter: str, exercise: str, answers: list | None) -> tuple[dict, str]:
    """Execute the solutions notebook's code cells before ``exercise``'s check, planting the
    wrong answer; returns the namespace and the check cell's source."""
    from IPython.core.inputtransformer2 import TransformerManager

    nb, name = _notebook(chapter)
    index = exercise_index(nb, name=name)
    ex = index[exercise]
    skip = {i for e in index.values() for i in (*e.check_cells, *e.hidden_cells)}
    namespace = {"__name__": "__main__"}
    transform = TransformerManager().transform_cell
    with contextlib.redirect_stdout(io.StringIO()):
        for i in range(ex.check_cells[0]):
            cell = nb.cells[i]
            if cell.cell_type != "code" or i in skip or "solution-only" in cell.metadata.get("tags", []):
                continue
            source = cell.source
            if i in ex.solution_cells and answers is not None:
                regions = source.count(BEGIN)
                if isinstance(answers, Every):
                    mine = [answers.body] * regions
                else:
                    mine = answers[:regions]
                    answers = answers[regions:]
                source = plant(source, mine)
            exec(compile(transform(source), f"<{name} cell {i}>", "exec"), namespace)
    assert isinstance(answers, Every) or not answers, f"{exercise}: more answers than solution regions"
    return namespace, nb.cells[ex.check_cells[0]].source


class Every:
    """The same body for every solution region of an exercise (``return None`` everywhere)."""

    def __init__(self, body: str):
        self.body = body


def verdicts(chapter: str, exercise: str, answer, *, seed: int, hidden: bool = False) -> dict:
    """``{"visible": verdict, "hidden": verdict}`` (hidden only when asked) for one planted answer."""
    judge = judge_of(chapter)
    answers = None if answer is None else answer if isinstance(answer, (list, Every)) else [answer]
    namespace, check_source = _student_namespace(chapter, exercise, answers)
    out = {}
    mode = harness._state["mode"]
    harness._state["mode"] = "graded"
    try:
        slots = [exercise] + ([f"{exercise}/hidden"] if hidden else [])
        for slot in slots:
            payload = judge.cases(slot, seed)
            harness.prime(slot, __import__("json").dumps(payload))
            with contextlib.redirect_stdout(io.StringIO()):
                try:
                    if slot == exercise:
                        exec(compile(check_source, f"<check {exercise}>", "exec"), namespace)
                    else:
                        harness.run_hidden(exercise)
                except Exception as e:  # noqa: BLE001 - a check cell that cannot run sends nothing
                    out["hidden" if "/" in slot else "visible"] = {
                        "passed": False, "message": f"the check cell raised {type(e).__name__}: {e}"}
                    harness.collect()
                    continue
            values = harness.collect()
            if values is None:
                out["hidden" if "/" in slot else "visible"] = {"passed": False, "message": "no values"}
                continue
            out["hidden" if "/" in slot else "visible"] = judge.compare(slot, seed, values)
    finally:
        harness._state["mode"] = mode
        harness._state["runs"].pop(exercise, None)
    return out


def _cases(table: dict) -> list:
    return [(e, kind) for e, answers in table.items() for kind in answers]


def chapter_tests(chapter: str, visible: dict, hidden: dict):
    """The three tests of a chapter's mutation module (assign them to module-level names)."""
    nb, name = _notebook(chapter)
    exercises = sorted(exercise_index(nb, name=name))

    @pytest.mark.parametrize("exercise, kind", _cases(visible), ids=[f"{e}-{k}" for e, k in _cases(visible)])
    def test_visible_check_rejects(exercise, kind):
        for seed in SEEDS:
            v = verdicts(chapter, exercise, visible[exercise][kind], seed=seed)["visible"]
            assert not v["passed"], f"{exercise}: the visible check passed the wrong answer '{kind}' (seed {seed})"

    @pytest.mark.parametrize("exercise, kind", _cases(hidden), ids=[f"{e}-{k}" for e, k in _cases(hidden)])
    def test_hidden_check_rejects(exercise, kind):
        for seed in SEEDS:
            v = verdicts(chapter, exercise, hidden[exercise][kind], seed=seed, hidden=True)
            assert v["visible"]["passed"], (f"{exercise}: '{kind}' should pass the visible check (else it "
                                            f"belongs in VISIBLE), seed {seed}: {v['visible']['message']}")
            assert not v["hidden"]["passed"], f"{exercise}: the hidden check passed '{kind}' (seed {seed})"

    @pytest.mark.parametrize("exercise", exercises)
    def test_solution_passes_and_mutations_are_kept(exercise):
        v = verdicts(chapter, exercise, None, seed=SEEDS[0], hidden=True)
        assert v["visible"]["passed"], v["visible"]["message"]
        assert v["hidden"]["passed"], v["hidden"]["message"]
        assert len(visible.get(exercise, {})) >= MIN_VISIBLE, (
            f"{exercise}: keep at least {MIN_VISIBLE} plausible wrong answers its visible check rejects")
        assert hidden.get(exercise), f"{exercise}: keep a wrong answer that only its hidden check rejects"

    @pytest.mark.parametrize("exercise", exercises)
    @pytest.mark.parametrize("body", ["return None", "return 0"])
    def test_trivial_answers_fail(exercise, body):
        v = verdicts(chapter, exercise, Every(body), seed=SEEDS[0])["visible"]
        assert not v["passed"], f"{exercise}: the visible check passed `{body}` as the answer"

    return (test_visible_check_rejects, test_hidden_check_rejects, test_solution_passes_and_mutations_are_kept,
            test_trivial_answers_fail)


__all__ = ["MIN_VISIBLE", "SEEDS", "chapter_tests", "judge_of", "plant", "verdicts", "EXERCISE_HEADING"]
