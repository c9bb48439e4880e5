"""Data parallel × pipeline parallel: arranging ranks in a 2-D grid.

With ``dp_size`` copies of a ``pp_size``-stage pipeline there are ``dp_size × pp_size`` processes.
Each process has two coordinates:

* ``pp_rank`` — which stage it runs; it exchanges activations/gradients with ``pp_rank ± 1`` of
  *its* pipeline (point-to-point, small messages);
* ``dp_rank`` — which pipeline (data shard) it belongs to; it all-reduces its stage's gradients with
  the same stage of the other pipelines (a collective over the whole stage's parameters).

The layout here is Megatron-LM's: ``rank = pp_rank × dp_size + dp_rank`` — data-parallel peers get
consecutive ranks (on one node, fast links for the big all-reduce) and pipeline neighbours are
``dp_size`` ranks apart (often on different nodes: point-to-point traffic is the light one).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..runtime import check_int

__all__ = ["ParallelGrid"]


@dataclass(frozen=True)
class ParallelGrid:
    """Rank arithmetic for ``dp_size`` data-parallel copies of a ``pp_size``-stage pipeline.

    Args:
        dp_size: number of pipelines (data-parallel replicas).
        pp_size: stages per pipeline.

    Example::

        >>> grid = ParallelGrid(dp_size=2, pp_size=4)
        >>> grid.world_size, grid.coords(5)             # rank 5 runs stage 2 of pipeline 1
        (8, (2, 1))
        >>> grid.pipeline_ranks(1)                      # send/recv along a pipeline
        [1, 3, 5, 7]
        >>> grid.data_parallel_ranks(2)                 # all-reduce stage 2's gradients
        [4, 5]
        >>> print(grid)
                    dp 0  dp 1
        stage 0        0     1
        stage 1        2     3
        stage 2        4     5
        stage 3        6     7

    .. warning::
        Every process must create *every* group (``dist.new_group`` is collective), in the same
        order — also the groups it is not part of.
    """

    dp_size: int
    pp_size: int

    def __post_init__(self):
        for name in ("dp_size", "pp_size"):
            value = getattr(self, name)
            check_int(name, value, 1)

    @property
    def world_size(self) -> int:
        return self.dp_size * self.pp_size

    def rank(self, pp_rank: int, dp_rank: int) -> int:
        """The global rank of stage ``pp_rank`` in pipeline ``dp_rank``."""
        if not 0 <= pp_rank < self.pp_size:
            raise ValueError(f"pp_rank must be in [0, {self.pp_size - 1}], got {pp_rank}")
        if not 0 <= dp_rank < self.dp_size:
            raise ValueError(f"dp_rank must be in [0, {self.dp_size - 1}], got {dp_rank}")
        return pp_rank * self.dp_size + dp_rank

    def coords(self, rank: int) -> tuple[int, int]:
        """``(pp_rank, dp_rank)`` of a global rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"Invalid rank {rank}, rank should be in the interval "
                             f"[0, {self.world_size - 1}]")
        return divmod(rank, self.dp_size)

    def pipeline_ranks(self, dp_rank: int) -> list[int]:
        """The ranks of pipeline ``dp_rank``, stage 0 first."""
        return [self.rank(p, dp_rank) for p in range(self.pp_size)]

    def data_parallel_ranks(self, pp_rank: int) -> list[int]:
        """The ranks that run stage ``pp_rank`` (one per pipeline)."""
        return [self.rank(pp_rank, d) for d in range(self.dp_size)]

    def __str__(self) -> str:
        lines = [" " * 10 + "".join(f"{'dp ' + str(d):>6}" for d in range(self.dp_size))]
        for p in range(self.pp_size):
            lines.append(f"{'stage ' + str(p):<10}" + "".join(f"{self.rank(p, d):>6}"
                                                              for d in range(self.dp_size)))
        return "\n".join(lines)
