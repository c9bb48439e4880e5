"""Kernel → Interrupt (the stop button; ``nbgrader validate`` when a cell overruns its time) signals
the kernel's whole process group. The check's judge is not in it: it survives, and the next check
is decided by it — not reported as "the judge process ended while answering: crash (signal 2)",
which reads as the learner's values having crashed it."""

import threading
from pathlib import Path

import nbformat
import pytest
from _kernel import kernel  # noqa: F401 - the fixture
from _processes import alive, children_of, wait_gone

ROOT = Path(__file__).resolve().parents[2]



def _cells(*starts: str) -> list[str]:
    nb = nbformat.read(ROOT / "solutions" / "00_setup_exercises.ipynb", as_version=4)
    return [next(c.source for c in nb.cells if c.cell_type == "code" and c.source.startswith(s)) for s in starts]


def _stdout(outputs) -> str:
    return "".join(o[1] for o in outputs if o[0] == "stdout")


@pytest.mark.slow
def test_an_interrupted_cell_leaves_the_judge_alive_and_the_next_check_passes(kernel):
    setup, answer, check = _cells("import random", "def physical_gpu", "# Check 00.2")
    for source in (setup, answer):
        assert kernel.run(source)[0] == "ok"
    status, out = kernel.run(check)
    assert status == "ok" and "00.2" in _stdout(out), out
    status, out = kernel.run("from gpucourse.grading import harness\nharness._state['judges']['00'].proc.pid")
    judge = int(out[0][1])
    assert alive(judge)

    timer = threading.Timer(2.0, kernel.km.interrupt_kernel)     # what the stop button does: SIGINT to the group
    timer.start()
    status, out = kernel.run("import time\ntime.sleep(30)")
    timer.join()
    assert status == "error" and out[-1][1] == "KeyboardInterrupt", out
    assert alive(judge), "the kernel's interrupt killed the check's judge"

    status, out = kernel.run(check)
    assert status == "ok" and "✓" in _stdout(out) and "crash" not in str(out), out
    assert kernel.run("harness._state['judges']['00'].proc.pid")[1][0][1] == str(judge)   # the same judge decided

    # in a session of its own, it still ends with its kernel, and takes its live ranks along
    family = [judge, *children_of(judge)]
    assert len(family) > 1, "expected the judge's live ranks (the chapter starts 3)"
    kernel.close()
    assert wait_gone(family, 15) == []
