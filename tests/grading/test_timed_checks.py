"""A timed hidden check (``check_hidden(..., max_slowdown=k)``): the clock that decides is outside
the kernel.

01.1 asks for ``pairwise_sq_dists`` without a Python loop. Its visible check counts torch calls in
the learner's kernel, where the learner can switch the counter off
(``torch._C.DisableTorchFunction()``): one call it sees, the loop it does not. The hidden check also
runs the answer on a million rows, then a million columns, and the grader times that cell itself:
over ``max(k × the course's time on the same inputs, 3 s)`` it fails, values right or not.
"""

import json
import re
from pathlib import Path

import nbformat
import pytest
from _grading_helpers import HIDDEN, tiny_solutions, tiny_submission, write_tiny_course
from make_corpus import solved

from gpucourse.grading import harness
from gpucourse.grading.grade import Options, grade
from gpucourse.grading.sandbox import isolation

ROOT = Path(__file__).resolve().parents[2]
CH01 = "01_serial_vs_parallel_exercises.ipynb"
CLOCK = "timed by the grader outside your kernel"
#: the tiny chapter's hidden cases (square of 10**6 and of another large number), timed: k = 3
TIMED = HIDDEN.replace('gc.check_hidden("99.1", hidden_cases)', 'gc.check_hidden("99.1", hidden_cases, max_slowdown=3)')
#: right on every input, slow on the hidden check's large ones: 2 s each, 4 s for the two
SLOW = "import time\n    time.sleep(2 if abs(x) >= 10**5 else 0)\n    return x * x"


@pytest.fixture
def timed_release(tmp_path):
    """(release, solutions) of the tiny chapter 99 whose hidden check is timed (max_slowdown=3)."""
    nb = tiny_solutions(hidden=True)
    hidden = next(c for c in nb.cells if "hidden" in c.metadata.get("tags", []))
    hidden.source = TIMED
    return write_tiny_course(tmp_path, nb)


def test_the_limit_is_k_times_the_course_and_never_under_the_floor():
    assert harness.time_limit(5, 0.1) == harness.TIMED_FLOOR_SECONDS == 3.0
    assert harness.time_limit(5, 1.0) == 5.0
    for bad in (1, 0.5, float("nan"), float("inf"), "5", [5]):
        with pytest.raises(ValueError, match=re.escape(f"max_slowdown={bad!r}")):
            harness.check_hidden("99.1", lambda rng: [], max_slowdown=bad)


def test_the_judge_fails_right_values_over_the_limit_and_names_both_times(timed_release):
    _, sol = timed_release
    judge = harness.JudgeProcess("99", sol, local=True)
    try:
        judge.request({"op": "cases", "slot": "99.1/hidden", "seed": 3})
        right = judge.request({"op": "reference", "slot": "99.1/hidden", "seed": 3})["values"]

        def compare(**extra):
            return judge.request({"op": "compare", "slot": "99.1/hidden", "seed": 3, "values": right, **extra})

        fast = compare(seconds=0.01)
        assert fast["passed"] and fast["limit"] == harness.TIMED_FLOOR_SECONDS, fast
        slow = compare(seconds=7.5)
        assert not slow["passed"], slow
        first = slow["message"].splitlines()[0]
        assert "every value was right" in first and "7.50 s" in first and CLOCK in first, first
        assert "limit is 3.00 s (3× that, at least 3 s)" in first, first
        assert compare()["passed"]                     # no clock, no timing: values only
        # the visible check is never timed, whatever time comes with it
        visible = judge.request({"op": "reference", "slot": "99.1", "seed": 3})["values"]
        assert judge.request({"op": "compare", "slot": "99.1", "seed": 3, "values": visible, "seconds": 99})["passed"]
        assert "timed in your kernel" in compare(seconds=7.5, clock="kernel")["message"]
        for bad in ("1", -1, float("nan"), True):
            with pytest.raises(RuntimeError, match="seconds must be a finite number"):
                compare(seconds=bad)
        with pytest.raises(RuntimeError, match="clock must be one of grader, kernel, got 'wall'"):
            compare(seconds=1, clock="wall")
    finally:
        judge.close()


@pytest.mark.skipif(isolation() != "bwrap", reason="grade needs bwrap (Debian package bubblewrap)")
def test_grade_times_the_hidden_cell_itself(timed_release, tmp_path):
    """The engine times the hidden cell it inserted: an answer right on every input but slow on the
    hidden check's large ones scores 0, with a message that says so, also where it stopped the
    kernel's clocks first; the quick one full marks."""
    rel, sol = timed_release
    subs = tmp_path / "subs"
    tiny_submission(subs, "good", "return x * x")
    tiny_submission(subs, "slow", SLOW)
    # the clocks a check in the kernel would read, stopped: the grader reads none of them
    tiny_submission(subs, "slow_stopped_clocks", SLOW, before=True, extra=[
        "import time\n_now, _ns = time.perf_counter(), time.perf_counter_ns()\n"
        "time.perf_counter, time.perf_counter_ns = (lambda: _now), (lambda: _ns)"])
    out = tmp_path / "g.json"
    grade([str(subs)], release=str(rel), hidden_from=str(sol), workers=2, json_path=str(out),
          options=Options(cell_timeout=60, notebook_timeout=120))
    rows = {r["student"]: r for r in json.loads(out.read_text())["rows"]}
    assert (rows["good"]["visible"], rows["good"]["hidden"]) == ("✓", "✓"), rows["good"]
    for student in ("slow", "slow_stopped_clocks"):
        r = rows[student]
        assert (r["visible"], r["hidden"], r["points"]) == ("✓", "✗", 0), r
        assert CLOCK in r["error"] and "every value was right" in r["error"], r["error"]


def test_the_learners_own_hidden_check_is_timed_too(timed_release, monkeypatch):
    """In JupyterLab the kernel times its own hidden check (it is the learner's to fool): the same
    verdict as the grader's, before hand-in."""
    import time

    _, sol = timed_release
    monkeypatch.setenv("GPUCOURSE_SOLUTIONS", str(sol))
    monkeypatch.setitem(harness._state, "judges", {})
    monkeypatch.setitem(harness._state, "runs", {})

    def slow_square(x):
        time.sleep(2 if abs(x) >= 10**5 else 0)
        return x * x

    try:
        harness.check_exercise("99.1", slow_square, lambda rng: [])
        with pytest.raises(harness.CheckFailed, match="every value was right, but its 2 cases took .* timed in your kernel"):
            harness.check_hidden("99.1", lambda rng: [])
        harness._state["runs"]["99.1"] = lambda x: x * x
        harness.check_hidden("99.1", lambda rng: [])
    finally:
        for judge in harness._state["judges"].values():
            judge.close()


@pytest.mark.slow
@pytest.mark.skipif(isolation() != "bwrap", reason="grade needs bwrap (Debian package bubblewrap)")
@pytest.mark.timeout(600)
def test_a_row_loop_hidden_from_the_call_counter_fails_011_on_the_graders_clock(tmp_path):
    """Chapter 01 solved, but 01.1 loops over the rows with the torch-call counter switched off: the
    visible check passes (the counter sees one call at every size); the hidden check's values are
    right and its million rows take seconds: 01.1 scores 0, every other exercise full marks."""
    nb = solved(CH01)
    answer = next(c for c in nb.cells if c.cell_type == "code" and c.source.startswith("def pairwise_sq_dists("))
    answer.source = ("def pairwise_sq_dists(x, y):\n"
                     "    out = torch.empty(len(x), len(y), dtype=x.dtype)\n"
                     "    with torch._C.DisableTorchFunction():\n"
                     "        for i in range(len(x)):\n"
                     "            out[i] = ((x[i] - y) ** 2).sum(-1)\n"
                     "    return out\n")
    (tmp_path / "subs" / "walker").mkdir(parents=True)
    nbformat.write(nb, tmp_path / "subs" / "walker" / CH01)
    out = tmp_path / "g.json"
    grade([str(tmp_path / "subs")], release=str(ROOT / "exercises"), hidden_from=str(ROOT / "solutions"),
          workers=1, json_path=str(out), options=Options(cell_timeout=300, notebook_timeout=600))
    rows = {r["exercise"]: r for r in json.loads(out.read_text())["rows"]}
    walked = rows.pop("01.1")
    assert (walked["visible"], walked["hidden"], walked["points"]) == ("✓", "✗", 0), walked
    assert CLOCK in walked["error"] and "every value was right" in walked["error"], walked["error"]
    for r in rows.values():
        assert (r["visible"], r["hidden"]) == ("✓", "✓") and r["points"] == r["max"] > 0, r
