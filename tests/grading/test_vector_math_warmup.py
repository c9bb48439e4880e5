"""MKL's vector math picks its code on a function's first call in a process; threads that make that
first call together can get a less accurate variant (02.4's honest answer failed by 2e-5 in CI, and
by 2e-4 in a gradient here). ``run_cases`` — the kernel's and the judge's — calls each VML-backed
torch function once, in its own thread, before the first case."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _python(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=ENV)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1]


def test_the_first_case_runs_after_every_vml_function_was_called_once():
    # a fresh process; the case records which of the functions ran before it (tracked by wrapping them)
    out = _python("""
import json, torch
from gpucourse.grading import harness
called = []
for name in harness._VML_FUNCTIONS:
    original = getattr(torch, name)
    setattr(torch, name, lambda *a, _f=original, _n=name, **k: (called.append(_n), _f(*a, **k))[1])
seen, counts = [], []
def case(x):
    seen.append(sorted(set(called)))
    counts.append(len(called))
    return x
harness.run_cases(case, [1, 2], [11, 12])
harness.run_cases(case, [3], [13])
print(json.dumps({"first": seen[0], "counts": counts}))
""")
    seen = json.loads(out)
    from gpucourse.grading.harness import _VML_FUNCTIONS
    assert seen["first"] == sorted(_VML_FUNCTIONS), seen
    # once per process: a second case, and a second run_cases, call none of them again
    assert seen["counts"] == [2 * len(_VML_FUNCTIONS)] * 3, seen       # float32 and float64 each


def test_the_warm_up_imports_no_torch_where_none_is_loaded():
    # the grader's own process never imports torch: without it the warm-up does nothing
    out = _python("""
import sys
from gpucourse.grading import harness
harness._warm_vector_math()
print('torch' in sys.modules)
""")
    assert out == "False"
