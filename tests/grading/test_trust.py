"""No false alarms, no free marks: the course's own notebooks graded as a class would be (issue 28).

One ``grade --hidden`` run over a class of 26 submissions: every solutions notebook (honest work:
full marks, visible and hidden, in all 13 chapters) and every untouched release notebook (0 marks,
each exercise "not implemented yet" — never "tampered"). Torch's, numpy's and the package's import
side effects happen in every one of them; none may change a grade.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpucourse.grading.grade import Options, grade
from gpucourse.grading.sandbox import isolation

ROOT = Path(__file__).resolve().parents[2]
# one grade --hidden run over the class is the module fixture: it runs inside the first test's time,
# and a passing forbidding exercise is checked a second time without the helper (graded build)
pytestmark = pytest.mark.timeout(1500)
SOLUTIONS = sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb"))


@pytest.fixture(scope="module")
def graded_course(tmp_path_factory):
    if isolation() != "bwrap":
        pytest.skip("grade needs bwrap (Debian package bubblewrap)")
    root = tmp_path_factory.mktemp("course")
    for path in SOLUTIONS:
        for student, source in (("honest", path), ("untouched", ROOT / "exercises" / path.name)):
            folder = root / "subs" / f"{student}-{path.name[:2]}"
            folder.mkdir(parents=True)
            (folder / path.name).write_bytes(source.read_bytes())
    out = root / "grades.json"
    code = grade([str(root / "subs")], release=str(ROOT / "exercises"), hidden_from=str(ROOT / "solutions"),
                 workers=2, json_path=str(out), options=Options(cell_timeout=300, notebook_timeout=900))
    return code, json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("chapter", [p.name[:2] for p in SOLUTIONS])
def test_the_solutions_get_full_marks(graded_course, chapter):
    _, data = graded_course
    rows = [r for r in data["rows"] if r["student"] == f"honest-{chapter}"]
    assert len(rows) >= (3 if chapter == "00" else 4)
    for r in rows:
        assert (r["visible"], r["hidden"], r["status"]) == ("✓", "✓", "graded"), r
        assert r["points"] == r["max"] > 0, r
    notebook = next(n for n in data["notebooks"] if n["student"] == f"honest-{chapter}")
    assert notebook["status"] == "graded" and not notebook["problem"], notebook
    assert notebook["other_errors"] == [], notebook["other_errors"]


@pytest.mark.slow
@pytest.mark.parametrize("chapter", [p.name[:2] for p in SOLUTIONS])
def test_untouched_releases_get_zero_for_not_implemented(graded_course, chapter):
    _, data = graded_course
    rows = [r for r in data["rows"] if r["student"] == f"untouched-{chapter}"]
    assert rows
    for r in rows:
        assert r["points"] == 0 and r["status"] == "graded", r
        assert r["error"].startswith(f"{r['exercise']}: not implemented yet"), r
        assert "tamper" not in json.dumps(r)


#: runs of an honest notebook: one where a graded build serves every exercise; where the judge's plan
#: has groups that each strip something, one per group (the first runs whole); where an exercise
#: needs a helper another forbids, the notebook as run plus one stripped re-check per group. 05: a
#: cell after 05.6's check fits a link model, which reaches gc.ring_all_reduce_time (05.6 forbids
#: it), so no build serves the whole notebook: as run, then 05.1-05.5 and 05.6 each stripped (the
#: helper used to stay in every build, behind the kernel's gate, which a course wrapper walked past).
#: 06: 06.1 and 06.2 are checked with a torch whose operators they forbid do nothing, and 06.3's
#: check needs them (GradScaler): two runs
HONEST_RUNS = {"00": 1, "01": 1, "06": 2, "08": 1, "10": 1, "05": 3, "11": 2, "09": 3,
               "02": 2, "03": 2, "04": 2, "07": 2, "12": 2}


@pytest.mark.slow
def test_honest_work_takes_the_fewest_runs_and_untouched_work_one(graded_course):
    _, data = graded_course
    runs = {n["student"]: n["runs"] for n in data["notebooks"]}
    assert {c: runs[f"honest-{c}"] for c in HONEST_RUNS} == HONEST_RUNS
    assert {s: r for s, r in runs.items() if s.startswith("untouched")} == \
        {f"untouched-{p.name[:2]}": 1 for p in SOLUTIONS}


@pytest.mark.slow
def test_the_class_exit_status_and_seed(graded_course):
    code, data = graded_course
    assert code == 1                                    # some exercises failed (the untouched ones)
    assert isinstance(data["seed"], int)
