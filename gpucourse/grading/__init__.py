"""Exercises and grading: ``solutions/`` → ``exercises/`` generation, self-check and class grading.

- ``exercises``  the generator: solution markers become stubs, check cells carry id/points/hash
- ``restore``    match a submission to its release; put the course's check cells back
- ``engine``     run a notebook in a fresh kernel; a check passes only on an ``ok`` reply
- ``guard``      (kernel side) detects rebinding of what checks use; caps output
- ``sandbox``    temp copy, own session, rlimits, bwrap, whole process tree killed
- ``gradebook``  CSV / JSON / per-student table / feedback files
- ``grade``      ``python -m gpucourse grade``: all of the above for a class, N at a time
- ``check``      ``python -m gpucourse check`` and ``gc.check_this_notebook()``: the learner's
                 one-notebook self-check on the same engine
- ``nbgrader``   ``python -m gpucourse export-nbgrader``

This package imports no other part of ``gpucourse`` (and not torch): the grader's sandbox
shepherd loads it on its own.
"""

from .check import check, check_this_notebook, run_notebook
from .exercises import generate_exercises

__all__ = ["check", "check_this_notebook", "generate_exercises", "run_notebook"]
