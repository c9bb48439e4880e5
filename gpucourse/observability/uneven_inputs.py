"""Uneven inputs: one rank runs out of batches first — and, without ``Join``, the others hang.

DDP all-reduces gradients in every backward. If rank 0 has 3 batches and rank 1 has 4, rank 1's
4th backward starts an all-reduce that rank 0 never joins: rank 1 waits until the process group's
timeout (30 min by default on NCCL). ``torch.distributed.algorithms.Join`` fixes it: a rank that has
run out *shadows* the others — it keeps answering their collectives with zeros (DDP's
``join_hook``) until every rank is done. With ``divide_by_initial_world_size=True`` (the default) the
zeros still count in the average, so a step with fewer ranks takes a proportionally smaller step.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from ..runtime import check_type

__all__ = ["train_uneven"]


def train_uneven(ddp_model, batches, *, join: bool = True, lr: float = 0.1) -> int:
    """Train a DDP model on this rank's ``batches`` (a different number per rank), SGD, MSE loss.

    Args:
        ddp_model: a ``DistributedDataParallel`` model.
        batches: this rank's list of ``(inputs, targets)``.
        join: wrap the loop in ``Join([ddp_model])``; ``False`` shows the hang.
        lr: SGD learning rate.

    Returns:
        the number of batches this rank trained on.

    Example::

        >>> import torch, gpucourse as gc
        >>> from torch.nn.parallel import DistributedDataParallel as DDP
        >>> def run(rank, world_size):
        ...     torch.manual_seed(0)
        ...     model = DDP(torch.nn.Linear(2, 1))
        ...     batches = [(torch.randn(4, 2), torch.randn(4, 1)) for _ in range(2 + rank)]
        ...     gc.train_uneven(model, batches, join=True)
        ...     return model.module.weight.detach()
        >>> w0, w1 = gc.launch(run, 2)
        >>> torch.equal(w0, w1)             # rank 0 shadowed rank 1's third step
        True

    .. warning::
        Without ``Join`` nothing fails at once: the rank with more batches *waits* in its all-reduce
        until the group's timeout. Bound it (a short ``timeout`` on the group) when you test this.
    """
    from torch.distributed.algorithms.join import Join
    from torch.nn.parallel import DistributedDataParallel

    check_type("ddp_model", ddp_model, DistributedDataParallel)
    check_type("join", join, bool)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=lr)
    steps = 0
    with Join([ddp_model]) if join else contextlib.nullcontext():
        for inputs, targets in batches:
            optimizer.zero_grad()
            F.mse_loss(ddp_model(inputs), targets).backward()
            optimizer.step()
            steps += 1
    return steps
