"""Tensor parallelism equals the unsplit model: outputs, shard gradients, input gradients (gloo, 1-4 ranks).

Oracles: the full ``nn.Linear`` / MLP / ``gc.TinyGPT`` in one process, ``F.cross_entropy`` and
``torch.distributed.tensor.parallel.parallelize_module``.
"""

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import gpucourse as gc

T = 60          # seconds per launch


def _rows(n, world, rank):
    sizes = [len(c) for c in torch.tensor_split(torch.arange(n), world)]
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


# ---------------------------------------------------------------------------------- f and g
def _f_g(rank, world):
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(3, 4, generator=g, requires_grad=True)
    w = torch.randn(3, 4, generator=g)
    y = gc.copy_to_tensor_parallel(x)
    (y * w).sum().backward()                         # backward: Σ_r w_r
    z = gc.reduce_from_tensor_parallel(x * 1.0)      # forward: Σ_r x_r
    x2 = x.detach().clone().requires_grad_()
    out = gc.reduce_from_tensor_parallel(x2)
    (out * w).sum().backward()                       # backward: identity
    return torch.equal(y, x), x.grad, w, z.detach(), x.detach(), x2.grad


@pytest.mark.parametrize("world", [2, 3])
def test_f_is_identity_forward_all_reduce_backward_and_g_the_reverse(world):
    res = gc.launch(_f_g, world, timeout=T)
    w_sum = sum(r[2] for r in res)
    x_sum = sum(r[4] for r in res)
    for same, fgrad, w, z, x, ggrad in res:
        assert same
        torch.testing.assert_close(fgrad, w_sum)
        torch.testing.assert_close(z, x_sum)
        torch.testing.assert_close(ggrad, w)


# ------------------------------------------------------------------- column/row parallel MLP
def _mlp_worker(rank, world, d_in, d_ff, d_out, variant):
    torch.manual_seed(0)                              # the same full layers on every rank
    fc1, fc2 = nn.Linear(d_in, d_ff), nn.Linear(d_ff, d_out)
    x = torch.randn(5, 2, d_in, generator=torch.Generator().manual_seed(7), requires_grad=True)
    if variant == "mlp":
        col, row = gc.column_parallel(fc1), gc.row_parallel(fc2)
        y = row(torch.tanh(col(x)))
    elif variant == "gather":       # column with gathered output, then row that splits its input itself
        col, row = gc.column_parallel(fc1, gather_output=True), gc.row_parallel(fc2, input_is_parallel=False)
        h = col(x)
        assert h.shape[-1] == d_ff
        y = row(torch.tanh(h))
    w = torch.randn(y.shape, generator=torch.Generator().manual_seed(3))
    (y * w).sum().backward()
    return {"y": y.detach(), "xgrad": x.grad, "col": (col.weight.grad, col.bias.grad),
            "row": (row.weight.grad, row.bias.grad), "shapes": (tuple(col.weight.shape), tuple(row.weight.shape))}


def _mlp_reference(d_in, d_ff, d_out):
    torch.manual_seed(0)
    fc1, fc2 = nn.Linear(d_in, d_ff), nn.Linear(d_ff, d_out)
    x = torch.randn(5, 2, d_in, generator=torch.Generator().manual_seed(7), requires_grad=True)
    y = fc2(torch.tanh(fc1(x)))
    w = torch.randn(y.shape, generator=torch.Generator().manual_seed(3))
    (y * w).sum().backward()
    return y.detach(), x.grad, fc1, fc2


@pytest.mark.parametrize("world, d_ff", [(1, 6), (2, 8), (2, 7), (3, 9), (3, 10), (4, 6), (4, 4)])
@pytest.mark.parametrize("variant", ["mlp", "gather"])
def test_column_then_row_equals_the_unsplit_mlp(world, d_ff, variant):
    d_in, d_out = 5, 3
    res = gc.launch(functools.partial(_mlp_worker, d_in=d_in, d_ff=d_ff, d_out=d_out, variant=variant), world,
                    timeout=T)
    y, xgrad, fc1, fc2 = _mlp_reference(d_in, d_ff, d_out)
    for rank, r in enumerate(res):
        s = _rows(d_ff, world, rank)                          # tensor_split: first d_ff % world get one more
        assert r["shapes"] == ((s.stop - s.start, d_in), (d_out, s.stop - s.start))
        torch.testing.assert_close(r["y"], y)
        torch.testing.assert_close(r["xgrad"], xgrad)         # f's backward all-reduce
        torch.testing.assert_close(r["col"][0], fc1.weight.grad[s])
        torch.testing.assert_close(r["col"][1], fc1.bias.grad[s])
        torch.testing.assert_close(r["row"][0], fc2.weight.grad[:, s])
        torch.testing.assert_close(r["row"][1], fc2.bias.grad)     # added once, after the sum


# ------------------------------------------------------------------- vocab-parallel cross-entropy
def _vocab_worker(rank, world, vocab, shape):
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(*shape, vocab, generator=g) * 3
    target = torch.randint(0, vocab, shape, generator=g)
    shard = torch.tensor_split(logits, world, dim=-1)[rank].clone().requires_grad_()
    loss = gc.vocab_parallel_cross_entropy(shard, target)
    loss.backward()
    return loss.detach(), shard.grad


@pytest.mark.parametrize("world, vocab", [(1, 7), (2, 8), (2, 7), (3, 7), (4, 10), (4, 4)])
def test_vocab_parallel_cross_entropy_equals_f_cross_entropy(world, vocab):
    shape = (3, 4)
    res = gc.launch(functools.partial(_vocab_worker, vocab=vocab, shape=shape), world, timeout=T)
    g = torch.Generator().manual_seed(11)
    logits = (torch.randn(*shape, vocab, generator=g) * 3).requires_grad_()
    target = torch.randint(0, vocab, shape, generator=g)
    loss = F.cross_entropy(logits.flatten(0, 1), target.flatten())
    loss.backward()
    for rank, (l, grad) in enumerate(res):
        torch.testing.assert_close(l, loss.detach())
        torch.testing.assert_close(grad, logits.grad[..., _rows(vocab, world, rank)])


def test_vocab_parallel_cross_entropy_large_logits_are_stable():
    def worker(rank, world):
        shard = torch.full((2, 3), 1000.0 + rank, requires_grad=True)
        loss = gc.vocab_parallel_cross_entropy(shard, torch.tensor([0, 5]))
        loss.backward()
        return loss.item(), bool(torch.isfinite(shard.grad).all())
    res = gc.launch(worker, 2, timeout=T)
    ref = F.cross_entropy(torch.cat([torch.full((2, 3), 1000.0), torch.full((2, 3), 1001.0)], 1), torch.tensor([0, 5]))
    for loss, finite in res:
        assert loss == pytest.approx(ref.item(), rel=1e-6) and finite


# ------------------------------------------------------------------- TinyGPT split, and bytes
CFG = dict(vocab_size=11, seq_len=6, num_layers=2, hidden=12, num_heads=3, ffn_hidden=10)


def _gpt_worker(rank, world, cfg):
    torch.manual_seed(0)
    model = gc.tensor_parallel_gpt(gc.TinyGPT(**cfg))
    g = torch.Generator().manual_seed(5)
    idx = torch.randint(0, cfg["vocab_size"], (3, cfg["seq_len"]), generator=g)
    tgt = torch.randint(0, cfg["vocab_size"], (3, cfg["seq_len"]), generator=g)
    with gc.comm_meter() as meter:
        loss = model.loss(idx, tgt)
        loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    return loss.detach(), grads, meter.bytes(site=("f", "g")), meter.count(site=("f", "g")), meter.summary()


@pytest.mark.parametrize("world", [1, 2, 3])
def test_tensor_parallel_gpt_equals_tinygpt_and_counts_tp_comm_bytes(world):
    res = gc.launch(functools.partial(_gpt_worker, cfg=CFG), world, timeout=T)
    torch.manual_seed(0)
    ref = gc.TinyGPT(**CFG)
    g = torch.Generator().manual_seed(5)
    idx = torch.randint(0, CFG["vocab_size"], (3, CFG["seq_len"]), generator=g)
    tgt = torch.randint(0, CFG["vocab_size"], (3, CFG["seq_len"]), generator=g)
    loss = ref.loss(idx, tgt)
    loss.backward()
    full = dict(ref.named_parameters())
    heads = [len(c) for c in torch.tensor_split(torch.arange(CFG["num_heads"]), world)]
    hd = CFG["hidden"] // CFG["num_heads"]
    expected_bytes = gc.tp_comm_bytes(3, CFG["seq_len"], CFG["hidden"], CFG["num_layers"], world, dtype_bytes=4)
    for rank, (l, grads, nbytes, count, summary) in enumerate(res):
        torch.testing.assert_close(l, loss.detach())
        assert nbytes == expected_bytes, summary
        assert count == (0 if world == 1 else 4 * CFG["num_layers"])
        v = _rows(CFG["vocab_size"], world, rank)
        h0 = sum(heads[:rank]) * hd
        hs = slice(h0, h0 + heads[rank] * hd)
        f = _rows(CFG["ffn_hidden"], world, rank)
        for name, grad in grads.items():
            ref_grad = full[name].grad if name in full else None
            if name == "tok_emb.weight":
                ref_grad = full[name].grad[v]
            for lin in ("q", "k", "v"):
                if name.endswith(f"attn.{lin}.weight") or name.endswith(f"attn.{lin}.bias"):
                    ref_grad = full[name].grad[hs]
            if name.endswith("attn.proj.weight"):
                ref_grad = full[name].grad[:, hs]
            if name.endswith("mlp.fc1.weight") or name.endswith("mlp.fc1.bias"):
                ref_grad = full[name].grad[f]
            if name.endswith("mlp.fc2.weight"):
                ref_grad = full[name].grad[:, f]
            assert ref_grad is not None, name
            torch.testing.assert_close(grad, ref_grad, atol=1e-6, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


def test_tp_comm_bytes_formula_and_arguments():
    assert gc.tp_comm_bytes(2, 3, 5, 7, 2, dtype_bytes=4) == 4 * 7 * 2 * 3 * 5 * 4
    assert gc.tp_comm_bytes(2, 3, 5, 7, 1) == 0
    assert gc.tp_comm_bytes(2, 3, 5, 7, 8) == gc.tp_comm_bytes(2, 3, 5, 7, 2)
    with pytest.raises(ValueError, match="tp must be >= 1"):
        gc.tp_comm_bytes(2, 3, 5, 7, 0)
    with pytest.raises(TypeError):
        gc.tp_comm_bytes(2.0, 3, 5, 7, 2)
    # projected with chapter 05's model: 4·layers ring all-reduces of one activation each
    link = gc.LINKS["1 GbE"]
    one = gc.ring_all_reduce_time(2 * 3 * 5 * 2, 4, link.alpha, link.beta)
    assert gc.tp_comm_time(2, 3, 5, 7, 4, link) == pytest.approx(4 * 7 * one)
    rows = gc.parallelism_comm(2, 3, 5, 7, params=1000, degree=4, links={"1 GbE": link})
    assert [r["strategy"] for r in rows] == ["TP", "DP", "PP"] and rows[1]["bytes"] == 2000


# ------------------------------------------------------------------- DTensor as the oracle
def _dtensor_worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    mlp = gc.FeedForward(6, 8)
    ours = gc.tensor_parallel_mlp(mlp)
    theirs = parallelize_module(mlp, init_device_mesh("cpu", (world,)), {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(2))
    a, b = ours(x), theirs(x)
    a.sum().backward()
    b.sum().backward()
    return (a.detach(), torch.as_tensor(b.detach()), ours.fc1.weight.grad, theirs.fc1.weight.grad.to_local(),
            ours.fc2.weight.grad, theirs.fc2.weight.grad.to_local())


def test_column_row_equal_parallelize_module():
    for a, b, g1, h1, g2, h2 in gc.launch(_dtensor_worker, 2, timeout=T):
        torch.testing.assert_close(a, b)
        torch.testing.assert_close(g1, h1)
        torch.testing.assert_close(g2, h2)


# ------------------------------------------------------------------- 2-D mesh training
def test_two_d_mesh_trains_like_one_process():
    cfg = dict(vocab_size=27, seq_len=8, num_layers=1, hidden=16, num_heads=2)
    runs = gc.train_tinygpt_2d(cfg, tp=2, dp=2, steps=3, batch_size=5, timeout=120)
    ref = gc.train_tinygpt(cfg, steps=3, batch_size=5)
    assert [r["coords"] for r in runs] == [(0, 0), (1, 0), (0, 1), (1, 1)]     # rank = dp·tp + tp_rank
    assert [r["tp_ranks"] for r in runs] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["dp_ranks"] for r in runs] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    for r in runs:
        assert r["losses"] == pytest.approx(ref, rel=1e-4)
    assert ref[-1] < ref[0]
    # a TP group's batch is its dp shard: rows 3 and 2 of 5
    assert runs[0]["tp_bytes"] == sum(gc.tp_comm_bytes(b, 8, 16, 1, 2, 4) for b in [3] * 3)
    assert runs[2]["tp_bytes"] == sum(gc.tp_comm_bytes(b, 8, 16, 1, 2, 4) for b in [2] * 3)


# ------------------------------------------------------------------- bad input: ValueError everywhere
def _catch(fn):
    try:
        fn()
    except (ValueError, TypeError) as e:
        return type(e).__name__, str(e)
    return None


def _bad_worker(rank, world, case):
    torch.manual_seed(0)
    if case == "too_few_features":
        return _catch(lambda: gc.column_parallel(nn.Linear(4, world - 1)))
    if case == "too_few_rows":
        return _catch(lambda: gc.row_parallel(nn.Linear(world - 1, 4)))
    if case == "shapes_differ":
        return _catch(lambda: gc.column_parallel(nn.Linear(4, 6 + rank)))
    if case == "values_differ":
        torch.manual_seed(rank)
        return _catch(lambda: gc.column_parallel(nn.Linear(4, 6)))
    if case == "groups_differ":       # rank 0 splits over {0, 1}, the others over {1, ..}
        g01, g_rest = dist.new_group([0, 1]), dist.new_group(list(range(1, world)))
        return _catch(lambda: gc.column_parallel(nn.Linear(4, 6), g01 if rank == 0 else g_rest))
    if case == "not_member":
        g = dist.new_group([0, 1])
        return _catch(lambda: gc.column_parallel(nn.Linear(4, 6), g))     # rank 2 is not in g
    if case == "inputs_differ":
        col = gc.column_parallel(nn.Linear(4, 6))
        return _catch(lambda: col(torch.randn(2 + rank, 4)))
    if case == "vocab_split":
        return _catch(lambda: gc.vocab_parallel_cross_entropy(torch.randn(3, 2 + 2 * rank), torch.zeros(3, dtype=torch.long)))
    if case == "target_range":
        return _catch(lambda: gc.vocab_parallel_cross_entropy(torch.randn(3, 2), torch.tensor([0, 1, 4 if rank else 0])))
    if case == "attn_not_member":
        g = dist.new_group([0, 1])
        return _catch(lambda: gc.tensor_parallel_attention(gc.CausalSelfAttention(4, 2), g))
    if case == "heads":
        return _catch(lambda: gc.tensor_parallel_attention(gc.CausalSelfAttention(4, world - 1)))
    raise AssertionError(case)


@pytest.mark.parametrize("case, world, match", [
    ("too_few_features", 3, "fewer than the 3 ranks"),
    ("too_few_rows", 4, "fewer than the 4 ranks"),
    ("shapes_differ", 2, "disagree on the layer"),
    ("values_differ", 3, "sum of the weights"),
    ("groups_differ", 3, "passed the group"),
    ("not_member", 3, "not a member"),
    ("inputs_differ", 2, "same shape on every rank"),
    ("vocab_split", 2, "tensor_split"),
    ("target_range", 2, r"target ids must be in \[0, 3\]"),
    ("heads", 3, "cannot be split over 3 ranks"),
    ("attn_not_member", 3, "not a member"),
])
def test_bad_input_raises_value_error_on_every_rank(case, world, match):
    res = gc.launch(functools.partial(_bad_worker, case=case), world, timeout=T)
    for rank, r in enumerate(res):
        assert r is not None, f"rank {rank} did not raise"
        assert r[0] == "ValueError", r
        assert __import__("re").search(match, r[1]), r[1]


def test_one_process_wrong_arguments():
    with pytest.raises(TypeError, match="torch.nn.Linear"):
        gc.column_parallel(nn.Conv1d(2, 2, 1))
    with pytest.raises(TypeError, match="FeedForward"):
        gc.tensor_parallel_mlp(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="shape of logits_shard"):
        gc.vocab_parallel_cross_entropy(torch.randn(3, 4), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="not initialised"):
        gc.column_parallel(nn.Linear(2, 2), group=object())


def test_widget_is_a_view_over_tp_comm_bytes():
    w = gc.tp_comm_widget(batch=2, seq=256, hidden=512, layers=3, tp=4)
    assert f"= {gc.tp_comm_bytes(2, 256, 512, 3, 4) / 2**20:.1f} MiB" in w.summary
    w.children[3].value = 6                                  # layers slider
    assert f"= {gc.tp_comm_bytes(2, 256, 512, 6, 4) / 2**20:.1f} MiB" in w.summary
    w.children[4].value = 1                                  # tp = 1: nothing to reduce
    assert "0 all-reduces" in w.summary and "0.00 ms" in w.summary
