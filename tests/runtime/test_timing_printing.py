import time

import pytest

import gpucourse as gc


def test_measure_counts_warmup_and_repeats():
    calls = []
    t = gc.measure(lambda: calls.append(1), repeats=4, warmup=2, name="x")
    assert len(calls) == 6 and len(t.times) == 4 and t.name == "x"


def test_measure_really_measures():
    # time.sleep never returns early, so every timing is at least the sleep (no upper bound:
    # a busy machine may add any delay, and tests never assert on speed)
    t = gc.measure(lambda: time.sleep(0.02), repeats=3, warmup=0)
    assert len(t.times) == 3 and min(t.times) >= 0.0195


def test_speedup_is_ratio_of_medians():
    base = gc.Timing("a", [3.0, 1.0, 2.0])
    fast = gc.Timing("b", [0.5, 2.0, 1.0])
    assert gc.speedup(base, fast) == 2.0
    assert "2.00x" in gc.format_comparison(base, fast)


@pytest.mark.parametrize("kw, exc", [(dict(repeats=0), ValueError), (dict(warmup=-1), ValueError),
                                     (dict(repeats=1.5), TypeError), (dict(warmup=True), TypeError)])
def test_measure_bad_args(kw, exc):
    name = next(iter(kw))
    with pytest.raises(exc, match=name):
        gc.measure(lambda: None, **kw)


def test_print_ordered_in_rank_order(capsys):
    def fn(rank, world_size):
        time.sleep(0.1 * (world_size - rank))
        gc.print_ordered(f"loss {rank / 10}")
        gc.print0("only once")
        return gc.rank_prefix()

    assert gc.launch(fn, 3) == ["[rank 0] ", "[rank 1] ", "[rank 2] "]
    lines = capsys.readouterr().out.splitlines()
    # rank 0 printed everything; launch prefixes the printing rank
    assert lines == ["[rank 0] [rank 0] loss 0.0", "[rank 0] [rank 1] loss 0.1",
                     "[rank 0] [rank 2] loss 0.2", "[rank 0] only once"]


def test_speedup_of_timings_without_measurements_says_so():
    with pytest.raises(ValueError, match="'b' has no measurements"):
        gc.speedup(gc.Timing("a", [1.0]), gc.Timing("b"))
    with pytest.raises(ValueError, match="has no measurements"):
        gc.speedup(gc.Timing("a"), gc.Timing("b"))
    with pytest.raises(ValueError, match="too little to divide by"):
        gc.speedup(gc.Timing("a", [1.0]), gc.Timing("b", [0.0]))
