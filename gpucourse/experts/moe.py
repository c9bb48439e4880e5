"""A mixture of experts: many MLPs, and a router that sends each token to ``k`` of them.

A dense transformer runs every token through the same MLP. A mixture-of-experts (MoE) layer holds
``E`` MLPs — the *experts* — and a small linear *router* that picks ``k`` of them per token::

    logits = router(x)                      # (T, E)   one score per token and expert
    probs  = softmax(logits)                # (T, E)
    w, e   = top_k(probs, k)                # (T, k)   the k best experts of each token
    w      = w / w.sum(-1)                  # (T, k)   renormalised: a token's weights sum to 1
    y[t]   = Σ_j  w[t, j] · expert_{e[t, j]}(x[t])

Parameters grow with ``E``, compute per token only with ``k``: that is the point (Mixtral: 8
experts, top-2 — 47B parameters, 13B used per token).

Two more pieces make it train:

* **capacity** — an expert takes at most ``C = ceil(capacity_factor · T · k / E)`` token copies
  per forward (a fixed buffer, as on accelerators); the rest are *dropped* (their expert output is
  0; the residual connection around the layer carries the token on). First choices are served
  before second choices, and in token order within a choice (GShard's priority).
* **load balancing** — left alone, a router sends most tokens to a few experts (they get better,
  so they get chosen more). The Switch-Transformer auxiliary loss ``E · Σ_e f_e · P_e`` (``f_e``
  the share of token copies routed to ``e``, ``P_e`` its mean router probability) is 1 when
  routing is uniform and grows with imbalance; it is added to the training loss.

:class:`MoE` computes this in one process — the reference that expert parallelism must match.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..data import FeedForward
from ..runtime import check_int, check_number, check_tensor

__all__ = ["MoE", "Routing"]


class Routing(NamedTuple):
    """What the router decided for ``T`` tokens (see :meth:`MoE.route`).

    Example::

        >>> _ = torch.manual_seed(0)
        >>> r = MoE(4, 8, num_experts=3, top_k=2).route(torch.randn(5, 4))
        >>> r.experts.shape, r.weights.sum(-1).allclose(torch.ones(5)), r.keep.all().item()
        (torch.Size([5, 2]), True, True)
    """

    probs: torch.Tensor        # (T, E)  softmax of the router logits
    weights: torch.Tensor      # (T, k)  top-k probabilities, renormalised to sum to 1 per token
    experts: torch.Tensor      # (T, k)  the chosen experts' ids, best first
    keep: torch.Tensor         # (T, k)  False where the copy is over its expert's capacity
    capacity: int | None       # token copies per expert, None = unlimited


def capacity_mask(experts: torch.Tensor, num_experts: int, capacity: int | None) -> torch.Tensor:
    """``(T, k)`` bool: which token copies fit their expert's capacity.

    Priority: all first choices (in token order), then all second choices, … — so a token loses
    its second expert before another token loses its first.
    """
    if capacity is None:
        return torch.ones_like(experts, dtype=torch.bool)
    by_choice = experts.t().reshape(-1)                              # (k·T,) choice-major order
    one_hot = F.one_hot(by_choice, num_experts)                      # (k·T, E)
    position = (one_hot.cumsum(0) * one_hot).sum(1) - 1              # place in its expert's queue
    return (position < capacity).view(experts.shape[1], -1).t()      # back to (T, k)


def aux_loss(probs: torch.Tensor, tokens_per_expert: torch.Tensor, top_k: int) -> torch.Tensor:
    """Switch Transformer's load-balancing loss ``E · Σ_e f_e · P_e`` (1.0 when perfectly balanced)."""
    num_tokens, num_experts = probs.shape
    f = tokens_per_expert.to(probs.dtype) / max(num_tokens * top_k, 1)   # share of copies (no gradient)
    p = probs.mean(0) if num_tokens else probs.sum(0)                     # mean router probability
    return num_experts * (f * p).sum()


class MoE(nn.Module):
    """A mixture-of-experts MLP layer in one process: router, top-k, capacity, load-balancing loss.

    Args:
        d_model: token width (input and output features).
        d_hidden: hidden width of each expert (``Linear(d_model, d_hidden) → GELU → Linear``).
        num_experts: ``E``, the number of experts.
        top_k: experts per token (1 ≤ k ≤ E); their weights are renormalised to sum to 1.
        capacity_factor: ``None`` for unlimited capacity, else each expert takes at most
            ``ceil(capacity_factor · tokens · top_k / E)`` token copies per forward.

    After each forward: ``.aux_loss`` (the Switch load-balancing loss, differentiable),
    ``.tokens_per_expert`` (``(E,)`` int64, copies routed to each expert before the capacity cut)
    and ``.dropped`` (copies over capacity, an ``int``).

    Example::

        >>> _ = torch.manual_seed(0)
        >>> moe = MoE(8, 16, num_experts=4, top_k=2, capacity_factor=1.0)
        >>> y = moe(torch.randn(10, 8))
        >>> y.shape, int(moe.tokens_per_expert.sum()), moe.capacity(10)     # 10 tokens × 2 copies
        (torch.Size([10, 8]), 20, 5)
        >>> round(moe.aux_loss.item(), 2) >= 1.0, moe.dropped >= 0
        (True, True)

    .. warning::
        A dropped copy contributes **zero**, silently: the layer's output for that token is only
        its other experts' (or nothing). Inside a transformer the residual connection carries the
        token on, so training does not crash — it just learns less. Watch ``.dropped``.
    """

    def __init__(self, d_model: int, d_hidden: int, num_experts: int, *, top_k: int = 2,
                 capacity_factor: float | None = None):
        super().__init__()
        check_int("d_model", d_model, 1)
        check_int("d_hidden", d_hidden, 1)
        check_int("num_experts", num_experts, 1)
        check_int("top_k", top_k, 1, maximum=num_experts, hint=f" (num_experts = {num_experts})")
        if capacity_factor is not None:
            check_number("capacity_factor", capacity_factor)
            if capacity_factor <= 0:
                raise ValueError(f"capacity_factor must be > 0 or None (unlimited), got {capacity_factor}")
        self.d_model, self.d_hidden, self.num_experts = d_model, d_hidden, num_experts
        self.top_k, self.capacity_factor = top_k, capacity_factor
        self.router = nn.Linear(d_model, num_experts, bias=False)
        self.experts = nn.ModuleList(FeedForward(d_model, d_hidden) for _ in range(num_experts))
        self.aux_loss: torch.Tensor | None = None
        self.tokens_per_expert: torch.Tensor | None = None
        self.dropped: int = 0

    def capacity(self, num_tokens: int) -> int | None:
        """Token copies one expert takes: ``ceil(capacity_factor · tokens · top_k / E)``, or None."""
        if self.capacity_factor is None:
            return None
        return math.ceil(self.capacity_factor * num_tokens * self.top_k / self.num_experts)

    # 1) route: scores → softmax → top-k → renormalise → capacity
    def route(self, x: torch.Tensor) -> Routing:
        """Route ``x`` ``(T, d_model)``; also sets ``.aux_loss``, ``.tokens_per_expert``, ``.dropped``."""
        check_tensor("x", x, ndim=2, floating=True)
        if x.shape[1] != self.d_model:
            raise ValueError(f"x must be (tokens, {self.d_model}), got {tuple(x.shape)}")
        return route(self, self.router, x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r = self.route(x)                                                # (T, k) each
        copies = dispatch_order(r, self.num_experts)
        xs = x[copies.token]                                             # (C, d) grouped by expert
        ys = run_experts(self.experts, xs, copies.per_expert.tolist())   # (C, d)
        return combine(ys, r, copies, x.shape[0])                        # (T, d)


# --- the four steps both the dense layer and expert parallelism use -----------------------------

def route(layer, router: nn.Linear, x: torch.Tensor) -> Routing:
    """Route ``x`` with ``router``; record ``aux_loss``, ``tokens_per_expert``, ``dropped`` on ``layer``."""
    num_experts, top_k = router.out_features, layer.top_k
    probs = router(x).softmax(dim=-1)                                # (T, E)
    weights, experts = probs.topk(top_k, dim=-1)                     # (T, k)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    capacity = layer.capacity(x.shape[0])
    keep = capacity_mask(experts, num_experts, capacity)
    layer.tokens_per_expert = torch.bincount(experts.reshape(-1), minlength=num_experts)
    layer.aux_loss = aux_loss(probs, layer.tokens_per_expert, top_k)
    layer.dropped = int((~keep).sum())
    return Routing(probs, weights, experts, keep, capacity)


class Copies(NamedTuple):
    token: torch.Tensor        # (C,)  the token of each kept copy, sorted by expert
    slot: torch.Tensor         # (C,)  which of the token's k choices it is
    per_expert: torch.Tensor   # (E,)  kept copies per expert (sums to C)


def dispatch_order(r: Routing, num_experts: int) -> Copies:
    """The kept token copies, sorted by expert (stable: token order within an expert)."""
    token, slot = r.keep.nonzero(as_tuple=True)                          # (C,), (C,) in token order
    expert = r.experts[token, slot]
    order = torch.sort(expert, stable=True).indices
    return Copies(token[order], slot[order], torch.bincount(expert, minlength=num_experts))


def run_experts(experts, xs: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Run expert ``i`` on the ``counts[i]`` rows of ``xs`` that belong to it (every expert runs,
    even on zero rows, so every rank's output stays in the autograd graph)."""
    chunks = xs.split(counts)
    return torch.cat([expert(chunk) for expert, chunk in zip(experts, chunks)])


def combine(ys: torch.Tensor, r: Routing, copies: Copies, num_tokens: int) -> torch.Tensor:
    """``y[t] = Σ_j w[t, j] · (expert output of copy (t, j))`` — dropped copies add nothing."""
    w = r.weights[copies.token, copies.slot].unsqueeze(-1)               # (C, 1)
    out = ys.new_zeros(num_tokens, ys.shape[-1])
    return out.index_add(0, copies.token, w * ys)
