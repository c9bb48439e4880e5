"""The judge host of a grading run imports, once for all its judges, what forking ranks needs.

A judge that runs the course's answers on ranks (chapters 00, 04, 05, 07-11) forks them through
``gc.launch`` or ``gc.start_ranks``, which first import ``torch._dynamo`` in the forking process
(:func:`gpucourse.runtime.warm_parent`): 1.5-2 s of CPU and 50-80 MB of its own pages,
once per judge. The host of :class:`~gpucourse.grading.grade.Judges` imports it before it forks
them, so they share it; the host of a self-check without ``solutions/`` (public judges: no answer
runs, no rank starts) does not pay for it.
"""

from __future__ import annotations

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from gpucourse.grading import wire
from gpucourse.grading.exercises import BEGIN, END
from gpucourse.grading.grade import Judges
from gpucourse.grading.harness import JudgeHost, JudgeProcess
from gpucourse.grading.selfcheck import PublicJudges

NAME = "98_warm_exercises.ipynb"
# the answer reports what its judge process had imported before it ran: nothing in this chapter
# launches ranks, so whatever is there came from the host the judge was forked from
CHECK = """# Check 98.1 — what the judge had imported
def cases(rng):
    return [(1,), (rng.randint(2, 9),)]


gc.check_exercise("98.1", imported, cases)"""


@pytest.fixture
def solutions(tmp_path):
    nb = new_notebook(cells=[
        new_markdown_cell("# 98 · warm"), new_code_cell("import gpucourse as gc"),
        new_markdown_cell("## Exercise 98.1 — imported"),
        new_code_cell(f"def imported(x):\n    {BEGIN}\n    import sys\n"
                      "    from gpucourse.runtime import processes\n"
                      f"    return [x, 'torch._dynamo' in sys.modules, processes._parent_warm]\n    {END}"),
        new_code_cell(CHECK, metadata={"tags": ["check"], "points": 1})])
    nbformat.write(nb, tmp_path / NAME)
    return tmp_path


def _imported_in_a_fork(solutions, warm: bool) -> list:
    host = JudgeHost(warm=warm)
    judge = None
    try:
        judge = JudgeProcess("98", solutions, local=False, host=host)
        reply = judge.request({"op": "reference", "slot": "98.1", "seed": 7}, timeout=120)
        return wire.loads(reply["values"])
    finally:
        if judge is not None:
            judge.close()
        host.close()


@pytest.mark.parametrize("warm", [True, False])
def test_a_warm_host_forks_judges_that_already_hold_what_ranks_need(solutions, warm):
    values = _imported_in_a_fork(solutions, warm)
    assert [v[0] for v in values][0] == 1 and len(values) == 2, values
    # warm: torch._dynamo imported and the launcher's warm-up marked done in the host, before the fork
    assert all(v[1:] == [warm, warm] for v in values), values


def test_grading_warms_its_host_and_a_self_check_without_solutions_does_not(solutions):
    for judges, warm in ((Judges(solutions, 7), True), (PublicJudges({}, 7), False)):
        try:
            assert ("--warm" in judges._judge_host().proc.args) is warm, judges._host.proc.args
        finally:
            judges.close()
