"""ring_all_reduce / naive_all_reduce equal dist.all_reduce; the ring schedule is a correct plan."""

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

import gpucourse as gc

# (shape, dtype, segment_bytes): odd sizes, fewer elements than ranks, 0-d, empty, tiny segments
CASES = [
    ((), torch.float32, 1 << 20),
    ((0,), torch.float32, 1 << 20),
    ((1,), torch.float64, 1 << 20),
    ((2,), torch.float32, 4),
    ((7,), torch.int64, 8),
    ((3, 5, 2), torch.float32, 12),
    ((10_007,), torch.float32, 1 << 10),
    ((10_007,), torch.float64, 1 << 20),
    ((257, 3), torch.int32, 100),
    ((33,), torch.bfloat16, 16),
    ((6, 4), torch.complex64, 24),
    ((100_000,), torch.float32, 1 << 20),
]


def _data(rank, shape, dtype, seed):
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    if dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=dtype)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-1000, 1000, shape, generator=g, dtype=dtype)


def _all_reduce_cases(rank, world_size, seed):
    out = []
    for i, (shape, dtype, seg) in enumerate(CASES):
        x = _data(rank, shape, dtype, seed + i)
        ref = x.clone()
        if dtype in (torch.bfloat16,):                  # reference sum in float64, rounded once
            ref64 = ref.double()
            dist.all_reduce(ref64)
            ref = ref64
        else:
            dist.all_reduce(ref)
        ring, naive = x.clone(), x.clone()
        returned = gc.ring_all_reduce(ring, segment_bytes=seg)
        gc.naive_all_reduce(naive)
        out.append((ref, ring, naive, returned is ring))
        # a non-contiguous tensor (a transposed view) is reduced in place too
        if len(shape) == 2:
            base = x.clone()
            view = base.t()
            gc.ring_all_reduce(view, segment_bytes=seg)
            out.append((ref, base, base, True))
    return out


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_ring_and_naive_equal_dist_all_reduce(world_size):
    results = gc.launch(_all_reduce_cases, world_size, args=(world_size * 7,), timeout=120)
    for rank, cases in enumerate(results):
        for ref, ring, naive, in_place in cases:
            assert in_place
            assert ring.dtype == naive.dtype and ring.shape == naive.shape == ref.shape
            if ring.dtype == torch.bfloat16:
                tol = dict(rtol=2e-2, atol=2e-2 * world_size)
                torch.testing.assert_close(ring.double(), ref, **tol)
                torch.testing.assert_close(naive.double(), ref, **tol)
            elif ring.dtype.is_floating_point or ring.dtype.is_complex:
                torch.testing.assert_close(ring, ref, msg=lambda m: f"rank {rank}: {m}")
                torch.testing.assert_close(naive, ref)
            else:
                assert torch.equal(ring, ref) and torch.equal(naive, ref), f"rank {rank}"
        # every rank ends with the same bits (not just close values)
        for mine, rank0 in zip(cases, results[0]):
            assert torch.equal(mine[1], rank0[1]) and torch.equal(mine[2], rank0[2])


# every collective a cheating ring could hide behind, in torch.distributed and in distributed_c10d
COLLECTIVES = ["all_reduce", "all_reduce_coalesced", "reduce", "all_gather", "all_gather_into_tensor",
               "all_gather_coalesced", "reduce_scatter", "reduce_scatter_tensor", "broadcast",
               "all_to_all", "all_to_all_single", "gather", "scatter"]
PG_COLLECTIVES = ["allreduce", "allreduce_coalesced", "reduce", "allgather", "reduce_scatter",
                  "broadcast", "alltoall", "alltoall_base", "gather", "scatter"]


def _forbidden(name):
    def call(*args, **kwargs):
        raise AssertionError(f"ring_all_reduce must use send/recv only, but it called {name}()")
    return call


def _forbid_collectives():
    """Inside a rank: make every collective raise (the 04.2 exercise check does the same)."""
    import torch.distributed.distributed_c10d as c10d
    for name in COLLECTIVES:
        for module in (dist, c10d):
            if hasattr(module, name):
                setattr(module, name, _forbidden(f"dist.{name}"))
    for name in PG_COLLECTIVES:
        if hasattr(dist.ProcessGroup, name):
            setattr(dist.ProcessGroup, name, _forbidden(f"ProcessGroup.{name}"))


def _cheating_ring(tensor, group=None, **kwargs):
    dist.all_reduce(tensor, group=group)
    return tensor


def _point_to_point_only(rank, world_size, mode):
    """mode: "ring" (the backend's transport), "batched" (NCCL's transport, here on gloo), "cheat"."""
    cases = [(1003, 256), (5, 8), (7, 8)]            # the last two: chunks of unequal segment counts
    xs = [torch.randn(n, generator=torch.Generator().manual_seed(rank)) for n, _ in cases]
    expected = [x.clone() for x in xs]
    for e in expected:
        dist.all_reduce(e)
    _forbid_collectives()
    for x, (_, seg) in zip(xs, cases):
        if mode == "cheat":
            _cheating_ring(x)
        else:
            gc.ring_all_reduce(x, segment_bytes=seg, _batched=(mode == "batched"))
    return xs, expected


@pytest.mark.parametrize("mode", ["ring", "batched"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_ring_uses_point_to_point_only(world_size, mode):
    results = gc.launch(_point_to_point_only, world_size, args=(mode,), timeout=60)
    for got, expected in results:
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e)


def test_a_ring_that_calls_a_collective_is_caught():
    with pytest.raises(gc.WorkerError, match=r"send/recv only, but it called dist.all_reduce"):
        gc.launch(_point_to_point_only, 2, args=("cheat",), timeout=60)


def _message_sizes(rank, world_size, numel, segment_bytes, batched):
    """The number of elements of every message this rank sends in one ring all-reduce."""
    sent = []
    isend, batch = dist.isend, dist.batch_isend_irecv

    def recording_isend(tensor, *args, **kwargs):
        sent.append(tensor.numel())
        return isend(tensor, *args, **kwargs)

    def recording_batch(ops):                   # P2POp insists on the real dist.isend
        sent.extend(op.tensor.numel() for op in ops if op.op is isend)
        return batch(ops)

    if batched:
        dist.batch_isend_irecv = recording_batch
    else:
        dist.isend = recording_isend
    x = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    expected = x.clone()
    dist.all_reduce(expected)
    gc.ring_all_reduce(x, segment_bytes=segment_bytes, check_shapes=False, _batched=batched)
    torch.testing.assert_close(x, expected)
    return sent


@pytest.mark.parametrize("batched", [False, True])
def test_a_chunk_is_cut_into_the_fewest_equal_segments(batched):
    # 3 ranks, 31 floats: chunks of 11, 10, 10; at most 4 floats (16 bytes) a segment → 3 pieces
    # each, 4+4+3 and 4+3+3 — not 4+4+3 and 4+4+2, whose short tail would pipeline nothing
    sent = gc.launch(_message_sizes, 3, args=(31, 16, batched), timeout=60)
    for rank, sizes in enumerate(sent):
        assert len(sizes) == 2 * (3 - 1) * 3, f"rank {rank} sent {sizes}"
        assert set(sizes) <= {3, 4}, f"rank {rank} sent segments of {sizes} elements"


def _on_cuda(rank, world_size):
    x = torch.randn(10_007, generator=torch.Generator().manual_seed(rank)).cuda()
    expected = x.clone()
    dist.all_reduce(expected)
    gc.ring_all_reduce(x, segment_bytes=4096)      # batched send/recv: must not deadlock on NCCL
    return x.cpu(), expected.cpu()


@pytest.mark.cuda
@pytest.mark.multigpu
@pytest.mark.parametrize("world_size", [2, 3])
def test_ring_on_nccl_does_not_deadlock(world_size):
    if torch.cuda.device_count() < world_size:
        pytest.skip(f"needs {world_size} GPUs")
    results = gc.launch(_on_cuda, world_size, backend="nccl", timeout=120)
    for got, expected in results:
        torch.testing.assert_close(got, expected)


def _on_subgroup(rank, world_size):
    group = dist.new_group([1, 2, 3])            # every rank must create it, even non-members
    t = torch.full((5,), float(rank))
    if rank in (1, 2, 3):
        gc.ring_all_reduce(t, group=group, segment_bytes=4)
        u = torch.full((3,), float(rank))
        gc.naive_all_reduce(u, group=group)
        return t.tolist(), u.tolist()
    return t.tolist(), None


def test_works_on_a_subgroup():
    res = gc.launch(_on_subgroup, 4, timeout=60)
    assert res[0] == ([0.0] * 5, None)
    for r in (1, 2, 3):
        assert res[r] == ([6.0] * 5, [6.0] * 3)


@given(world_size=st.integers(1, 12))
def test_schedule_reduces_every_chunk_once_and_gathers_it_everywhere(world_size):
    """Simulate the plan on symbolic data: which ranks' contributions each chunk holds."""
    p = world_size
    plans = [gc.ring_schedule(r, p) for r in range(p)]
    assert all(len(plan) == 2 * (p - 1) for plan in plans)
    held = [[{r} for _ in range(p)] for r in range(p)]        # held[rank][chunk] = contributors
    for step in range(2 * (p - 1)):
        sent = [(plans[r][step][2], set(held[r][plans[r][step][2]])) for r in range(p)]
        for r in range(p):
            phase, _, _, recv_chunk = plans[r][step]
            chunk, payload = sent[(r - 1) % p]                    # from the left neighbour
            assert chunk == recv_chunk, f"rank {r} step {step} expects {recv_chunk}, gets {chunk}"
            if phase == "reduce-scatter":
                assert not payload & held[r][chunk], "a contribution would be added twice"
                held[r][chunk] |= payload
            else:
                held[r][chunk] = payload
        if step == p - 2:                                         # after the reduce-scatter
            for r in range(p):
                assert held[r][(r + 1) % p] == set(range(p))
    assert all(h == set(range(p)) for row in held for h in row)


@pytest.mark.parametrize("call, exc, msg", [
    (lambda: gc.ring_schedule(3, 3), ValueError, r"Invalid rank 3"),
    (lambda: gc.ring_schedule(0, 0), ValueError, r"world_size must be >= 1"),
    (lambda: gc.ring_all_reduce([1.0]), TypeError, r"torch.Tensor"),
    (lambda: gc.ring_all_reduce(torch.ones(2, dtype=torch.bool)), TypeError, r"torch.bool"),
    (lambda: gc.ring_all_reduce(torch.ones(2)), RuntimeError, r"init_process_group"),
    (lambda: gc.naive_all_reduce(torch.ones(2)), RuntimeError, r"init_process_group"),
])
def test_bad_calls(call, exc, msg):
    with pytest.raises(exc, match=msg):
        call()


def _only_rank0_calls(rank, world_size):
    if rank == 0:
        gc.ring_all_reduce(torch.ones(4))


def test_collective_mismatch_times_out_instead_of_hanging():
    with pytest.raises(TimeoutError, match=r"rank\(s\) \[0\]"):
        gc.launch(_only_rank0_calls, 2, timeout=3)


def test_all_reduce_timings_returns_checked_timings():
    t = gc.all_reduce_timings(2, 1000, rounds=2)
    assert list(t) == ["gloo", "ring", "naive"]
    assert [x.name for x in t.values()] == ["dist.all_reduce", "gc.ring_all_reduce",
                                            "gc.naive_all_reduce"]
    assert all(len(x.times) == 2 and x.median > 0 for x in t.values())
    with pytest.raises(ValueError, match="subset"):
        gc.all_reduce_timings(2, implementations=("nccl",))
    floor = gc.all_reduce_timings(3, 1001, rounds=2, implementations=("messages",))["messages"]
    assert floor.name == "the ring's messages only" and len(floor.times) == 2 and floor.median > 0


def _mismatched_ring(rank, world_size, how):
    g = torch.Generator().manual_seed(rank)
    if how == "numel":       # gloo used to abort the process (SIGABRT)
        t = torch.randn(5 + rank, generator=g)
    elif how == "shape":     # same size, other shape: the sum would be silently meaningless
        t = torch.randn((2, 3) if rank == 0 else (3, 2), generator=g)
    else:                    # dtype
        t = torch.randn(4, generator=g, dtype=torch.float32 if rank == 0 else torch.float64)
    try:
        gc.ring_all_reduce(t)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("how", ["numel", "shape", "dtype"])
def test_ring_all_reduce_with_shapes_differing_between_ranks_raises_on_every_rank(how):
    out = gc.launch(_mismatched_ring, 3, args=(how,), timeout=60)
    assert all(msg is not None and "must be the same on every rank" in msg for msg in out), out
    assert len(set(out)) == 1                     # the same message everywhere, naming every rank
    assert "rank 0: " in out[0] and "rank 2: " in out[0]


def _same_shape_after_check(rank, world_size):
    t = torch.randn(7, generator=torch.Generator().manual_seed(rank))
    ref = t.clone()
    dist.all_reduce(ref)
    gc.ring_all_reduce(t)
    return torch.equal(t, ref) or torch.allclose(t, ref)


def test_the_shape_check_keeps_matching_calls_working():
    assert gc.launch(_same_shape_after_check, 3) == [True] * 3


def _agreeing_ranks_send_only_a_digest(rank, world_size, p2p):
    """Ranks that agree settle it with one round of a 2-element digest: the full values (pickled, two
    rounds) are never swapped. Counted on the wire: every message this rank sends."""
    from gpucourse.runtime import agreement

    def refuse(*a, **k):
        raise AssertionError("the full values were swapped although every rank agreed")

    agreement._objects_by_point_to_point = refuse
    dist.all_gather_object = refuse
    sent = []
    isend, all_gather = dist.isend, dist.all_gather
    dist.isend = lambda t, *a, **k: (sent.append(t.numel()), isend(t, *a, **k))[1]
    dist.all_gather = lambda out, t, *a, **k: (sent.append(t.numel()), all_gather(out, t, *a, **k))[1]
    t = torch.randn(6, 5, generator=torch.Generator().manual_seed(rank)).t()     # non-contiguous
    ref = t.clone()
    dist.all_reduce(ref)
    if p2p:
        gc.ring_all_reduce(t)
        checked = sent[:world_size - 1]
    else:
        t = gc.all_gather(t.contiguous())
        checked = sent[:1]
    return checked, (torch.allclose(t, ref) if p2p else t.shape[0] == 5 * world_size)


@pytest.mark.parametrize("p2p", [True, False], ids=["ring_all_reduce", "sharding.all_gather"])
def test_agreeing_ranks_check_their_shapes_with_one_small_digest(p2p):
    out = gc.launch(_agreeing_ranks_send_only_a_digest, 3, args=(p2p,), timeout=60)
    for checked, right in out:
        assert right and checked == [2] * len(checked), out


def _first_messages(rank, world_size, check_shapes):
    sent = []
    isend = dist.isend
    dist.isend = lambda t, *a, **k: (sent.append(t.numel()), isend(t, *a, **k))[1]
    t = torch.arange(12.0) * (rank + 1)
    gc.ring_all_reduce(t, check_shapes=check_shapes)
    return sent[0], t.tolist()


def test_check_shapes_false_sends_the_data_first_and_sums_the_same():
    checked, unchecked = (gc.launch(_first_messages, 3, args=(c,), timeout=60) for c in (True, False))
    assert [m for m, _ in checked] == [2] * 3 and [m for m, _ in unchecked] == [4] * 3    # digest vs a chunk
    assert [s for _, s in checked] == [s for _, s in unchecked] == [(torch.arange(12.0) * 6).tolist()] * 3
