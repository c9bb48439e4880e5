"""The α-β model: the ring formula against a simulated ring, fitting, measuring, projecting."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gpucourse as gc


def simulate_ring_all_reduce(values, alpha, beta, bytes_per_element=4):
    """Run a ring all-reduce on plain lists and time it round by round with the α-β model.

    Returns (the reduced lists, messages sent per rank, bytes sent per rank, total time).
    Rounds are synchronous: each costs the time of its largest message.
    """
    p, n = len(values), len(values[0])
    data = [list(v) for v in values]
    bounds = [round(i * n / p) for i in range(p + 1)]          # chunk c = [bounds[c], bounds[c+1])
    chunk = lambda c: range(bounds[c % p], bounds[c % p + 1])
    messages, sent, total = [0] * p, [0] * p, 0.0
    for step in range(2 * (p - 1)):
        reduce_phase = step < p - 1
        # rank r sends chunk (r - step) in reduce-scatter, (r + 1 - step') in all-gather
        c_of = [(r - step) % p if reduce_phase else (r + 1 - (step - (p - 1))) % p
                for r in range(p)]
        outgoing = [[data[r][i] for i in chunk(c_of[r])] for r in range(p)]
        largest = 0
        for r in range(p):
            dst, c = (r + 1) % p, c_of[r]
            for j, i in enumerate(chunk(c)):
                data[dst][i] = data[dst][i] + outgoing[r][j] if reduce_phase else outgoing[r][j]
            nbytes = len(chunk(c)) * bytes_per_element
            messages[r] += 1
            sent[r] += nbytes
            largest = max(largest, nbytes)
        total += alpha + beta * largest
    return data, messages, sent, total


@given(p=st.integers(1, 12), k=st.integers(1, 50), alpha=st.floats(1e-7, 1e-3),
       gbps=st.floats(0.1, 3000), seed=st.integers(0, 10**6))
@settings(max_examples=80, deadline=None)
def test_ring_formula_matches_a_simulated_ring(p, k, alpha, gbps, seed):
    n = p * k                                            # divisible: every chunk has n/p elements
    g = torch.Generator().manual_seed(seed)
    values = torch.randint(-100, 100, (p, n), generator=g).tolist()
    beta = 8 / (gbps * 1e9)
    data, messages, sent, total = simulate_ring_all_reduce(values, alpha, beta)
    expected = [sum(col) for col in zip(*values)]
    assert all(row == expected for row in data)          # the simulation is a real all-reduce
    assert messages == [2 * (p - 1)] * p
    assert sent == [pytest.approx(gc.ring_all_reduce_bytes(4 * n, p))] * p
    assert total == pytest.approx(gc.ring_all_reduce_time(4 * n, p, alpha, beta), rel=1e-9)
    assert gc.AlphaBeta(alpha, beta).ring_all_reduce_time(4 * n, p) == pytest.approx(total)


def test_ring_bandwidth_term_is_bounded_by_twice_the_message():
    for p in (2, 4, 8, 64, 1024):
        assert gc.ring_all_reduce_bytes(1e6, p) < 2e6
    assert gc.ring_all_reduce_time(1e6, 1, 1e-3, 1e-9) == 0.0   # alone: nothing to send


@pytest.mark.parametrize("args, exc", [
    ((-1, 2, 0, 0), ValueError), ((1, 0, 0, 0), ValueError), ((1, 2.0, 0, 0), TypeError),
    ((1, 2, -1e-6, 0), ValueError), ((float("nan"), 2, 0, 0), ValueError),
])
def test_ring_time_rejects_bad_input(args, exc):
    with pytest.raises(exc):
        gc.ring_all_reduce_time(*args)


@given(alpha=st.floats(1e-7, 1e-3), gbps=st.floats(0.01, 3000),
       sizes=st.lists(st.integers(0, 10**9), min_size=2, max_size=8, unique=True))
@settings(max_examples=80, deadline=None)
def test_fit_recovers_exact_parameters(alpha, gbps, sizes):
    link = gc.AlphaBeta.from_bandwidth("x", alpha, gbps)
    fitted = gc.fit_alpha_beta(sizes, [link.transfer_time(s) for s in sizes])
    assert fitted.alpha == pytest.approx(alpha, rel=1e-6, abs=1e-12)
    assert fitted.beta == pytest.approx(link.beta, rel=1e-6)


def test_fit_with_noise_keeps_both_orders_of_magnitude():
    g = torch.Generator().manual_seed(0)
    sizes = [4, 1024, 16384, 262144, 1 << 20, 4 << 20] * 5
    true = gc.AlphaBeta(40e-6, 1 / 3e9)
    noise = 1 + 0.1 * torch.rand(len(sizes), generator=g)   # up to 10% slower, as on a busy box
    fitted = gc.fit_alpha_beta(sizes, [true.transfer_time(s) * float(e) for s, e in zip(sizes, noise)])
    assert 0.8 < fitted.alpha / true.alpha < 1.3 and 0.8 < fitted.beta / true.beta < 1.3


@pytest.mark.parametrize("sizes, times, msg", [
    ([1, 1], [1e-3, 2e-3], "two different"), ([1, 2], [1e-3], "same length"),
    ([1, 2], [0, 1e-3], "> 0"),
])
def test_fit_rejects_bad_input(sizes, times, msg):
    with pytest.raises(ValueError, match=msg):
        gc.fit_alpha_beta(sizes, times)


def test_measurements_are_positive_and_grow_with_size():
    sizes = [4, 32 << 20]     # 32 MB: tens of ms even on a fast machine, far above scheduling noise
    p2p = gc.measure_point_to_point(sizes, repeats=3, warmup=1)
    ar = gc.measure_all_reduce(sizes, 2, repeats=3, warmup=1)
    assert len(p2p) == len(ar) == 2 and min(p2p + ar) > 0
    assert p2p[1] > p2p[0] and ar[1] > ar[0]           # 32 MB takes longer than 4 bytes
    with pytest.raises(ValueError, match="repeats"):
        gc.measure_point_to_point([4], repeats=0)


@given(compute=st.floats(1e-4, 1.0), grad=st.floats(1e3, 1e9), nnodes=st.integers(1, 16),
       nproc=st.integers(1, 8), link=st.sampled_from(sorted(gc.LINKS)))
@settings(max_examples=100, deadline=None)
def test_step_prediction_invariants(compute, grad, nnodes, nproc, link):
    inter, intra = gc.LINKS[link], gc.LINKS["NVLink"]
    p = gc.predict_step_time(compute, grad, nnodes, nproc, inter, intra)
    best = gc.predict_step_time(compute, grad, nnodes, nproc, inter, intra, overlap=True)
    assert p.world_size == nnodes * nproc
    assert p.total == pytest.approx(p.compute + p.communication)
    assert best.total <= p.total and 0 < p.speedup <= p.world_size + 1e-9
    faster = gc.AlphaBeta(inter.alpha, inter.beta / 10)
    assert gc.predict_step_time(compute, grad, nnodes, nproc, faster, intra).total <= p.total
    if nnodes > 1:   # the ring crosses the network: its α-β decides
        assert p.communication == pytest.approx(inter.ring_all_reduce_time(grad, p.world_size))


def test_seeds_net_over_1gbe_vs_infiniband():
    grad = 4 * sum(p.numel() for p in gc.Net().parameters())     # fp32 gradients: 248 kB
    slow = gc.predict_step_time(0.005, grad, 2, 8, gc.LINKS["1 GbE"], gc.LINKS["NVLink"])
    fast = gc.predict_step_time(0.005, grad, 2, 8, gc.LINKS["100 Gb InfiniBand"],
                                gc.LINKS["NVLink"])
    assert slow.communication > 10 * fast.communication
    with pytest.raises(ValueError, match="intra_node"):
        gc.predict_step_time(0.005, grad, 1, 8, gc.LINKS["1 GbE"])
    with pytest.raises(TypeError, match="AlphaBeta"):
        gc.predict_step_time(0.005, grad, 2, 8, 1e-9)


def test_scaling_table_rows():
    rows = gc.scaling_table(0.01, 1e6, nodes=(1, 2, 4), nproc_per_node=2)
    assert len(rows) == 3 * len(gc.LINKS)
    for r in rows:
        assert r["world_size"] == 2 * r["nnodes"]
        assert math.isclose(r["efficiency"], r["speedup"] / r["world_size"])
    one_node = {r["step_s"] for r in rows if r["nnodes"] == 1}
    assert len(one_node) == 1                          # one node: the network does not matter


def test_link_presets_and_printing():
    assert gc.LINKS["1 GbE"].bandwidth == pytest.approx(125e6)
    assert gc.LINKS["100 Gb InfiniBand"].bandwidth == pytest.approx(12.5e9)
    assert str(gc.LINKS["10 GbE"]) == "10 GbE: α = 20 µs, bandwidth = 1.25 GB/s"
    with pytest.raises(ValueError, match="gbit_per_s must be > 0"):
        gc.AlphaBeta.from_bandwidth("x", 1e-6, 0)
