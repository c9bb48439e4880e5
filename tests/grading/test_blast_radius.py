"""One student, one blast radius (issue 37, part C): a judge that crashes or stalls on a submission's
values costs that submission its case — never another student's grade.

- the mechanism: a judge killed while it answers request A (thread A gets ``JudgeCrashed``), while
  thread B waits for it: B's compare is answered by a fresh judge;
- ``Judges``: values that crash (SIGSEGV) or stall a judge fail that case ("not compared") and the
  same notebook's later compares at once; other submissions' compares are answered;
- a class: wire attacks (a quantized tensor, a set of ints that hash alike), a crasher, a staller
  and two honest students — the honest ones get full marks, in bounded time.

Chapter 99's compare here crashes or stalls its judge on purpose for two values (-11 and -5), as
values that exploit a judge's bug would: the grader must contain what it cannot prevent.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
from _grading_helpers import tiny_submission, write_tiny_course
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from gpucourse.grading import wire
from gpucourse.grading.exercises import BEGIN, END
from gpucourse.grading.grade import Judges, Options, grade
from gpucourse.grading.harness import JudgeCrashed, JudgeGone, JudgeProcess

SEED = 99
CHECK = """# Check 99.1 — square of small numbers
def cases(rng):
    return [(v,) for v in range(-3, 4)] + [(rng.randint(-50, 50),) for _ in range(5)]


def compare(case, got, want):
    import os, signal, time
    if got == -11:                      # values this judge crashes on (a stand-in for a bug's exploit)
        os.kill(os.getpid(), signal.SIGSEGV)
    if got == -5:                       # values it stalls on
        time.sleep(float(os.environ.get("TINY_STALL", "60")))
    gc.expect_equal(got, want)


gc.check_exercise("99.1", square, cases, compare=compare, hint="multiply x by itself")"""
HIDDEN = """# Hidden 99.1 — square of large numbers
def hidden_cases(rng):
    return [(10**6,), (rng.randint(10**5, 10**7),)]


gc.check_hidden("99.1", hidden_cases)"""


@pytest.fixture
def fragile_release(tmp_path):
    """(release, solutions) of a chapter 99 whose judge crashes on the value -11 and stalls on -5."""
    nb = new_notebook(cells=[
        new_markdown_cell("# 99 · tiny"), new_code_cell("import gpucourse as gc"),
        new_markdown_cell("## Exercise 99.1 — square"),
        new_code_cell(f"def square(x):\n    {BEGIN}\n    return x * x\n    {END}"),
        new_code_cell(CHECK, metadata={"tags": ["check"], "points": 3}),
        new_code_cell(HIDDEN, metadata={"tags": ["hidden"]})])
    return write_tiny_course(tmp_path, nb)


def values_of(judges: Judges, slot: str, answer) -> str:
    """What a kernel sends for ``slot`` when ``square`` returns ``answer(x)``."""
    cases = wire.loads(judges.cases("99", slot)["cases"])
    return wire.dumps([answer(x) for (x,) in cases])


def test_a_judge_killed_mid_request_fails_that_request_and_the_waiting_one_gets_a_fresh_judge(
        fragile_release, monkeypatch):
    _, sol = fragile_release
    monkeypatch.setenv("TINY_STALL", "60")
    judges = Judges(sol, SEED)
    try:
        judge = judges.get("99")
        stalling, honest = values_of(judges, "99.1", lambda x: -5), values_of(judges, "99.1", lambda x: x * x)
        outcome = {}

        def a():
            try:
                judge.request({"op": "compare", "slot": "99.1", "seed": SEED, "values": stalling},
                              timeout=120)
            except Exception as e:  # noqa: BLE001
                outcome["a"] = e

        def b():
            outcome["b"] = judges.compare("99", "99.1", honest, "b")

        ta = threading.Thread(target=a)
        ta.start()
        while not judge.lock.locked():
            time.sleep(0.01)
        tb = threading.Thread(target=b)
        tb.start()
        time.sleep(1.0)                                     # A is in the judge's compare, B waits
        assert "b" not in outcome and ta.is_alive()
        os.kill(judge.proc.pid, signal.SIGKILL)
        ta.join(30)
        tb.join(60)
        assert isinstance(outcome["a"], JudgeCrashed) and outcome["a"].how == "crash (signal 9)", outcome
        assert outcome["b"]["passed"], outcome["b"]
        assert judges.get("99") is not judge
        with pytest.raises(JudgeGone):
            judge.request({"op": "hello"})
    finally:
        judges.close()


def test_a_request_that_stalls_is_stopped_and_says_so(fragile_release, monkeypatch):
    _, sol = fragile_release
    monkeypatch.setenv("TINY_STALL", "60")
    judge = JudgeProcess("99", sol, local=True)
    try:
        judge.request({"op": "cases", "slot": "99.1", "seed": SEED})
        started = time.monotonic()
        with pytest.raises(JudgeCrashed) as info:
            judge.request({"op": "compare", "slot": "99.1", "seed": SEED,
                           "values": wire.dumps([-5] * 12)}, timeout=2)
        assert info.value.stalled and info.value.how == "stall (over 2 s)"
        assert time.monotonic() - started < 15 and judge.proc.poll() is not None
    finally:
        judge.close()


def test_values_that_crash_or_stall_the_judge_cost_only_their_submission(fragile_release, monkeypatch):
    _, sol = fragile_release
    monkeypatch.setenv("TINY_STALL", "60")
    monkeypatch.setattr(Judges, "compare_timeout", 3)
    judges = Judges(sol, SEED)
    try:
        honest = {slot: values_of(judges, slot, lambda x: x * x) for slot in ("99.1", "99.1/hidden")}
        for name, answer, how in (("crasher", -11, "crash (signal 11)"), ("staller", -5, "stall (over 3 s)")):
            v = judges.compare("99", "99.1", values_of(judges, "99.1", lambda x: answer), name)
            assert not v["passed"], v
            assert v["message"] == f"99.1: your values made the judge {how}: not compared", v
            assert judges.compare("99", "99.1", honest["99.1"], "honest")["passed"]
            started = time.monotonic()                           # its next check: failed at once
            v = judges.compare("99", "99.1/hidden", honest["99.1/hidden"], name)
            assert not v["passed"] and "an earlier check of this notebook" in v["message"], v
            assert how in v["message"], v
            assert time.monotonic() - started < 1
            assert judges.compare("99", "99.1/hidden", honest["99.1/hidden"], "honest")["passed"]
    finally:
        judges.close()


QUANTIZED = """\
import base64, json
import gpucourse.grading.harness as h
real_collect = h.collect
def collect():
    real_collect()
    bad = {"$tensor": {"dtype": "qint8", "shape": [4], "data": base64.b64encode(bytes(4)).decode()}}
    return json.dumps({"wire": 1, "value": [bad] * 12})
h.collect = collect
"""

ALIKE_SET = """\
import json
import gpucourse.grading.harness as h
real_collect = h.collect
def collect():
    real_collect()
    alike = {"$s": [(2**61 - 1) * k for k in range(1, 90_000)]}       # one hash: quadratic to build
    return json.dumps({"wire": 1, "value": [alike] + [0] * 11})
h.collect = collect
"""


@pytest.mark.slow
def test_a_class_with_crashers_and_stallers_grades_the_honest_in_bounded_time(fragile_release, tmp_path,
                                                                               monkeypatch):
    rel, sol = fragile_release
    monkeypatch.setenv("TINY_STALL", "600")
    monkeypatch.setattr(Judges, "compare_timeout", 10)
    subs = tmp_path / "subs"
    tiny_submission(subs, "quantized", "return x * x", extra=[QUANTIZED], before=True)
    tiny_submission(subs, "alike-set", "return x * x", extra=[ALIKE_SET], before=True)
    tiny_submission(subs, "crasher", "return -11")
    tiny_submission(subs, "staller", "return -5")
    tiny_submission(subs, "honest-1", "return x * x")
    tiny_submission(subs, "honest-2", "return x ** 2")
    out = tmp_path / "g.json"
    started = time.monotonic()
    grade([str(subs)], release=str(rel), hidden_from=str(sol), workers=2, json_path=str(out), seed=SEED,
          options=Options(cell_timeout=60, notebook_timeout=120))
    elapsed = time.monotonic() - started
    data = json.loads(out.read_text())
    rows = {r["student"]: r for r in data["rows"]}
    for student in ("honest-1", "honest-2"):
        r = rows[student]
        assert (r["visible"], r["hidden"], r["points"], r["status"]) == ("✓", "✓", 3, "graded"), r
    for student, why in (("quantized", "could not be read"), ("alike-set", "could not be read"),
                         ("crasher", "made the judge crash (signal 11)"),
                         ("staller", "made the judge stall (over 10 s)")):
        r = rows[student]
        assert (r["visible"], r["points"], r["status"]) == ("✗", 0, "graded") and why in r["error"], r
    assert rows["crasher"]["hidden"] == rows["staller"]["hidden"] == "✗"
    assert all(n["status"] == "graded" for n in data["notebooks"]), data["notebooks"]
    assert elapsed < 120, f"the class took {elapsed:.0f} s"


def _parent(pid: int) -> int:
    return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])


def _private_mb(pid: int) -> int:
    """Memory only this process holds (its pages no other process maps), MB."""
    fields = dict(line.split(":", 1) for line in open(f"/proc/{pid}/smaps_rollup").read().splitlines()[1:])
    return sum(int(fields[k].split()[0]) for k in ("Private_Clean", "Private_Dirty")) >> 10


def test_judges_are_forked_from_one_host_and_one_crash_costs_a_fork_not_a_start(fragile_release):
    """The judges of a grading run are forks of one host that imported torch and the course once: they
    share those pages instead of each holding its own copy, and a judge that values crashed is
    replaced in a fraction of a second, by the same host."""
    _, sol = fragile_release
    judges = Judges(sol, SEED)
    try:
        judge = judges.get("99")
        host = judges._host.proc.pid
        assert _parent(judge.proc.pid) == host
        rss = int(next(line for line in open(f"/proc/{judge.proc.pid}/status") if line.startswith("VmRSS"))
                  .split()[1]) >> 10
        # torch alone is hundreds of MB here; a judge started on its own holds ~45% of its RSS as its
        # own pages (295 of 671 MB, chapter 00), a fork ~8% (24 of 310 MB here)
        assert _private_mb(judge.proc.pid) < rss / 4, (_private_mb(judge.proc.pid), rss)
        crashing = values_of(judges, "99.1", lambda x: -11)
        honest = values_of(judges, "99.1", lambda x: x * x)
        v = judges.compare("99", "99.1", crashing, "crasher")
        assert v["message"] == "99.1: your values made the judge crash (signal 11): not compared", v
        started = time.monotonic()
        assert judges.compare("99", "99.1", honest, "honest")["passed"]
        again = judges.get("99")
        assert again is not judge and judges._host.proc.pid == host and _parent(again.proc.pid) == host
        # a fresh judge loads the chapter's solutions and draws the slot's reference again: seconds,
        # not the import of torch as well
        assert time.monotonic() - started < 20
    finally:
        judges.close()
    assert judge.proc.poll() is not None and again.proc.poll() is not None


def test_a_host_that_ends_takes_its_judges_and_the_next_request_starts_another(fragile_release):
    _, sol = fragile_release
    judges = Judges(sol, SEED)
    try:
        judge = judges.get("99")
        first = judges._host
        honest = values_of(judges, "99.1", lambda x: x * x)
        os.kill(first.proc.pid, signal.SIGKILL)
        first.proc.wait(10)
        deadline = time.monotonic() + 10
        while judge.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert judge.proc.poll() is not None, "a judge outlived its host"
        assert not os.path.exists(f"/proc/{judge.proc.pid}/stat") or _parent(judge.proc.pid) != first.proc.pid
        assert judges.compare("99", "99.1", honest, "honest")["passed"]
        assert judges._host is not first and _parent(judges.get("99").proc.pid) == judges._host.proc.pid
    finally:
        judges.close()


def test_a_gpucourse_in_the_current_folder_does_not_replace_the_judges(fragile_release, tmp_path, monkeypatch):
    """Grading from inside another checkout of the course (an older version, a student's copy): the
    judges run the grader's own package, not the one ``python -m`` would find in the current folder."""
    _, sol = fragile_release
    shadow = tmp_path / "elsewhere" / "gpucourse"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise SystemExit('the package in the current folder was imported')\n")
    monkeypatch.chdir(shadow.parent)
    judges = Judges(sol, SEED)
    try:
        assert judges.compare("99", "99.1", values_of(judges, "99.1", lambda x: x * x), "honest")["passed"]
    finally:
        judges.close()
