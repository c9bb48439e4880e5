"""Worker threads of virtual devices: ordering, errors, propagated state, one intra-op thread."""

import threading

import pytest
import torch

import gpucourse as gc
from gpucourse.data_parallel.device_workers import (as_device, as_devices, current_device_index, device_context,
                                      run_on_devices)

CPU = [torch.device("cpu", i) for i in range(3)]


def test_results_in_device_order_from_persistent_threads():
    names = run_on_devices(lambda: threading.current_thread().name, [(), (), ()], CPU)
    again = run_on_devices(lambda: threading.current_thread().name, [(), (), ()], CPU)
    assert names == again and len(set(names)) == 3            # the same thread per device
    assert names[1].startswith("gpucourse-cpu:1")


def test_workers_run_with_one_intra_op_thread_and_their_device_index():
    got = run_on_devices(lambda: (torch.get_num_threads(), current_device_index()), [(), ()], CPU[:2])
    assert got == [(1, 0), (1, 1)]


def test_caller_state_is_propagated():
    def state():
        return torch.is_grad_enabled(), torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")

    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert run_on_devices(state, [()], CPU[:1]) == [(False, True, torch.bfloat16)]
    assert run_on_devices(state, [()], CPU[:1])[0][:2] == (True, False)


def test_first_error_is_raised_after_all_finished():
    done = []

    def work(i):
        if i == 0:
            raise KeyError("zero")
        done.append(i)
        return i

    with pytest.raises(KeyError, match="zero") as info:
        run_on_devices(work, [(0,), (1,), (2,)], CPU)
    assert sorted(done) == [1, 2]
    assert "replica 0 on device cpu:0" in info.value.__notes__[0]


def test_nested_call_on_the_same_device_runs_inline():
    inner = lambda: run_on_devices(lambda: current_device_index(), [()], CPU[1:2])  # noqa: E731
    assert run_on_devices(inner, [()], CPU[1:2]) == [[1]]


def test_device_context_and_as_device():
    assert current_device_index() == 0
    with device_context("cpu:2"):
        assert current_device_index() == 2
    assert current_device_index() == 0
    assert as_device(1) == torch.device("cuda" if torch.cuda.is_available() else "cpu", 1)
    with pytest.raises(ValueError, match=">= 0"):
        as_device(-1)
    with pytest.raises(TypeError, match="bool"):
        as_device(True)
    with pytest.raises(ValueError, match="not a device name"):
        as_device("gpu zero")
    with pytest.raises(ValueError, match="mixes"):
        as_devices(["cpu:0", "cuda:0"])


def test_timeline_overlap_arithmetic():
    tl = gc.data_parallel.device_timeline.Timeline(spans=[("a", "f", 0.0, 2.0), ("b", "f", 1.0, 3.0), ("c", "g", 0.0, 9.0)])
    assert tl.overlap("f") == pytest.approx(1.0)
    assert tl.overlap("g") == 0.0


def test_timeline_totals_sum_spans_per_label_and_row():
    tl = gc.data_parallel.device_timeline.Timeline(spans=[("a", "f", 0.0, 2.0), ("a", "f", 3.0, 3.5), ("b", "f", 1.0, 3.0),
                                           ("main thread", "gather", 4.0, 4.25)])
    assert tl.totals() == {"f": {"a": 2.5, "b": 2.0}, "gather": {"main thread": 0.25}}


def test_a_data_parallel_step_records_every_stage():
    dp = gc.DataParallel(gc.MLP(4, 8, 2), device_ids=CPU[:2])
    with gc.record_timeline() as tl:
        dp(torch.randn(6, 4)).sum().backward()
    totals = tl.totals()
    for label in ("scatter", "replicate", "wait for forward", "gather", "wait for backward"):
        assert set(totals[label]) == {"main thread"}, label
    assert set(totals["forward"]) == set(totals["backward"]) == {"cpu:0", "cpu:1"}


def test_workers_are_recreated_in_a_forked_child():
    """A process forked after the parent used the workers (e.g. by gc.launch) gets its own threads."""
    run_on_devices(lambda: None, [()], CPU[:1])                 # parent's worker exists

    def child(rank, world_size):
        return run_on_devices(lambda: current_device_index(), [(), ()], CPU[:2])

    assert gc.launch(child, 1, init_process_group=False, timeout=60) == [[0, 1]]
