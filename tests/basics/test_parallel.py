"""chunk → run → merge: the parallel map/reduce equal the serial ones, for any chunking and back-end."""

import operator
import os
import threading
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gpucourse as gc

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SLOW = settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --- 1) split ------------------------------------------------------------------------------------

@FAST
@given(n=st.integers(0, 200), k=st.integers(1, 40))
def test_chunk_sizes_match_torch_tensor_split(n, k):
    sizes = gc.chunk_sizes(n, k)
    assert sizes == [len(c) for c in torch.tensor_split(torch.arange(n), k)]
    assert len(sizes) == k and sum(sizes) == n and max(sizes) - min(sizes) <= 1


@settings(max_examples=300, deadline=None)
@given(n=st.integers(0, 2**70), k=st.integers(1, 5000))
def test_chunk_sizes_is_integer_exact(n, k):
    """Far beyond float64's 2**53: the first n % k chunks get one more, in exact integers."""
    sizes = gc.chunk_sizes(n, k)
    base, extra = divmod(n, k)
    assert sizes == [base + 1] * extra + [base] * (k - extra)
    assert all(type(s) is int and s >= 0 for s in sizes) and sum(sizes) == n and len(sizes) == k


@FAST
@given(items=st.lists(st.integers(), max_size=60), k=st.integers(1, 80))
def test_split_into_chunks_sizes_are_chunk_sizes(items, k):
    """More chunks than items included: the first len(items) % k chunks hold one item more."""
    chunks = gc.split_into_chunks(iter(items), k)           # any iterable, read once
    assert [len(c) for c in chunks] == gc.chunk_sizes(len(items), k)
    assert [x for c in chunks for x in c] == items and all(type(c) is list for c in chunks)


@FAST
@given(items=st.lists(st.integers()), k=st.integers(1, 12))
def test_split_into_chunks_is_contiguous_and_complete(items, k):
    chunks = gc.split_into_chunks(items, k)
    assert len(chunks) == k
    assert [x for c in chunks for x in c] == items
    assert [len(c) for c in chunks] == gc.chunk_sizes(len(items), k)


@pytest.mark.parametrize("args, exc, msg", [
    ((-1, 2), ValueError, "n must be >= 0, got -1"),
    ((5, 0), ValueError, "num_chunks must be >= 1, got 0"),
    ((5, 2.0), TypeError, "num_chunks must be an int"),
    ((True, 2), TypeError, "n must be an int"),
])
def test_chunk_sizes_rejects_bad_arguments(args, exc, msg):
    with pytest.raises(exc, match=msg):
        gc.chunk_sizes(*args)


# --- 2) run: the parallel map equals the serial map ----------------------------------------------

@FAST
@given(items=st.lists(st.integers(-1000, 1000), max_size=40), workers=st.integers(1, 5),
       num_chunks=st.none() | st.integers(1, 12), backend=st.sampled_from(["serial", "thread"]))
def test_parallel_map_equals_serial_map(items, workers, num_chunks, backend):
    fn = lambda x: (x * 7919) % 101 - x  # noqa: E731
    out = gc.parallel_map(fn, items, workers=workers, backend=backend, num_chunks=num_chunks)
    assert out == list(map(fn, items))


@SLOW
@given(items=st.lists(st.integers(-50, 50), min_size=1, max_size=25), workers=st.integers(1, 3),
       num_chunks=st.none() | st.integers(1, 7))
def test_parallel_map_equals_serial_map_in_processes(items, workers, num_chunks):
    offset = 17                      # a closure over a local: fine for forked workers
    fn = lambda x: x * x - offset  # noqa: E731
    out = gc.parallel_map(fn, items, workers=workers, backend="process", num_chunks=num_chunks)
    assert out == list(map(fn, items))


@FAST
@given(words=st.lists(st.text(max_size=3), min_size=1, max_size=30), workers=st.integers(1, 4),
       num_chunks=st.none() | st.integers(1, 9), backend=st.sampled_from(["serial", "thread"]))
def test_parallel_reduce_keeps_the_order_of_a_non_commutative_op(words, workers, num_chunks, backend):
    # string concatenation is associative but not commutative: any out-of-order merge shows
    out = gc.parallel_reduce(str.upper, words, operator.add, workers=workers, backend=backend,
                             num_chunks=num_chunks)
    assert out == "".join(words).upper()


def test_parallel_reduce_in_processes_matches_torch_sum():
    g = torch.Generator().manual_seed(0)
    rows = list(torch.randn(37, 8, generator=g))
    out = gc.parallel_reduce(lambda r: r * 2, rows, workers=3, backend="process", num_chunks=5)
    torch.testing.assert_close(out, torch.stack(rows).sum(0) * 2)


def test_parallel_map_over_tensor_rows_matches_vectorised_op():
    x = torch.randn(10, 4, generator=torch.Generator().manual_seed(1))
    out = gc.parallel_map(torch.tanh, x, workers=2, num_chunks=4)
    torch.testing.assert_close(torch.stack(out), torch.tanh(x))


def test_empty_input():
    assert gc.parallel_map(abs, [], workers=3, backend="process") == []
    with pytest.raises(ValueError, match="empty sequence"):
        gc.parallel_reduce(abs, [])


def test_threads_are_distinct_and_run_at_the_same_time():
    idents = []

    def fn(x):
        idents.append(threading.get_ident())
        time.sleep(0.2)                  # releases the GIL: the other worker runs meanwhile
        return x

    trace = gc.Trace()
    gc.parallel_map(fn, [1, 2], workers=2, trace=trace)
    assert len(set(idents)) == 2 and threading.get_ident() not in idents
    a, b = sorted(trace, key=lambda r: r.start)
    assert b.start < a.end, "the two chunks did not overlap in time: threads ran one after the other"


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="Linux lists a process's threads there")
def test_thread_workers_have_left_the_system_when_parallel_map_returns():
    """join() returns before a thread's OS thread has run its libraries' clean-up (always, measured:
    ~20 µs median, ms under load); a fork in that window can inherit a lock nobody releases."""
    native = []

    def fn(x):
        native.append(threading.get_native_id())
        return float(torch.ones(8, 8).matmul(torch.ones(8, 8)).sum()) + x

    for _ in range(20):
        native.clear()
        assert gc.parallel_map(fn, [0, 1], workers=2) == [64.0 * 8, 64.0 * 8 + 1]
        left = [i for i in native if os.path.exists(f"/proc/self/task/{i}")]
        assert not left, f"worker threads {left} still exist after parallel_map returned"


def test_processes_are_other_processes():
    pids = gc.parallel_map(lambda _: os.getpid(), range(4), workers=2, backend="process")
    assert len(set(pids)) == 2 and os.getpid() not in pids
    assert pids[0] == pids[1] and pids[2] == pids[3]       # contiguous chunks, one per worker


@pytest.mark.parametrize("backend", ["serial", "thread", "process"])
def test_trace_has_one_record_per_chunk_round_robin(backend):
    trace = gc.Trace(backend)
    gc.parallel_map(abs, range(-5, 5), workers=2, num_chunks=5, backend=backend, trace=trace)
    by_chunk = sorted(trace, key=lambda r: r.chunk)
    assert [r.chunk for r in by_chunk] == [0, 1, 2, 3, 4]
    expected_workers = [0] * 5 if backend == "serial" else [0, 1, 0, 1, 0]
    assert [r.worker for r in by_chunk] == expected_workers
    assert all(r.end >= r.start and r.cpu >= 0 for r in trace)


def test_workers_beyond_the_chunks_are_not_started():
    trace = gc.Trace()
    assert gc.parallel_map(abs, [-1, -2], workers=8, trace=trace) == [1, 2]
    assert sorted(r.worker for r in trace) == [0, 1]


def _fail_on_three(x):
    if x == 3:
        raise KeyError(f"bad item {x}")
    return x


@pytest.mark.parametrize("backend", ["serial", "thread"])
def test_errors_keep_their_type_and_name_the_chunk(backend):
    with pytest.raises(KeyError, match="bad item 3") as info:
        gc.parallel_map(_fail_on_three, range(6), workers=2, backend=backend)
    if backend == "thread":
        assert "chunk 1" in "".join(getattr(info.value, "__notes__", []))


def test_process_error_names_the_worker():
    with pytest.raises(gc.WorkerError, match="KeyError") as info:
        gc.parallel_map(_fail_on_three, range(6), workers=2, backend="process")
    assert info.value.rank == 1


def test_thread_timeout():
    with pytest.raises(TimeoutError, match="did not finish within 0.2 s"):
        gc.parallel_map(time.sleep, [1.0, 0.0], workers=2, timeout=0.2)


def test_process_timeout_stops_the_workers():
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        gc.parallel_map(time.sleep, [30.0, 30.0], workers=2, backend="process", timeout=1.0)
    assert time.monotonic() - start < 15
    # and the next call works at once
    assert gc.parallel_map(abs, [-1], backend="process") == [1]


@pytest.mark.parametrize("kwargs, exc, msg", [
    (dict(workers=0), ValueError, "workers must be >= 1, got 0"),
    (dict(backend="gpu"), ValueError, "backend must be one of"),
    (dict(num_chunks=0), ValueError, "num_chunks must be >= 1"),
    (dict(timeout=0), ValueError, "timeout must be a number of seconds > 0"),
    (dict(trace=[]), TypeError, "trace must be a gpucourse.Trace"),
])
def test_parallel_map_rejects_bad_arguments(kwargs, exc, msg):
    with pytest.raises(exc, match=msg):
        gc.parallel_map(abs, [1, 2], **kwargs)


def test_parallel_map_rejects_non_callable():
    with pytest.raises(TypeError, match="fn must be callable"):
        gc.parallel_map(3, [1])
    with pytest.raises(TypeError, match="op must be a function"):
        gc.parallel_reduce(abs, [1], op=3)


# --- 3) merge into shared state ------------------------------------------------------------------

def test_locked_total_never_loses_an_update():
    ones = [torch.ones(())] * 5000
    for _ in range(3):
        assert gc.accumulate_in_threads(ones, workers=2, lock=True).item() == 5000.0


def test_unlocked_total_never_gains_and_plain_adds_work():
    ones = [torch.ones(())] * 2000
    unlocked = gc.accumulate_in_threads(ones, workers=2, lock=False).item()
    assert 0.0 < unlocked <= 2000.0          # updates may be lost, but never all, and none gained
    assert gc.accumulate_in_threads(ones, workers=2, lock=True).item() == 2000.0   # the lock: exact
    assert gc.accumulate_in_threads(list(range(100)), workers=1, lock=False) == 4950


def test_shared_total_repr_and_bad_lock():
    assert repr(gc.SharedTotal(3, lock=False)) == "SharedTotal(3, lock=False)"
    with pytest.raises(TypeError, match="lock must be True or False"):
        gc.SharedTotal(0, lock="yes")


def test_processes_do_not_share_a_total():
    total = gc.SharedTotal(0)
    gc.parallel_map(total.add, [1, 2, 3, 4], workers=2, backend="process")
    assert total.value == 0           # each child added into its own copy


def test_processes_started_with_spawn_get_their_own_total_too(monkeypatch):
    # once CUDA is loaded (any GPU machine: torch.cuda.is_available() loads the driver) launch()
    # spawns and pickles fn: a bound method of a locked total must still travel (seen on an H200)
    from gpucourse.runtime import processes

    monkeypatch.setattr(processes, "why_not_fork", lambda backend: "as on a machine with CUDA loaded")
    total = gc.SharedTotal(0)
    results = gc.parallel_map(lambda x: x * 2, [1, 2, 3, 4], workers=2, backend="process")
    assert results == [2, 4, 6, 8]
    gc.parallel_map(total.add, [1, 2, 3, 4], workers=2, backend="process")
    assert total.value == 0 and total.locked
    assert gc.parallel_reduce(lambda x: x, [1, 2, 3, 4], workers=2, backend="process") == 10


# --- the environment of a measurement ------------------------------------------------------------

def test_intra_op_threads_restores_after_an_error():
    before = torch.get_num_threads()
    with pytest.raises(RuntimeError, match="boom"):
        with gc.intra_op_threads(1):
            assert torch.get_num_threads() == 1
            raise RuntimeError("boom")
    assert torch.get_num_threads() == before
    with pytest.raises(ValueError, match="n must be >= 1"):
        with gc.intra_op_threads(0):
            pass


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux only")
def test_pinned_to_cpus_applies_to_forked_workers_and_restores():
    before = os.sched_getaffinity(0)
    core = min(before)
    with gc.pinned_to_cpus([core]):
        seen = gc.parallel_map(lambda _: os.sched_getaffinity(0), [0, 1], workers=2, backend="process")
    assert seen == [{core}, {core}]
    assert os.sched_getaffinity(0) == before
    with pytest.raises(ValueError, match="subset of the cores"):
        with gc.pinned_to_cpus([max(before) + 1000]):
            pass


def test_worker_threads_get_the_callers_intra_op_setting(monkeypatch):
    # torch.set_num_threads is per thread for OpenMP/MKL: parallel_map must repeat it in each worker
    calls = []
    real = torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda n: (calls.append((threading.get_ident(), n)),
                                                             real(n)))
    with gc.intra_op_threads(1):
        calls.clear()
        gc.parallel_map(time.sleep, [0.05, 0.05], workers=2)   # overlap: thread ids stay distinct
        seen = list(calls)
    assert sorted(n for _, n in seen) == [1, 1]
    assert len({i for i, _ in seen}) == 2 and threading.get_ident() not in {i for i, _ in seen}
