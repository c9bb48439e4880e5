"""Expert parallelism: the experts of one MoE layer live on different ranks; tokens travel to them.

Every rank holds the (small) router and ``E / world`` of the experts; rank ``r`` keeps
``torch.tensor_split(torch.arange(E), world)[r]``. Each rank routes its own tokens, then::

    1) route          weights, experts = top_k(softmax(router(x)))      (T, k)   as the dense MoE
    2) sort           token copies grouped by expert — so also by the rank that owns the expert
    3) counts         all-gather how many copies each rank sends to each expert   (small, int64)
    4) dispatch       all_to_all: my copies to their experts' ranks; I receive others' copies
    5) experts        run my experts on what I received (grouped by expert)
    6) return         all_to_all back: results to the ranks the copies came from (splits swapped)
    7) combine        y[t] = Σ_j w[t, j] · result(t, j)                   as the dense MoE

Steps 1, 2, 5 and 7 are the dense layer's (``moe.py``); expert parallelism adds the two
all-to-alls (4 and 6), and their backward is the same two exchanges in reverse order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..runtime import check_type, group_info
from .all_to_all import all_to_all, exchange_headers
from .moe import MoE, combine, dispatch_order, route, run_experts

__all__ = ["ExpertParallelMoE", "expert_parallel"]


class ExpertParallelMoE(nn.Module):
    """One rank's part of an expert-parallel :class:`MoE` (build it with :func:`expert_parallel`).

    Attributes: ``router`` (replicated), ``experts`` (``ModuleDict``: global id as a string →
    expert), ``expert_ids`` (this rank's global ids), ``aux_loss`` / ``tokens_per_expert`` /
    ``dropped`` of this rank's tokens (as the dense layer on them), ``comm_bytes`` — the bytes this
    rank sent in the last step: ``{"forward", "backward", "total", "counts"}``; forward/backward
    are the token all-to-alls (what :func:`ep_comm_bytes` predicts), ``counts`` the header
    all-gather, not in ``total``. ``send_counts`` / ``recv_counts``: token copies sent to and
    received from each rank in the last forward.

    Example::

        >>> import gpucourse as gc
        >>> def one_rank(rank, world):                    # one rank holds every expert: no traffic
        ...     ep = expert_parallel(MoE(4, 8, num_experts=3))
        ...     ep(torch.randn(5, 4, requires_grad=True)).sum().backward()
        ...     return list(ep.experts), ep.comm_bytes["total"], ep.send_counts
        >>> gc.launch(one_rank, 1, timeout=60)
        [(['0', '1', '2'], 0, [10])]

    .. warning::
        The module holds this rank's experts only: ``state_dict()`` is this rank's shard, and the
        router's gradient covers this rank's tokens only (all-reduce it over the ranks).
    """

    def __init__(self, moe: MoE, group=None):
        super().__init__()
        rank, world, _ = group_info(group)
        self.group, self.rank, self.world_size = group, rank, world
        self.moe_config = dict(d_model=moe.d_model, d_hidden=moe.d_hidden, num_experts=moe.num_experts,
                               top_k=moe.top_k, capacity_factor=moe.capacity_factor)
        self.d_model, self.num_experts = moe.d_model, moe.num_experts
        self.top_k, self.capacity_factor = moe.top_k, moe.capacity_factor
        self.router = moe.router                     # replicated: every rank routes its own tokens
        owners = torch.tensor_split(torch.arange(moe.num_experts), world)
        self.expert_ids = owners[rank].tolist()
        self.experts_per_rank = [len(o) for o in owners]
        self.experts = nn.ModuleDict({str(e): moe.experts[e] for e in self.expert_ids})
        self.aux_loss, self.tokens_per_expert, self.dropped = None, None, 0
        self.comm_bytes = {"forward": 0, "backward": 0, "total": 0, "counts": 0}
        self.send_counts = self.recv_counts = None

    def capacity(self, num_tokens: int) -> int | None:
        """Token copies one expert takes from this rank's tokens (``MoE.capacity``)."""
        return MoE.capacity(self, num_tokens)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg, world, me = self.moe_config, self.world_size, self.rank
        ok = isinstance(x, torch.Tensor) and x.dim() == 2 and x.shape[1] == cfg["d_model"] \
            and x.dtype == self.router.weight.dtype
        # 1-2) route and sort this rank's copies by expert (skipped when x is bad: the header says so)
        if ok:
            r = route(self, self.router, x)
            copies = dispatch_order(r, cfg["num_experts"])
            per_expert = copies.per_expert
        else:
            per_expert = torch.zeros(cfg["num_experts"], dtype=torch.int64)
        # 3) counts: every rank learns what every rank sends to every expert (and checks the input)
        needs_grad = torch.is_grad_enabled() and bool(getattr(x, "requires_grad", False))
        table = exchange_headers(self.group, d_model=cfg["d_model"], layer_dtype=self.router.weight.dtype,
                                 shape=tuple(x.shape) if isinstance(x, torch.Tensor) else (),
                                 dtype=getattr(x, "dtype", None), needs_grad=needs_grad,
                                 counts=per_expert)                      # (world, E)
        by_rank = torch.stack([c.sum(1) for c in table.split(self.experts_per_rank, dim=1)], 1)  # (world, world)
        send, recv = by_rank[me].tolist(), by_rank[:, me].tolist()
        mine = table[:, self.expert_ids[0]:self.expert_ids[-1] + 1]      # (world, my experts)
        self.comm_bytes = meter = {"forward": 0, "backward": 0, "total": 0,
                                   "counts": (world - 1) * (4 + cfg["num_experts"]) * 8}   # header, not in total
        self.send_counts, self.recv_counts = send, recv
        # 4) dispatch: my copies go to the ranks of their experts
        x_recv = all_to_all(x[copies.token], send, recv, self.group, meter)   # (Σ recv, d) by source, then expert
        # 5) my experts on what arrived: regroup by expert, run, put back in arrival order
        expert_of = torch.repeat_interleave(torch.arange(len(self.expert_ids)).repeat(world),
                                            mine.reshape(-1)).to(x_recv.device)
        order = torch.sort(expert_of, stable=True).indices
        y_sorted = run_experts(list(self.experts.values()), x_recv[order], mine.sum(0).tolist())
        y_recv = y_sorted[torch.argsort(order)]
        # 6) return the results to the ranks the copies came from
        ys = all_to_all(y_recv, recv, send, self.group, meter)                # (C, d) in my sorted order
        # 7) combine with the router weights, as the dense layer
        return combine(ys, r, copies, x.shape[0])


def expert_parallel(moe: MoE, group=None) -> ExpertParallelMoE:
    """Split ``moe``'s experts over the ranks of ``group``: rank ``r`` keeps ``tensor_split(arange(E), world)[r]``.

    Every rank must pass the same ``MoE`` (same seed); the router stays replicated. With unlimited
    capacity the module's output equals ``moe(x_local)``, and after every rank's backward each kept
    expert's gradient equals that expert's gradient in the dense ``moe`` run on all ranks' tokens.
    With a ``capacity_factor``, capacity is applied per rank (to its own tokens), as ``moe(x_local)``.

    Args:
        moe: the full layer, identical on every rank.
        group: the expert-parallel process group (``None``: the default group).

    Example::

        >>> import gpucourse as gc
        >>> def run(rank, world):
        ...     torch.manual_seed(0)
        ...     moe = MoE(8, 16, num_experts=4, top_k=2)
        ...     ep = expert_parallel(moe)
        ...     x = torch.randn(6, 8, generator=torch.Generator().manual_seed(rank))
        ...     return sorted(ep.experts), torch.allclose(ep(x), moe(x), atol=1e-6)
        >>> gc.launch(run, 2, timeout=60)
        [(['0', '1'], True), (['2', '3'], True)]

    .. warning::
        Every rank must run every forward *and* every backward of the layer: each one is an
        all-to-all that waits for all ranks. A rank with no tokens still calls it (with a
        ``(0, d_model)`` tensor). The router's gradient is this rank's tokens' only: average it
        over the ranks (it is replicated — data parallel) before the optimizer step.
    """
    check_type("moe", moe, MoE, "a gpucourse MoE")
    rank, world, _ = group_info(group)
    facts = (moe.d_model, moe.d_hidden, moe.num_experts, moe.top_k, moe.capacity_factor, world,
             round(float(moe.router.weight.detach().double().sum()), 9))
    every = [None] * world
    dist.all_gather_object(every, facts, group=group)
    problems = []
    if world > moe.num_experts:
        problems.append(f"{world} ranks but only {moe.num_experts} experts: some ranks would hold no "
                        f"expert (use a group of at most {moe.num_experts} ranks)")
    if len(set(every)) > 1:
        problems.append("the ranks passed different MoE layers (d_model, d_hidden, E, top_k, capacity, "
                        "group size, router checksum): " + "; ".join(f"rank {s}: {f}" for s, f in enumerate(every))
                        + " — build the same MoE on every rank (same seed)")
    if problems:
        raise ValueError("expert_parallel: " + "; ".join(problems))
    return ExpertParallelMoE(moe, group)
