"""Chapter 08 — sharded data parallelism: ZeRO-1/2/3 from scratch, FSDP2, activation recomputation.

- ``memory_model``  where DDP's memory goes (16Ψ) and what each ZeRO stage removes; measured per rank
- ``communication`` bytes and α-β time per step of each stage (ZeRO-1/2 = DDP, ZeRO-3 = 1.5×), measured
- ``collectives``   reduce-scatter and all-gather from send/recv: the two halves of the ring
- ``zero``          ``ZeroOptimizer``: ZeRO-1/2 on a flat buffer of padded shards, a ``torch.optim.Optimizer``
- ``zero_bookkeeping`` its parameter groups on the flat buffer and its checkpoints (per rank, consolidated)
- ``fsdp``          ``FullyShardedModule``: ZeRO-3, parameters gathered per layer, gradients reduce-scattered;
                    frozen parameters, tied weights, a compute dtype (``param_dtype``) on fp32 shards
- ``recompute``     activation checkpointing: memory vs step time, measured
- ``training``      one run six ways: DDP, ZeRO-1/2/3, ``ZeroRedundancyOptimizer``, FSDP2 ``fully_shard``
"""

from .collectives import all_gather, reduce_scatter, shard_size
from .communication import measure_zero_comm, zero_comm_bytes, zero_comm_time
from .fsdp import FullyShardedModule
from .memory_model import (RankMemory, measure_step_memory, plot_zero_memory, plot_zero_stages, zero_memory,
                           zero_memory_parts, zero_memory_widget)
from .recompute import (CheckpointedSequential, MLPBlock, RecomputePoint, activation_bytes, recompute_sweep,
                        residual_mlp)
from .training import STRATEGIES, ShardedRun, train_sharded, wrap_for
from .zero import ZeroOptimizer, shard_ranges

__all__ = ["STRATEGIES", "CheckpointedSequential", "FullyShardedModule", "MLPBlock", "RankMemory",
           "RecomputePoint", "ShardedRun", "ZeroOptimizer", "activation_bytes", "all_gather",
           "measure_step_memory", "measure_zero_comm", "plot_zero_memory", "plot_zero_stages",
           "recompute_sweep", "reduce_scatter", "residual_mlp", "shard_ranges", "shard_size",
           "train_sharded", "wrap_for", "zero_comm_bytes", "zero_comm_time", "zero_memory",
           "zero_memory_parts", "zero_memory_widget"]
