"""``forbid=[...]``: the functions and classes an exercise asks the learner to write raise when called."""

import pytest
import torch

import gpucourse as gc
from gpucourse.grading.harness import ForbiddenCall, forbidden


def test_a_plain_function_raises_inside_and_works_after():
    alias = gc.zero_memory
    with forbidden(["gc.zero_memory"], "99.1"):
        with pytest.raises(ForbiddenCall, match="99.1"):
            alias(1000, 2, 1)                                  # through another name bound to it
    assert gc.zero_memory(1000, 2, 1) > 0


def test_a_class_whose_init_calls_super_raises_too():
    """``MoE.__init__`` calls ``super().__init__()``: its code has a ``__class__`` cell, and the
    stand-in must have one too (before, such classes were silently left callable)."""
    assert gc.MoE.__init__.__closure__                         # the case this test is about
    with forbidden(["gc.MoE"], "99.2"):
        with pytest.raises(ForbiddenCall, match="gc.MoE is off limits in exercise 99.2"):
            gc.MoE(4, 8, num_experts=2)
    moe = gc.MoE(4, 8, num_experts=2)                          # restored, super() and all
    assert moe(torch.randn(3, 4)).shape == (3, 4)


def test_the_package_itself_may_still_call_it():
    """A forbidden class constructed by the course's own code (here ``load_balance_run``) works."""
    with forbidden(["gc.MoE"], "99.3"):
        run = gc.load_balance_run(0.0, steps=1)
    assert run["counts"].shape[0] == 1
