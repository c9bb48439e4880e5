from _grading_helpers import tiny_release  # noqa: F401  (fixture)
