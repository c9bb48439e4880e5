"""Context parallelism equals attention on the whole sequence: outputs and q/k/v gradients.

Oracle: ``F.scaled_dot_product_attention`` on the full sequence, in float64, with random data.
One ``gc.launch`` per world size runs every case (both layouts, causal or not, both kernels,
grouped-query K/V, Ulysses, the byte counts and the bad-input errors).
"""

import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import gpucourse as gc

T = 120
TOL = {"atol": 1e-9, "rtol": 1e-7}


def _qkv(seed, b=2, h=2, s=12, d=4, kv_heads=None, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, s, d, generator=g, dtype=dtype)
    k, v = (torch.randn(b, kv_heads or h, s, d, generator=g, dtype=dtype) for _ in range(2))
    return q, k, v


def _reference(q, k, v, causal, dout):
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    ke, ve = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    out = F.scaled_dot_product_attention(q, ke, ve, is_causal=causal)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


# ------------------------------------------------------------------------------- one process
@pytest.mark.parametrize("kernel", ["readable", "fused"])
def test_blockwise_equals_sdpa_any_length(kernel):
    for s, block, causal in itertools.product((1, 7, 16), (2, 3, 16), (False, True)):
        q, k, v = _qkv(s, s=s)
        out, lse = gc.blockwise_attention(q, k, v, block_size=block, causal=causal, kernel=kernel, return_lse=True)
        torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=causal), **TOL)
        scores = q @ k.transpose(-1, -2) / 2.0
        if causal:
            scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
        torch.testing.assert_close(lse, torch.logsumexp(scores, -1), **TOL)


def test_blockwise_readable_gradients_and_errors():
    q, k, v = _qkv(3, s=10)
    dout = torch.randn_like(q)
    ref = _reference(q, k, v, True, dout)
    qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
    gc.blockwise_attention(qq, kk, vv, block_size=4, causal=True).backward(dout)
    for got, want in zip((qq.grad, kk.grad, vv.grad), ref[1:]):
        torch.testing.assert_close(got, want, **TOL)
    with pytest.raises(ValueError, match="block_size"):
        gc.blockwise_attention(q, k, v, block_size=0)
    with pytest.raises(ValueError, match="kernel"):
        gc.blockwise_attention(q, k, v, block_size=2, kernel="flash")
    with pytest.raises(ValueError, match="4 dimensions"):
        gc.blockwise_attention(q[0], k[0], v[0], block_size=2)


def test_block_backward_is_the_blocks_share():
    """Two tiles' backward with the final out/lse sum to the full gradients (both kernels)."""
    q, k, v = _qkv(4, s=9)
    dout = torch.randn_like(q)
    out, lse = gc.blockwise_attention(q, k, v, block_size=9, return_lse=True)
    ref = _reference(q, k, v, False, dout)
    for kernel in ("readable", "fused"):
        a = gc.attention_block_backward(dout, q, k[:, :, :4], v[:, :, :4], out, lse, kernel=kernel)
        b = gc.attention_block_backward(dout, q, k[:, :, 4:], v[:, :, 4:], out, lse, kernel=kernel)
        torch.testing.assert_close(a[0] + b[0], ref[1], **TOL)
        torch.testing.assert_close(torch.cat([a[1], b[1]], 2), ref[2], **TOL)
        torch.testing.assert_close(torch.cat([a[2], b[2]], 2), ref[3], **TOL)


def test_zigzag_split_merge_and_ring_order():
    x = torch.randn(2, 3, 24, 2)
    for world in (1, 2, 3, 4):
        shards = [gc.zigzag_split(x, r, world) for r in range(world)]
        assert torch.equal(gc.zigzag_merge(shards), x)
        c = 24 // (2 * world)
        for r in range(world):
            want = torch.cat([x[:, :, r * c:(r + 1) * c], x[:, :, (2 * world - 1 - r) * c:(2 * world - r) * c]], 2)
            assert torch.equal(shards[r], want)
        for r, t in itertools.product(range(world), range(world)):
            assert gc.ring_kv_chunks(r, t, world) == ((r - t) % world,)
    y = torch.arange(12).view(12, 1)
    assert gc.zigzag_split(y, 1, 3, dim=0).flatten().tolist() == [2, 3, 8, 9]
    assert torch.equal(gc.zigzag_merge([gc.zigzag_split(y, r, 3, dim=0) for r in range(3)], dim=0), y)
    with pytest.raises(ValueError, match="divide by 10"):
        gc.zigzag_split(x, 0, 5)
    with pytest.raises(ValueError, match="rank"):
        gc.zigzag_split(x, 2, 2)
    with pytest.raises(ValueError, match="step"):
        gc.ring_kv_chunks(0, 2, 2)


def test_cp_comm_bytes_formula_and_errors():
    b = gc.cp_comm_bytes(batch=2, heads=4, seq=16, head_dim=8, world_size=4, kv_heads=2, dtype_bytes=2)
    shard = 2 * 2 * 4 * 8 * 2
    assert b == {"forward": 3 * 2 * shard, "backward": 7 * 2 * shard, "total": 20 * shard}
    assert gc.cp_comm_bytes(batch=1, heads=1, seq=5, head_dim=1, world_size=1)["total"] == 0
    u = gc.cp_comm_bytes(batch=1, heads=4, seq=8, head_dim=2, world_size=2, method="ulysses")
    assert u["forward"] == u["backward"] == 4 * (4 * 4 * 2 * 4) // 2
    with pytest.raises(ValueError, match="divide"):
        gc.cp_comm_bytes(batch=1, heads=3, seq=8, head_dim=2, world_size=2, method="ulysses")
    with pytest.raises(ValueError, match="seq"):
        gc.cp_comm_bytes(batch=1, heads=4, seq=9, head_dim=2, world_size=2)
    with pytest.raises(ValueError, match="method"):
        gc.cp_comm_bytes(batch=1, heads=4, seq=8, head_dim=2, world_size=2, method="tree")
    with pytest.raises(TypeError):
        gc.cp_comm_bytes(batch=1.0, heads=4, seq=8, head_dim=2, world_size=2)
    t = gc.cp_comm_time(gc.LINKS["NVLink"], batch=1, heads=4, seq=8, head_dim=2, world_size=2)
    assert t["messages"] == 4 and t["seconds"] > 0


# ------------------------------------------------------------------------------- the ring
def _all_cases(rank, world):
    """Every check on this rank; returns [(case, ok, detail)] for the parent to report."""
    results = []
    s = 2 * world * 3                                             # 3 positions per zig-zag chunk
    cases = [(causal, layout, "fused", None) for causal in (False, True) for layout in ("contiguous", "zigzag")]
    cases += [(True, "zigzag", "readable", None), (True, "contiguous", "fused", 1)]   # readable; GQA
    for i, (causal, layout, kernel, kv_heads) in enumerate(cases):
        q, k, v = _qkv(100 + i, s=s, kv_heads=kv_heads)
        dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(200 + i), dtype=q.dtype)
        ref = _reference(q, k, v, causal, dout)
        if layout == "zigzag":
            split = lambda x: gc.zigzag_split(x, rank, world)
        else:
            split = lambda x: x.chunk(world, dim=2)[rank]
        mine = [split(x).clone().requires_grad_() for x in (q, k, v)]
        with gc.cp_meter() as meter:
            out = gc.ring_attention(*mine, causal=causal, layout=layout, kernel=kernel)
            out.backward(split(dout))
        # gather in sequence order, compare with the full run
        outs = [torch.empty_like(out) for _ in range(world)]
        dist.all_gather(outs, out.detach().contiguous())
        merged = gc.zigzag_merge(outs) if layout == "zigzag" else torch.cat(outs, 2)
        name = f"ring causal={causal} {layout} {kernel} kv_heads={kv_heads}"
        results.append((name + " out", torch.allclose(merged, ref[0], **TOL),
                        float((merged - ref[0]).abs().max())))
        for g, r, what in zip(mine, ref[1:], "qkv"):
            results.append((f"{name} d{what}", torch.allclose(g.grad, split(r), **TOL),
                            float((g.grad - split(r)).abs().max())))
        want = gc.cp_comm_bytes(batch=2, heads=2, seq=s, head_dim=4, world_size=world, kv_heads=kv_heads,
                                causal=causal, dtype_bytes=8)
        got = {"forward": meter.bytes("forward"), "backward": meter.bytes("backward")}
        results.append((name + " bytes", got == {k: want[k] for k in got}, (got, want)))
    # Ulysses: heads divisible by world
    for causal in (False, True):
        q, k, v = _qkv(300, h=2 * world, s=2 * world)
        dout = torch.randn_like(q)
        ref = _reference(q, k, v, causal, dout)
        split = lambda x: x.chunk(world, dim=2)[rank]
        mine = [split(x).clone().requires_grad_() for x in (q, k, v)]
        with gc.cp_meter() as meter:
            out = gc.ulysses_attention(*mine, causal=causal)
            out.backward(split(dout))
        results.append((f"ulysses causal={causal} out", torch.allclose(out, split(ref[0]), **TOL), ""))
        for g, r, what in zip(mine, ref[1:], "qkv"):
            results.append((f"ulysses causal={causal} d{what}", torch.allclose(g.grad, split(r), **TOL), ""))
        want = gc.cp_comm_bytes(batch=2, heads=2 * world, seq=2 * world, head_dim=4, world_size=world,
                                method="ulysses", dtype_bytes=8)
        got = {"forward": meter.bytes("forward"), "backward": meter.bytes("backward")}
        results.append((f"ulysses causal={causal} bytes", got == {k: want[k] for k in got}, (got, want)))
    # bad input: every rank raises ValueError, nobody hangs
    if world > 1:
        q = torch.randn(1, 2, 4 + (rank == world - 1), 4)
        results.append(("uneven shards", _raises(lambda: gc.ring_attention(q, q, q)), ""))
        q = torch.randn(1, 2, 4, 4) if rank else torch.randn(1, 2, 4)
        results.append(("bad rank input", _raises(lambda: gc.ring_attention(q, q, q, layout="zigzag")), ""))
        q = torch.randn(1, world + 1, 4, 4)
        results.append(("ulysses heads", _raises(lambda: gc.ulysses_attention(q, q, q)), ""))
        q = torch.randn(1, 2, 3, 4)
        results.append(("odd zigzag shard", _raises(lambda: gc.ring_attention(q, q, q, layout="zigzag")), ""))
        dist.barrier()
    return results


def _raises(fn):
    try:
        fn()
    except ValueError:
        return True
    return False


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_ring_and_ulysses_equal_full_attention(world):
    per_rank = gc.launch(_all_cases, world, timeout=T)
    failed = [(rank, name, detail) for rank, results in enumerate(per_rank) for name, ok, detail in results if not ok]
    assert failed == []
    assert len(per_rank[0]) >= 40


def test_one_process_without_a_group():
    q, k, v = _qkv(7, s=6)
    dout = torch.randn_like(q)
    ref = _reference(q, k, v, True, dout)
    mine = [x.clone().requires_grad_() for x in (q, k, v)]
    out = gc.ring_attention(*mine, causal=True, kernel="readable")
    out.backward(dout)
    torch.testing.assert_close(out, ref[0], **TOL)
    torch.testing.assert_close(mine[1].grad, ref[2], **TOL)
    torch.testing.assert_close(gc.ulysses_attention(q, k, v, causal=True), ref[0], **TOL)
    with pytest.raises(ValueError, match="layout"):
        gc.ring_attention(q, k, v, layout="spiral")
