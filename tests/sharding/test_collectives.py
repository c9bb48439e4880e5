"""reduce_scatter / all_gather from send/recv equal dist.reduce_scatter_tensor / all_gather_into_tensor."""

import pytest
import torch
import torch.distributed as dist

import gpucourse as gc

SHAPES = [(), (1,), (2,), (7,), (3, 5), (10_007,), (4, 6, 2), (0,)]
DTYPES = [torch.float32, torch.float64, torch.int64]
# torch 2.14 renamed them (the old names still work, with a FutureWarning)
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _data(rank, shape, dtype, seed):
    g = torch.Generator().manual_seed(seed * 100 + rank)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g, dtype=dtype)
    return torch.randint(-1000, 1000, shape, generator=g, dtype=dtype)


def _cases(rank, world_size):
    out = []
    for i, shape in enumerate(SHAPES):
        for j, dtype in enumerate(DTYPES):
            x = _data(rank, shape, dtype, 10 * i + j)
            before = x.clone()
            n = x.numel()
            s = -(-n // world_size)
            padded = torch.zeros(world_size * s, dtype=dtype)
            padded[:n] = x.reshape(-1)
            ref = torch.empty(s, dtype=dtype)
            REDUCE_SCATTER(ref, padded)                   # torch's, on the padded tensor
            got = gc.reduce_scatter(x)
            ref_g = torch.empty(world_size * s, dtype=dtype)
            ALL_GATHER(ref_g, got)
            gathered = gc.all_gather(got)
            out.append((shape, dtype, ref, got, ref_g, gathered, torch.equal(x, before)))
    # a non-contiguous shard (a transposed view) and a 2-D shard: gathered along dim 0
    m = _data(rank, (3, 4), torch.float32, 99).t()
    ref2 = torch.empty(world_size * 4, 3)
    ALL_GATHER(ref2, m.contiguous())
    out.append(("t", torch.float32, ref2, gc.all_gather(m), ref2, gc.all_gather(m), True))
    return out


@pytest.mark.parametrize("segment_bytes", [4 << 20, 12])
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_equal_torch_collectives(world_size, segment_bytes, monkeypatch):
    # tiny segments: every chunk travels in many pieces (the children are forked: they see the patch)
    monkeypatch.setattr(gc.sharding.collectives, "SEGMENT_BYTES", segment_bytes)
    for rank_out in gc.launch(_cases, world_size, timeout=120):
        for shape, dtype, ref, got, ref_g, gathered, unchanged in rank_out:
            assert unchanged, f"{shape} {dtype}: the input was modified"
            assert got.shape == ref.shape and got.dtype == dtype
            torch.testing.assert_close(got, ref, msg=lambda m: f"reduce_scatter {shape} {dtype}: {m}")
            torch.testing.assert_close(gathered, ref_g, msg=lambda m: f"all_gather {shape} {dtype}: {m}")


def _composed(rank, world_size):
    x = torch.randn(1001, generator=torch.Generator().manual_seed(rank))
    ref = x.clone()
    dist.all_reduce(ref)
    return ref, gc.all_gather(gc.reduce_scatter(x))[:1001]


def test_reduce_scatter_then_all_gather_is_all_reduce():
    for ref, got in gc.launch(_composed, 3, timeout=60):
        torch.testing.assert_close(got, ref)


def _mismatch(rank, world_size, which):
    x = torch.randn(5 + rank)
    try:
        (gc.reduce_scatter if which == "rs" else gc.all_gather)(x)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("which", ["rs", "ag"])
def test_shape_mismatch_raises_on_every_rank(which):
    msgs = gc.launch(_mismatch, 2, args=(which,), timeout=60)
    assert all(m is not None and "same on every rank" in m for m in msgs), msgs


def _bad_types(rank, world_size):
    errors = []
    for bad in ([1.0, 2.0], torch.ones(3, dtype=torch.bool), torch.ones(2, dtype=torch.complex64)):
        for fn in (gc.reduce_scatter, gc.all_gather):
            try:
                fn(bad)
            except TypeError:
                errors.append(True)
    return len(errors)


def test_bad_types():
    assert gc.launch(_bad_types, 2, timeout=60) == [6, 6]


def test_needs_a_process_group():
    with pytest.raises(RuntimeError, match="init_process_group"):
        gc.reduce_scatter(torch.ones(3))
