"""Train TinyGPT on a 2-D mesh — tensor parallel × data parallel — and in one process, to compare.

With ``world = dp × tp`` processes, ``init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))``
puts rank ``dp_rank · tp + tp_rank`` at mesh position ``(dp_rank, tp_rank)``: tensor-parallel peers
get consecutive ranks (on one node, where links are fast — TP all-reduces every block).

Each step, every rank:

1) draws the global batch ``TinyText.batch(B, T, step)`` and keeps the rows of its data-parallel
   shard (``tensor_split`` over ``dp``);
2) runs forward and backward of its tensor-parallel model on them (the tp group communicates);
3) all-reduces the gradients over its dp group, each weighted by its share of the rows, so the
   sum is the gradient of the global batch's mean loss;
4) takes an AdamW step. Every rank of a tp group holds different shards; every rank of a dp group
   the same shard, updated identically.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..data import TinyGPT, TinyText
from ..runtime import default_backend, launch, rank_device
from ..runtime import check_int, check_positive
from .meter import comm_meter
from .transformer import tensor_parallel_gpt

__all__ = ["train_tinygpt", "train_tinygpt_2d"]


def train_tinygpt(config: dict, *, steps: int = 20, batch_size: int = 8, lr: float = 3e-3, seed: int = 0,
                  text_chars: int = 20_000) -> list[float]:
    """Train ``TinyGPT(**config)`` in this process on ``TinyText``; return the loss of every step.

    Example::

        >>> cfg = dict(vocab_size=27, seq_len=16, num_layers=1, hidden=32, num_heads=2)
        >>> losses = train_tinygpt(cfg, steps=30, batch_size=8)
        >>> losses[-1] < losses[0]
        True
    """
    _check(steps, batch_size, lr)
    data = TinyText(text_chars, seed)
    torch.manual_seed(seed)
    model = TinyGPT(**config)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        x, y = data.batch(batch_size, config["seq_len"], step)
        loss = model.loss(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _worker_2d(rank, world_size, config, tp, dp, steps, batch_size, lr, seed, text_chars):
    from torch.distributed.device_mesh import init_device_mesh

    device = rank_device()                      # the CPU under gloo, cuda:<rank> under NCCL
    mesh = init_device_mesh(device.type, (dp, tp), mesh_dim_names=("dp", "tp"))
    tp_group, dp_group = mesh.get_group("tp"), mesh.get_group("dp")
    dp_rank = mesh.get_local_rank("dp")
    data = TinyText(text_chars, seed)
    torch.manual_seed(seed)
    model = tensor_parallel_gpt(TinyGPT(**config).to(device), tp_group)  # the same full model everywhere
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    with comm_meter() as meter:
        for step in range(steps):
            x, y = data.batch(batch_size, config["seq_len"], step)     # the global batch ...
            rows = torch.tensor_split(torch.arange(batch_size), dp)[dp_rank]
            share = len(rows) / batch_size                             # ... and this dp rank's rows
            loss = model.loss(x[rows].to(device), y[rows].to(device)) * share
            opt.zero_grad(set_to_none=True)
            loss.backward()
            flat = torch.cat([p.grad.flatten() for p in model.parameters()] + [loss.detach().view(1)])
            dist.all_reduce(flat, group=dp_group)                      # Σ over dp of share × grad
            offset = 0
            for p in model.parameters():
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
            opt.step()
            losses.append(flat[-1].item())                             # the global batch's loss
    return {"losses": losses, "coords": (mesh.get_local_rank("tp"), dp_rank),
            "tp_ranks": dist.get_process_group_ranks(tp_group), "dp_ranks": dist.get_process_group_ranks(dp_group),
            "tp_bytes": meter.bytes(site=("f", "g")), "all_bytes": meter.bytes()}


def train_tinygpt_2d(config: dict, *, tp: int, dp: int, steps: int = 20, batch_size: int = 8, lr: float = 3e-3,
                     seed: int = 0, text_chars: int = 20_000, timeout: float = 120.0,
                     backend: str | None = None) -> list[dict]:
    """Train ``TinyGPT(**config)`` on ``dp × tp`` processes (2-D mesh); one dict per rank.

    Each dict holds ``losses`` (the global batch's loss per step, as :func:`train_tinygpt` returns it),
    ``coords`` (``(tp_rank, dp_rank)``), the global ranks of its ``tp_ranks`` and ``dp_ranks`` groups,
    and the bytes its blocks all-reduced (``tp_bytes``) and all its tensor-parallel collectives
    moved (``all_bytes``).

    Example::

        >>> cfg = dict(vocab_size=27, seq_len=8, num_layers=1, hidden=16, num_heads=2)
        >>> runs = train_tinygpt_2d(cfg, tp=2, dp=1, steps=2, batch_size=4)
        >>> ref = train_tinygpt(cfg, steps=2, batch_size=4)
        >>> [round(a - b, 4) for a, b in zip(runs[0]["losses"], ref)]
        [0.0, 0.0]

    ``backend``: ``"gloo"`` (CPU) or ``"nccl"`` (rank ``r`` on ``cuda:r``); default
    :func:`~gpucourse.default_backend` for ``tp × dp`` ranks (NCCL with a GPU per rank, else gloo).

    .. warning::
        The losses match one process up to floating-point rounding (sums in a different order),
        not bit for bit; over many steps the difference can grow.
    """
    check_int("tp", tp, 1)
    check_int("dp", dp, 1)
    _check(steps, batch_size, lr)
    if batch_size < dp:
        raise ValueError(f"batch_size ({batch_size}) must be >= dp ({dp}): every data-parallel rank needs a row")
    backend = default_backend(tp * dp) if backend is None else backend
    return launch(_worker_2d, tp * dp, args=(dict(config), tp, dp, steps, batch_size, lr, seed, text_chars),
                  backend=backend, timeout=timeout)


def _check(steps, batch_size, lr):
    check_int("steps", steps, 1)
    check_int("batch_size", batch_size, 1)
    check_positive("lr", lr)
