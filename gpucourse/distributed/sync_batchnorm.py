"""What ``SyncBatchNorm`` computes: batch statistics over the *global* batch, not each rank's slice.

Under DDP each process normalises with the mean and variance of its own slice of the batch. With
small per-GPU batches (detection, segmentation: 2–4 images per GPU) those statistics are noisy, and
the model trains differently from the same model on one big batch. ``torch.nn.SyncBatchNorm``
all-reduces three numbers per channel — sample count, sum, sum of squares — so that every rank
normalises with the statistics of the whole global batch. :func:`sync_batch_stats` is that
computation, runnable on CPU (PyTorch's ``SyncBatchNorm`` runs on GPUs only).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..runtime import same_on_every_rank

__all__ = ["sync_batch_stats"]


def sync_batch_stats(x: torch.Tensor, group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel mean and (biased) variance of the batch gathered from all ranks of ``group``.

    A collective: every rank calls it with its own slice ``x`` of shape ``(N_rank, C, ...)``; the
    slices may have different sizes. Each rank gets the statistics of the concatenated batch —
    what ``SyncBatchNorm`` normalises with. Outside a process group it returns ``x``'s own.

    Args:
        x: this rank's activations, channels in dimension 1 (``(N, C)``, ``(N, C, H, W)``, …).
        group: the process group (default: the default group).

    Returns:
        ``(mean, var)``, each of shape ``(C,)``; ``var`` is the biased variance used to normalise.

    Example::

        >>> import torch, gpucourse as gc
        >>> def stats(rank, world_size):
        ...     x = torch.full((2, 1), float(rank))          # rank 0: zeros, rank 1: ones
        ...     local = (x.mean(0).item(), x.var(0, unbiased=False).item())
        ...     mean, var = gc.sync_batch_stats(x)
        ...     return local, (mean.item(), var.item())
        >>> gc.launch(stats, 2)                               # local: (0, 0) and (1, 0); global: (0.5, 0.25)
        [((0.0, 0.0), (0.5, 0.25)), ((1.0, 0.0), (0.5, 0.25))]

    .. warning::
        ``nn.SyncBatchNorm.convert_sync_batchnorm(model)`` must be applied *before* wrapping the
        model in DDP, and — being a collective in every forward — it requires every rank to run the
        same number of forward passes.
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor, got {type(x).__name__}"
                        f"{'' if not isinstance(x, torch.Tensor) else ' of dtype ' + str(x.dtype)}")
    if x.dim() < 2:
        raise ValueError(f"x must have shape (N, C, ...) with channels in dim 1, got shape {tuple(x.shape)}")
    dims = [d for d in range(x.dim()) if d != 1]
    xd = x.double()                                            # sums of squares: keep precision
    count = torch.tensor([x.numel() / x.shape[1]], dtype=torch.float64, device=x.device)
    stats = torch.cat([count, xd.sum(dims), (xd * xd).sum(dims)])   # (1 + 2C,): n, Σx, Σx²
    if dist.is_available() and dist.is_initialized():
        same_on_every_rank("sync_batch_stats: the number of channels x.shape[1]", x.shape[1], group)
        dist.all_reduce(stats, group=group)
    c = x.shape[1]
    n, total, total_sq = stats[0], stats[1: 1 + c], stats[1 + c:]
    mean = total / n
    var = total_sq / n - mean * mean
    return mean.to(x.dtype), var.clamp_min(0).to(x.dtype)
