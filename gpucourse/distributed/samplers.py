"""Which samples each rank trains on: ``DistributedSampler``, written out step by step.

In data-parallel training every process loads its *own* batches from its own copy of the dataset —
nothing is sent from rank 0. For that to be a partition of the data (no sample seen twice, none
forgotten), every rank must agree on one order of the indices and take its own share of it:

1) all ranks build the **same** permutation (same ``seed + epoch`` → same random order);
2) the list is made divisible by ``num_replicas``: padded by repeating its first indices
   (default), or its tail dropped (``drop_last=True``);
3) rank ``r`` takes every ``num_replicas``-th index starting at ``r`` (a stride, not a block).

The result is exactly what ``torch.utils.data.DistributedSampler`` yields (tests check it for every
argument combination), so what you learn here is what PyTorch does.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator, Sized

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from ..runtime import check_int

__all__ = ["DistributedSampler"]


class DistributedSampler(Sampler[int]):
    """Give each of ``num_replicas`` processes its own equal share of a dataset's indices.

    Pass one to the ``DataLoader`` of every rank (``sampler=``, and leave the loader's ``shuffle``
    off — the sampler shuffles). Together the ranks see every sample once per epoch; when the
    dataset does not divide evenly, a few samples are repeated (or, with ``drop_last=True``, left
    out) so that every rank runs the same number of steps.

    Args:
        dataset: anything with ``len()``; only its length is used.
        num_replicas: number of processes sharing the data (the world size). Default: the size of
            the default process group.
        rank: this process's rank in ``[0, num_replicas - 1]``. Default: its rank in the default
            process group.
        shuffle: a new random order every epoch (the same on all ranks), else ``0, 1, 2, …``.
        seed: base of the shuffle; must be the same on every rank.
        drop_last: drop the tail so the length divides evenly, instead of padding by repeating
            the first indices.

    Example::

        >>> sampler = DistributedSampler(range(10), num_replicas=3, rank=1, shuffle=False)
        >>> list(sampler)      # 10 indices padded to 12 (0 and 1 repeated), rank 1 takes 1, 4, 7, 10
        [1, 4, 7, 0]
        >>> len(sampler)
        4
        >>> list(DistributedSampler(range(10), num_replicas=3, rank=1, shuffle=False, drop_last=True))
        [1, 4, 7]
        >>> s = DistributedSampler(range(8), num_replicas=2, rank=0, seed=0)
        >>> s.set_epoch(1); epoch1 = list(s)
        >>> s.set_epoch(2); epoch2 = list(s)
        >>> epoch1 != epoch2                     # a fresh shuffle every epoch
        True
        >>> DistributedSampler(range(8), num_replicas=2, rank=2)
        Traceback (most recent call last):
        ...
        ValueError: Invalid rank 2, rank should be in the interval [0, 1]

    .. warning::
        Call ``sampler.set_epoch(epoch)`` at the start of **every** epoch, before iterating the
        ``DataLoader``. Without it the shuffle depends on ``seed + 0`` only, so every epoch
        repeats the first epoch's order (a shuffling sampler warns when it is iterated again
        without a ``set_epoch`` call in between).
    """

    def __init__(self, dataset: Sized, num_replicas: int | None = None, rank: int | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False) -> None:
        if not hasattr(dataset, "__len__"):
            raise TypeError(f"dataset must have a length (len(dataset)), got {type(dataset).__name__}")
        if num_replicas is None or rank is None:
            if not (dist.is_available() and dist.is_initialized()):
                raise RuntimeError(
                    "DistributedSampler needs num_replicas and rank, or an initialised process "
                    "group to read them from. Call torch.distributed.init_process_group() first "
                    "(torchrun / gc.launch do it for you), or pass num_replicas= and rank=.")
            num_replicas = dist.get_world_size() if num_replicas is None else num_replicas
            rank = dist.get_rank() if rank is None else rank
        check_int("num_replicas", num_replicas, 1)
        check_int("seed", seed, -(2**63))
        check_int("rank", rank)
        if not 0 <= rank < num_replicas:  # PyTorch's wording
            raise ValueError(f"Invalid rank {rank}, rank should be in the interval [0, {num_replicas - 1}]")
        self.dataset = dataset
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = bool(shuffle)
        self.seed = seed
        self.drop_last = bool(drop_last)
        self.epoch = 0
        self._iterated_since_set_epoch = False
        n = len(dataset)
        if self.drop_last:
            self.num_samples = n // num_replicas            # the tail that does not divide is dropped
        else:
            self.num_samples = math.ceil(n / num_replicas)   # padded up to a multiple
        self.total_size = self.num_samples * num_replicas

    def __iter__(self) -> Iterator[int]:
        n = len(self.dataset)
        if self.shuffle and self._iterated_since_set_epoch:
            warnings.warn(
                f"DistributedSampler iterated again at epoch {self.epoch}: it yields the same order "
                "as last time. Call sampler.set_epoch(epoch) at the start of every epoch.",
                stacklevel=2)
        self._iterated_since_set_epoch = True
        # 1) one order for all ranks: seeded by seed + epoch, identical in every process
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            indices = torch.randperm(n, generator=g).tolist()
        else:
            indices = list(range(n))
        # 2) make the length a multiple of num_replicas
        if self.drop_last:
            indices = indices[: self.total_size]
        elif n > 0:
            repeats = math.ceil(self.total_size / n)         # > 1 only when n < num_replicas
            indices = (indices * repeats)[: self.total_size]
        # 3) rank r takes positions r, r + num_replicas, r + 2 * num_replicas, ...
        return iter(indices[self.rank : self.total_size : self.num_replicas])

    def __len__(self) -> int:
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Use the shuffle of ``epoch`` for the next iteration (call it at every epoch's start).

        Args:
            epoch: the epoch number; all ranks must pass the same value.
        """
        check_int("epoch", epoch)
        self.epoch = epoch
        self._iterated_since_set_epoch = False

    def __repr__(self) -> str:
        return (f"DistributedSampler(len(dataset)={len(self.dataset)}, num_replicas={self.num_replicas}, "
                f"rank={self.rank}, shuffle={self.shuffle}, seed={self.seed}, drop_last={self.drop_last})")
