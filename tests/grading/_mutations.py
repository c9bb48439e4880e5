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

    judge  = a judge process for the chapter     # the course's answers (and its own live ranks)
    student: this process's IPython shell runs the solutions notebook's code cells up to the
             exercise's check, with the exercise's solution regions replaced by the wrong answer
             (``%%ranks`` cells included: they run on this process's live ranks)
    for each seed: harness.prime(slot, judge cases(slot, seed)); the check cell → values (wire text);
    judge compare(slot, seed, values[, seconds]) # passed / message (a hidden check: its cell's time)

Each answer is judged on :data:`SEEDS` (fixed, so a failure reproduces): a visible check that
catches a wrong answer on one seed and not another is too weak, and fails this test.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import time
import types
from pathlib import Path

import nbformat
import pytest

from gpucourse.grading import harness
from gpucourse.grading.exercises import BEGIN, END, EXERCISE_HEADING, definition_cells, exercise_index

ROOT = Path(__file__).resolve().parents[2]
SOLUTIONS = ROOT / "solutions"
#: the seeds every planted answer is judged with (``GPUCOURSE_MUTATION_SEEDS=n`` tries n more)
SEEDS = [11, 12] + list(range(1000, 1000 + int(os.environ.get("GPUCOURSE_MUTATION_SEEDS", "0"))))
#: a visible check must reject at least this many plausible wrong answers of its exercise
MIN_VISIBLE = 3

_judges: dict = {}


class _Judge:
    """A chapter's judge in a process of its own (as in ``grade``), asked over its pipe."""

    def __init__(self, chapter: str, public: Path | None = None):
        """``public``: a public cases file — the judge of a class without ``solutions/``, which loads
        the release next to it (:mod:`gpucourse.grading.public`)."""
        folder = SOLUTIONS if public is None else public.parent.parent
        self.process = harness.JudgeProcess(chapter, folder, local=True, public=public)
        self.errors = self.process.hello.get("errors", [])

    def cases(self, slot: str, seed: int) -> dict:
        return self.process.request({"op": "cases", "slot": slot, "seed": seed})

    def compare(self, slot: str, seed: int, values: str, seconds: float | None = None) -> dict:
        return self.process.request({"op": "compare", "slot": slot, "seed": seed, "values": values,
                                     "seconds": seconds})


def solutions_namespace(chapter: str) -> dict:
    """The course's answers of a chapter as functions of this process (for tests that compare them
    with the package): the judge's own loading, in-process; IPython's shell is let go afterwards."""
    from IPython.core.interactiveshell import InteractiveShell

    from gpucourse.grading.judge import Judge

    try:
        return Judge(chapter, SOLUTIONS).namespace
    finally:
        InteractiveShell.clear_instance()


def judge_of(chapter: str) -> _Judge:
    if chapter not in _judges:
        _judges[chapter] = _Judge(chapter)
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


def _shell():
    from IPython.core.interactiveshell import InteractiveShell

    return InteractiveShell.instance()


def _run(shell, source: str, where: str) -> None:
    result = shell.run_cell(source, store_history=False, silent=True)
    if not result.success:
        err = result.error_in_exec or result.error_before_exec
        raise RuntimeError(f"{where} raised {type(err).__name__}: {err}") from err


def _student_namespace(chapter: str, exercise: str, answers) -> tuple[dict, str]:
    """Run the solutions notebook's code cells before ``exercise``'s check in a fresh namespace of
    this process's IPython shell, planting the wrong answer; returns the namespace and the check."""
    nb, name = _notebook(chapter)
    index = exercise_index(nb, name=name)
    ex = index[exercise]
    skip = {i for e in index.values() for i in (*e.check_cells, *e.hidden_cells)}
    needed = set(definition_cells(nb, name=name, upto=exercise))   # no earlier exercise's measurements
    shell = _shell()
    module = types.ModuleType("__main__")
    shell.user_module, shell.user_ns = module, module.__dict__
    shell.init_user_ns()
    with contextlib.redirect_stdout(io.StringIO()):
        for i in range(ex.check_cells[0]):
            cell = nb.cells[i]
            if (cell.cell_type != "code" or i in skip or i not in needed
                    or "solution-only" in cell.metadata.get("tags", [])):
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
            _run(shell, source, f"{name} cell {i}")
    assert isinstance(answers, Every) or not answers, f"{exercise}: more answers than solution regions"
    return module.__dict__, nb.cells[ex.check_cells[0]].source


class Every:
    """The same body for every solution region of an exercise (``return None`` everywhere)."""

    def __init__(self, body: str):
        self.body = body


def _live_ranks():
    """The live ranks the notebook started (``gc.start_ranks``), if they are running."""
    ranks = getattr(__import__("gpucourse").runtime, "ranks", None)
    return ranks if ranks is not None and ranks.running else None


def verdicts(chapter: str, exercise: str, answer, *, seeds: list[int], hidden: bool = False,
             judge: _Judge | None = None) -> list[dict]:
    """Per seed, ``{"visible": verdict, "hidden": verdict}`` (hidden only when asked) for one planted
    answer. The notebook's cells run once; the check cell runs once per seed on that seed's cases
    (as a learner re-running a check cell does). ``judge``: another than the chapter's (a public one)."""
    judge = judge or judge_of(chapter)
    answers = None if answer is None else answer if isinstance(answer, (list, Every)) else [answer]
    mode = harness._state["mode"]
    results = []
    try:
        _, check_source = _student_namespace(chapter, exercise, answers)
        live = _live_ranks() is not None
        harness._state["mode"] = "graded"
        for i, seed in enumerate(seeds):
            if i and live and _live_ranks() is None:    # an answer blocked them: a fresh run, as grade's
                harness._state["mode"] = mode
                _, check_source = _student_namespace(chapter, exercise, answers)
                harness._state["mode"] = "graded"
            out = {}
            slots = [exercise] + ([f"{exercise}/hidden"] if hidden else [])
            for slot in slots:
                key = "hidden" if "/" in slot else "visible"
                payload = judge.cases(slot, seed)
                harness.prime(slot, json.dumps(payload))
                started = time.perf_counter()           # the hidden cell, timed as grade's engine does
                with contextlib.redirect_stdout(io.StringIO()):
                    try:
                        if slot == exercise:
                            _run(_shell(), check_source, f"check {exercise}")
                        else:
                            harness.run_hidden(exercise)
                    except Exception as e:  # noqa: BLE001 - a check cell that cannot run sends nothing
                        out[key] = {"passed": False, "message": f"the check cell raised {type(e).__name__}: {e}"}
                        harness.collect()
                        continue
                seconds = time.perf_counter() - started
                values = harness.collect()
                if values is None:
                    out[key] = {"passed": False, "message": "no values"}
                    continue
                out[key] = judge.compare(slot, seed, values, seconds if key == "hidden" else None)
            results.append(out)
            harness._state["runs"].pop(exercise, None)
    finally:
        harness._state["mode"] = mode
        harness._state["runs"].pop(exercise, None)
        if (ranks := _live_ranks()) is not None:          # live ranks the notebook started
            ranks.stop()
        # no IPython shell is left behind: other tests in this process would think they run in a
        # notebook (figures and widgets display themselves there)
        from IPython.core.interactiveshell import InteractiveShell

        InteractiveShell.clear_instance()
    return results


def _cases(table: dict) -> list:
    return [(e, kind) for e, answers in table.items() for kind in answers]


def chapter_tests(chapter: str, visible: dict, hidden: dict):
    """The three tests of a chapter's mutation module (assign them to module-level names)."""
    nb, name = _notebook(chapter)
    exercises = sorted(exercise_index(nb, name=name))

    @pytest.mark.parametrize("exercise, kind", _cases(visible), ids=[f"{e}-{k}" for e, k in _cases(visible)])
    def test_visible_check_rejects(exercise, kind):
        for seed, v in zip(SEEDS, verdicts(chapter, exercise, visible[exercise][kind], seeds=SEEDS)):
            assert not v["visible"]["passed"], (
                f"{exercise}: the visible check passed the wrong answer '{kind}' (seed {seed})")

    @pytest.mark.parametrize("exercise, kind", _cases(hidden), ids=[f"{e}-{k}" for e, k in _cases(hidden)])
    def test_hidden_check_rejects(exercise, kind):
        for seed, v in zip(SEEDS, verdicts(chapter, exercise, hidden[exercise][kind], seeds=SEEDS, hidden=True)):
            assert v["visible"]["passed"], (f"{exercise}: '{kind}' should pass the visible check (else it "
                                            f"belongs in VISIBLE), seed {seed}: {v['visible']['message']}")
            assert not v["hidden"]["passed"], f"{exercise}: the hidden check passed '{kind}' (seed {seed})"

    @pytest.mark.parametrize("exercise", exercises)
    def test_solution_passes_and_mutations_are_kept(exercise):
        (v,) = verdicts(chapter, exercise, None, seeds=SEEDS[:1], hidden=True)
        assert v["visible"]["passed"], v["visible"]["message"]
        assert v["hidden"]["passed"], v["hidden"]["message"]
        assert len(visible.get(exercise, {})) >= MIN_VISIBLE, (
            f"{exercise}: keep at least {MIN_VISIBLE} plausible wrong answers its visible check rejects")
        assert hidden.get(exercise), f"{exercise}: keep a wrong answer that only its hidden check rejects"

    @pytest.mark.parametrize("exercise", exercises)
    @pytest.mark.parametrize("body", ["return None", "return 0"])
    def test_trivial_answers_fail(exercise, body):
        (v,) = verdicts(chapter, exercise, Every(body), seeds=SEEDS[:1])
        assert not v["visible"]["passed"], f"{exercise}: the visible check passed `{body}` as the answer"

    return (test_visible_check_rejects, test_hidden_check_rejects, test_solution_passes_and_mutations_are_kept,
            test_trivial_answers_fail)


__all__ = ["MIN_VISIBLE", "SEEDS", "EXERCISE_HEADING", "Every", "chapter_tests", "judge_of", "plant",
           "solutions_namespace", "verdicts"]
