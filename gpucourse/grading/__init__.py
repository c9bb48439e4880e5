"""Exercises and grading: ``solutions/`` → ``exercises/`` generation, checks, self-check and class grading.

- ``exercises``  the generator: solution markers become stubs, check cells carry id/points/hash
- ``harness``    what a check cell calls (``gc.check_exercise``): runs the learner's code on the
                 grader's inputs and sends the values out; the ``compare`` vocabulary
- ``wire``       values as data (JSON; tensors from raw bytes): nothing a kernel sends can run code
- ``judge``      the process that decides: runs the course's solutions on the same inputs, compares;
                 a grading run forks its judges from one host that imported torch once
- ``public``     the public cases shipped in ``exercises/public/``: what a check decides with where
                 ``solutions/`` is absent (a public judge: the release's checks, the shipped values)
- ``restore``    match a submission to its release; put the course's check cells back
- ``engine``     run a notebook in a fresh kernel; prime each check cell with its inputs, collect
                 its values
- ``sandbox``    temp copy, own session, rlimits, bwrap, whole process tree killed
- ``gradebook``  CSV / JSON / per-student table / feedback files
- ``grade``      ``python -m gpucourse grade``: all of the above for a class, N at a time
- ``selfcheck``  ``python -m gpucourse check`` and ``gc.check_this_notebook()``: the learner's
                 one-notebook self-check on the same engine
- ``nbgrader``   ``python -m gpucourse export-nbgrader``

The grader's own process imports neither torch nor any other part of ``gpucourse``: only the
judge (the course's answers) and the students' kernels load torch. Names are loaded on first use.
"""

import importlib as _importlib

_WHERE = {
    "check": "selfcheck", "check_this_notebook": "selfcheck", "run_notebook": "selfcheck",
    "generate_exercises": "exercises",
    "CheckFailed": "harness", "ForbiddenCall": "harness", "check_exercise": "harness",
    "check_hidden": "harness", "expect": "harness", "expect_close": "harness", "expect_equal": "harness",
    "set_check_seed": "harness",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(_importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
