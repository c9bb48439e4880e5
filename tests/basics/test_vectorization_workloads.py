"""SISD loop vs vectorised op, SIMD on/off, and the two GIL-holding / GIL-releasing workloads."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gpucourse as gc


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 300), seed=st.integers(0, 10**6))
def test_dot_loop_equals_torch_dot(n, seed):
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(n, generator=g, dtype=torch.float64), torch.randn(n, generator=g,
                                                                        dtype=torch.float64)
    assert gc.dot_loop(a, b) == pytest.approx(torch.dot(a, b).item(), rel=1e-9, abs=1e-9)


def test_dot_loop_rejects_bad_shapes():
    with pytest.raises(ValueError, match=r"got shapes \(3,\) and \(4,\)"):
        gc.dot_loop(torch.ones(3), torch.ones(4))
    with pytest.raises(TypeError, match="must be tensors"):
        gc.dot_loop([1.0], [2.0])


def test_time_with_cpu_capability_runs_the_baseline_code_path():
    t = gc.time_with_cpu_capability("default", op="mul", numel=4096, repeats=5)
    assert t.name == "mul with DEFAULT" and len(t.times) == 5 and t.median > 0
    with pytest.raises(ValueError, match="op must be one of"):
        gc.time_with_cpu_capability("default", op="matmul")
    with pytest.raises(ValueError, match="capability must be a name"):
        gc.time_with_cpu_capability("")
    assert isinstance(gc.cpu_capability(), str)


@settings(max_examples=20, deadline=None)
@given(n=st.integers(0, 3000))
def test_python_work_computes_its_sum(n):
    assert gc.python_work(n) == sum(i * i % 7 for i in range(n))


def test_torch_work_keeps_the_norm_and_splits_into_chunks():
    # x <- x @ Q with orthogonal Q: |x|^2 stays = size, whatever the chain length
    for n in (0, 1, 37):
        assert gc.torch_work(n, size=32) == pytest.approx(32.0, rel=1e-4)
    assert gc.parallel_map(gc.torch_work, [3, 4], workers=2) == [gc.torch_work(3), gc.torch_work(4)]


@pytest.mark.parametrize("call, error, match", [
    (lambda: gc.python_work(-1), ValueError, "n must be >= 0, got -1"),
    (lambda: gc.torch_work(2, size=0), ValueError, "size must be >= 1, got 0"),
    (lambda: gc.torch_work(1.5), TypeError, "must be an int, got float 1.5")])
def test_workloads_reject_bad_sizes(call, error, match):
    with pytest.raises(error, match=match):
        call()
