"""Expert parallelism equals the dense MoE (gloo, one launch of 3 ranks running every check).

Oracle: ``gc.MoE`` in one process — on each rank's tokens (outputs, capacity) and on all ranks'
tokens together (each expert's gradient). Bytes: ``gc.ep_comm_bytes`` of the recorded counts.
"""

import pytest
import torch

import gpucourse as gc

D, H, E = 6, 10, 5
TOKENS = [7, 12, 0]                 # rank 2 has no tokens: it still takes part in every all-to-all


def _data(rank, seed):
    g = torch.Generator().manual_seed(seed + rank)
    return torch.randn(TOKENS[rank], D, generator=g), torch.randn(TOKENS[rank], D, generator=g)


def _moe(cf):
    torch.manual_seed(3)
    return gc.MoE(D, H, E, top_k=2, capacity_factor=cf)


def _worker(rank, world):
    out = {}
    for cf in (None, 0.75):
        moe = _moe(cf)
        ep = gc.expert_parallel(moe)
        x, w = _data(rank, 100)
        x.requires_grad_()
        y = ep(x)
        (y * w).sum().backward()
        out[cf] = dict(y=y.detach(), ref=moe(x.detach()).detach(), ids=sorted(ep.experts, key=int),
                       grads={e: [p.grad.clone() for p in ep.experts[e].parameters()] for e in ep.experts},
                       router=ep.router.weight.grad.clone(), xgrad=x.grad.clone(), comm=dict(ep.comm_bytes),
                       counts=(ep.send_counts, ep.recv_counts), dropped=ep.dropped, ref_dropped=moe.dropped,
                       params=sorted(n for n, _ in ep.named_parameters()))
    # bad input: every rank raises the same ValueError, and the group still works afterwards
    ep = gc.expert_parallel(_moe(None))
    errors = []
    for bad in ("width", "dtype", "requires_grad"):
        x = torch.randn(4, D)
        if rank == 1:
            x = {"width": torch.randn(4, D + 1), "dtype": x.double(), "requires_grad": x.requires_grad_()}[bad]
        try:
            ep(x)
            errors.append(None)
        except ValueError as err:
            errors.append(str(err))
    for bad in ("seed", "too many ranks"):
        try:
            if bad == "seed":
                torch.manual_seed(rank == 2)
                gc.expert_parallel(gc.MoE(D, H, E))
            else:
                gc.expert_parallel(gc.MoE(D, H, 2, top_k=1))
            errors.append(None)
        except ValueError as err:
            errors.append(str(err))
    out["errors"] = errors
    y = ep(torch.randn(4 + rank, D))                 # x without grad on every rank: only the return all-to-all has a backward
    y.sum().backward()
    out["no_input_grad"] = (ep.comm_bytes["backward"] > 0, ep.experts[str(ep.expert_ids[0])].fc1.weight.grad is not None)
    sub = torch.distributed.new_group([1, 2])        # group ranks 0, 1 are global ranks 1, 2
    if rank in (1, 2):
        ep = gc.expert_parallel(_moe(None), group=sub)
        x = torch.randn(5, D, generator=torch.Generator().manual_seed(rank))
        out["subgroup"] = (sorted(ep.experts, key=int), torch.allclose(ep(x), _moe(None)(x), atol=1e-6))
    return out


@pytest.fixture(scope="module")
def runs():
    return gc.launch(_worker, 3, timeout=90)


def test_output_equals_dense_moe_on_local_tokens(runs):
    for cf in (None, 0.75):
        for r in runs:
            torch.testing.assert_close(r[cf]["y"], r[cf]["ref"], atol=1e-6, rtol=1e-5)
            assert r[cf]["dropped"] == r[cf]["ref_dropped"]
    assert any(r[0.75]["dropped"] for r in runs)                   # capacity really dropped something
    assert [r[None]["ids"] for r in runs] == [["0", "1"], ["2", "3"], ["4"]]
    assert runs[2][None]["params"] == ["experts.4.fc1.bias", "experts.4.fc1.weight", "experts.4.fc2.bias",
                                       "experts.4.fc2.weight", "router.weight"]


@pytest.mark.parametrize("cf", [None, 0.75])
def test_expert_gradients_equal_the_dense_moe_on_all_tokens(runs, cf):
    moe = _moe(cf)
    xs = []
    for rank in range(3):
        x, w = _data(rank, 100)
        x.requires_grad_()
        if cf is None and rank == 0:       # unlimited capacity: one dense run on all ranks' tokens
            xa = torch.cat([_data(r, 100)[0] for r in range(3)]).requires_grad_()
            (moe(xa) * torch.cat([_data(r, 100)[1] for r in range(3)])).sum().backward()
        elif cf is not None:               # capacity is per rank: the sum of the dense runs on each rank's tokens
            (moe(x) * w).sum().backward()
        xs.append(x)
    for r in runs:
        for e, grads in r[cf]["grads"].items():
            for got, want in zip(grads, moe.experts[int(e)].parameters()):
                torch.testing.assert_close(got, want.grad, atol=1e-5, rtol=1e-4)
    router = sum(r[cf]["router"] for r in runs)                     # replicated: the ranks' sum = the dense grad
    torch.testing.assert_close(router, moe.router.weight.grad, atol=1e-5, rtol=1e-4)
    if cf is None:
        torch.testing.assert_close(torch.cat([r[cf]["xgrad"] for r in runs]), xa.grad, atol=1e-5, rtol=1e-4)


def test_counted_bytes_equal_ep_comm_bytes(runs):
    for cf in (None, 0.75):
        sent = [r[cf]["counts"][0] for r in runs]
        for rank, r in enumerate(runs):
            send, recv = r[cf]["counts"]
            assert recv == [sent[s][rank] for s in range(3)]
            want = gc.ep_comm_bytes(tokens=max(TOKENS[rank], 1), d_model=D, world_size=3, top_k=2,
                                    send_counts=send, recv_counts=recv, rank=rank)
            assert {k: r[cf]["comm"][k] for k in want} == want
            assert r[cf]["comm"]["forward"] > 0 and r[cf]["comm"]["counts"] == 2 * (4 + E) * 8


def test_a_subgroup_uses_group_ranks(runs):
    assert "subgroup" not in runs[0]
    assert [runs[1]["subgroup"], runs[2]["subgroup"]] == [(["0", "1", "2"], True), (["3", "4"], True)]


def test_input_without_grad_still_trains_the_experts(runs):
    assert all(r["no_input_grad"] == (True, True) for r in runs)


def test_bad_input_raises_on_every_rank(runs):
    for i, what in enumerate(["width", "dtype", "need a backward", "different MoE", "only 2 experts"]):
        msgs = [r["errors"][i] for r in runs]
        assert all(m is not None for m in msgs), (what, msgs)
        assert len(set(msgs)) == 1 and (what in msgs[0] or what.split()[0] in msgs[0]), msgs[0]
