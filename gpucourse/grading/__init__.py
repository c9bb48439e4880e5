"""Exercises and grading: ``solutions/`` → ``exercises/`` generation, and running check cells.

- ``exercises``  the generator: solution markers become stubs, check cells are kept
- ``check``      ``python -m gpucourse check``: a fresh kernel per notebook, one row per exercise
"""

from .check import run_notebook
from .exercises import generate_exercises

__all__ = ["run_notebook", "generate_exercises"]
