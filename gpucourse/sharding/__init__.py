"""Chapter 08 — sharded data parallelism: ZeRO-1/2/3 from scratch, FSDP2, activation recomputation.

- ``memory_model``  where DDP's memory goes (16Ψ) and what each ZeRO stage removes; measured per rank
- ``collectives``   reduce-scatter and all-gather from send/recv: the two halves of the ring
- ``zero``          ``ZeroOptimizer``: ZeRO-1/2 on a flat buffer of padded shards
- ``fsdp``          ``FullyShardedModule``: ZeRO-3, parameters gathered per layer, gradients reduce-scattered
- ``recompute``     activation checkpointing: memory vs step time, measured
- ``training``      one run six ways: DDP, ZeRO-1/2/3, ``ZeroRedundancyOptimizer``, FSDP2 ``fully_shard``
"""

from .collectives import all_gather, reduce_scatter, shard_size
from .fsdp import FullyShardedModule
from .memory_model import RankMemory, measure_step_memory, zero_memory, zero_memory_parts
from .recompute import (CheckpointedSequential, MLPBlock, RecomputePoint, activation_bytes, recompute_sweep,
                        residual_mlp)
from .training import STRATEGIES, ShardedRun, train_sharded, wrap_for
from .zero import ZeroOptimizer, shard_ranges

__all__ = ["all_gather", "reduce_scatter", "shard_size", "FullyShardedModule", "RankMemory",
           "measure_step_memory", "zero_memory", "zero_memory_parts", "ZeroOptimizer", "shard_ranges",
           "CheckpointedSequential", "MLPBlock", "RecomputePoint", "activation_bytes", "recompute_sweep",
           "residual_mlp", "STRATEGIES", "ShardedRun", "train_sharded", "wrap_for"]
