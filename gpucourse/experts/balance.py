"""What the load-balancing loss does: a short training run of one MoE layer, expert counts recorded.

A router learns like any layer: the experts that happen to get more tokens early learn faster,
so the router prefers them more, so they get even more tokens. Left alone, a few experts take
everything — the others' parameters are dead weight, and under expert parallelism their ranks
idle while the popular experts' ranks set the pace. The Switch-Transformer loss
``aux = E · Σ_e f_e · P_e`` pulls the router back towards uniform routing; it is added to the
task loss with a small weight (0.01 in Switch; larger here, for a short run).

The task: fit a fixed random teacher MLP on tokens that share a common offset (real hidden states
share directions too; it is what lets one expert win every token).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..runtime import check_int, check_number
from .moe import MoE

__all__ = ["load_balance_run"]


def load_balance_run(aux_weight: float, *, steps: int = 100, num_experts: int = 8, top_k: int = 2,
                     d_model: int = 16, tokens: int = 256, shift: float = 3.0, lr: float = 0.03,
                     seed: int = 0) -> dict:
    """Train one :class:`MoE` for ``steps`` Adam steps on ``task + aux_weight · aux_loss``.

    Args:
        aux_weight: weight of the load-balancing loss (0: none).
        steps, tokens: training steps, tokens per step.
        num_experts, top_k, d_model: the layer (each expert ``d_model → 2·d_model → d_model``).
        shift: length of the offset all tokens share (0: centred tokens, which balance more easily).
        lr, seed: Adam's learning rate; the seed of the layer, the teacher and the data.

    Returns:
        ``{"counts": (steps, E) int64 tokens_per_expert per step,``
        ``"task_loss": [float], "aux_loss": [float]}``.

    Example::

        >>> run = load_balance_run(0.1, steps=3, tokens=32)
        >>> run["counts"].shape, int(run["counts"][0].sum())        # 32 tokens × top-2
        (torch.Size([3, 8]), 64)

    .. warning::
        Whether and how fast a router collapses depends on the data, the learning rate and the
        seed — the imbalance is a tendency, not a law. Measure it (``tokens_per_expert``) in your run.
    """
    check_number("aux_weight", aux_weight, 0)
    for name, v in (("steps", steps), ("tokens", tokens), ("d_model", d_model), ("num_experts", num_experts)):
        check_int(name, v, 1)
    check_number("shift", shift, 0)
    check_number("lr", lr, 0)
    torch.manual_seed(seed)
    moe = MoE(d_model, 2 * d_model, num_experts, top_k=top_k)
    teacher = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.Tanh(), nn.Linear(4 * d_model, d_model))
    opt = torch.optim.Adam(moe.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed + 1)
    offset = torch.randn(d_model, generator=g) * shift / d_model ** 0.5      # shared by every token
    counts, task_losses, aux_losses = [], [], []
    for _ in range(steps):
        x = torch.randn(tokens, d_model, generator=g) + offset               # (T, d)
        with torch.no_grad():
            target = teacher(x)
        task = F.mse_loss(moe(x), target)
        loss = task + aux_weight * moe.aux_loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        counts.append(moe.tokens_per_expert.clone())
        task_losses.append(task.item())
        aux_losses.append(moe.aux_loss.item())
    return {"counts": torch.stack(counts), "task_loss": task_losses, "aux_loss": aux_losses}
