"""The dense MoE against a token-by-token loop: routing, capacity (priority), aux loss, gradients."""

import math

import pytest
import torch

import gpucourse as gc


def _loop_reference(moe, x):
    """Token by token, choice by choice: the definition, with capacity served first choices first."""
    probs = torch.softmax(x @ moe.router.weight.t(), dim=-1)
    w, e = probs.topk(moe.top_k, dim=-1)
    w = w / w.sum(-1, keepdim=True)
    cap = math.inf if moe.capacity_factor is None else math.ceil(moe.capacity_factor * len(x) * moe.top_k / moe.num_experts)
    used, keep = [0] * moe.num_experts, torch.zeros_like(e, dtype=torch.bool)
    for j in range(moe.top_k):
        for t in range(len(x)):
            if used[e[t, j]] < cap:
                used[e[t, j]] += 1
                keep[t, j] = True
    rows = []
    for t in range(len(x)):
        rows.append(sum((w[t, j] * moe.experts[int(e[t, j])](x[t:t + 1])[0] for j in range(moe.top_k) if keep[t, j]),
                        torch.zeros(x.shape[1])))
    counts = torch.bincount(e.reshape(-1), minlength=moe.num_experts)
    aux = moe.num_experts * ((counts.float() / (len(x) * moe.top_k)) * probs.mean(0)).sum()
    return torch.stack(rows), counts, aux, int((~keep).sum())


@pytest.mark.parametrize("experts, k, cf, tokens", [(4, 2, None, 9), (5, 1, None, 7), (4, 2, 1.0, 13),
                                                    (6, 3, 0.5, 10), (3, 3, 1.25, 8)])
def test_moe_equals_the_token_loop_forward_and_backward(experts, k, cf, tokens):
    torch.manual_seed(experts * 10 + k)
    moe = gc.MoE(6, 10, experts, top_k=k, capacity_factor=cf)
    x = torch.randn(tokens, 6, requires_grad=True)
    w = torch.randn(tokens, 6)
    y = moe(x)
    (y * w).sum().backward()
    got = [p.grad.clone() for p in moe.parameters()] + [x.grad.clone()]
    moe.zero_grad()
    x.grad = None
    ref, counts, aux, dropped = _loop_reference(moe, x)
    (ref * w).sum().backward()
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)
    for a, b in zip(got, [p.grad for p in moe.parameters()] + [x.grad]):
        torch.testing.assert_close(a, torch.zeros_like(a) if b is None else b, atol=1e-5, rtol=1e-5)  # None: unused expert
    assert torch.equal(moe.tokens_per_expert, counts)
    torch.testing.assert_close(moe.aux_loss, aux)
    assert moe.dropped == dropped and (cf is None) <= (dropped == 0)
    assert moe.capacity(tokens) == (None if cf is None else math.ceil(cf * tokens * k / experts))


def test_capacity_drops_second_choices_before_first_and_dropped_rows_are_zero():
    torch.manual_seed(0)
    moe = gc.MoE(4, 8, 4, top_k=2, capacity_factor=0.25)        # capacity ceil(.25·8·2/4) = 1 per expert
    with torch.no_grad():
        moe.router.weight.copy_(torch.tensor([[9.0, 0, 0, 0], [0, 5.0, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]]))
    x = torch.eye(4).repeat(2, 1)                                # tokens 0..3, then the same again
    r = moe.route(x)
    assert moe.capacity(8) == 1 and r.keep[:, 0].tolist() == [True, True, True, True, False, False, False, False]
    assert not r.keep[:, 1].any() and moe.dropped == 12          # every expert's one slot went to a first choice
    assert moe(x)[4:].abs().max() == 0


def test_aux_loss_is_one_when_balanced_and_grows_with_skew():
    probs = torch.full((8, 4), 0.25)
    from gpucourse.experts.moe import aux_loss
    assert aux_loss(probs, torch.tensor([4, 4, 4, 4]), 2).item() == pytest.approx(1.0)
    skew = torch.tensor([[0.7, 0.1, 0.1, 0.1]]).repeat(8, 1)
    assert aux_loss(skew, torch.tensor([8, 8, 0, 0]), 2).item() > 1.5


def test_bad_arguments():
    with pytest.raises(ValueError, match="top_k must be <= 4"):
        gc.MoE(4, 8, 4, top_k=5)
    with pytest.raises(ValueError, match="capacity_factor"):
        gc.MoE(4, 8, 4, capacity_factor=0)
    with pytest.raises(ValueError, match=r"\(tokens, 4\)"):
        gc.MoE(4, 8, 4)(torch.randn(3, 5))
    with pytest.raises(TypeError):
        gc.MoE(4, 8, 4)(torch.ones(3, 4, dtype=torch.long))


def test_ep_comm_bytes_exact_and_expected():
    b = gc.ep_comm_bytes(tokens=10, d_model=3, world_size=3, top_k=2, send_counts=[4, 9, 7], rank=1,
                         recv_counts=[5, 9, 2], dtype_bytes=2)
    assert b == {"forward": (11 + 7) * 3 * 2, "backward": (11 + 7) * 3 * 2, "total": 2 * 18 * 6}
    e = gc.ep_comm_bytes(tokens=5, d_model=2, world_size=3, top_k=1)        # 5·2/3 = 3.33 -> 3 copies
    assert e["forward"] == 2 * 3 * 2 * 4 and gc.ep_comm_bytes(tokens=3, d_model=1, world_size=2, top_k=1)["forward"] == 2 * 2 * 4
    assert gc.ep_comm_bytes(tokens=7, d_model=2, world_size=1, top_k=2)["total"] == 0
    for bad in (dict(send_counts=[1, 2]), dict(send_counts=[1, 2, 3], rank=3), dict(send_counts=[9, 9, 9], rank=0),
                dict(rank=0), dict(tokens=0), dict(top_k=0)):
        kw = dict(tokens=5, d_model=2, world_size=3, top_k=2) | bad
        with pytest.raises(ValueError):
            gc.ep_comm_bytes(**kw)


def test_ep_comm_time_charges_the_network_only_for_rows_that_leave_the_node():
    """Chapter 11 B5: with 8 ranks per node, (N − 8)/(N − 1) of the rows cross the network."""
    layer = dict(tokens=8192, d_model=4096, top_k=2, dtype_bytes=2)
    ib, nv = gc.LINKS["100 Gb InfiniBand"], gc.LINKS["NVLink"]
    flat = gc.ep_comm_time(world_size=64, link=ib, **layer)
    assert gc.ep_comm_time(world_size=64, link=ib, ranks_per_node=1, **layer) == pytest.approx(flat)
    assert gc.ep_comm_time(world_size=8, link=ib, ranks_per_node=8, intra=nv, **layer) == pytest.approx(
        gc.ep_comm_time(world_size=8, link=nv, **layer))
    one = gc.ep_comm_bytes(world_size=64, **layer)["forward"] / 2 / 63          # one message of an all-to-all
    by_hand = 4 * max(7 * (nv.alpha + one * nv.beta), 56 * (ib.alpha + one * ib.beta))
    nodes = gc.ep_comm_time(world_size=64, link=ib, ranks_per_node=8, **layer)
    assert nodes == pytest.approx(by_hand) and nodes < flat
    eight_nodes = gc.ep_comm_time(world_size=8, link=ib, **layer)                 # 8 ranks, one per node
    assert eight_nodes < nodes < 1.05 * eight_nodes                               # more nodes do not help
    with pytest.raises(ValueError, match="divide"):
        gc.ep_comm_time(world_size=12, link=ib, ranks_per_node=8, **layer)
